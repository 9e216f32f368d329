"""Built-in task: integer arithmetic small enough for a tiny model trained on CPU.

Prompts look like ``"12+7="`` and answers like ``"19"``: characters from
``ARITHMETIC_ALPHABET`` only, so the character tokenizer covers them. ``solve_arithmetic`` is the
verifier that recomputes an answer from its prompt.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence

import numpy as np

from jaxrl_llm.data.datasets import Example

OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_MAX_DIGITS = 18  # operands must fit numpy's int64 draws
_PROBLEM = re.compile(r"\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*=\s*")


def _operand_range(digit_count: int) -> tuple[int, int]:
    """Inclusive bounds of the ``digit_count``-digit integers (one digit includes 0)."""
    low = 0 if digit_count == 1 else 10 ** (digit_count - 1)
    return low, 10**digit_count - 1


def _check_digits(digits: int | Sequence[int]) -> tuple[int, ...]:
    counts = (digits,) if isinstance(digits, int | np.integer) else tuple(digits)
    if not counts:
        raise ValueError("digits must name at least one operand digit count")
    for d in counts:
        if isinstance(d, bool) or not isinstance(d, int | np.integer) or not 1 <= d <= _MAX_DIGITS:
            raise ValueError(f"digit counts must be ints in [1, {_MAX_DIGITS}], got {digits!r}")
    if len(set(counts)) != len(counts):
        raise ValueError(f"digit counts must be distinct, got {digits!r}")
    return tuple(int(d) for d in counts)


def _check_ops(ops: Sequence[str]) -> tuple[str, ...]:
    ops = (ops,) if isinstance(ops, str) and len(ops) == 1 else tuple(ops)
    unknown = [op for op in ops if op not in OPERATORS]
    if not ops or unknown or len(set(ops)) != len(ops):
        raise ValueError(f"ops must be distinct operators from {sorted(OPERATORS)}, got {ops!r}")
    return ops


def _draw_operand(rng: np.random.Generator, ranges: Sequence[tuple[int, int]]) -> int:
    low, high = ranges[rng.integers(len(ranges))]
    return int(rng.integers(low, high, endpoint=True))


def num_problems(
    *,
    digits: int | Sequence[int] = (1, 2),
    ops: Sequence[str] = ("+", "-"),
    allow_negative: bool = False,
) -> int:
    """How many distinct prompts ``arithmetic_examples`` can produce with these settings.

    With ``V`` the number of possible operands, ``+`` and ``*`` give ``V**2`` prompts, ``-``
    gives ``V**2`` with negative answers and ``V(V+1)/2`` (pairs ``a >= b``) without.
    """
    values = sum(hi - lo + 1 for lo, hi in map(_operand_range, _check_digits(digits)))
    per_op = {"+": values**2, "*": values**2}
    per_op["-"] = values**2 if allow_negative else values * (values + 1) // 2
    return sum(per_op[op] for op in _check_ops(ops))


def arithmetic_examples(
    n: int,
    *,
    seed: int,
    digits: int | Sequence[int] = (1, 2),
    ops: Sequence[str] = ("+", "-"),
    allow_negative: bool = False,
) -> list[Example]:
    """``n`` distinct problems ``"a<op>b="`` with their answers, deterministic in ``seed``.

    Each draw picks an operator uniformly from ``ops``, then for each operand a digit count
    uniformly from ``digits`` and a value uniformly among the integers with that many digits
    (one digit: 0-9). Without ``allow_negative`` the operands of a subtraction are ordered so
    that ``a >= b``. Repeated prompts are redrawn, so slicing the list gives disjoint splits.

    Args:
      n: number of examples, at most ``num_problems(...)``.
      seed: seed of the draws.
      digits: allowed operand digit counts, e.g. ``(1, 2)`` or ``2``.
      ops: operators among ``"+"``, ``"-"``, ``"*"``.
      allow_negative: keep ``a - b`` with ``a < b`` (negative answers).

    Returns:
      Examples with ``prompt="12+7="``, ``answer="19"`` and
      ``extra={"task": "arithmetic", "operands": [12, 7], "op": "+"}``.

    Raises:
      ValueError: on bad settings or when fewer than ``n`` distinct prompts exist.
    """
    counts, ops = _check_digits(digits), _check_ops(ops)
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    available = num_problems(digits=counts, ops=ops, allow_negative=allow_negative)
    if n > available:
        raise ValueError(
            f"asked for {n} distinct problems but digits={counts} ops={ops} "
            f"allow_negative={allow_negative} only give {available}"
        )
    rng = np.random.default_rng(seed)
    ranges = [_operand_range(d) for d in counts]
    examples, seen = [], set()
    while len(examples) < n:
        op = ops[rng.integers(len(ops))]
        a, b = _draw_operand(rng, ranges), _draw_operand(rng, ranges)
        if op == "-" and not allow_negative and a < b:
            a, b = b, a
        prompt = f"{a}{op}{b}="
        if prompt in seen:
            continue
        seen.add(prompt)
        answer = str(OPERATORS[op](a, b))
        extra = {"task": "arithmetic", "operands": [a, b], "op": op}
        examples.append(Example(prompt=prompt, answer=answer, extra=extra))
    return examples


def solve_arithmetic(prompt: str) -> str:
    """The verifier: recomputes the answer of a prompt ``"a<op>b="`` (``"12+7=" -> "19"``).

    Raises:
      ValueError: if ``prompt`` is not a single binary operation followed by ``=``.
    """
    match = _PROBLEM.fullmatch(prompt)
    if match is None:
        raise ValueError(f"not an arithmetic prompt of the form 'a<op>b=': {prompt!r}")
    a, op, b = match.groups()
    return str(OPERATORS[op](int(a), int(b)))


def demonstration(example: Example) -> str:
    """The completion text an SFT warm-up trains on (the caller appends EOS).

    ``example.extra["demonstration"]`` when the record has one (e.g. a worked solution),
    otherwise the reference answer itself (``"19"`` for ``"12+7="``).

    Raises:
      ValueError: if the demonstration is not a non-empty string.
    """
    text = example.extra.get("demonstration", example.answer)
    if not isinstance(text, str) or not text:
        raise ValueError(f"example {example.prompt!r} has no usable demonstration: {text!r}")
    return text
