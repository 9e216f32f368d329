"""Attention pieces: rotary embeddings, the causal key mask, attention over a cache, and causal
self-attention over a whole sequence with one implementation per backend.

Shapes: B batch, S sequence, N query heads, K key/value heads, H head dim.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm.models import attention_backends as backends
from jaxrl_llm.models.attention_backends import (
    attention_mask,
    sink_softmax,
    softcap,
    window_limit,
)
from jaxrl_llm.models.config import ModelConfig, rope_inv_freq
from jaxrl_llm.parallel.mesh import current_platform

Array = jax.Array


def rope_angles(
    config: ModelConfig, positions: Array, *, local: bool = False
) -> tuple[Array, Array]:
    """``m cos, m sin`` of ``positions * inv_freq``: ``[B, S]`` int -> two ``[B, S, H/2]`` f32.

    ``m`` is ``config.rope_attention_scaling`` (YaRN's attention factor, which thus scales the
    queries and keys, and the scores by ``m^2``, as transformers' rotary embeddings do; 1 for
    the other RoPE types). ``local``: the sliding-window layers' frequencies
    (``rope_inv_freq(config, local=True)``, unscaled: ``m = 1``).
    """
    inv_freq = jnp.asarray(rope_inv_freq(config, local=local))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    scale = 1.0 if local and config.rope_local_theta is not None else config.rope_attention_scaling
    if scale == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


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


def cache_attention(
    q: Array,
    k: Array,
    v: Array,
    mask: Array,
    *,
    scale: float,
    kv_major: bool = False,
    logit_softcap: float | None = None,
    sinks: Array | None = None,
) -> Array:
    """``o_i = sum_j softmax_j(scale * q_i . k_j) v_j`` over the cached slots ``j`` in ``mask``.

    Scaled dot-product attention (Vaswani et al. 2017) over a head-major cache; query head ``n``
    reads key/value head ``n // (N / K)`` (grouped-query attention, Ainslie et al. 2023). Both
    products are batched over (row, kv-head) with the cache as the right operand in its stored
    layout, so XLA reads it in place.

    Args:
      q: ``[B, S, N, H]`` queries (after RoPE).
      k, v: ``[B, K, S_kv, H]`` cached keys (after RoPE) and values (``[K, B, S_kv, H]`` with
        ``kv_major``: a paged cache's gathered blocks).
      mask: ``[B, 1, S, S_kv]`` bool; every query must see at least one slot.
      scale: score multiplier, usually ``H ** -0.5``.
      kv_major: the layout of ``k, v``.
      logit_softcap: ``c``: the scaled scores ``s`` become ``c tanh(s / c)`` before the mask
        (Gemma 2), or None.
      sinks: ``[N]`` each query head's sink logit ``σ_n``, joined to its softmax's denominator
        (``sink_softmax``: ``p_j = exp(s_j) / (sum_k exp(s_k) + exp(σ_n))``; gpt-oss), or None.

    Returns:
      ``[B, S, N, H]`` in ``q.dtype``.
    """
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[0 if kv_major else 1]
    if seq == 1 and current_platform()[0] == "cpu":
        return _decode_attention(
            q,
            k,
            v,
            mask,
            scale=scale,
            kv_major=kv_major,
            logit_softcap=logit_softcap,
            sinks=sinks,
        )
    grouped = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)
    # Products in the cache's dtype (XLA:CPU has no bf16 x bf16 -> f32 batched matmul), as
    # jax.nn.dot_product_attention does; the softmax in f32. A kv-major cache keeps its
    # layout: the (small) queries move to it (with the operands' batch dims in different
    # orders XLA:CPU ran the products up to 5x slower).
    rows, queries = ("kb", "kbgqh") if kv_major else ("bk", "bqkgh")
    grouped = jnp.einsum(f"bqkgh->{queries}", grouped)
    scores = jnp.einsum(f"{queries},{rows}sh->{rows}gqs", grouped.astype(k.dtype), k)
    mask = mask[:, 0][None, :, None] if kv_major else mask[:, :, None]
    scores = softcap(scores.astype(jnp.float32) * scale, logit_softcap)
    scores = jnp.where(mask, scores, -jnp.inf)
    sink = None
    if sinks is not None:  # [N] -> [K, G], on the scores' (kv head, group) dims
        grouped_sinks = sinks.reshape(kv_heads, heads // kv_heads)
        sink = grouped_sinks[:, None, :, None, None] if kv_major else grouped_sinks[..., None, None]
    probs = sink_softmax(scores, sink).astype(v.dtype)
    out = jnp.einsum(f"{rows}gqs,{rows}sh->bqkgh", probs, v)
    return out.reshape(batch, seq, heads, head_dim).astype(q.dtype)


def _decode_attention(
    q: Array,
    k: Array,
    v: Array,
    mask: Array,
    *,
    scale: float,
    kv_major: bool = False,
    logit_softcap: float | None = None,
    sinks: Array | None = None,
) -> Array:
    """``cache_attention`` for one query per row, the query axis dropped (CPU decode).

    With the singleton query axis in the products (``bqkgh,bksh->bkgqs``) XLA:CPU runs a decode
    step's attention as ``B x K`` tiny GEMMs; without it (``bkgh,bksh->bkgs``) the same
    contractions take up to 2x less time (``B=256, K=G=2, S_kv=160, H=64``: 6.5 -> 4.8 ms;
    ``B=32, K=2, G=7, S_kv=512``: 4.3 -> 2.2 ms) and never more in the shapes measured
    (benchmarks/RESULTS.md). Same dtypes as the general path.
    """
    batch, _, heads, head_dim = q.shape
    kv_heads = k.shape[0 if kv_major else 1]
    rows = "kb" if kv_major else "bk"
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)
    if kv_major:  # the queries move to the cache's layout (see cache_attention)
        grouped = grouped.swapaxes(0, 1)
    scores = jnp.einsum(f"{rows}gh,{rows}sh->{rows}gs", grouped.astype(k.dtype), k)
    mask = mask[:, 0, 0][None, :, None] if kv_major else mask[:, :, 0][:, :, None]
    scores = softcap(scores.astype(jnp.float32) * scale, logit_softcap)
    scores = jnp.where(mask, scores, -jnp.inf)
    sink = None
    if sinks is not None:  # [N] -> [K, G], on the scores' (kv head, group) dims
        grouped_sinks = sinks.reshape(kv_heads, heads // kv_heads)
        sink = grouped_sinks[:, None, :, None] if kv_major else grouped_sinks[..., None]
    probs = sink_softmax(scores, sink)
    out = jnp.einsum(f"{rows}gs,{rows}sh->{rows}gh", probs.astype(v.dtype), v)
    out = out.swapaxes(0, 1) if kv_major else out
    return out.reshape(batch, 1, heads, head_dim).astype(q.dtype)


# --- Causal self-attention over the S tokens of one call, one implementation per backend. ---

_IMPLEMENTATIONS = ("auto", "xla", "einsum", "splash", "cudnn")
# Splash attention works on tiles whose sides are multiples of the TPU lane width.
_SPLASH_LANES = 128
_SPLASH_BLOCK = 512
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def attention_implementations() -> tuple[str, ...]:
    """Names accepted by ``dot_product_attention(..., implementation=...)``.

    * ``"auto"``: ``resolve_attention_implementation`` picks one of the others per backend.
    * ``"xla"``: ``jax.nn.dot_product_attention`` with the ``[B, 1, S, S]`` mask of
      ``attention_mask`` (the reference; materialises ``[B, N, S, S]`` f32 scores and, under
      autodiff, keeps them for the backward pass).
    * ``"einsum"``: blocks of queries as head-major batched matmuls in f32 with a hand-written
      backward pass, each block against only the keys up to its last query (faster than
      ``"xla"`` on CPU; keeps about half of the ``O(S^2)`` probabilities).
    * ``"splash"``: the Pallas TPU splash-attention kernel (``O(S)`` memory; it takes
      attention sinks); ``KernelOptions(interpret=True)`` emulates it off TPU (slow; tests).
    * ``"cudnn"``: cuDNN flash attention via ``jax.nn.dot_product_attention`` (NVIDIA GPU,
      bf16/f16; ``O(S)`` memory; no soft cap, sliding window or attention sinks).
    """
    return _IMPLEMENTATIONS


def resolve_attention_implementation(
    implementation: str,
    *,
    dtype: Any,
    head_dim: int,
    logit_softcap: float | None = None,
    sliding_window: int | None = None,
    sinks: bool = False,
) -> str:
    """The implementation ``dot_product_attention`` runs for ``implementation``.

    ``"auto"`` means ``"splash"`` on TPU, ``"cudnn"`` on an NVIDIA GPU for bf16/f16 inputs with
    ``head_dim <= 128`` and ``head_dim % 8 == 0`` and no logit soft cap, sliding window or
    attention sinks (``sinks``: whether there are any; the cuDNN path takes none of the three:
    else ``"xla"``), ``"einsum"`` on CPU and
    ``"xla"`` elsewhere. The backend is that of the context mesh (``jax.set_mesh`` or an
    abstract mesh with a device description), else of ``jax.devices()``. Other names are
    returned as they are. cuDNN's flash attention also needs compute capability >= 8.0
    (Ampere or later), which is not checked here: pass ``"xla"`` on older GPUs.

    Raises:
      ValueError: ``implementation`` is not in ``attention_implementations()``.
    """
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            f"unknown attention implementation {implementation!r}; expected one of "
            f"{_IMPLEMENTATIONS}"
        )
    if implementation != "auto":
        return implementation
    platform, kind = current_platform()
    if platform == "tpu":
        return "splash"
    if platform in ("gpu", "cuda"):
        nvidia = platform == "cuda" or "nvidia" in kind.lower()
        cudnn_ok = jnp.dtype(dtype) in _CUDNN_DTYPES and head_dim % 8 == 0 and head_dim <= 128
        cudnn_ok = cudnn_ok and logit_softcap is None and sliding_window is None and not sinks
        return "cudnn" if nvidia and cudnn_ok else "xla"
    return "einsum" if platform == "cpu" else "xla"


class KernelOptions(NamedTuple):
    """Tiling and emulation of ``dot_product_attention``'s fused kernels.

    Attributes:
      block_q: queries per block. ``"splash"``: a multiple of 128 (default 512); ``"einsum"``:
        any positive int (default: about 3 MiB of f32 scores per block, at most 16 blocks).
      block_kv: ``"splash"`` keys per block, a multiple of 128 (default 512). The sequence is
        padded to a multiple of 128 (padding masked, output sliced) and each splash block
        shrinks to the largest multiple of 128 that divides the padded length.
      interpret: run ``"splash"`` in the Pallas interpreter (off TPU, for tests).
    """

    block_q: int | None = None
    block_kv: int | None = None
    interpret: bool = False


def dot_product_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    key_valid: Array,
    scale: float,
    implementation: str = "auto",
    kernel: KernelOptions | None = None,
    logit_softcap: float | None = None,
    sliding_window: int | None = None,
    window_active: Any = True,
    segment_ids: Array | None = None,
    sinks: Array | None = None,
) -> Array:
    """Causal self-attention over the S tokens of this call, pad keys masked.

    ``o_i = sum_j softmax_j(scale * q_i . k_j) v_j`` (Vaswani et al. 2017) over the keys ``j``
    with ``j <= i`` and ``key_valid[b, j]`` (and, for packed rows, ``segment_ids[b, j] ==
    segment_ids[b, i]``); query head ``n`` reads key/value head ``n // (N / K)`` (grouped-query
    attention, Ainslie et al. 2023). Pads may sit anywhere in a row (left-padded prompts,
    right-padded completions, gaps).

    Rows of pad queries (``key_valid[b, i]`` False) are finite but implementation-defined:
    ``"xla"`` and ``"einsum"`` let a pad query see the real keys before it plus its own slot
    (``attention_mask``), ``"splash"`` the pad keys up to its own slot, ``"cudnn"`` returns
    zeros there. Real query rows never read pad keys, so they, and gradients that flow only
    through them, agree across implementations; callers ignore pad rows (the losses mask them).

    Args:
      q: ``[B, S, N, H]`` queries (after RoPE).
      k, v: ``[B, S, K, H]`` keys (after RoPE) and values of the same S tokens; ``N % K == 0``.
      key_valid: ``[B, S]`` bool, True on real tokens.
      scale: score multiplier, usually ``H ** -0.5`` (a Python number).
      implementation: one of ``attention_implementations()``.
      kernel: the fused kernels' tiling and emulation (:class:`KernelOptions`; None: the
        defaults).
      logit_softcap: ``c``: the scaled scores ``s`` become ``c tanh(s / c)`` before the mask
        (Gemma 2's attention soft-capping), or None. Not on ``"cudnn"``.
      sliding_window: ``W``: query ``i`` sees only the keys ``j > i - W`` (a sliding-window
        layer; transformers' rule, over slots), or None. Not on ``"cudnn"``.
      window_active: whether ``sliding_window`` applies: True, False, or a traced bool (the
        flag of a layer inside a scan over sliding and global layers; the kernels then run
        under ``jax.lax.cond``, the masked paths mask with the traced limit).
      segment_ids: ``[B, S]`` int32 for packed rows (``jaxrl_llm.packing``): ``k >= 1`` on
        the ``k``-th sequence of a row, 0 on padding; a query sees only keys of its own
        segment (a window counts slots, which within a segment are its positions). Real
        tokens are those with ``key_valid`` and a nonzero id. ``"cudnn"`` has no segment ids
        (JAX's public cuDNN attention takes none): packed rows run the ``"einsum"`` path there.
      sinks: ``[N]`` each query head's learned sink logit ``σ_n`` (gpt-oss), joined to the
        softmax's denominator and dropped from its output: ``o_i = sum_j p_ij v_j`` with
        ``p_ij = exp(s_ij) / (sum_k exp(s_ik) + exp(σ_n))`` (``sink_softmax``), or None. Taken
        by ``"xla"`` (then the jnp form of ``cache_attention``, since
        ``jax.nn.dot_product_attention`` has no sinks), ``"einsum"`` (with ``dσ`` in its
        backward pass) and ``"splash"`` (the kernel's ``sinks``); ``"cudnn"`` refuses them
        (``"auto"`` picks ``"xla"`` on GPU then).

    Returns:
      ``[B, S, N, H]`` in ``q.dtype``.

    Raises:
      ValueError: bad shapes or dtypes, an unknown ``implementation``, bad block sizes,
        ``"splash"`` off TPU without ``KernelOptions(interpret=True)``, ``"cudnn"`` with an
        unsupported dtype or head dim or with a soft cap, sliding window or sinks, bad sinks,
        or a bad cap or window.
    """
    _check_inputs(q, k, v, key_valid)
    block_q, block_kv, interpret = KernelOptions() if kernel is None else kernel
    scale = _check_scale(scale)
    if logit_softcap is not None:
        logit_softcap = _check_scale(logit_softcap)
        if not logit_softcap > 0:
            raise ValueError(f"logit_softcap must be > 0, got {logit_softcap}")
    if window_active is False:
        sliding_window = None
    if sliding_window is not None:
        _check_block("sliding_window", sliding_window, multiple=1)
    if segment_ids is not None:
        segment_ids = _check_segments(segment_ids, key_valid.shape)
        key_valid = key_valid & (segment_ids > 0)
    if sinks is not None:
        _check_sinks(sinks, q.shape[2])
    name = resolve_attention_implementation(
        implementation,
        dtype=q.dtype,
        head_dim=q.shape[-1],
        logit_softcap=logit_softcap,
        sliding_window=sliding_window,
        sinks=sinks is not None,
    )
    if name == "xla":
        seq = q.shape[1]
        window = window_limit(sliding_window, window_active, seq)
        segments = None if segment_ids is None else (segment_ids, segment_ids)
        mask = attention_mask(key_valid, jnp.arange(seq), window=window, segments=segments)
        if logit_softcap is not None or sinks is not None:  # not in jax.nn's: the same in jnp
            k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
            return cache_attention(
                q, k, v, mask, scale=scale, logit_softcap=logit_softcap, sinks=sinks
            )
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation=None)
    if name == "cudnn" and sinks is not None:
        raise ValueError(
            "implementation='cudnn' takes no attention sinks (gpt-oss); use 'xla' (what 'auto' "
            "picks for them on GPU)"
        )
    if name == "cudnn" and segment_ids is not None:  # no segment ids in jax.nn's cuDNN path
        _check_cudnn(q)
        name = "einsum"
    if name == "einsum":
        if block_q is not None:
            _check_block("block_q", block_q, multiple=1)
        return backends._einsum_attention(
            q,
            k,
            v,
            key_valid,
            scale,
            block=block_q,
            logit_softcap=logit_softcap,
            sliding_window=sliding_window,
            window_active=window_active,
            segment_ids=segment_ids,
            sinks=sinks,
        )
    if name == "cudnn":
        _check_cudnn(q)
        if logit_softcap is not None or sliding_window is not None:
            raise ValueError(
                "implementation='cudnn' takes no logit soft cap or sliding window (Gemma); use "
                "'xla' (what 'auto' picks for them on GPU)"
            )
        return backends._compacted_attention(q, k, v, key_valid, scale, implementation="cudnn")
    block_q = _SPLASH_BLOCK if block_q is None else block_q
    block_kv = _SPLASH_BLOCK if block_kv is None else block_kv
    _check_block("block_q", block_q, multiple=_SPLASH_LANES)
    _check_block("block_kv", block_kv, multiple=_SPLASH_LANES)
    if not interpret and current_platform()[0] != "tpu":
        raise ValueError(
            "implementation='splash' needs a TPU (the context mesh's or the default devices); "
            "pass kernel=KernelOptions(interpret=True) to emulate the kernel elsewhere"
        )
    splash = functools.partial(
        backends._splash_attention,
        scale=scale,
        block_q=block_q,
        block_kv=block_kv,
        interpret=interpret,
        logit_softcap=logit_softcap,
    )
    # Splash's segments: 0 on pads, the sequence's id (1 when unpacked) on real tokens.
    segments = key_valid.astype(jnp.int32)
    if segment_ids is not None:
        segments = jnp.where(key_valid, segment_ids, 0)
    if sliding_window is None or window_active is True:
        return splash(q, k, v, segments, sinks, sliding_window=sliding_window)
    # A scanned layer's own flag: one kernel or the other (the masks are static).
    return jax.lax.cond(
        window_active,
        functools.partial(splash, sliding_window=sliding_window),
        functools.partial(splash, sliding_window=None),
        q,
        k,
        v,
        segments,
        sinks,
    )


def _check_sinks(sinks: Any, heads: int) -> None:
    if jnp.shape(sinks) != (heads,) or not jnp.issubdtype(jnp.result_type(sinks), jnp.floating):
        raise ValueError(
            f"sinks must be a [N] = ({heads},) floating array (one sink logit per query head), "
            f"got shape {jnp.shape(sinks)} dtype {jnp.result_type(sinks)}"
        )


def _check_segments(segment_ids: Any, shape: tuple[int, ...]) -> Array:
    """``segment_ids`` as int32 after checking it is an integer array of ``key_valid``'s shape."""
    if jnp.shape(segment_ids) != tuple(shape) or not jnp.issubdtype(
        jnp.result_type(segment_ids), jnp.integer
    ):
        raise ValueError(
            f"segment_ids must be a [B, S] = {tuple(shape)} integer array, got shape "
            f"{jnp.shape(segment_ids)} dtype {jnp.result_type(segment_ids)}"
        )
    return jnp.asarray(segment_ids, jnp.int32)


def _check_inputs(q: Array, k: Array, v: Array, key_valid: Array) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.ndim(x) != 4:
            raise ValueError(f"{name} must be [B, S, heads, H], got shape {jnp.shape(x)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
    batch, seq, heads, head_dim = q.shape
    if k.shape[:2] != (batch, seq) or k.shape[3] != head_dim:
        raise ValueError(
            f"k/v {k.shape} must be [B, S, K, H] with q's B, S and H (self-attention), q {q.shape}"
        )
    if heads % k.shape[2]:
        raise ValueError(
            f"query heads ({heads}) must be a multiple of key/value heads ({k.shape[2]})"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q, k, v must be floating point, got {q.dtype}")
    if jnp.shape(key_valid) != (batch, seq) or jnp.result_type(key_valid) != jnp.bool_:
        raise ValueError(
            f"key_valid must be a [B, S] = {(batch, seq)} bool array, got shape "
            f"{jnp.shape(key_valid)} dtype {jnp.result_type(key_valid)}"
        )


def _check_scale(scale: Any) -> float:
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite Python number, got {scale!r}")
    return float(scale)


def _check_block(name: str, block: Any, *, multiple: int) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or block % multiple:
        raise ValueError(f"{name} must be a positive multiple of {multiple}, got {block!r}")


def _check_cudnn(q: Array) -> None:
    if q.dtype not in _CUDNN_DTYPES:
        raise ValueError(f"implementation='cudnn' needs bf16 or f16 inputs, got {q.dtype}")
    if current_platform()[0] not in ("gpu", "cuda"):
        raise ValueError(
            "implementation='cudnn' needs an NVIDIA GPU (the context mesh's or the default devices)"
        )
    head_dim = q.shape[-1]
    if head_dim % 8 or head_dim > 256:
        raise ValueError(
            f"implementation='cudnn' needs a head dim that is a multiple of 8 and <= 256 "
            f"(<= 128 before Hopper), got {head_dim}"
        )


# --- "einsum": query blocks of head-major batched matmuls, hand-written backward (CPU). ---

# Query block of the "einsum" path: about this many bytes of f32 scores per block (a few MiB
# stays in a CPU's caches between the products and the softmax), at most this many blocks.
