"""Math answer extraction, normalisation and comparison (builtin and math-verify backends), on
hand-checked cases."""

import signal
import threading
import time
from fractions import Fraction

import pytest

from jaxrl_llm.data import Example
from jaxrl_llm.rewards import (
    MathMatch,
    RewardInput,
    answer_value,
    answers_match,
    equivalence,
    extract_answer,
    has_boxed_answer,
    is_correct,
    make_reward,
    parse_number,
)

GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


@pytest.mark.parametrize(
    "text, value",
    [
        ("42", Fraction(42)),
        ("-3", Fraction(-3)),
        ("\u22123", Fraction(-3)),  # Unicode minus sign
        ("+4", Fraction(4)),
        ("1,234", Fraction(1234)),
        ("1,234,567.25", Fraction(123456725, 100)),
        ("1{,}234", Fraction(1234)),
        ("$5.00", Fraction(5)),
        ("\\$5", Fraction(5)),
        ("5.0", Fraction(5)),
        ("0.1", Fraction(1, 10)),  # exact, not the binary float 0.1
        (".5", Fraction(1, 2)),
        ("7.", Fraction(7)),
        ("50%", Fraction(50)),
        ("50\\%", Fraction(50)),
        ("\\frac{1}{2}", Fraction(1, 2)),
        ("\\dfrac{3}{4}", Fraction(3, 4)),
        ("-\\frac{3}{4}", Fraction(-3, 4)),
        ("\\frac{-3}{6}", Fraction(-1, 2)),
        ("\\frac12", Fraction(1, 2)),
        ("\\frac{1.5}{3}", Fraction(1, 2)),
        ("3/4", Fraction(3, 4)),
        ("-6 / 8", Fraction(-3, 4)),
        ("{5}", Fraction(5)),
        ("(-3)", Fraction(-3)),
        ("$\\frac{1}{4}$", Fraction(1, 4)),
        ("\\text{12}", Fraction(12)),
    ],
)
def test_parse_number(text, value):
    got = parse_number(text)
    assert isinstance(got, Fraction) and got == value


@pytest.mark.parametrize(
    "text", ["", "abc", "1/0", "\\frac{1}{0}", "x+1", "1,23", "(1)+(2)", "1 2", "2^{10}", "--3"]
)
def test_parse_number_rejects_non_numbers(text):
    assert parse_number(text) is None


@pytest.mark.parametrize(
    "text, answer",
    [
        ("so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\frac{\\sqrt{2}}{2}} done", "\\frac{\\sqrt{2}}{2}"),  # nested braces
        ("first \\boxed{1}, finally \\boxed{2}", "2"),  # the last box
        ("\\fbox{7}", "7"),
        ("\\boxed 5", "5"),
        ("\\boxed{3} and the number 9 after it", "3"),  # a box beats the last number
        ("#### 1,234", "1,234"),
        ("work 3+4=7\n#### 7\nextra 9", "7"),  # #### beats the last number
        ("#### The answer is 12 apples", "12"),
        ("#### 42 apples\nok", "42"),
        ("#### $18 dollars", "18"),
        ("6*7 = 42.\n\n#### Final Answer\nThe answer is 42.", "42"),  # a heading: passed over
        ("#### Step 2: Double\n7*6 = 42\nThe answer is 42.", "42"),
        ("the choice is\n#### B", "B"),  # a text answer ending the completion
        ("#### B\nbecause 7 > 3", "3"),
        ("3 apples and 4 pears make 7", "7"),  # several numbers: the last
        ("12-7=5", "5"),
        ("x = -3", "-3"),
        ("x = \u22123", "-3"),
        ("from 3-4", "4"),  # a minus after a digit is a subtraction, not a sign
        ("It costs $1,000.50.", "1,000.50"),
        ("half is \\frac{1}{2}", "\\frac{1}{2}"),
        ("ratio 3/4", "3/4"),
        ("-5", "-5"),
        ("no number here", None),
        ("", None),
        ("\\boxed{unbalanced", None),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        ("\\boxed{\\frac{1}{2}}", "0.5", True),
        ("\\boxed{0.5}", "\\frac{1}{2}", True),
        ("the answer is 1/2", "0.50", True),
        ("#### 1,234", "1234", True),
        ("#### 1,234", "1235", False),
        ("It costs $5.00", "5", True),
        ("5", "$5.00", True),
        ("-3", "\u22123", True),
        ("\u22123", "-3", True),
        ("3", "-3", False),
        ("answer: 19.0", "19", True),
        ("0.333", "1/3", False),  # exact comparison, no tolerance
        ("\\boxed{x + 1}", "x+1", True),  # text answers compare without whitespace
        ("\\boxed{\\text{yes}}", "yes", True),
        ("\\boxed{18 \\text{ dollars}}", "18", True),  # a unit after the number
        ("\\boxed{5\\,\\mbox{cm}}", "5", True),
        ("\\boxed{\\frac{1}{2} \\text{ hour}}", "0.5", True),
        ("\\boxed{18 \\text{ dollars}}", "19", False),
        ("\\boxed{2^{10}}", "1024", False),  # no symbolic evaluation
        ("I cannot say", "0", False),
        ("", "0", False),
        ("1 then 2 then 3", "3", True),
        ("1 then 2 then 3", "1", False),
        ("the answer is 72", GSM8K_SOLUTION, True),  # GSM8K reference solution
        ("\\boxed{72}", GSM8K_SOLUTION, True),
        ("24", GSM8K_SOLUTION, False),
        ("\\boxed{5}", "The answer is $\\boxed{5}$.", True),  # MATH reference solution
        ("the answer is 1", "x+1", False),  # number vs text never match
    ],
)
def test_answers_match(completion, reference, expected):
    assert answers_match(completion, reference) is expected


