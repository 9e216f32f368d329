"""Math answer verification: extract the final answer, then compare it with the reference.

Extraction from a completion, first that applies:

1. the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces included;
2. the number that follows the last GSM8K ``####`` marker on its line (a line of text instead,
   such as a ``#### Step 2`` heading, counts only when nothing follows it: ``#### B`` at the
   end; otherwise the marker is passed over);
3. the last number in the text (a sign counts only where it cannot be a binary minus, so
   ``"12-7=5"`` ends in ``5`` and ``"x = -3"`` in ``-3``).

A reference holding ``####`` or ``\\boxed`` (a GSM8K / MATH solution) is reduced the same way.
``MathMatch(strict=True)`` asks for the boxed format: a completion without a ``\\boxed{...}``
(or ``\\fbox{...}``) scores ``incorrect``, instead of falling back to ``####`` or the last number.

Comparison, ``backend``:

* ``builtin``: numbers are compared as exact rationals (``fractions.Fraction``): integers,
  decimals, thousands separators (``1,234`` and LaTeX ``1{,}234``), ``$`` signs, ``%``, trailing
  ``.0``, Unicode minus signs, ``\\frac{a}{b}`` / ``\\dfrac`` / ``\\frac12`` and ``a/b`` all
  normalise, so ``\\boxed{\\frac{1}{2}}`` matches ``0.5`` and ``$5.00`` matches ``5``; ``0.333``
  does not match ``1/3``; a unit in ``\\text{}`` after a number is dropped (``18 \\text{ dollars}``
  matches ``18``). Answers that are not numbers are compared as strings after removing
  whitespace, ``$`` and ``\\text{}`` wrappers; there is no symbolic algebra (``2^{10}`` does
  not match ``1024``).
* ``math_verify``: what ``builtin`` accepts, plus what ``math-verify`` proves equal
  (``rewards.equivalence``): ``2^{10}`` = ``1024``, ``\\sqrt{4}`` = ``2``, ``x+1`` = ``1+x``,
  ``\\frac{\\sqrt{2}}{2}`` = ``\\frac{1}{\\sqrt{2}}``, sets, intervals, ``x=2`` = ``2``. The
  extracted answer and the reference are each parsed as ``\\boxed{...}``. math-verify is asked
  only when the builtin comparison fails and one side is not a plain number (two numbers keep
  the exact rational verdict, so no float tolerance, and numeric tasks never pay for SymPy);
  when it cannot parse a side, fails or runs past ``timeout_s``, the builtin verdict stands.
* ``auto`` (``MathMatch``'s default): ``math_verify`` when the package imports, else
  ``builtin``.

The answer is always extracted by the rules above, whatever the backend, so the reward,
``is_correct`` and the evaluation's majority vote (``extract_answer``) agree on what the answer
*is*. ``is_correct`` (the accuracy metric the trainer and ``jaxrl-llm eval`` report) compares
with ``builtin`` by default: its meaning must not depend on which packages are installed, it
runs on every sample in the training loop (outside any scoring pool) and it stays comparable
with earlier runs. So a ``math_verify`` reward can exceed the reported accuracy on answers only
math-verify accepts (``\\boxed{2^{10}}`` for ``1024``).
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction
from typing import Any, ClassVar

from jaxrl_llm.rewards import equivalence
from jaxrl_llm.rewards.base import RewardInput, reference_answer

_MINUS_SIGNS = str.maketrans({c: "-" for c in "\u2212\u2012\u2013\ufe63\uff0d"})
_LATEX_NOISE = re.compile(r"\\(?:left|right|!|,|;|:)")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_BOX_COMMANDS = ("\\boxed", "\\fbox")

# Unsigned number: digits with optional 3-digit comma groups and decimals, or ".5".
_NUM = r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
# A minus is a sign unless it follows something it could subtract from.
_TEXT_SIGN = r"(?:(?<![\w)\]}])-)?"
_TEXT_FRACTION = (
    r"\\frac\{-?" + _NUM + r"\}\{-?" + _NUM + r"\}|\\frac\d\d|" + _NUM + "(?:/" + _NUM + ")?"
)
_TEXT_NUMBER = re.compile(r"(?<![\d.])" + _TEXT_SIGN + "(?:" + _TEXT_FRACTION + ")")
_SIGNED = r"([-+]?)\s*(" + _NUM + r")"
_WHOLE_DECIMAL = re.compile(_SIGNED)
_WHOLE_LATEX_FRAC = re.compile(
    r"([-+]?)\s*\\frac\s*\{\s*" + _SIGNED + r"\s*\}\s*\{\s*" + _SIGNED + r"\s*\}"
)
_WHOLE_SHORT_FRAC = re.compile(r"([-+]?)\s*\\frac\s*(\d)(\d)")
_WHOLE_SLASH = re.compile(_SIGNED + r"\s*/\s*" + _SIGNED)


def _clean(text: str) -> str:
    """Removes notation that never changes a value: LaTeX spacing, ``$``, text wrappers."""
    text = text.translate(_MINUS_SIGNS)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    text = _LATEX_NOISE.sub("", text).replace("\\$", "").replace("$", "")
    while True:
        unwrapped = _TEXT_WRAPPER.sub(r"\1", text)
        if unwrapped == text:
            return text
        text = unwrapped


# Longer numbers are not answers (a degenerate completion repeating digits): no value, rather
# than Python's int-from-string limit (4,300 digits) raising.
_MAX_DIGITS = 1000


class _TooLong(Exception):
    pass


def _signed(sign: str, digits: str) -> Fraction:
    if len(digits) > _MAX_DIGITS:
        raise _TooLong
    value = Fraction(digits.replace(",", ""))
    return -value if sign == "-" else value


def _matching(text: str, open_: str, close: str) -> dict[int, int]:
    """``{i: j}``: the ``close`` at ``j`` that balances the ``open_`` at ``i`` (one pass)."""
    stack, pairs = [], {}
    for i, char in enumerate(text):
        if char == open_:
            stack.append(i)
        elif char == close and stack:
            pairs[stack.pop()] = i
    return pairs


def _strip_enclosing(text: str) -> str:
    """``{5}`` / ``(−3)`` → inner text, when the outer pair encloses everything (in linear time:
    a degenerate completion may nest thousands of them)."""
    pairs = {"{": _matching(text, "{", "}"), "(": _matching(text, "(", ")")}
    lo, hi = 0, len(text) - 1  # text[lo : hi + 1], stripped
    while lo < hi and text[lo] in pairs and pairs[text[lo]].get(lo) == hi:
        lo, hi = lo + 1, hi - 1
        while lo <= hi and text[lo].isspace():
            lo += 1
        while hi >= lo and text[hi].isspace():
            hi -= 1
    return text[lo : hi + 1]


def parse_number(text: str) -> Fraction | None:
    """The exact value of a string that is one number, or ``None``.

    Accepts ``-3``, ``+4``, ``1,234.50``, ``$5``, ``50%``, ``0.5.`` (trailing period),
    ``\\frac{1}{2}``, ``-\\dfrac{3}{4}``, ``\\frac12``, ``1/2``, ``{5}``, ``(-3)``; a zero
    denominator gives ``None``.
    """
    text = _clean(text).strip().rstrip(".").strip()
    text = text.removesuffix("\\%").removesuffix("%").strip()
    text = _strip_enclosing(text)
    try:
        return _value(text)
    except _TooLong:
        return None


def _value(text: str) -> Fraction | None:
    if match := _WHOLE_DECIMAL.fullmatch(text):
        return _signed(*match.groups())
    if match := _WHOLE_SLASH.fullmatch(text):
        sign_a, a, sign_b, b = match.groups()
        numerator, denominator = _signed(sign_a, a), _signed(sign_b, b)
    elif match := _WHOLE_LATEX_FRAC.fullmatch(text):
        sign, sign_a, a, sign_b, b = match.groups()
        numerator, denominator = _signed(sign, "1") * _signed(sign_a, a), _signed(sign_b, b)
    elif match := _WHOLE_SHORT_FRAC.fullmatch(text):
        sign, a, b = match.groups()
        numerator, denominator = _signed(sign, a), Fraction(b)
    else:
        return None
    return None if denominator == 0 else numerator / denominator


def _boxed_content(text: str) -> str | None:
    """The content of the last balanced ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed 5``)."""
    starts = sorted(
        (m.end() for cmd in _BOX_COMMANDS for m in re.finditer(re.escape(cmd), text)),
        reverse=True,
    )
    pairs = _matching(text, "{", "}") if starts else {}
    for start in starts:
        brace = start
        while brace < len(text) and text[brace].isspace():
            brace += 1
        if not text.startswith("{", brace):
            bare = re.match(r"[^\s$]+", text[brace:])
            if bare:
                return bare.group()
            continue
        if brace in pairs:
            return text[brace + 1 : pairs[brace]]
    return None


def _numbers(text: str) -> list[str]:
    return [m.group() for m in _TEXT_NUMBER.finditer(_clean(text))]


def extract_answer(text: str) -> str | None:
    """The final answer written in ``text`` (see the module docstring for the order), or ``None``.

    Examples: ``"so \\boxed{\\frac{1}{2}}"`` → ``"\\frac{1}{2}"``; ``"... #### 1,234"`` →
    ``"1,234"``; ``"3 apples, then 5"`` → ``"5"``; ``"no idea"`` → ``None``.
    """
    boxed = _boxed_content(text)
    if boxed is not None:
        return boxed
    marker = text.rfind("####")
    if marker >= 0:
        line, _, after = text[marker + 4 :].partition("\n")
        line = line.strip()
        if line and parse_number(line) is not None:
            return line
        numbers = _numbers(line)
        if numbers and _clean(line).lstrip().startswith(numbers[0]):
            return numbers[0]  # "#### 42 apples"
        if line and not numbers and not after.strip():
            return line  # a text answer ending the completion: "#### B"
    numbers = _numbers(text)
    return numbers[-1] if numbers else None


# A number followed by a unit in a text wrapper: ``18 \text{ dollars}``, ``5\,\mbox{cm}``.
_TRAILING_UNIT = re.compile(
    r"(.*?\S)\s*\\(?:text|mbox|mathrm|textrm)\s*\{\s*[A-Za-z][A-Za-z .]*\}\s*\.?\s*", re.S
)


def answer_value(answer: str) -> Fraction | str:
    """A comparable form of an extracted answer: its exact value (a number followed by a unit
    in ``\text{}``, ``18 \text{ dollars}``, is the number, as verl's ``strip_string`` and
    math-verify read it), else normalised text."""
    number = parse_number(answer)
    if number is None and (unit := _TRAILING_UNIT.fullmatch(answer)):
        number = parse_number(unit.group(1))
    if number is not None:
        return number
    return re.sub(r"\s+", "", _clean(answer)).rstrip(".")


BACKENDS = ("auto", "math_verify", "builtin")


def _check_backend(backend: str) -> str:
    """The backend that will run: ``auto`` resolved to ``math_verify`` or ``builtin``.

    Raises:
      ValueError: on an unknown backend, or ``math_verify`` without the package.
    """
    if backend not in BACKENDS:
        raise ValueError(f"math_match backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "math_verify" if equivalence.installed() else "builtin"
    if backend == "math_verify" and not equivalence.installed():
        raise ValueError(
            "math_match backend 'math_verify' needs the math-verify package: "
            "pip install 'jaxrl-llm[math]' (or backend: builtin)"
        )
    return backend


def _reference_text(reference: str) -> str:
    """References are usually bare answers; GSM8K / MATH solutions hold ``####`` / ``\\boxed``."""
    if "####" in reference or any(cmd in reference for cmd in _BOX_COMMANDS):
        extracted = extract_answer(reference)
        if extracted is not None:
            return extracted
    return reference


