"""The attention backends behind ``attention.dot_product_attention``: blocked einsums (CPU),
the Pallas TPU splash kernel, and cuDNN over rows compacted to causal + lengths form.

Packed rows (several sequences per row, ``segment_ids``; ``jaxrl_llm.packing``): the masked
paths (``"xla"``, ``"einsum"``) mask keys of other segments, splash takes the segment ids as
its ``SegmentIds``. cuDNN does not take them here: JAX 0.10's public
``jax.nn.dot_product_attention`` has no segment ids or packed (THD) layout (only causal masks
and per-row lengths; the ``q_offsets`` of the private ``jax._src.cudnn`` entry point are not
public API), so ``"cudnn"`` runs packed batches on the ``"einsum"`` path (exact, but its
memory is ``O(S^2 / blocks)`` rather than ``O(S)``).

Attention sinks (gpt-oss: a learned logit per query head in each softmax's denominator,
``sink_softmax``): the einsum path takes them (with their gradient in its backward pass), and
so does splash (the kernel's ``sinks``); cuDNN does not (``attention.dot_product_attention``
refuses them there), nor does the TPU paged-attention kernel (``kv_cache`` gathers instead).

Context parallelism: ``splash_chunk_attention`` runs one device's chunk of queries over the
whole sequence's keys (splash with a rectangular causal mask at the chunk's offset).

Shapes: B batch, S sequence, N query heads, K key/value heads, H head dim.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxrl_llm.parallel.rules import ACTIVATION_RULES, mesh_axes_of, spec_entry

Array = jax.Array

_SPLASH_LANES = 128


def attention_mask(
    key_valid: Array,
    query_slots: Array,
    *,
    window: Any = None,
    key_offset: int = 0,
    segments: tuple[Array, Array] | None = None,
    key_slots: Array | None = None,
) -> Array:
    """``[B, 1, S, S_kv]``: key slot j visible to query slot i iff j <= i and j is real (and,
    with a ``window`` W, ``i - j < W``: a sliding window of the W newest slots, transformers'
    rule; with ``segments``, j in i's segment).

    ``query_slots`` is ``[S]`` (the same for every row) or ``[B, S]`` (per row). A query always
    sees its own slot, so pad queries get a finite (ignored) output instead of attending to
    nothing; for real queries this changes nothing since their own slot is real. ``window`` is
    None, an int, or a traced int scalar (``window_limit``). ``key_offset``: the slot of
    ``key_valid``'s first column (a block of keys that starts later). ``segments``: ``(query
    segment ids [B, S], key segment ids [B, S_kv])`` of packed rows (several sequences per row,
    ``jaxrl_llm.packing``), or None (one sequence per row). ``key_slots``: ``[S_kv]`` each key
    column's slot when the keys are not in slot order (context parallelism's zigzag layout);
    default ``key_offset + arange(S_kv)``.
    """
    if key_slots is None:
        key_slots = key_offset + jnp.arange(key_valid.shape[1])
    query_slots = query_slots if query_slots.ndim == 2 else query_slots[None]
    distance = query_slots[:, :, None] - key_slots[None, None, :]
    causal = distance >= 0
    if window is not None:
        causal = causal & (distance < window)
    own = distance == 0
    visible = causal & key_valid[:, None, :]
    if segments is not None:
        query_segments, key_segments = segments
        visible = visible & (query_segments[:, :, None] == key_segments[:, None, :])
    return (visible | own)[:, None]


def window_limit(window: int | None, active: Any, slots: int) -> Any:
    """The key-distance limit of ``attention_mask`` for a sliding ``window`` that applies where
    ``active`` (a Python bool, or a traced bool: a scanned layer's own flag): None (no window),
    ``window``, or a traced scalar that is ``window`` or ``max(slots, window)`` (no limit over
    ``slots`` keys)."""
    if window is None or active is False:
        return None
    if active is True:
        return window
    return jnp.where(active, window, max(slots, window)).astype(jnp.int32)


def softcap(scores: Array, cap: float | None) -> Array:
    """``cap * tanh(scores / cap)`` (Gemma 2's logit soft-capping), or ``scores`` when None."""
    if cap is None:
        return scores
    return cap * jnp.tanh(scores / cap)


def sink_softmax(scores: Array, sinks: Array | None) -> Array:
    """Softmax over the last axis with an attention sink in the denominator.

    ``p_j = exp(s_j) / (sum_k exp(s_k) + exp(σ))``: the sink logit ``σ`` joins the softmax and
    its probability is dropped, so a row's probabilities sum to ``1 - p_σ`` (gpt-oss's learned
    per-head sinks; Xiao et al. 2023, "Efficient Streaming Language Models with Attention
    Sinks"; transformers' ``GptOssAttention``). Plain ``softmax`` when ``sinks`` is None.

    Args:
      scores: ``[..., S_kv]`` f32 scores (``-inf`` on masked keys).
      sinks: ``σ`` broadcastable to ``scores.shape[:-1] + (1,)``, or None.

    Returns:
      ``[..., S_kv]`` probabilities in ``scores.dtype``.
    """
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    sinks = jnp.broadcast_to(sinks.astype(scores.dtype), (*scores.shape[:-1], 1))
    return jax.nn.softmax(jnp.concatenate([scores, sinks], axis=-1), axis=-1)[..., :-1]


_EINSUM_BLOCK_BYTES = 3 * 2**20
_EINSUM_MAX_BLOCKS = 16


def _einsum_block(batch: int, heads: int, seq: int) -> int:
    """Queries per block: ``B * N * block * S * 4`` bytes near ``_EINSUM_BLOCK_BYTES``."""
    block = _EINSUM_BLOCK_BYTES // (4 * batch * heads * seq)
    block = max(block, -(-seq // _EINSUM_MAX_BLOCKS), 8)
    return min(seq, block)


def _einsum_attention(
    q: Array,
    k: Array,
    v: Array,
    key_valid: Array,
    scale: float,
    block: int | None = None,
    *,
    logit_softcap: float | None = None,
    sliding_window: int | None = None,
    window_active: Any = True,
    segment_ids: Array | None = None,
    sinks: Array | None = None,
) -> Array:
    """Attention over blocks of queries, each against only the keys up to its last query.

    Per block, ``[B, K, b*G, H] x [B, K, t, H]`` batched matmuls (the ``G = N / K`` query heads
    of one key/value head stacked as rows ``i * G + g``, ``t`` = the block's last query + 1), in
    f32. Blocks keep the scores and probabilities cache-sized, causality skips the keys after a
    block (about half the work), and XLA:CPU runs the products and the softmax as separate
    kernels instead of fusing the softmax into the second product's operand. A sliding window
    that surely applies (``window_active`` True) also skips the keys before the block's first
    query's window; a traced ``window_active`` masks them instead. ``segment_ids`` ``[B, S]``
    (packed rows): a query sees only the keys of its own segment (``attention_mask``).
    ``sinks`` ``[N]``: each query head's sink logit joins its softmax's denominator
    (``sink_softmax``), with its gradient in the hand-written backward pass.
    """
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    if sinks is not None:  # query head n = k * G + g
        sinks = sinks.astype(jnp.float32).reshape(kv_heads, group)
    block = _einsum_block(batch, heads, seq) if block is None else block
    qh = q.astype(jnp.float32) * scale  # [B, S, K, G, H] -> [B, K, S, G, H] -> [B, K, S*G, H]
    qh = qh.reshape(batch, seq, kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    qh = qh.reshape(batch, kv_heads, seq * group, head_dim)
    kh = jnp.swapaxes(k.astype(jnp.float32), 1, 2)
    vh = jnp.swapaxes(v.astype(jnp.float32), 1, 2)
    window = window_limit(sliding_window, window_active, seq)
    outs = []
    for start in range(0, seq, block):
        stop = min(seq, start + block)
        first = max(0, start - sliding_window + 1) if window_active is True and window else 0
        segments = None
        if segment_ids is not None:
            segments = (segment_ids[:, start:stop], segment_ids[:, first:stop])
        mask = attention_mask(
            key_valid[:, first:stop],
            jnp.arange(start, stop),
            window=window,
            key_offset=first,
            segments=segments,
        )[:, 0]
        rows = slice(start * group, stop * group)
        keys = slice(first, stop)
        outs.append(
            _einsum_core(qh[:, :, rows], kh[:, :, keys], vh[:, :, keys], mask, sinks, logit_softcap)
        )
    out = jnp.concatenate(outs, axis=2).reshape(batch, kv_heads, seq, group, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(batch, seq, heads, head_dim).astype(q.dtype)


def _einsum_scores(q: Array, k: Array, mask: Array) -> Array:
    """``q k^T``: ``[B, K, b, G, t]`` f32 (rows split back into queries and heads)."""
    batch, kv_heads, _, _ = q.shape
    queries, keys = mask.shape[1:]
    return jnp.einsum("bkrh,bksh->bkrs", q, k).reshape(batch, kv_heads, queries, -1, keys)


def _einsum_probs(
    q: Array, k: Array, mask: Array, sinks: Array | None, cap: float | None
) -> tuple[Array, Array | None]:
    """``P = softmax(softcap(q k^T))`` over the keys in ``mask`` (a sink in the denominator
    with ``sinks``): ``([B, K, b*G, t] f32, the sinks' probabilities [B, K, b*G, 1] or None)``.

    ``q: [B, K, b*G, H]`` (row ``i * G + g``), ``k: [B, K, t, H]``, ``mask: [B, b, t]`` bool,
    ``sinks: [K, G]`` f32 or None.
    """
    batch, kv_heads, rows, _ = q.shape
    scores = softcap(_einsum_scores(q, k, mask), cap)
    scores = jnp.where(mask[:, None, :, None, :], scores, -jnp.inf)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
        return probs.reshape(batch, kv_heads, rows, mask.shape[2]), None
    sink = jnp.broadcast_to(sinks[None, :, None, :, None], (*scores.shape[:-1], 1))
    joined = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)
    probs = joined[..., :-1].reshape(batch, kv_heads, rows, mask.shape[2])
    return probs, joined[..., -1:].reshape(batch, kv_heads, rows, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _einsum_core(
    q: Array, k: Array, v: Array, mask: Array, sinks: Array | None, cap: float | None
) -> Array:
    return jnp.einsum("bkrs,bksh->bkrh", _einsum_probs(q, k, mask, sinks, cap)[0], v)


def _einsum_core_fwd(q, k, v, mask, sinks, cap):
    probs, sink_probs = _einsum_probs(q, k, mask, sinks, cap)
    out = jnp.einsum("bkrs,bksh->bkrh", probs, v)
    return out, (q, k, v, mask, sinks, probs, sink_probs, out)


def _einsum_core_bwd(cap, residuals, d_out):
    """Softmax-attention gradients (as in FlashAttention-2, Dao 2023, sec. 2.2).

    ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - rowsum(dO * O))``, ``dQ = dS K``,
    ``dK = dS^T Q`` (``q`` is already scaled, so ``dQ`` is w.r.t. the scaled queries). With a
    soft cap ``c tanh(s / c)`` of the scores ``s``, ``dS`` is multiplied by its derivative
    ``1 - tanh(s / c)^2``, ``s`` recomputed from ``q`` and ``k`` (no stored ``O(S^2)`` array).
    A sink ``σ`` leaves ``dS`` as it is (it only adds to the denominator) and gets
    ``dσ = -sum_rows p_σ rowsum(dO * O)`` (``∂p_j / ∂σ = -p_j p_σ``).
    """
    q, k, v, mask, sinks, probs, sink_probs, out = residuals
    d_v = jnp.einsum("bkrs,bkrh->bksh", probs, d_out)
    d_probs = jnp.einsum("bkrh,bksh->bkrs", d_out, v)
    delta = jnp.sum(d_out * out, axis=-1, keepdims=True)
    d_scores = probs * (d_probs - delta)
    if cap is not None:
        tanh = jnp.tanh(_einsum_scores(q, k, mask) / cap).reshape(d_scores.shape)
        d_scores = d_scores * (1.0 - tanh * tanh)
    d_q = jnp.einsum("bkrs,bksh->bkrh", d_scores, k)
    d_k = jnp.einsum("bkrs,bkrh->bksh", d_scores, q)
    d_sinks = None
    if sinks is not None:  # rows r = i * G + g: sum over rows and queries, per (k, g)
        per_row = -(sink_probs * delta)[..., 0]  # [B, K, b*G]
        batch, kv_heads, rows = per_row.shape
        d_sinks = per_row.reshape(batch, kv_heads, -1, sinks.shape[1]).sum(axis=(0, 2))
    return d_q, d_k, d_v, None, d_sinks


_einsum_core.defvjp(_einsum_core_fwd, _einsum_core_bwd)


# --- "cudnn": real tokens packed to the front of each row, causal + length masks (GPU). ---


def _compacted_attention(
    q: Array, k: Array, v: Array, key_valid: Array, scale: float, *, implementation: str
) -> Array:
    """Attention on each row's real tokens moved (in order) to the front: causal + lengths.

    cuDNN's flash attention takes a causal mask and per-row query/key lengths (real tokens
    first), not an arbitrary mask. A stable sort of each row puts its ``n`` real tokens first in
    their original order, so "``j <= i`` and ``j`` real" becomes "``j' <= i'`` and ``j' < n``";
    the output is moved back and pad rows are zero. ``O(B S N H)`` extra memory for the moves.
    ``implementation`` is passed to ``jax.nn.dot_product_attention`` (``"xla"`` in tests).
    """
    order = jnp.argsort(jnp.logical_not(key_valid).astype(jnp.int32), axis=1, stable=True)
    # A row of pads only still gets length 1, so cuDNN never sees an empty row.
    lengths = jnp.maximum(jnp.sum(key_valid, axis=1, dtype=jnp.int32), 1)

    def move(x: Array, index: Array) -> Array:
        return jnp.take_along_axis(x, index[:, :, None, None], axis=1)

    out = jax.nn.dot_product_attention(
        move(q, order),
        move(k, order),
        move(v, order),
        scale=scale,
        is_causal=True,
        query_seq_lengths=lengths,
        key_value_seq_lengths=lengths,
        implementation=implementation,
    )
    out = move(out, jnp.argsort(order, axis=1))
    return jnp.where(key_valid[:, :, None, None], out, jnp.zeros((), out.dtype))


# --- "splash": the Pallas TPU splash-attention kernel, pads in their own segment. ---


def _splash_block(seq: int, block: int) -> int:
    """Largest multiple of 128 that is ``<= block`` and divides ``seq`` (a multiple of 128)."""
    return max(b for b in range(_SPLASH_LANES, min(block, seq) + 1, _SPLASH_LANES) if seq % b == 0)


def _splash_kernel(
    seq: int,
    heads: int,
    block_q: int,
    block_kv: int,
    interpret: bool,
    logit_softcap: float | None = None,
    sliding_window: int | None = None,
    kv_seq: int | None = None,
    offset: int = 0,
) -> Any:
    """A causal splash kernel for one row's ``[heads, seq, H]`` queries and ``[K, kv_seq, H]``
    keys (``kv_seq`` defaults to ``seq``), query ``i`` at key slot ``offset + i``: key ``j``
    visible to query ``i`` iff ``j <= offset + i``; with ``sliding_window`` W a local one (iff
    ``offset + i - W < j <= offset + i``), with ``logit_softcap`` c the scores capped to
    ``c tanh(s / c)`` (the kernel's ``attn_logits_soft_cap``).

    Built at every trace: its mask tables become constants of the traced program (a cached
    kernel would hold arrays of one trace). JAX caches the NumPy processing of the mask.
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    sizes = splash.BlockSizes(
        block_q=block_q,
        block_kv=block_kv,
        block_kv_compute=block_kv,
        block_q_dkv=block_q,
        block_kv_dkv=block_kv,
        block_kv_dkv_compute=block_kv,
        # Separate dq kernel: the fused one keeps [S / block_kv, N, S, H] partial dq in q's dtype.
        block_q_dq=block_q,
        block_kv_dq=block_kv,
    )
    shape = (seq, seq if kv_seq is None else kv_seq)
    if sliding_window is None:
        one = splash.CausalMask(shape, offset=offset)
    else:
        one = splash.LocalMask(shape, window_size=(sliding_window - 1, 0), offset=offset)
    mask = splash.MultiHeadMask([one] * heads)
    return splash.make_splash_mha(
        mask,
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=1,
        interpret=interpret,
        attn_logits_soft_cap=logit_softcap,
    )


def _splash_local(
    q: Array,
    k: Array,
    v: Array,
    segments: Array,
    *,
    scale: float,
    block_q: int,
    block_kv: int,
    interpret: bool,
    logit_softcap: float | None = None,
    sliding_window: int | None = None,
    sinks: Array | None = None,
) -> Array:
    """Splash attention on one device's ``[B, S, N, H]`` block (``sinks [N]``: the heads'
    sink logits, which the kernel adds to its softmax's denominator, or None).

    ``segments`` ``[B, S]`` int32: the segment id of each token, 0 on pads (the padding up to
    a multiple of 128 too): 1 on every real token of an unpacked row, ``k`` on the ``k``-th
    sequence of a packed one. The kernel lets query i see key j iff ``j <= i``
    (``CausalMask``) and both share a segment (``SegmentIds``). Real queries thus see exactly
    the real keys of their own sequence before them, and a pad query sees at least itself, so
    no row of the softmax is empty.
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    seq, heads = q.shape[1], q.shape[2]
    padded = -(-seq // _SPLASH_LANES) * _SPLASH_LANES
    kernel = _splash_kernel(
        padded,
        heads,
        _splash_block(padded, block_q),
        _splash_block(padded, block_kv),
        interpret,
        logit_softcap,
        sliding_window,
    )

    def head_major(x: Array) -> Array:  # [B, S, h, H] -> [B, h, S_pad, H]
        return jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, padded - seq), (0, 0)))

    # The kernel has no scale argument: scale the queries (in f32, then back to their dtype).
    scaled = (q.astype(jnp.float32) * scale).astype(q.dtype)
    segments = jnp.pad(segments.astype(jnp.int32), ((0, 0), (0, padded - seq)))
    args = (head_major(scaled), head_major(k), head_major(v), SegmentIds(q=segments, kv=segments))
    if sinks is None:
        out = jax.vmap(kernel)(*args)
    else:  # one sink per head, shared by the rows
        out = jax.vmap(kernel, in_axes=(0, 0, 0, 0, None))(*args, sinks.astype(jnp.float32))
    return jnp.swapaxes(out[:, :, :seq], 1, 2).astype(q.dtype)


def _is_int(x: Any) -> bool:
    """A Python or NumPy integer (not a bool, not a traced value)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_chunk(
    q: Array,
    k: Array,
    v: Array,
    q_segments: Array,
    kv_segments: Array,
    *,
    offset: Any,
    block_q: Any,
    block_kv: Any,
    sliding_window: Any,
    sinks: Array | None,
) -> None:
    """One-line ``ValueError`` on inputs ``splash_chunk_attention`` cannot run."""
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(
            f"need q [B, C, N, H], k = v [B, S, K, H]: got {q.shape}, {k.shape}, {v.shape}"
        )
    (batch, chunk, heads, dim), (kv_batch, seq, kv_heads, kv_dim) = q.shape, k.shape
    if kv_batch != batch or kv_dim != dim or heads % kv_heads:
        raise ValueError(f"q {q.shape} and k, v {k.shape} differ in B or H, or K does not divide N")
    if q_segments.shape != (batch, chunk) or kv_segments.shape != (batch, seq):
        raise ValueError(
            f"q_segments {q_segments.shape} must be {(batch, chunk)} and kv_segments"
            f" {kv_segments.shape} {(batch, seq)}"
        )
    if chunk % _SPLASH_LANES or seq % _SPLASH_LANES:
        raise ValueError(
            f"C = {chunk} (q {q.shape}) and S = {seq} (k {k.shape}) must be multiples of 128"
        )
    if not _is_int(offset) or offset < 0 or offset + chunk > seq:
        raise ValueError(
            f"offset must be a Python int in [0, S - C] = [0, {seq - chunk}], got {offset!r}"
        )
    for name, block in (("block_q", block_q), ("block_kv", block_kv)):
        if not _is_int(block) or block < _SPLASH_LANES:
            raise ValueError(f"{name} must be an int >= 128, got {block!r}")
    if sliding_window is not None and (not _is_int(sliding_window) or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if sinks is not None and sinks.shape != (heads,):
        raise ValueError(f"sinks must be [N] = {(heads,)}, got {sinks.shape}")


def splash_chunk_attention(
    q: Array,
    k: Array,
    v: Array,
    segments: tuple[Array, Array],
    *,
    offset: int,
    scale: float,
    block_q: int = 512,
    block_kv: int = 512,
    interpret: bool = False,
    logit_softcap: float | None = None,
    sliding_window: int | None = None,
    sinks: Array | None = None,
) -> Array:
    """Splash attention of one sequence chunk's queries over the whole sequence's keys: the
    per-device core of context parallelism (run it inside the caller's ``jax.shard_map``).

    Query ``i`` sits at slot ``offset + i``, key ``j`` at slot ``j``. Query ``i`` of row ``b``
    sees key ``j`` iff ``j <= offset + i`` and ``q_segments[b, i] == kv_segments[b, j]``
    (``segments = (q_segments, kv_segments)``; and,
    with ``sliding_window`` W, ``offset + i - j < W``):
    ``O_i = sum_j p_ij V_j``, ``p_ij = exp(s_ij) / (sum_k exp(s_ik) + exp(σ))`` over the
    visible keys, ``s_ij = cap(scale q_i . k_j)`` (``cap(s) = c tanh(s / c)`` with
    ``logit_softcap`` c, else ``s``; ``σ`` the head's sink, ``exp(σ) = 0`` without ``sinks``).
    The kernel's mask is ``CausalMask((C, S), offset)`` (``LocalMask`` with a window): static,
    so ``offset`` is a Python int, one compiled kernel per offset. Under a ``jax.shard_map``
    whose devices hold different chunks, pick the device's kernel with
    ``lax.switch(lax.axis_index(axis), [one call per offset], ...)``, and map with
    ``check_vma=False`` (the Pallas call's outputs carry no varying-axes type).

    Every query should see at least one key (its own slot, when ``q_segments`` is
    ``kv_segments[:, offset:offset + C]``); a query that sees none gets an undefined output.

    Args:
      q: ``[B, C, N, H]`` queries (after RoPE).
      k, v: ``[B, S, K, H]`` keys and values of all ``S`` slots in order (``N % K == 0``).
      segments: ``(q_segments [B, C], kv_segments [B, S])`` int32 segment ids of the queries
        and of the keys: 0 on pads, ``k >= 1`` on the ``k``-th packed sequence of the row (1
        on every real token of an unpacked row).
      offset: the slot of the first query, ``0 <= offset <= S - C``.
      scale: the score scale (queries are scaled in f32, then cast back to their dtype).
      block_q, block_kv: the kernel's tiles are the largest multiples of 128 that divide C
        (resp. S) and are at most these.
      interpret: run the Pallas kernel in the interpreter (CPU tests).
      logit_softcap: ``c``, or None.
      sliding_window: ``W``, or None.
      sinks: ``[N]`` sink logits ``σ`` (f32), or None.

    Returns:
      ``[B, C, N, H]`` in ``q.dtype``.

    Raises:
      ValueError: C or S not a multiple of 128, ``offset`` outside ``[0, S - C]``, or
        mismatched shapes.
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    q_segments, kv_segments = segments
    _check_chunk(
        q,
        k,
        v,
        q_segments,
        kv_segments,
        offset=offset,
        block_q=block_q,
        block_kv=block_kv,
        sliding_window=sliding_window,
        sinks=sinks,
    )
    chunk, heads, seq = q.shape[1], q.shape[2], k.shape[1]
    kernel = _splash_kernel(
        chunk,
        heads,
        _splash_block(chunk, block_q),
        _splash_block(seq, block_kv),
        interpret,
        logit_softcap,
        sliding_window,
        kv_seq=seq,
        offset=int(offset),
    )

    def head_major(x: Array) -> Array:  # [B, L, h, H] -> [B, h, L, H]
        return jnp.swapaxes(x, 1, 2)

    scaled = (q.astype(jnp.float32) * scale).astype(q.dtype)
    segments = SegmentIds(q=q_segments.astype(jnp.int32), kv=kv_segments.astype(jnp.int32))
    args = (head_major(scaled), head_major(k), head_major(v), segments)
    if sinks is None:
        out = jax.vmap(kernel)(*args)
    else:  # one sink per head, shared by the rows
        out = jax.vmap(kernel, in_axes=(0, 0, 0, 0, None))(*args, sinks.astype(jnp.float32))
    return jnp.swapaxes(out, 1, 2).astype(q.dtype)


def _mapped_axes(mesh: Any, rule: str, sizes: tuple[int, ...]) -> tuple[str, ...]:
    """The mesh axes of ``ACTIVATION_RULES[rule]`` that exist, are not manual, and divide."""
    manual = set(getattr(mesh, "manual_axes", ()))
    axes: list[str] = []
    for axis in mesh_axes_of(ACTIVATION_RULES[rule]):
        if axis not in mesh.axis_names or axis in manual:
            continue
        width = math.prod(mesh.shape[a] for a in (*axes, axis))
        if all(size % width == 0 for size in sizes):
            axes.append(axis)
    return tuple(axes)


def per_device_attention(
    local: Any,
    q: Array,
    k: Array,
    v: Array,
    segments: Array,
    *extra: Array,
    sinks: Array | None = None,
    sequence: str | None = None,
) -> Array:
    """``local(q, k, v, segments, *extra[, sinks])`` on each device's block, under
    ``jax.shard_map`` over the current (abstract) mesh.

    A Pallas kernel is one opaque custom call that XLA's partitioner cannot split, and a
    sequence split over devices needs its keys gathered by hand, so attention runs per device:
    the batch mapped over the activation rules' ``batch`` axes and the heads over the
    ``heads`` axes (where they divide B, and N and K), each device with its heads' ``sinks``;
    the positions of ``q, k, v [B, S, ., H]``, ``segments [B, S]`` and each ``extra [S]`` over
    the mesh axis ``sequence`` (None: whole on every device). Returns ``[B, S, N, H]`` split as
    ``q``.
    """
    mesh = jax.sharding.get_abstract_mesh()
    batch_axes = spec_entry(_mapped_axes(mesh, "batch", (q.shape[0],)))
    head_axes = spec_entry(_mapped_axes(mesh, "heads", (q.shape[2], k.shape[2])))
    heads_spec = PartitionSpec(batch_axes, sequence, head_axes, None)
    in_specs = [heads_spec] * 3 + [PartitionSpec(batch_axes, sequence)]
    in_specs += [PartitionSpec(sequence)] * len(extra)
    args = [q, k, v, segments, *extra]
    if sinks is not None:
        in_specs.append(PartitionSpec(head_axes))
        args.append(sinks)
    manual = set(getattr(mesh, "manual_axes", ()))
    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=tuple(in_specs),
        out_specs=heads_spec,
        axis_names=frozenset(a for a in mesh.axis_names if a not in manual),
        check_vma=False,
    )
    return mapped(*args)


def _splash_attention(
    q: Array,
    k: Array,
    v: Array,
    segments: Array,
    sinks: Array | None = None,
    **options: Any,
) -> Array:
    """Splash attention (``_splash_local``, ``segments [B, S]`` int32 with 0 on pads, ``sinks``
    ``[N]`` or None), per device (``per_device_attention``) when a multi-device mesh is set."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return _splash_local(q, k, v, segments, sinks=sinks, **options)

    def local(q, k, v, segments, sinks=None):
        return _splash_local(q, k, v, segments, sinks=sinks, **options)

    return per_device_attention(local, q, k, v, segments, sinks=sinks)


# Slots of one row the paged kernel loads per compute block (pages_per_compute_block x P).
_PAGED_COMPUTE_SLOTS = 512


def megacore_mode(device: Any, kv_heads: int, batch: int) -> str | None:
    """The paged-attention kernel's ``megacore_mode`` on ``device``: on a chip whose device
    has two TensorCores (``num_cores == 2``: TPU v4, v5p) the kernel splits its work between
    them — over the key/value heads when they split evenly, else over the rows — or runs on
    one of them (None: every single-core chip; the kernel may hang if told of a megacore that
    is not there). JetStream makes the same choice."""
    if device.platform != "tpu" or (getattr(device, "num_cores", None) or 1) < 2:
        return None
    if kv_heads % 2 == 0:
        return "kv_head"
    return "batch" if batch % 2 == 0 else None


def _paged_kernel_attention(
    q: Array,
    k_pool: Array,
    v_pool: Array,
    lengths: Array,
    table: Array,
    *,
    scale: float,
    logit_softcap: float | None = None,
) -> Array:
    """One query per row over a paged cache with JAX's Pallas TPU paged-attention kernel
    (``jax.experimental.pallas.ops.tpu.paged_attention``; off TPU, its TPU interpreter).

    Row ``b`` attends to its logical slots ``[0, lengths[b])`` (rows packed from slot 0), found
    through ``table`` (``[B, W]`` block ids; entries past a row's length are never read, and
    unmapped ones are clamped into the pool). Lengths are clamped to ``[0, W * P]``: the kernel
    skips a row of length 0 (its output is left unset: a dead row, ignored), and a finished
    slot keeps its next slot, which may lie one past its table (the kernel must not read past
    the table). The kernel loads the pool's blocks as bf16 and computes the scores and softmax
    in f32; on a two-core chip both cores run it (``megacore_mode``).

    Args:
      q: ``[B, N, H]`` queries (after RoPE).
      k_pool, v_pool: ``[K, N_blocks, P, H]`` one layer's pools.
      lengths: ``[B]`` int32.
      table: ``[B, W]`` int32 block ids.
      scale: score multiplier.
      logit_softcap: the scaled scores' soft cap ``c tanh(s / c)`` (the kernel's
        ``attn_logits_soft_cap``), or None.

    Returns:
      ``[B, N, H]`` in ``q.dtype``.
    """
    from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention  # noqa: PLC0415

    from jaxrl_llm.parallel.mesh import current_device  # noqa: PLC0415

    device = current_device()
    width, block_size = table.shape[1], k_pool.shape[2]
    # Compute blocks of up to _PAGED_COMPUTE_SLOTS slots; the table is padded to a whole number
    # of them (the padding, past every length, is never read).
    per_block = max(1, min(width, _PAGED_COMPUTE_SLOTS // block_size))
    table = jnp.clip(table, 0, k_pool.shape[1] - 1)
    table = jnp.pad(table, ((0, 0), (0, -width % per_block)))
    lengths = jnp.clip(lengths, 0, width * block_size)  # a dead row may point past its table
    queries = q.astype(jnp.float32) * scale  # the kernel applies no scale

    def run() -> Array:
        return paged_attention(
            queries,
            k_pool,
            v_pool,
            lengths.astype(jnp.int32),
            table.astype(jnp.int32),
            pages_per_compute_block=per_block,
            megacore_mode=megacore_mode(device, k_pool.shape[0], q.shape[0]),
            attn_logits_soft_cap=logit_softcap,
        )

    if device.platform == "tpu":
        return run().astype(q.dtype)
    with pltpu.force_tpu_interpret_mode():
        return run().astype(q.dtype)
