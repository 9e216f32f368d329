"""Context parallelism: a training or scoring forward's sequence split over the mesh's
``sequence`` axis (``parallel.make_mesh(..., sequence=s)``, ``mesh.sequence``).

Each device holds ``T / s`` positions of every row through the whole layer stack: the norms,
projections, MLPs and RoPE are position-wise, so GSPMD runs them on the local positions with no
communication (the residual stream is pinned to ``("batch", "sequence", "embed")``); only
attention needs other positions. Per layer, each device all-gathers the keys and values (and
their validity, segment ids and slots) over ``sequence`` and attends with its own queries
against all ``T`` keys (Megatron-LM's and MaxText's all-gather context parallelism; Liu et al.
2023's ring attention passes the blocks around instead). The backward reduce-scatters the keys'
and values' gradients. Attention memory per device is that of ``T / s`` queries: linear in T
with the splash kernel on TPU, ``[T / s, T]`` scores elsewhere.

Causal load balance. With the positions split in order, device ``s - 1`` would attend to all
of T and device 0 to its own chunk only. The forward therefore permutes the sequence once
(``zigzag``): cut into ``2s`` chunks, device ``r`` holds chunks ``r`` and ``2s - 1 - r``, so
every device has the same number of causal (query, key) pairs; the mask is built from each
position's true slot, and the hidden states are put back in order after the last layer. The
sequence is padded (masked) to a multiple of ``2s`` (of ``2s x 128`` for the splash kernel,
whose blocks are 128 wide).

The weights are stored split over ``fsdp x sequence`` (``parallel.rules.PARAM_RULES``) and
gathered for use as on any FSDP mesh. Sampling never splits a sequence (a decode step has one
position): on a sampling mesh the axis splits rows like ``data``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from jaxrl_llm.models import attention_backends as backends
from jaxrl_llm.models.attention import cache_attention, resolve_attention_implementation
from jaxrl_llm.models.attention_backends import attention_mask, window_limit

Array = jax.Array

AXIS = "sequence"
# The splash kernel's block width: each of a device's two chunks is a multiple of it.
_SPLASH_LANES = 128


def shards() -> int:
    """``s``: the context mesh's ``sequence`` axis size; 1 without a mesh, without the axis, or
    inside a ``shard_map`` that made it manual."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.axis_names or AXIS in getattr(mesh, "manual_axes", ()):
        return 1
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        raise ValueError(
            "context parallelism (a 'sequence' mesh axis) needs a mesh of Auto axes "
            "(parallel.make_mesh's default)"
        )
    return int(dict(mesh.shape)[AXIS])


def zigzag(length: int, count: int) -> np.ndarray:
    """The load-balanced order of ``length`` slots over ``count`` devices: ``order[p]`` is the
    slot at permuted position ``p``. The slots are cut into ``2 count`` equal chunks and device
    ``r`` (positions ``[r L / count, (r + 1) L / count)``) holds chunks ``r`` and
    ``2 count - 1 - r``: ``zigzag(8, 2) = [0, 1, 6, 7, 2, 3, 4, 5]``.

    Raises:
      ValueError: ``length`` is not a multiple of ``2 count``.
    """
    if count < 1 or length % (2 * count):
        raise ValueError(f"zigzag needs a length divisible by 2 x {count} shards, got {length}")
    chunk = length // (2 * count)
    chunks = np.arange(length).reshape(2 * count, chunk)
    return np.concatenate(
        [np.concatenate([chunks[r], chunks[2 * count - 1 - r]]) for r in range(count)]
    )


