"""Per-layer layout of the weights and KV cache for decoding on CPU.

``models.forward`` scans over layers stacked along a leading ``[L, ...]`` axis, which keeps
compile time flat in depth. On CPU, XLA copies each layer's slice out of a stacked array before
the matmuls that read it: every decode step would copy all the weights and the whole cache once
more than it reads them. Split into per-layer arrays (one copy per ``decode`` call, outside its
loop), ``forward`` runs the layers unrolled and every step reads weights and cache in place;
the cache is also updated in place, one slot per layer. Longer calls also decode in windows
(``decode_windows``): each of a few loops carries only the cache slots its steps can attend to.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm.models import KVCache

Params = dict[str, Any]

# Largest layer weights (bytes) that CPU decoding copies into per-layer arrays.
UNROLL_MAX_BYTES = 2**31


def _split(stacked: Any) -> tuple[Any, ...]:
    """A pytree of ``[L, ...]`` arrays as a tuple of ``L`` pytrees (static slices)."""
    count = jax.tree.leaves(stacked)[0].shape[0]
    return tuple(jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(count))


def unstack_layers(params: Params) -> Params:
    """``params`` with ``params["layers"]`` (``[L, ...]`` leaves) split into ``L`` dicts.

    Args:
      params: model parameters from ``init_params`` / ``load_pretrained``.

    Returns:
      The same dict with ``"layers"`` a tuple of per-layer dicts (unchanged if already split).
    """
    layers = params["layers"]
    return params if isinstance(layers, tuple) else {**params, "layers": _split(layers)}


def unstack_cache(cache: KVCache) -> KVCache:
    """``k, v: [L, B, K, S, H]`` split into tuples of ``L`` ``[B, K, S, H]`` arrays."""
    if isinstance(cache.k, tuple):
        return cache
    return cache._replace(k=_split(cache.k), v=_split(cache.v))


def stack_cache(cache: KVCache) -> KVCache:
    """Inverse of ``unstack_cache``: ``k, v`` back to ``[L, B, K, S, H]`` arrays."""
    if not isinstance(cache.k, tuple):
        return cache
    return cache._replace(k=jnp.stack(cache.k), v=jnp.stack(cache.v))


DECODE_LAYERS = ("auto", "stacked", "per_layer")


def worth_unstacking(params: Params, mode: str = "auto") -> bool:
    """Whether ``decode`` splits ``params`` and the cache (``mode``: ``rollout.decode_layers``).

    ``auto``: on CPU, up to a size; accelerators keep the scan. The split holds a second copy
    of the layer weights while decoding; past ``UNROLL_MAX_BYTES`` of them the memory is worth
    more than the speed. Traced params count as the default backend's. ``stacked`` never
    splits; ``per_layer`` always does: on TPU, XLA copies a stacked cache's layer slices every
    step, which long completions pay for (Qwen2.5-7B with 8k tokens on v5p-8: 26% of the HBM
    roofline stacked, 85% per layer; Qwen2.5-0.5B with 256 tokens on v5litepod-4: at the
    roofline either way), at the cost of the weights' second copy on each chip while decoding;
    ``jaxrl-llm plan`` estimates either.

    Raises:
      ValueError: an unknown ``mode``.
    """
    if mode not in DECODE_LAYERS:
        raise ValueError(f"rollout.decode_layers must be one of {DECODE_LAYERS}, got {mode!r}")
    if mode != "auto":
        return mode == "per_layer"
    size = sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params["layers"]))
    return _on_cpu(params) and size <= UNROLL_MAX_BYTES


def _on_cpu(params: Params) -> bool:
    """Whether ``params`` live on CPU devices (traced params: the default backend)."""
    leaf = jax.tree.leaves(params)[0]
    if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
        return jax.default_backend() == "cpu"
    return all(device.platform == "cpu" for device in leaf.sharding.device_set)


# A decode window covers at least this many steps; a call runs at most this many windows.
WINDOW_MIN_STEPS = 32
MAX_WINDOWS = 4
# The continuous engine's cache widths (``sampling.engine``): at most this many.
ENGINE_WIDTHS = 8


def decode_windows(
    params: Params, max_new_tokens: int, mode: str = "auto", most: int = MAX_WINDOWS
) -> tuple[int, ...]:
    """The steps at which ``decode``'s windows end (``()``: one loop over the whole cache).

    A step at column ``t`` attends to the prompt and the ``t`` tokens before it, but a loop
    over a ``P + T``-slot cache reads all of it every step. Split into ``n`` loops ending at
    steps ``ceil(T * i / n)``, the ``i``-th carries and attends over the first
    ``P + ceil(T * i / n)`` slots (the cache is padded by the next window's slots between
    loops, once), so a call reads ``(n + 1) / (2n)`` of the K/V it did, plus the pads. Each
    window is another loop body to compile: ``n = min(most, T // WINDOW_MIN_STEPS)``, none
    below two. The continuous engine cuts its cache to these widths (``most=ENGINE_WIDTHS``).

    Only where the loop runs per layer on CPU (``worth_unstacking``): a stacked cache's pad
    would hold two copies of it at once, and ``jaxrl-llm plan`` estimates one loop on
    accelerators.
    """
    if not (worth_unstacking(params, mode) and _on_cpu(params)):
        return ()
    count = min(most, max_new_tokens // WINDOW_MIN_STEPS)
    if count < 2:
        return ()
    return tuple(-(-max_new_tokens * i // count) for i in range(1, count + 1))
