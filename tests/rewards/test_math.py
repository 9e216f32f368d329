"""Math answer extraction, normalisation and exact comparison, on hand-checked cases."""

from fractions import Fraction

import pytest

from jaxrl_llm.data import Example
from jaxrl_llm.rewards import (
    MathMatch,
    RewardInput,
    answer_value,
    answers_match,
    extract_answer,
    is_correct,
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


def test_math_match_reward_values():
    example = Example("12+7=", "19")
    reward = MathMatch()
    assert reward(RewardInput("12+7=", "19", example, 3)) == 1.0
    assert reward(RewardInput("12+7=", "20", example, 3)) == 0.0
    scaled = MathMatch(correct=2.0, incorrect=-0.5)
    assert scaled(RewardInput("12+7=", "19", example)) == 2.0
    assert scaled(RewardInput("12+7=", "", example)) == -0.5
    assert isinstance(reward(RewardInput("p", "19", example)), float)
