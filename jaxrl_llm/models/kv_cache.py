"""The KV cache of incremental decoding: its layout, logical axes, creation and slot writes.

Head-major: each (row, head) keeps its slots as one contiguous ``[S_max, H]`` block. The cache is
either stacked over layers (``[L, B, K, S_max, H]``, what the scanned model reads) or a tuple of
``L`` per-layer arrays (``jaxrl_llm.sampling.layout.unstack_cache``, what the unrolled CPU
decode reads).

Shapes: B batch, S sequence, K key/value heads, H head dim, L layers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm.models.config import ModelConfig

Array = jax.Array


class KVCache(NamedTuple):
    """Per-layer key/value cache for incremental decoding (a plain pytree).

    Head-major: each (row, head) keeps its slots as one contiguous ``[S_max, H]`` block, the
    operand layout of the attention's batched matmuls, so a decode step reads the cache where it
    lies instead of transposing it.

    Attributes:
      k: ``[L, B, K, S_max, H]`` keys after RoPE, or a tuple of ``L`` per-layer
        ``[B, K, S_max, H]`` arrays (``jaxrl_llm.sampling.layout.unstack_cache``).
      v: values, like ``k``.
      mask: ``[B, S_max]`` bool, True on slots that hold a real (non-pad) token.
    """

    k: Array
    v: Array
    mask: Array


CACHE_AXES = KVCache(
    k=("layers", "batch", "kv_heads", "cache_seq", "head_dim"),
    v=("layers", "batch", "kv_heads", "cache_seq", "head_dim"),
    mask=("batch", "cache_seq"),
)


def init_cache(
    config: ModelConfig, batch_size: int, max_len: int, *, dtype: Any = jnp.bfloat16
) -> KVCache:
    """An empty cache: zeros ``k, v: [L, B, K, max_len, H]`` and an all-False mask."""
    shape = (
        config.num_hidden_layers,
        batch_size,
        config.num_key_value_heads,
        max_len,
        config.head_dim,
    )
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        mask=jnp.zeros((batch_size, max_len), bool),
    )


def write_slots(cache: Array, new: Array, layer_index: Any, cache_index: Array) -> Array:
    """Writes ``new: [B, S, K, H]`` at slots ``[cache_index, cache_index + S)`` of a cache.

    A ``[B]`` ``cache_index`` writes row ``b`` from slot ``cache_index[b]`` (one scatter, which
    XLA updates in place inside a loop).
    """
    if jnp.ndim(cache_index) == 1:
        rows = jnp.arange(new.shape[0])[:, None]
        slots = cache_index[:, None] + jnp.arange(new.shape[1])  # [B, S]
        new = new.astype(cache.dtype)
        # Advanced indices split by a slice put their [B, S] first: the value is [B, S, K, H].
        if layer_index is None:
            return cache.at[rows, :, slots].set(new, mode="drop")
        return cache.at[layer_index, rows, :, slots].set(new, mode="drop")
    new = new.swapaxes(1, 2).astype(cache.dtype)  # head-major [B, K, S, H]
    if layer_index is None:
        return jax.lax.dynamic_update_slice(cache, new, (0, 0, cache_index, 0))
    return jax.lax.dynamic_update_slice(cache, new[None], (layer_index, 0, 0, cache_index, 0))


def layer_slice(stacked: Array, index: Any) -> Array:
    """Layer ``index`` (may be traced) of a stacked cache array: ``[L, ...] -> [...]``."""
    return jax.lax.dynamic_index_in_dim(stacked, index, 0, keepdims=False)


def check_cache(
    config: ModelConfig, cache: KVCache, token_shape: tuple[int, ...], cache_index: Any
) -> None:
    """Raises ValueError unless ``cache`` can take ``[B, S]`` tokens at ``cache_index``.

    k and v must be ``[L, B, K, S_max, H]`` (stacked, or ``L`` per-layer arrays) for the
    model's ``L, K, H`` and the tokens' ``B``, with ``S <= S_max``; ``cache_index`` is a scalar
    (every row writes the same slots) or ``[B]`` (row ``b`` writes from ``cache_index[b]``).
    """
    if cache_index is None:
        raise ValueError("a cache needs cache_index (the first slot this call writes)")
    batch, seq = token_shape
    if jnp.ndim(cache_index) != 0 and tuple(jnp.shape(cache_index)) != (batch,):
        raise ValueError(
            f"cache_index must be a scalar or one slot per row [{batch}], got shape "
            f"{jnp.shape(cache_index)}"
        )
    layers, kv_heads, head_dim = (
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
    )
    max_len = cache.mask.shape[-1] if jnp.ndim(cache.mask) == 2 else -1
    want = (layers, batch, kv_heads, max_len, head_dim)
    got_k, got_v = _cache_shape(cache.k), _cache_shape(cache.v)
    if got_k != want or got_v != want:
        raise ValueError(
            f"cache k/v must have shape [L, B, K, S_max, H]={want} for tokens {token_shape}, "
            f"got k{got_k} v{got_v} mask{tuple(cache.mask.shape)}"
        )
    if seq > max_len:
        raise ValueError(f"{seq} tokens do not fit a cache of {max_len} slots")


def _cache_shape(x: Any) -> tuple[Any, ...]:
    """``[L, B, K, S, H]`` of a stacked cache array or of a tuple of ``L`` per-layer arrays."""
    if not isinstance(x, tuple):
        return tuple(jnp.shape(x))
    shapes = {tuple(jnp.shape(a)) for a in x}
    return (len(x), *shapes.pop()) if len(shapes) == 1 else (len(x), *sorted(shapes))
