"""The built-in arithmetic task and its verifier."""

import itertools
import re

import pytest

from jaxrl_llm.data import (
    ARITHMETIC_ALPHABET,
    Example,
    arithmetic_examples,
    demonstration,
    num_problems,
    solve_arithmetic,
)
from jaxrl_llm.rewards import is_correct

_PROMPT = re.compile(r"(\d+)([-+*])(\d+)=")


def _brute_force_count(digit_counts, ops, allow_negative):
    values = [v for d in digit_counts for v in range(0 if d == 1 else 10 ** (d - 1), 10**d)]
    prompts = set()
    for a, b, op in itertools.product(values, values, ops):
        if op == "-" and not allow_negative and a < b:
            continue
        prompts.add(f"{a}{op}{b}=")
    return len(prompts)


def test_examples_are_distinct_verified_and_in_the_alphabet():
    examples = arithmetic_examples(500, seed=0)
    assert len({ex.prompt for ex in examples}) == 500
    for ex in examples:
        match = _PROMPT.fullmatch(ex.prompt)
        assert match, ex.prompt
        a, op, b = match.groups()
        assert set(ex.prompt) <= set(ARITHMETIC_ALPHABET)
        assert set(ex.answer) <= set("0123456789-")
        assert int(ex.answer) == {"+": int(a) + int(b), "-": int(a) - int(b)}[op]
        assert len(a) in (1, 2) and len(b) in (1, 2)
        assert ex.extra == {"task": "arithmetic", "operands": [int(a), int(b)], "op": op}
    assert {ex.extra["op"] for ex in examples} == {"+", "-"}
    assert min(int(ex.answer) for ex in examples) >= 0


def test_examples_are_deterministic_in_seed():
    assert arithmetic_examples(50, seed=3) == arithmetic_examples(50, seed=3)
    assert arithmetic_examples(50, seed=3) != arithmetic_examples(50, seed=4)


def test_digits_ops_and_negative_answers():
    examples = arithmetic_examples(300, seed=1, digits=3, ops=("-", "*"), allow_negative=True)
    for ex in examples:
        a, b = ex.extra["operands"]
        assert 100 <= a <= 999 and 100 <= b <= 999
        assert ex.answer == solve_arithmetic(ex.prompt)
    assert any(int(ex.answer) < 0 for ex in examples)
    assert {ex.extra["op"] for ex in examples} == {"-", "*"}


@pytest.mark.parametrize(
    "digits, ops, allow_negative",
    [
        ((1,), ("+",), False),
        ((1,), ("-",), False),
        ((1,), ("-",), True),
        ((1, 2), ("+", "-"), False),
    ],
)
def test_num_problems_matches_enumeration(digits, ops, allow_negative):
    expected = _brute_force_count(digits, ops, allow_negative)
    assert num_problems(digits=digits, ops=ops, allow_negative=allow_negative) == expected


def test_exhausting_the_problem_space():
    count = num_problems(digits=1, ops=("-",))
    examples = arithmetic_examples(count, seed=0, digits=1, ops=("-",))
    assert len({ex.prompt for ex in examples}) == count == 55
    with pytest.raises(ValueError, match="only give 55"):
        arithmetic_examples(56, seed=0, digits=1, ops=("-",))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 0}, "positive int"),
        ({"n": 5, "digits": ()}, "at least one"),
        ({"n": 5, "digits": (0,)}, r"ints in \[1, 18\]"),
        ({"n": 5, "digits": (2, 2)}, "distinct"),
        ({"n": 5, "ops": ("/",)}, "distinct operators"),
        ({"n": 5, "ops": ()}, "distinct operators"),
    ],
)
def test_bad_settings(kwargs, message):
    n = kwargs.pop("n")
    with pytest.raises(ValueError, match=message):
        arithmetic_examples(n, seed=0, **kwargs)


@pytest.mark.parametrize(
    "prompt, answer", [("12+7=", "19"), ("3-12=", "-9"), ("7*8=", "56"), (" 5 + 0 = ", "5")]
)
def test_solve_arithmetic(prompt, answer):
    assert solve_arithmetic(prompt) == answer


@pytest.mark.parametrize("prompt", ["12+7", "1+2+3=", "a+b=", "12/3="])
def test_solve_arithmetic_rejects_other_text(prompt):
    with pytest.raises(ValueError, match="not an arithmetic prompt"):
        solve_arithmetic(prompt)


def test_demonstrations_verify_and_wrong_answers_do_not():
    for ex in arithmetic_examples(100, seed=2):
        demo = demonstration(ex)
        assert demo == ex.answer
        assert is_correct(demo, ex)
        assert not is_correct(str(int(ex.answer) + 1), ex)
        assert not is_correct("", ex)


def test_demonstration_prefers_an_explicit_one():
    ex = Example("q", "4", {"demonstration": "2+2 makes 4"})
    assert demonstration(ex) == "2+2 makes 4"
    with pytest.raises(ValueError, match="no usable demonstration"):
        demonstration(Example("q", ""))
