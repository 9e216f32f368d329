"""Attention pieces: rotary embeddings, the causal key mask and attention over a cache.

Shapes: B batch, S sequence, N query heads, K key/value heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.models.config import ModelConfig, rope_inv_freq

Array = jax.Array


def rope_angles(config: ModelConfig, positions: Array) -> tuple[Array, Array]:
    """``cos, sin`` of ``positions * inv_freq``: ``[B, S]`` int -> two ``[B, S, H/2]`` f32."""
    inv_freq = jnp.asarray(rope_inv_freq(config))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotary embedding (Su et al. 2021, RoFormer), half-split layout as in transformers.

    ``[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]`` on ``x: [B, S, heads, H]`` in f32.
    """
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def cache_attention(q: Array, k: Array, v: Array, mask: Array, *, scale: float) -> Array:
    """``o_i = sum_j softmax_j(scale * q_i . k_j) v_j`` over the cached slots ``j`` in ``mask``.

    Scaled dot-product attention (Vaswani et al. 2017) over a head-major cache; query head ``n``
    reads key/value head ``n // (N / K)`` (grouped-query attention, Ainslie et al. 2023). Both
    products are batched over (row, kv-head) with the cache as the right operand in its stored
    layout, so XLA reads it in place.

    Args:
      q: ``[B, S, N, H]`` queries (after RoPE).
      k, v: ``[B, K, S_kv, H]`` cached keys (after RoPE) and values.
      mask: ``[B, 1, S, S_kv]`` bool; every query must see at least one slot.
      scale: score multiplier, usually ``H ** -0.5``.

    Returns:
      ``[B, S, N, H]`` in ``q.dtype``.
    """
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)
    # Products in the cache's dtype (XLA:CPU has no bf16 x bf16 -> f32 batched matmul), as
    # jax.nn.dot_product_attention does; the softmax in f32.
    scores = jnp.einsum("bqkgh,bksh->bkgqs", grouped.astype(k.dtype), k).astype(jnp.float32)
    scores = jnp.where(mask[:, :, None], scores * scale, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgqs,bksh->bqkgh", probs.astype(v.dtype), v)
    return out.reshape(batch, seq, heads, head_dim).astype(q.dtype)


def attention_mask(key_valid: Array, query_slots: Array) -> Array:
    """``[B, 1, S, S_kv]``: key slot j visible to query slot i iff j <= i and j is real.

    A query always sees its own slot, so pad queries get a finite (ignored) output instead of
    attending to nothing; for real queries this changes nothing since their own slot is real.
    """
    key_slots = jnp.arange(key_valid.shape[1])
    causal = key_slots[None, :] <= query_slots[:, None]
    own = key_slots[None, :] == query_slots[:, None]
    mask = (causal[None] & key_valid[:, None, :]) | own[None]
    return mask[:, None]
