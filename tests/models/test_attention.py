"""Attention pieces: attention over a head-major cache (against a float64 reference), masks."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models.attention import attention_mask, cache_attention
from tests.reference import attention as ref


def _random_attention_inputs(rng, *, batch=2, seq=3, heads=4, kv_heads=2, slots=7, dim=8):
    q = rng.normal(size=(batch, seq, heads, dim)).astype(np.float32)
    k = rng.normal(size=(batch, kv_heads, slots, dim)).astype(np.float32)
    v = rng.normal(size=(batch, kv_heads, slots, dim)).astype(np.float32)
    mask = rng.random((batch, 1, seq, slots)) < 0.6
    mask[..., 0] = True  # every query sees at least one slot
    return q, k, v, mask


def test_cache_attention_matches_reference_with_gqa(rng):
    q, k, v, mask = _random_attention_inputs(rng)
    got = jax.jit(cache_attention, static_argnames="scale")(q, k, v, mask, scale=8**-0.5)
    chex.assert_shape(got, q.shape)
    want = ref.cache_attention(q, k, v, mask, 8**-0.5)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    # Query head 1 reads kv head 0 and head 2 reads kv head 1: grouped, not interleaved.
    other = ref.cache_attention(q, k[:, ::-1], v[:, ::-1], mask, 8**-0.5)
    assert not np.allclose(np.asarray(got), other, atol=1e-3)


def test_cache_attention_ignores_masked_slots(rng):
    q, k, v, mask = _random_attention_inputs(rng, seq=1)
    mask[:] = False
    mask[..., :3] = True
    noisy_k, noisy_v = k.copy(), v.copy()
    noisy_k[:, :, 3:] = 1e4  # would dominate the softmax if it leaked in
    noisy_v[:, :, 3:] = 1e6
    got = cache_attention(q, noisy_k, noisy_v, mask, scale=0.5)
    want = ref.cache_attention(q, k[:, :, :3], v[:, :, :3], mask[..., :3], 0.5)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def test_cache_attention_bf16_cache_is_close(rng):
    q, k, v, mask = _random_attention_inputs(rng)
    got = cache_attention(
        jnp.asarray(q, jnp.bfloat16),
        jnp.asarray(k, jnp.bfloat16),
        jnp.asarray(v, jnp.bfloat16),
        mask,
        scale=8**-0.5,
    )
    assert got.dtype == jnp.bfloat16
    want = ref.cache_attention(q, k, v, mask, 8**-0.5)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=5e-2, rtol=5e-2)


def test_attention_mask_is_causal_over_real_keys_and_always_sees_its_own_slot():
    # Row 0: slot 0 is padding; row 1: all real. Queries sit at slots 1 and 2 of 3.
    key_valid = np.array([[False, True, True], [True, True, True]])
    mask = np.asarray(attention_mask(jnp.asarray(key_valid), jnp.array([1, 2])))
    assert mask.shape == (2, 1, 2, 3)
    np.testing.assert_array_equal(mask[0, 0], [[0, 1, 0], [0, 1, 1]])
    np.testing.assert_array_equal(mask[1, 0], [[1, 1, 0], [1, 1, 1]])
    # A pad query (its own slot not real) still sees itself, so its softmax stays finite.
    lone = np.asarray(attention_mask(jnp.array([[False, False]]), jnp.array([0, 1])))
    np.testing.assert_array_equal(lone[0, 0], [[1, 0], [0, 1]])
