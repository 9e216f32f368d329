"""Drawing an example's SFT demonstration among its alternatives (``data.demonstrations``)."""

import numpy as np
import pytest

from jaxrl_llm.data.datasets import Example
from jaxrl_llm.data.demonstrations import demonstration_choices, draw_demonstration


def _example(texts, weights) -> Example:
    return Example("7+5=", "12", {"demonstrations": texts, "demonstration_weights": weights})


def test_an_example_without_alternatives_has_its_one_demonstration_and_leaves_rng_alone():
    rng = np.random.default_rng(0)
    before = rng.bit_generator.state
    assert draw_demonstration(Example("7+5=", "12"), rng) == "12"
    assert draw_demonstration(Example("7+5=", "12", {"demonstration": "2"}), rng) == "2"
    assert rng.bit_generator.state == before
    assert demonstration_choices(Example("7+5=", "12")) is None


def test_draws_follow_the_weights():
    ex = _example(("12", "2", "13"), (0.2, 0.7, 0.1))
    rng = np.random.default_rng(1)
    draws = [draw_demonstration(ex, rng) for _ in range(4000)]
    share = {t: draws.count(t) / len(draws) for t in ("12", "2", "13")}
    # Binomial standard deviations at n=4000 are <= 0.008: 0.03 is over 3.5 of them.
    assert share == pytest.approx({"12": 0.2, "2": 0.7, "13": 0.1}, abs=0.03)


def test_a_draw_is_the_uniform_against_the_cumulative_weights():
    """One ``rng.random()`` a draw, text ``i`` where ``cum[i-1] <= u < cum[i]``."""
    ex = _example(("a", "b", "c"), (0.25, 0.5, 0.25))
    us = np.random.default_rng(7).random(200)
    want = ["a" if u < 0.25 else "b" if u < 0.75 else "c" for u in us]
    rng = np.random.default_rng(7)
    assert [draw_demonstration(ex, rng) for _ in us] == want


def test_zero_and_one_weights_are_never_and_always():
    rng = np.random.default_rng(2)
    assert {draw_demonstration(_example(("12", "2"), (0.0, 1.0)), rng) for _ in range(300)} == {"2"}
    assert {draw_demonstration(_example(("12", "2"), [1, 0]), rng) for _ in range(300)} == {"12"}


@pytest.mark.parametrize(
    ("texts", "weights", "match"),
    [
        ("12", (1.0,), "demonstrations must be non-empty strings"),
        ((), (), "demonstrations must be non-empty strings"),
        (("12", ""), (0.5, 0.5), "demonstrations must be non-empty strings"),
        (("12", 2), (0.5, 0.5), "demonstrations must be non-empty strings"),
        (("12", "2"), None, "demonstration_weights must be 2 probabilities"),
        (("12", "2"), (1.0,), "demonstration_weights must be 2 probabilities"),
        (("12", "2"), (0.5, 0.6), "demonstration_weights must be non-negative and sum to 1"),
        (("12", "2"), (1.5, -0.5), "demonstration_weights must be non-negative and sum to 1"),
        (("12", "2"), (True, False), "demonstration_weights must be non-negative and sum to 1"),
        (("12", "2"), ("0.5", "0.5"), "demonstration_weights must be non-negative and sum to 1"),
    ],
)
def test_malformed_alternatives_are_refused(texts, weights, match):
    with pytest.raises(ValueError, match=f"example '7\\+5=': {match}"):
        draw_demonstration(_example(texts, weights), np.random.default_rng(0))
