"""pass@k, mean@k, maj@k and the bootstrap interval against brute force and hand-checked cases.

The pass@k reference enumerates every k-subset of the n completions (``itertools``, exact
fractions): the unbiased estimator must equal the fraction of subsets holding a correct one.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest

from jaxrl_llm.evaluation import (
    bootstrap_interval,
    majority_at_k,
    mean_at_k,
    pass_at_k,
    summarize,
)


def _brute_pass_at_k(row, k) -> float:
    subsets = list(itertools.combinations(range(len(row)), k))
    hits = sum(any(row[j] for j in s) for s in subsets)
    return float(Fraction(hits, len(subsets)))


def test_pass_at_k_equals_the_fraction_of_k_subsets_with_a_correct_completion(rng):
    correct = rng.random((40, 9)) < rng.random((40, 1))  # per-problem difficulty
    for k in (1, 2, 3, 5, 9):
        want = np.array([_brute_pass_at_k(row, k) for row in correct])
        np.testing.assert_allclose(pass_at_k(correct, k), want, rtol=1e-12, atol=1e-15)


def test_pass_at_k_by_hand():
    # n = 4, c = 1: 1 - C(3, 2) / C(4, 2) = 1 - 3/6 = 0.5; k = 1: c / n = 0.25.
    row = [[False, True, False, False]]
    assert pass_at_k(row, 2)[0] == pytest.approx(0.5)
    assert pass_at_k(row, 1)[0] == pytest.approx(0.25)
    # Edge cases: none correct -> 0; all correct -> 1; n - c < k -> exactly 1.
    assert pass_at_k([[0, 0, 0]], 3)[0] == 0.0
    assert pass_at_k([[1, 1, 1]], 1)[0] == 1.0
    assert pass_at_k([[1, 1, 0]], 2)[0] == 1.0
    # Large n stays finite (no binomials of 1000 choose 500).
    big = np.zeros((1, 1000), bool)
    big[0, :3] = True
    assert pass_at_k(big, 500)[0] == pytest.approx(1 - (500 * 499 * 498) / (1000 * 999 * 998))


def test_mean_and_majority_at_k_by_hand():
    correct = np.array([[1, 0, 0, 1], [0, 1, 1, 0], [0, 0, 0, 0]], bool)
    np.testing.assert_allclose(mean_at_k(correct, 4), [0.5, 0.5, 0.0])
    np.testing.assert_allclose(mean_at_k(correct, 2), [0.5, 0.5, 0.0])
    answers = [
        ["7", "3", "3", "7"],  # 2-2 tie: "7" seen first wins -> correct
        ["5", "6", "6", None],  # "6" twice -> correct (completion 1)
        [None, None, None, None],  # nobody answered -> 0
    ]
    np.testing.assert_allclose(majority_at_k(answers, correct, 4), [1.0, 1.0, 0.0])
    # Only the first k vote: k = 1 -> the first answer decides.
    np.testing.assert_allclose(majority_at_k(answers, correct, 1), [1.0, 0.0, 0.0])


def test_bootstrap_interval():
    values = np.array([0.0, 1.0] * 50)
    low, high = bootstrap_interval(values, resamples=2000, seed=3)
    assert low < 0.5 < high
    # The normal approximation's half width, 1.96 * 0.5 / sqrt(100), within bootstrap noise.
    assert (high - low) / 2 == pytest.approx(0.098, abs=0.015)
    assert bootstrap_interval(values, seed=3) == bootstrap_interval(values, seed=3)
    assert bootstrap_interval(np.full(7, 0.25)) == (0.25, 0.25)


def test_summarize_reports_every_metric_with_its_interval():
    correct = np.array([[1, 0, 0, 1], [0, 1, 1, 0], [0, 0, 0, 0]], bool)
    answers = [["7", "3", "3", "7"], ["5", "6", "6", None], [None] * 4]
    out = summarize(correct, ks=(1, 4), answers=answers, resamples=200)
    assert out["problems"] == 3 and out["samples"] == 4
    assert out["pass@4"] == pytest.approx(2 / 3)
    assert out["pass@1"] == pytest.approx((0.5 + 0.5 + 0) / 3)
    assert out["maj@4"] == pytest.approx(2 / 3)
    for key in ("pass@1", "pass@4", "mean@1", "mean@4", "maj@1", "maj@4"):
        assert out[f"{key}_low"] <= out[key] <= out[f"{key}_high"], key


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: pass_at_k([[1, 0]], 3), "k=3 exceeds the 2 completions"),
        (lambda: pass_at_k([[1, 0]], 0), "k must be a positive int"),
        (lambda: pass_at_k([1, 0], 1), r"correct must be \[problems, samples\]"),
        (lambda: pass_at_k([[2, 0]], 1), "bool or 0/1"),
        (lambda: majority_at_k([["1"]], [[1, 0]], 1), "answers must be 1 rows of 2"),
        (lambda: bootstrap_interval([]), "non-empty 1-D"),
        (lambda: bootstrap_interval([1.0], confidence=1.0), "confidence"),
    ],
)
def test_bad_input_is_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()
