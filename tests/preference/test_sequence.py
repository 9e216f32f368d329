"""Tests for jaxrl_llm.preference._sequence against tests/reference/preference.py."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import preference as P
from tests.reference import preference as ref

# ------------------------------------------------------------------------------------------
# Sequence helpers.


def test_sequence_helpers_match_reference(rng):
    token_logps = rng.normal(-2.0, 1.0, (5, 7)).astype(np.float32)
    mask = rng.random((5, 7)) < 0.6
    mask[2] = False
    np.testing.assert_allclose(
        P.sequence_logps(token_logps, mask), ref.seq_sum(token_logps, mask), rtol=1e-6
    )
    np.testing.assert_allclose(
        P.average_logps(token_logps, mask), ref.seq_avg(token_logps, mask), rtol=1e-6
    )
    np.testing.assert_array_equal(P.sequence_lengths(mask), ref.seq_len(mask))
    assert float(P.average_logps(token_logps, mask)[2]) == 0.0  # empty completion guarded
    chex.assert_type(P.sequence_logps(token_logps.astype(jnp.bfloat16), mask), jnp.float32)


def test_padding_contributes_nothing_even_if_non_finite():
    token_logps = jnp.array([[-1.0, -2.0, -jnp.inf, jnp.nan]], jnp.float32)
    mask = jnp.array([[1, 1, 0, 0]], jnp.float32)
    assert float(P.sequence_logps(token_logps, mask)[0]) == -3.0
    grad = jax.grad(lambda x: P.average_logps(x, mask).sum())(token_logps)
    np.testing.assert_array_equal(grad, [[0.5, 0.5, 0.0, 0.0]])


def test_sequence_helpers_reject_bad_shapes():
    with pytest.raises(ValueError, match="mask"):
        P.sequence_logps(jnp.zeros((2, 3)), jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="rank 2"):
        P.sequence_lengths(jnp.ones(3))


def test_token_mean_nll_matches_reference(rng):
    token_logps = rng.normal(-2.0, 1.0, (5, 7)).astype(np.float32)
    mask = rng.random((5, 7)) < 0.6
    mask[2] = False
    prompt_logps = rng.normal(-3.0, 1.0, (5, 4)).astype(np.float32)
    prompt_mask = rng.random((5, 4)) < 0.7
    sums, lengths = P.sequence_logps(token_logps, mask), P.sequence_lengths(mask)
    got = P.token_mean_nll(sums, lengths)
    chex.assert_shape(got, (5,))
    np.testing.assert_allclose(got, ref.batch_token_mean_nll(token_logps, mask), rtol=1e-6)
    got = P.token_mean_nll(
        sums,
        lengths,
        prompt_logps=P.sequence_logps(prompt_logps, prompt_mask),
        prompt_len=P.sequence_lengths(prompt_mask),
    )
    want = ref.batch_token_mean_nll(token_logps, mask, prompt_logps, prompt_mask)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # No tokens at all: guarded, 0 rather than NaN.
    assert float(P.token_mean_nll(jnp.zeros(3), jnp.zeros(3))[0]) == 0.0


def test_token_mean_nll_errors():
    z = jnp.zeros(3)
    with pytest.raises(ValueError, match="both prompt_logps and prompt_len"):
        P.token_mean_nll(z, z, prompt_logps=z)
    with pytest.raises(ValueError, match="shape mismatch"):
        P.token_mean_nll(z, jnp.zeros(4))