def padded_length(length: int, count: int, *, splash: bool) -> int:
    """``length`` rounded up to what ``count`` shards split into load-balanced chunks: a
    multiple of ``2 count`` (``2 count x 128`` for the splash kernel)."""
    multiple = 2 * count * (_SPLASH_LANES if splash else 1)
    return -(-length // multiple) * multiple


def uses_splash(dtype: Any, head_dim: int, **features: Any) -> bool:
    """Whether attention on the context mesh runs the splash kernel (TPU)."""
    return (
        resolve_attention_implementation("auto", dtype=dtype, head_dim=head_dim, **features)
        == "splash"
    )


def attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    key_valid: Array,
    slots: Array,
    segment_ids: Array | None,
    scale: float,
    logit_softcap: float | None = None,
    sliding_window: int | None = None,
    window_active: Any = True,
    sinks: Array | None = None,
) -> Array:
    """Causal self-attention over a sequence split over the ``sequence`` axis.

    ``o_i = sum_j softmax_j(scale q_i . k_j) v_j`` over the keys ``j`` with ``slot_j <=
    slot_i``, ``key_valid[b, j]`` and (packed rows) ``segment_ids[b, j] == segment_ids[b, i]``
    (and, with a sliding window W, ``slot_i - slot_j < W``): the same attention as
    ``attention.dot_product_attention`` over the sequence in slot order, for sequences stored
    in any order (``slots``: the true slot of each position, here the ``zigzag`` order).

    Args:
      q: ``[B, T, N, H]``, ``k, v: [B, T, K, H]`` with ``T`` split over ``sequence``.
      key_valid: ``[B, T]`` bool (True on real tokens).
      slots: ``[T]`` int32, each position's slot in the sequence (a permutation of ``0..T-1``
        that is ``zigzag(T, s)`` when the splash kernel runs).
      segment_ids: ``[B, T]`` int32 of packed rows (0 on padding), or None.
      scale, logit_softcap, sliding_window, window_active, sinks: as
        ``attention.dot_product_attention``.

    Returns:
      ``[B, T, N, H]`` in ``q.dtype``, split as ``q``.
    """
    mesh = jax.sharding.get_abstract_mesh()
    count = dict(mesh.shape)[AXIS]
    if window_active is False:
        sliding_window = None
    splash = uses_splash(
        q.dtype,
        q.shape[-1],
        logit_softcap=logit_softcap,
        sliding_window=sliding_window,
        sinks=sinks is not None,
    )
    segments = key_valid.astype(jnp.int32)
    if segment_ids is not None:
        segments = jnp.where(key_valid, segment_ids, 0)
    options = dict(
        count=count,
        scale=scale,
        logit_softcap=logit_softcap,
        sliding_window=sliding_window,
        window_active=window_active,
    )
    local = functools.partial(_splash_local if splash else _masked_local, **options)
    slots = jnp.asarray(slots, jnp.int32)
    return backends.per_device_attention(
        local, q, k, v, segments, slots, sinks=sinks, sequence=AXIS
    )


def _gather(x: Array, axis: int) -> Array:
    """All of the sequence's positions, in stored order (backward: a reduce-scatter)."""
    return jax.lax.all_gather(x, AXIS, axis=axis, tiled=True)


def _masked_local(
    q: Array,
    k: Array,
    v: Array,
    segments: Array,
    slots: Array,
    sinks: Array | None = None,
    *,
    count: int,
    scale: float,
    logit_softcap: float | None,
    sliding_window: int | None,
    window_active: Any,
) -> Array:
    """One device's queries against every key, masked by slots (``attention.cache_attention``:
    ``[B, N, T / s, T]`` f32 scores)."""
    del count
    keys, values = _gather(k, 1), _gather(v, 1)
    key_segments, key_slots = _gather(segments, 1), _gather(slots, 0)
    mask = attention_mask(  # [B, 1, C, T]; a query always sees its own slot
        key_segments > 0,
        slots,
        window=window_limit(sliding_window, window_active, key_slots.shape[0]),
        segments=(segments, key_segments),
        key_slots=key_slots,
    )
    return cache_attention(
        q,
        jnp.swapaxes(keys, 1, 2),
        jnp.swapaxes(values, 1, 2),
        mask,
        scale=scale,
        logit_softcap=logit_softcap,
        sinks=sinks,
    )


def _splash_local(
    q: Array,
    k: Array,
    v: Array,
    segments: Array,
    slots: Array,
    sinks: Array | None = None,
    *,
    count: int,
    scale: float,
    logit_softcap: float | None,
    sliding_window: int | None,
    window_active: Any,
) -> Array:
    """One device's two zigzag chunks with the splash kernel (``splash_chunk_attention``)
    against the keys put back in slot order: chunk ``j`` of ``c`` queries sees keys up to slot
    ``j c + i``. The chunks' slots depend on the device's index, so the kernels (whose masks are
    static) are chosen by ``lax.switch`` over it."""
    del slots  # the zigzag order is implied by the device index
    length = k.shape[1] * count
    chunk = length // (2 * count)
    order = np.argsort(zigzag(length, count))  # stored position of each slot
    keys, values = (jnp.take(_gather(x, 1), order, axis=1) for x in (k, v))
    key_segments = jnp.take(_gather(segments, 1), order, axis=1)
    windowed = sliding_window is not None and window_active is not False

    def kernel(x: Array, x_segments: Array, offset: int, window: int | None) -> Array:
        return backends.splash_chunk_attention(
            x,
            keys,
            values,
            (x_segments, key_segments),
            offset=offset,
            scale=scale,
            logit_softcap=logit_softcap,
            sliding_window=window,
            sinks=sinks,
        )

    def device(r: int, window: int | None) -> Array:
        first = kernel(q[:, :chunk], segments[:, :chunk], r * chunk, window)
        second = kernel(q[:, chunk:], segments[:, chunk:], (2 * count - 1 - r) * chunk, window)
        return jnp.concatenate([first, second], axis=1)

    def run(window: int | None) -> Array:
        index = jax.lax.axis_index(AXIS)
        return jax.lax.switch(index, [functools.partial(device, r, window) for r in range(count)])

    if not windowed or window_active is True:
        return run(sliding_window if windowed else None)
    return jax.lax.cond(window_active, lambda: run(sliding_window), lambda: run(None))


__all__ = ["AXIS", "attention", "padded_length", "shards", "uses_splash", "zigzag"]