def test_answer_value_normalises_text():
    assert answer_value(" x + 1 .") == "x+1"
    assert answer_value("$\\left( 1, 2 \\right)$") == "(1,2)"


def test_is_correct_reads_examples_and_mappings():
    assert is_correct("\\boxed{19}", Example("12+7=", "19"))
    assert is_correct("19", {"answer": "19"})
    assert not is_correct("18", Example("12+7=", "19"))
    with pytest.raises(ValueError, match="reference answer"):
        is_correct("19", {"solution": "19"})
    with pytest.raises(ValueError, match="reference answer"):
        is_correct("19", None)


@pytest.mark.parametrize("backend", ["builtin", "auto"])
def test_a_number_of_thousands_of_digits_is_no_answer_and_no_error(backend):
    """A degenerate completion repeating a digit: past Python's int-from-string limit (4,300
    digits) a parse would raise and stop the run; it scores incorrect."""
    digits = "9" * 5000
    example = Example("p", "5")
    for completion in (f"The answer is {digits}", f"\\boxed{{{digits}}}", f"#### {digits}"):
        assert not answers_match(completion, "5")
        assert not is_correct(completion, example)
        assert MathMatch(backend=backend)(RewardInput("p", completion, example)) == 0.0
    assert parse_number(digits) is None and parse_number("9" * 1000) == int("9" * 1000)
    assert answers_match(f"\\boxed{{{digits}}}", digits)  # equal as text


def test_math_match_reward_values():
    example = Example("12+7=", "19")
    reward = MathMatch()
    assert reward(RewardInput("12+7=", "19", example, 3)) == 1.0
    assert reward(RewardInput("12+7=", "20", example, 3)) == 0.0
    scaled = MathMatch(correct=2.0, incorrect=-0.5)
    assert scaled(RewardInput("12+7=", "19", example)) == 2.0
    assert scaled(RewardInput("12+7=", "", example)) == -0.5
    assert isinstance(reward(RewardInput("p", "19", example)), float)


# --------------------------------------------------------------------------------------
# math-verify backend, strict mode
# --------------------------------------------------------------------------------------

# A tower SymPy cannot finish: only the time limit ends its comparison.
HOPELESS = "\\boxed{2^{10^{10}}}"

# math-verify is in the test extra; without it only the builtin tests run.
needs_math_verify = pytest.mark.skipif(not equivalence.installed(), reason="needs math-verify")


@needs_math_verify
@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        ("\\boxed{2^{10}}", "1024", True),  # powers
        ("\\boxed{2^{9}}", "1024", False),
        ("\\boxed{\\sqrt{4}}", "2", True),  # roots
        ("$\\boxed{2\\sqrt{3}}$", "\\sqrt{12}", True),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", True),
        ("\\boxed{x+1}", "1+x", True),  # commutativity
        ("\\boxed{x+2}", "x+1", False),
        ("\\boxed{\\dfrac{x^{2}}{2}}", "x^2/2", True),  # LaTeX expression vs plain
        ("\\boxed{\\{3,1,2\\}}", "\\{1,2,3\\}", True),  # sets
        ("\\boxed{\\{1,2\\}}", "\\{1,3\\}", False),
        ("\\boxed{[0,1)}", "[0, \\frac{2}{2})", True),  # intervals
        ("\\boxed{(1,2)}", "(1,2]", False),
        ("\\boxed{1024}", "so the answer is $\\boxed{2^{10}}$.", True),  # MATH solution
        ("\\fbox{2^3}", "8", True),
        ("the answer is 2^{10}, i.e. \\boxed{\\pi}", "3.14159", False),  # pi is not 3.14159
        # Two plain numbers keep the exact verdict: no float tolerance.
        ("\\boxed{0.3333333}", "\\frac{1}{3}", False),
        ("\\boxed{\\frac{1}{2}}", "0.5", True),
        ("no answer here", "x+1", False),
    ],
)
def test_math_verify_equivalence(completion, reference, expected):
    assert answers_match(completion, reference, backend="math_verify") is expected
    reward = MathMatch(backend="math_verify", correct=1.0, incorrect=-1.0)
    assert reward(RewardInput("q", completion, {"answer": reference})) == (
        1.0 if expected else -1.0
    )


def test_builtin_backend_has_no_algebra():
    assert not answers_match("\\boxed{2^{10}}", "1024", backend="builtin")
    assert MathMatch(backend="builtin")(RewardInput("q", "\\boxed{x+1}", {"answer": "1+x"})) == 0.0


