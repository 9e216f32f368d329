"""Tests for jaxrl_llm.token_selection against the float64 references of
tests/reference/stabilisers.py (TRL's formulas)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import token_selection
from tests.reference import losses as ref
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