def answers_match(
    completion: str, reference: str, *, backend: str = "builtin", timeout_s: float = 5.0
) -> bool:
    """Whether the answer extracted from ``completion`` equals the reference answer.

    Args:
      completion: the text holding the answer (see the module docstring for the extraction).
      reference: the reference answer, or a solution ending in ``#### x`` / ``\\boxed{x}``.
      backend: ``builtin``, ``math_verify`` or ``auto`` (module docstring). With ``builtin``,
        numbers compare exactly as rationals, anything else as normalised text; an empty answer
        never matches.
      timeout_s: math-verify's time budget for this comparison.

    Raises:
      ValueError: on an unknown backend, or ``math_verify`` without the package.
    """
    backend = _check_backend(backend)
    predicted = extract_answer(completion)
    if predicted is None:
        return False
    reference = _reference_text(reference)
    got, want = answer_value(predicted), answer_value(reference)
    if got == want and got != "" and isinstance(got, Fraction) == isinstance(want, Fraction):
        return True
    if backend == "builtin" or "" in (got, want):
        return False
    if isinstance(got, Fraction) and isinstance(want, Fraction):
        return False  # two plain numbers: the exact verdict stands, no float tolerance
    verdict = equivalence.equivalent(
        f"\\boxed{{{predicted}}}", f"\\boxed{{{reference.strip()}}}", timeout_s=timeout_s
    )
    return verdict is True


