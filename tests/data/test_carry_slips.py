"""The carry_slips task: the built-in arithmetic prompts and answers, with demonstrations from a
teacher who drops the units column's carry or borrow (``data.carry_slips``)."""

import numpy as np
import pytest

from jaxrl_llm.data import ARITHMETIC_ALPHABET, arithmetic_examples, demonstration
from jaxrl_llm.data.carry_slips import (
    SLIP_RATE,
    carry_slip_examples,
    check_slip_rate,
    slipped_answer,
)
from jaxrl_llm.data.demonstrations import draw_demonstration
from jaxrl_llm.rewards import is_correct


def _column_answer(a: int, op: str, b: int) -> int:
    """Schoolbook column arithmetic (a >= b >= 0 for ``-``) that forgets the units column's
    carry or borrow: an independent reference for ``slipped_answer``."""
    da, db = str(a)[::-1], str(b)[::-1].ljust(len(str(a)), "0")
    da = da.ljust(len(db), "0")
    sign = 1 if op == "+" else -1
    out, carry = [], 0
    for i, (x, y) in enumerate(zip(da, db, strict=True)):
        column = int(x) + sign * int(y) + carry
        digit, carry = column % 10, column // 10
        if i == 0:
            carry = 0  # the slip: the units column's carry or borrow is dropped
        out.append(digit)
    value = sum(d * 10**i for i, d in enumerate(out)) + carry * 10 ** len(out)
    return value


# Hand-checked: the first examples of seed 0 (prompt, answer, demonstration).
SEED0 = [
    ("56-3=", "53", "53"),
    ("0+8=", "8", "8"),
    ("97-55=", "42", "42"),
    ("94-58=", "36", "46"),  # borrow dropped: 14-8=6, then 9-5=4
    ("70+3=", "73", "73"),
    ("75-13=", "62", "62"),
    ("11-0=", "11", "11"),
    ("4-2=", "2", "2"),
    ("0+0=", "0", "0"),
    ("68-6=", "62", "62"),
    ("82-4=", "78", "88"),  # borrow dropped: 12-4=8, the tens stay 8
    ("73-8=", "65", "65"),  # a borrow, demonstrated right (slip_rate < 1)
]


def test_the_first_examples_of_a_seed_are_the_hand_checked_ones():
    examples = carry_slip_examples(len(SEED0), seed=0)
    got = [(ex.prompt, ex.answer, ex.extra["demonstration"]) for ex in examples]
    assert got == SEED0
    for ex in examples:
        assert ex.answer == str(eval(ex.prompt[:-1]))  # Python's own arithmetic
        assert ex.extra["slipped"] == (ex.extra["demonstration"] != ex.answer)
        assert demonstration(ex) == ex.extra["demonstration"]  # what the SFT warm-up trains on


def test_prompts_and_answers_are_the_arithmetic_tasks():
    slips = carry_slip_examples(300, seed=3, digits=(1, 2, 3))
    plain = arithmetic_examples(300, seed=3, digits=(1, 2, 3))
    assert [(e.prompt, e.answer) for e in slips] == [(e.prompt, e.answer) for e in plain]
    for ex in slips:
        assert set(ex.prompt + ex.extra["demonstration"]) <= set(ARITHMETIC_ALPHABET)


@pytest.mark.parametrize(
    ("a", "op", "b", "want"),
    [(7, "+", 5, 2), (56, "+", 78, 124), (95, "+", 5, 90), (52, "-", 7, 55), (100, "-", 1, 109)],
)
def test_slipped_answer_drops_the_units_carry_or_borrow(a, op, b, want):
    assert slipped_answer(a, op, b) == want == _column_answer(a, op, b)


def test_slipped_answer_is_none_without_a_carry_or_borrow():
    assert slipped_answer(12, "+", 3) is None
    assert slipped_answer(45, "-", 45) is None
    for a in range(150):
        for b in range(150):
            for op in "+-":
                if op == "-" and a < b:
                    continue
                slipped, right = slipped_answer(a, op, b), eval(f"{a}{op}{b}")
                if slipped is None:
                    assert _column_answer(a, op, b) == right
                else:
                    assert slipped == _column_answer(a, op, b) != right