@needs_math_verify
def test_is_correct_stays_builtin_unless_asked():
    # The accuracy metric keeps its exact meaning; a math-verify reward may exceed it.
    example = {"answer": "1024"}
    assert not is_correct("\\boxed{2^{10}}", example)
    assert is_correct("\\boxed{2^{10}}", example, backend="math_verify")
    assert MathMatch()(RewardInput("q", "\\boxed{2^{10}}", example)) == 1.0  # auto


def test_without_math_verify_auto_is_builtin(monkeypatch):
    monkeypatch.setattr(equivalence, "installed", lambda: False)
    reward = MathMatch()
    assert reward(RewardInput("q", "\\boxed{2^{10}}", {"answer": "1024"})) == 0.0
    assert reward(RewardInput("q", "\\boxed{0.5}", {"answer": "\\frac12"})) == 1.0
    with pytest.raises(ValueError, match="needs the math-verify package"):
        MathMatch(backend="math_verify")
    with pytest.raises(ValueError, match="needs the math-verify package"):
        answers_match("1", "1", backend="math_verify")


@needs_math_verify
def test_math_verify_that_fails_to_import_falls_back(monkeypatch):
    monkeypatch.setattr(equivalence, "_load", lambda: None)
    reward = MathMatch(backend="math_verify")
    assert reward(RewardInput("q", "\\boxed{2^{10}}", {"answer": "1024"})) == 0.0
    assert reward(RewardInput("q", "\\boxed{x + 1}", {"answer": "x+1"})) == 1.0


@needs_math_verify
def test_math_verify_errors_fall_back_to_builtin(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("parser bug")

    import math_verify

    monkeypatch.setattr(math_verify, "parse", broken)
    reward = MathMatch(backend="math_verify")
    assert reward(RewardInput("q", "\\boxed{2^{10}}", {"answer": "1024"})) == 0.0
    assert reward(RewardInput("q", "\\boxed{\\text{yes}}", {"answer": "yes"})) == 1.0


@needs_math_verify
def test_math_verify_time_is_bounded_and_outer_timers_survive():
    fired = []

    def mine(signum, frame):
        fired.append(signum)

    previous = signal.signal(signal.SIGALRM, mine)
    signal.setitimer(signal.ITIMER_REAL, 30.0)
    try:
        start = time.monotonic()
        assert not answers_match(HOPELESS, "1", backend="math_verify", timeout_s=0.3)
        elapsed = time.monotonic() - start
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert signal.getsignal(signal.SIGALRM) is mine  # the handler is restored
        assert 0.25 < elapsed < 2.0
        assert 27.0 < remaining <= 30.0 - elapsed + 0.1
        assert not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@needs_math_verify
def test_math_verify_from_another_thread():
    # signal.alarm only works in the main thread: other threads go through a helper process.
    results = {}

    def work():
        results["power"] = answers_match("\\boxed{2^{10}}", "1024", backend="math_verify")
        start = time.monotonic()
        results["hopeless"] = answers_match(HOPELESS, "1", backend="math_verify", timeout_s=0.3)
        results["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert results["power"] is True and results["hopeless"] is False
    assert results["elapsed"] < 0.3 + equivalence._HELPER_GRACE_S + 0.5


@needs_math_verify
@pytest.mark.parametrize(
    "completion, reward",
    [
        ("so the answer is 19", 0.0),  # the right number, but not boxed
        ("#### 19", 0.0),
        ("\\boxed{19}", 1.0),
        ("\\fbox{19}", 1.0),
        ("\\boxed 19", 1.0),
        ("\\boxed{20}, I mean 19", 0.0),
        ("\\boxed{19", 0.0),  # unbalanced: no box
    ],
)
def test_strict_mode_needs_a_box(completion, reward):
    for backend in ("builtin", "math_verify"):
        strict = MathMatch(strict=True, backend=backend)
        assert strict(RewardInput("12+7=", completion, Example("12+7=", "19"))) == reward
    assert MathMatch()(RewardInput("q", "so the answer is 19", {"answer": "19"})) == 1.0


@needs_math_verify
def test_strict_math_verify_needs_the_box_too():
    strict = MathMatch(strict=True, backend="math_verify")
    assert strict(RewardInput("q", "2^{10} = 1024", {"answer": "2^{10}"})) == 0.0
    assert strict(RewardInput("q", "so \\boxed{1024}", {"answer": "2^{10}"})) == 1.0
    assert has_boxed_answer("a \\boxed{1}") and not has_boxed_answer("a 1")


def test_backend_and_timeout_validation():
    with pytest.raises(ValueError, match=r"\['auto', 'math_verify', 'builtin'\], got 'sympy'"):
        MathMatch(backend="sympy")
    with pytest.raises(ValueError, match="must be one of"):
        make_reward("math_match", backend="latex")
    with pytest.raises(ValueError, match="must be one of"):
        answers_match("1", "1", backend="Builtin")
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        MathMatch(timeout_s=0)
    assert make_reward("math_match", strict=True, backend="builtin") == MathMatch(
        backend="builtin", strict=True
    )