def is_correct(completion: str, example: Any, *, backend: str = "builtin") -> bool:
    """The accuracy metric: the completion's final answer equals ``example``'s answer.

    Compared with the ``builtin`` backend unless asked otherwise: the metric must not change
    meaning with the installed packages (see the module docstring).
    """
    return answers_match(completion, reference_answer(example), backend=backend)


def has_boxed_answer(text: str) -> bool:
    """Whether ``text`` holds a complete ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed 5``)."""
    return _boxed_content(text) is not None


@dataclasses.dataclass(frozen=True)
class MathMatch:
    """Verifiable-answer reward: ``correct`` if the answers match, else ``incorrect``.

    ``r = correct · 1[answer(completion) = answer(example)] + incorrect · 1[otherwise]``,
    the rule-based outcome reward of DeepSeekMath (Shao et al., 2024) and DeepSeek-R1.

    Attributes:
      correct: reward of a matching answer.
      incorrect: reward of a wrong or missing answer.
      backend: how answers compare: ``auto`` (math-verify when installed, else builtin),
        ``math_verify`` or ``builtin`` (module docstring).
      strict: require the ``\\boxed{...}`` format: a completion without one gets
        ``incorrect``, whatever numbers it contains.
      timeout_s: math-verify's time budget per completion (parsing and comparing).

    Raises:
      ValueError: on an unknown backend, ``math_verify`` without the package, or a
        non-positive ``timeout_s``.
    """

    name: ClassVar[str] = "math_match"
    correct: float = 1.0
    incorrect: float = 0.0
    backend: str = "auto"
    strict: bool = False
    timeout_s: float = 5.0

    def __post_init__(self):
        _check_backend(self.backend)
        if not isinstance(self.timeout_s, int | float) or not 0 < self.timeout_s < float("inf"):
            raise ValueError(
                f"math_match timeout_s must be a positive number, got {self.timeout_s!r}"
            )

    def __call__(self, inp: RewardInput) -> float:
        reference = reference_answer(inp.example)
        if self.strict and not has_boxed_answer(inp.completion):
            return float(self.incorrect)
        ok = answers_match(
            inp.completion, reference, backend=self.backend, timeout_s=self.timeout_s
        )
        return float(self.correct if ok else self.incorrect)