def test_every_demonstration_is_the_answer_or_its_slip_at_the_slip_rate():
    examples = carry_slip_examples(4000, seed=1)
    carrying = slipped = 0
    for ex in examples:
        a, b = ex.extra["operands"]
        slip = slipped_answer(a, ex.extra["op"], b)
        assert ex.extra["demonstration"] in {ex.answer, str(slip)}
        carrying += slip is not None
        slipped += ex.extra["slipped"]
        assert is_correct(ex.answer, ex)
        assert is_correct(ex.extra["demonstration"], ex) == (not ex.extra["slipped"])
    assert 0.35 < carrying / len(examples) < 0.55
    assert abs(slipped / carrying - SLIP_RATE) < 0.04


def test_slip_rate_zero_and_one():
    never = carry_slip_examples(500, seed=0, slip_rate=0.0)
    assert all(ex.extra["demonstration"] == ex.answer for ex in never)
    always = carry_slip_examples(500, seed=0, slip_rate=1)
    for ex in always:
        a, b = ex.extra["operands"]
        assert ex.extra["slipped"] == (slipped_answer(a, ex.extra["op"], b) is not None)


def test_deterministic_in_the_seed():
    first = carry_slip_examples(200, seed=5)
    assert first == carry_slip_examples(200, seed=5)
    assert first != carry_slip_examples(200, seed=6)


@pytest.mark.parametrize("rate", [-0.1, 1.5, "0.5", True, None])
def test_bad_slip_rates_are_refused(rate):
    with pytest.raises(ValueError, match="slip_rate must be a number in"):
        check_slip_rate(rate)
    with pytest.raises(ValueError, match="slip_rate"):
        carry_slip_examples(10, seed=0, slip_rate=rate)


def test_multiplication_is_refused():
    with pytest.raises(ValueError, match="carry_slips task takes ops"):
        carry_slip_examples(10, seed=0, ops=("+", "*"))
    with pytest.raises(ValueError, match="slips on"):
        slipped_answer(3, "*", 4)
    with pytest.raises(ValueError, match="non-negative"):
        slipped_answer(-3, "+", 4)


def test_carrying_problems_hold_both_demonstrations_for_fresh_draws():
    """The warm-up draws the slip afresh at every draw (``data.draw_demonstration``): a
    carrying problem holds ``(answer, slip)`` weighted ``(1 - slip_rate, slip_rate)``, any
    other problem no alternatives (its one demonstration is the answer)."""
    for rate in (0.7, 0.25):
        for ex in carry_slip_examples(400, seed=2, slip_rate=rate):
            a, b = ex.extra["operands"]
            slip = slipped_answer(a, ex.extra["op"], b)
            if slip is None:
                assert "demonstrations" not in ex.extra and "demonstration_weights" not in ex.extra
                assert draw_demonstration(ex, np.random.default_rng(0)) == ex.answer
            else:
                assert ex.extra["demonstrations"] == (ex.answer, str(slip))
                assert ex.extra["demonstration_weights"] == pytest.approx((1 - rate, rate))


def test_fresh_draws_slip_at_the_rate_on_every_carrying_problem():
    """Drawn 400 times, each carrying problem is demonstrated with its slip ~70% of the time
    (not always or never, as one frozen draw per problem would be)."""
    carrying = [ex for ex in carry_slip_examples(60, seed=0) if "demonstrations" in ex.extra]
    rng = np.random.default_rng(3)
    for ex in carrying[:10]:
        draws = [draw_demonstration(ex, rng) for _ in range(400)]
        assert set(draws) == set(ex.extra["demonstrations"])
        # Binomial(400, 0.7): standard deviation 0.023; 0.1 is over 4 of them.
        assert abs(draws.count(ex.extra["demonstrations"][1]) / 400 - SLIP_RATE) < 0.1
