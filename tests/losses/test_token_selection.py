"""Tests for jaxrl_llm.losses.token_selection against the float64 references of
tests/reference/stabilisers.py (TRL's formulas) and tests/reference/m2po.py (AReaL's M2PO)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.losses import token_selection
from tests.reference import losses as ref
from tests.reference import m2po as m2ref
from tests.reference import stabilisers as stab

B, T = 6, 5


def _batch(rng):
    entropy = rng.uniform(0.0, 3.0, (B, T)).astype(np.float32)
    mask = ref.ragged_mask(rng, B, T, empty_rows=(4,), full_rows=(0,))
    return np.where(mask > 0, entropy, 100.0).astype(np.float32), mask  # padding: the largest


@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.5, 0.8, 1.0])
def test_top_entropy_mask_matches_reference(rng, quantile):
    entropy, mask = _batch(rng)
    out = token_selection.top_entropy_mask(entropy, mask, quantile=quantile)
    want = stab.top_entropy_mask(entropy, mask, quantile)
    np.testing.assert_array_equal(out, want)
    valid = int(mask.sum())
    kept = int(np.asarray(out).sum())
    # The top-ρ fraction: ⌈ρ·(N − 1)⌉ + 1 tokens or so, never fewer than one, all valid.
    assert 1 <= kept <= valid and not np.any(np.asarray(out)[mask == 0])
    if quantile == 1.0:
        assert kept == valid
    if quantile == 0.0:
        assert (
            kept == 1 and out[np.unravel_index(np.argmax(np.where(mask > 0, entropy, -1)), (B, T))]
        )


def test_top_entropy_mask_keeps_the_high_entropy_tokens_hand_checked():
    entropy = jnp.array([[0.1, 2.0, 0.5, 3.0, 1.0], [9.0, 9.0, 9.0, 9.0, 9.0]])
    mask = jnp.array([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], jnp.float32)
    # Valid entropies 0.1 0.5 1 2 3: the 0.6-quantile (ρ = 0.4) is 1 + 0.4·(2 − 1) = 1.4.
    np.testing.assert_allclose(token_selection.masked_quantile(entropy, mask, 0.6), 1.4)
    out = token_selection.top_entropy_mask(entropy, mask, quantile=0.4)
    np.testing.assert_array_equal(out, [[0, 1, 0, 1, 0], [0, 0, 0, 0, 0]])


def test_top_entropy_mask_ties_and_empty():
    mask = jnp.ones((2, 3))
    flat = jnp.full((2, 3), 0.7)
    np.testing.assert_array_equal(token_selection.top_entropy_mask(flat, mask, quantile=0.1), mask)
    empty = jnp.zeros((2, 3))
    np.testing.assert_array_equal(
        token_selection.top_entropy_mask(flat, empty, quantile=0.2), jnp.zeros((2, 3))
    )
    assert float(token_selection.masked_quantile(flat, empty, 0.5)) == 0.0


def test_top_entropy_mask_has_no_gradient_and_jits(rng):
    entropy, mask = _batch(rng)
    grad = jax.grad(lambda h: token_selection.top_entropy_mask(h, mask, quantile=0.3).sum())(
        jnp.asarray(entropy)
    )
    assert not np.any(grad)
    jitted = jax.jit(token_selection.top_entropy_mask, static_argnames="quantile")
    np.testing.assert_array_equal(
        jitted(entropy, mask, quantile=0.3),
        token_selection.top_entropy_mask(entropy, mask, quantile=0.3),
    )


@pytest.mark.parametrize("adv_rank", [1, 2])
@pytest.mark.parametrize("threshold", [0.0, 0.1, 0.5])
def test_off_policy_sequence_mask_matches_reference(rng, adv_rank, threshold):
    lp = -rng.uniform(0.1, 3.0, (B, T)).astype(np.float32)
    sampling = (lp + rng.normal(0.1, 0.3, (B, T))).astype(np.float32)
    adv = rng.normal(size=(B,) if adv_rank == 1 else (B, T)).astype(np.float32)
    adv[2] = -1.0
    mask = ref.ragged_mask(rng, B, T, empty_rows=(4,), full_rows=(0,))
    out = token_selection.off_policy_sequence_mask(lp, sampling, adv, mask, threshold=threshold)
    np.testing.assert_array_equal(
        out, stab.off_policy_sequence_mask(lp, sampling, adv, mask, threshold)
    )
    if threshold == 0.1 and adv_rank == 1:
        assert 0 < np.asarray(out).sum() < mask.sum()  # some rows dropped, some kept


def test_off_policy_sequence_mask_hand_checked():
    lp = jnp.log(jnp.array([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]))
    # Row drift (mean log π_old − log π_θ): 0.6, 0.6, 0.2 (one valid token), −1.
    sampling = lp + jnp.array([[0.6, 0.6], [0.6, 0.6], [0.2, 9.0], [-1.0, -1.0]])
    mask = jnp.array([[1, 1], [1, 1], [1, 0], [1, 1]], jnp.float32)
    adv = jnp.array([1.0, -1.0, -1.0, -1.0])
    out = token_selection.off_policy_sequence_mask(lp, sampling, adv, mask, threshold=0.5)
    # Kept: A ≥ 0; dropped: A < 0 and drift 0.6 > 0.5; kept: drift 0.2; kept: negative drift.
    np.testing.assert_array_equal(out, [[1, 1], [0, 0], [1, 0], [1, 1]])
    grad = jax.grad(
        lambda x: token_selection.off_policy_sequence_mask(
            x, sampling, adv, mask, threshold=0.5
        ).sum()
    )(lp)
    assert not np.any(grad)


def test_errors(rng):
    entropy, mask = _batch(rng)
    with pytest.raises(ValueError, match="quantile"):
        token_selection.top_entropy_mask(entropy, mask, quantile=1.5)
    with pytest.raises(ValueError, match="mask shape"):
        token_selection.top_entropy_mask(entropy[:, :-1], mask, quantile=0.2)
    with pytest.raises(ValueError, match="threshold"):
        token_selection.off_policy_sequence_mask(
            entropy, entropy, np.zeros(B), mask, threshold=-1.0
        )
    with pytest.raises(ValueError, match="advantages"):
        token_selection.off_policy_sequence_mask(
            entropy, entropy, np.zeros(B + 1), mask, threshold=0.5
        )


# ----------------------------------------------------------------------------- M2PO


def _log_ratios(rng, scale=0.3):
    log_ratio = rng.normal(0.0, scale, (B, T)).astype(np.float32)
    log_ratio[1, 0], log_ratio[2, 1] = 2.0, -1.5  # outliers
    mask = ref.ragged_mask(rng, B, T, empty_rows=(4,), full_rows=(0, 1))
    return np.where(mask > 0, log_ratio, np.inf).astype(np.float32), mask  # padding: inf


@pytest.mark.parametrize("threshold", [1e-4, 0.01, 0.04, 0.1, 1.0, 10.0])
def test_m2po_mask_matches_areal_reference(rng, threshold):
    log_ratio, mask = _log_ratios(rng)
    out = np.asarray(token_selection.m2po_mask(log_ratio, mask, threshold=threshold))
    want = m2ref.m2po_mask(log_ratio, mask, threshold)
    np.testing.assert_array_equal(out, want)
    assert not np.any(out[mask == 0]) and out.sum() >= 1
    kept_m2 = m2ref.second_moment(np.where(out > 0, log_ratio, 0.0), out)
    if out.sum() > 1:  # not AReaL's keep-one fallback: the kept tokens are under τ
        assert kept_m2 < threshold
    np.testing.assert_allclose(
        token_selection.second_moment(log_ratio, mask), m2ref.second_moment(log_ratio, mask), 1e-6
    )


def test_m2po_mask_hand_checked():
    # Valid (log r)²: .25 .01 .09 0 .04, M̂₂ = .39/5 = .078 ≥ .04; without .25: .14/4 = .035.
    log_ratio = jnp.array([[0.5, 0.1, -0.3], [0.0, 0.2, 9.0]])
    mask = jnp.array([[1, 1, 1], [1, 1, 0]], jnp.float32)
    out = token_selection.m2po_mask(log_ratio, mask, threshold=0.04)
    np.testing.assert_array_equal(out, [[0, 1, 1], [1, 1, 0]])
    np.testing.assert_allclose(token_selection.second_moment(log_ratio, mask), 0.078, rtol=1e-6)
    # τ = .03: .14/4 = .035 still ≥ τ; without .09 too: .05/3 ≈ .0167 < τ, so two go.
    out = token_selection.m2po_mask(log_ratio, mask, threshold=0.03)
    np.testing.assert_array_equal(out, [[0, 1, 0], [1, 1, 0]])


def test_m2po_mask_edge_cases():
    mask = jnp.array([[1, 1, 1], [1, 0, 0]], jnp.float32)
    # Already under the threshold: nothing is masked (the strict < of AReaL: M̂₂ = τ masks).
    small = jnp.full((2, 3), 0.1)
    np.testing.assert_array_equal(token_selection.m2po_mask(small, mask, threshold=0.02), mask)
    np.testing.assert_array_equal(
        token_selection.m2po_mask(small, mask, threshold=0.01), [[0, 0, 0], [1, 0, 0]]
    )
    # A suffix mean equal to τ is not under it (AReaL's strict <): (log r)² .25 .25 0, suffix
    # means 1/6, 1/8, 0 (exact in f32); τ = 1/8 masks two tokens.
    exact = jnp.array([[0.5, 0.0, -0.5], [0.5, 0.0, 0.0]])
    one_row = jnp.array([[1, 1, 1], [0, 0, 0]], jnp.float32)
    np.testing.assert_array_equal(
        token_selection.m2po_mask(exact, one_row, threshold=0.125), [[0, 1, 0], [0, 0, 0]]
    )
    # No suffix under τ: every token but the smallest goes (never all of them).
    big = jnp.array([[3.0, -2.0, 4.0], [1.0, 7.0, 7.0]])
    np.testing.assert_array_equal(
        token_selection.m2po_mask(big, mask, threshold=0.5), [[0, 0, 0], [1, 0, 0]]
    )
    # Ties: (log r)² .25 .25 .01 | .25, suffix means .19 .17 .13 .01: two of the three tied
    # tokens go (τ = .15), the earlier flat indices first.
    ties = jnp.array([[0.5, -0.5, 0.1], [0.5, 0.0, 0.0]])
    np.testing.assert_array_equal(
        token_selection.m2po_mask(ties, mask, threshold=0.15), [[0, 0, 1], [1, 0, 0]]
    )
    np.testing.assert_array_equal(
        token_selection.m2po_mask(ties, mask, threshold=0.15),
        m2ref.m2po_mask(np.asarray(ties), np.asarray(mask), 0.15),
    )
    # All tied above τ: AReaL's fallback keeps one, the last of them.
    flat = jnp.full((2, 3), 0.5)
    np.testing.assert_array_equal(
        token_selection.m2po_mask(flat, mask, threshold=0.2), [[0, 0, 0], [1, 0, 0]]
    )
    # Empty mask (and garbage padding): all 0, no NaN; one valid token: kept.
    empty = jnp.zeros((2, 3))
    garbage = jnp.array([[jnp.nan, jnp.inf, -jnp.inf], [1.0, 2.0, 3.0]])
    np.testing.assert_array_equal(token_selection.m2po_mask(garbage, empty, threshold=0.04), empty)
    assert float(token_selection.second_moment(garbage, empty)) == 0.0
    one = jnp.array([[0, 0, 0], [0, 0, 1]], jnp.float32)
    np.testing.assert_array_equal(token_selection.m2po_mask(garbage, one, threshold=0.04), one)


def test_m2po_mask_has_no_gradient_and_jits(rng):
    log_ratio, mask = _log_ratios(rng)
    log_ratio = np.where(mask > 0, log_ratio, 0.0).astype(np.float32)
    grad = jax.grad(lambda x: token_selection.m2po_mask(x, mask, threshold=0.04).sum())(
        jnp.asarray(log_ratio)
    )
    assert not np.any(grad)
    jitted = jax.jit(token_selection.m2po_mask, static_argnames="threshold")
    np.testing.assert_array_equal(
        jitted(log_ratio, mask, threshold=0.04),
        m2ref.m2po_mask(log_ratio, mask, 0.04),
    )


def test_m2po_errors(rng):
    log_ratio, mask = _log_ratios(rng)
    for bad in (0.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="m2_threshold"):
            token_selection.m2po_mask(log_ratio, mask, threshold=bad)
    with pytest.raises(ValueError, match="mask shape"):
        token_selection.m2po_mask(log_ratio[:, :-1], mask, threshold=0.04)
