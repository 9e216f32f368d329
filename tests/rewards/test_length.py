"""DAPO's soft overlong punishment, counted in tokens, against the float64 reference."""

import numpy as np
import pytest

from jaxrl_llm.rewards import OverlongPenalty, RewardInput, overlong_penalty
from tests.reference import rewards as ref


def test_boundaries_by_hand():
    # L_max = 20, L_cache = 5: free up to 15 tokens, -1/5 per token after, -1 at 20 and beyond.
    penalty = lambda n: overlong_penalty(n, max_tokens=20, buffer_tokens=5)  # noqa: E731
    assert penalty(0) == 0.0
    assert penalty(15) == 0.0
    assert penalty(16) == pytest.approx(-0.2)
    assert penalty(18) == pytest.approx(-0.6)
    assert penalty(19) == pytest.approx(-0.8)
    assert penalty(20) == -1.0
    assert penalty(21) == -1.0
    assert penalty(10_000) == -1.0


@pytest.mark.parametrize(
    "max_tokens, buffer_tokens", [(20, 5), (16, 1), (12, 12), (9, 0), (100, 37)]
)
def test_matches_reference(max_tokens, buffer_tokens):
    lengths = np.arange(0, max_tokens + 10)
    got = [
        overlong_penalty(int(n), max_tokens=max_tokens, buffer_tokens=buffer_tokens)
        for n in lengths
    ]
    want = ref.overlong_penalty(lengths, max_tokens, buffer_tokens)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    assert all(-1.0 <= g <= 0.0 for g in got)


def test_zero_buffer_is_a_hard_cut():
    assert overlong_penalty(9, max_tokens=9, buffer_tokens=0) == 0.0
    assert overlong_penalty(10, max_tokens=9, buffer_tokens=0) == -1.0


def test_reward_reads_token_count_not_characters():
    reward = OverlongPenalty(max_tokens=8, buffer_tokens=4)
    long_text = "x" * 1000  # characters do not matter
    assert reward(RewardInput("p", long_text, None, completion_tokens=4)) == 0.0
    assert reward(RewardInput("p", "", None, completion_tokens=6)) == pytest.approx(-0.5)
    assert reward(RewardInput("p", "", None, completion_tokens=9)) == -1.0
    with pytest.raises(ValueError, match="completion_tokens"):
        reward(RewardInput("p", "text"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0, "buffer_tokens": 0}, "max_tokens must be an int >= 1"),
        ({"max_tokens": 10, "buffer_tokens": -1}, "buffer_tokens must be an int >= 0"),
        ({"max_tokens": 10, "buffer_tokens": 11}, "must not exceed"),
        ({"max_tokens": 10.0, "buffer_tokens": 2}, "max_tokens must be an int"),
    ],
)
def test_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OverlongPenalty(**kwargs)
    with pytest.raises(ValueError, match=message):
        overlong_penalty(3, **kwargs)


def test_negative_token_count():
    with pytest.raises(ValueError, match="num_tokens"):
        overlong_penalty(-1, max_tokens=10, buffer_tokens=2)
