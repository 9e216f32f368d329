"""The KV cache of incremental decoding: its layout, logical axes, creation and slot writes.

Head-major: each (row, head) keeps its slots as one contiguous ``[S_max, H]`` block. The cache is
either stacked over layers (``[L, B, K, S_max, H]``, what the scanned model reads) or a tuple of
``L`` per-layer arrays (``jaxrl_llm.sampling.layout.unstack_cache``, what the unrolled CPU
decode reads).

A paged cache (``PagedKVCache``) keeps the same logical ``[B, S_max]`` slots of each row in
fixed-size blocks of a shared pool, found through a per-row block table: rows that share a
prompt point at the same blocks, and capacity is set in blocks, not in rows x ``S_max``.
``paged_cache_attention`` writes and attends through the table: on TPU with JAX's Pallas
paged-attention kernel (rows packed from slot 0, as the continuous engine lays them out),
elsewhere with an XLA block-table gather and ``cache_attention``.

Shapes: B batch, S sequence, K key/value heads, H head dim, L layers, N pool blocks, P block
size (slots a block).
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


class PagedKVCache(NamedTuple):
    """A KV cache in fixed-size blocks of a shared pool (vLLM's PagedAttention layout, Kwon et al.
    2023), read and written through a per-row block table (a plain pytree).

    Row ``b``'s logical slot ``s`` lives at offset ``s % P`` of block ``table[b, s // P]``.
    Decode on TPU (``paged_cache_attention``'s kernel) reads slots ``[0, cache_index + 1)`` of
    each row and ignores ``mask``: rows must be packed from slot 0, as the continuous engine
    lays them out (elsewhere the mask rules, and rows may have gaps).
    Table entries equal to ``N`` (``unmapped``) are no block: writes there are dropped and reads
    return some block's data, which the row's ``mask`` hides (it is False on such slots).

    Attributes:
      k: ``[L, K, N, P, H]`` key blocks, or a tuple of ``L`` per-layer ``[K, N, P, H]`` arrays
        (kv-head-major: the layout of JAX's TPU paged-attention kernels, and a block-table
        gather along ``N`` gives the ``[K, B, S_max, H]`` operand of ``cache_attention``'s
        ``kv_major`` form without a transpose).
      v: values, like ``k``.
      mask: ``[B, S_max]`` bool over the logical slots, as in ``KVCache``.
      table: ``[B, S_max // P]`` int32 block of each row's logical block.
    """

    k: Array
    v: Array
    mask: Array
    table: Array


CACHE_AXES = KVCache(
    k=("layers", "batch", "kv_heads", "cache_seq", "head_dim"),
    v=("layers", "batch", "kv_heads", "cache_seq", "head_dim"),
    mask=("batch", "cache_seq"),
)


class LayerCache(NamedTuple):
    """What one decoder layer's call reads and writes of a cache (``DecoderLayer.__call__``).

    Attributes:
      kv: the caches ``(k, v)``: stacked ``[L, B, K, S_max, H]`` (with ``layer_index``), this
        layer's own ``[B, K, S_max, H]`` (``layer_index=None``), or, with ``table``, the block
        pools (``[L, K, N, P, H]`` or ``[K, N, P, H]``) of a ``PagedKVCache``.
      cache_index: first cache slot written by this call (int32, ``[]`` or ``[B]``; may be
        traced).
      layer_index: this layer's index into stacked caches (int32, may be traced), or None.
      table: ``[B, S_max // P]`` block table of a paged cache, else None.
    """

    kv: tuple[Array, Array]
    cache_index: Array
    layer_index: Array | None = None
    table: Array | None = None


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


# The blocks split like the rows: batch shard j's rows use only its own blocks (shard-local ids).
PAGED_CACHE_AXES = PagedKVCache(
    k=("layers", "kv_heads", "batch", None, "head_dim"),
    v=("layers", "kv_heads", "batch", None, "head_dim"),
    mask=("batch", "cache_seq"),
    table=("batch", None),
)


def init_paged_cache(
    config: ModelConfig,
    batch_size: int,
    max_len: int,
    *,
    blocks: int,
    block_size: int,
    dtype: Any = jnp.bfloat16,
) -> PagedKVCache:
    """An empty paged cache: a zero pool ``[L, K, blocks, block_size, H]``, every table entry
    unmapped and an all-False mask; ``max_len`` must be a multiple of ``block_size``."""
    if block_size < 1 or max_len % block_size:
        raise ValueError(
            f"a paged cache's length ({max_len}) must be a multiple of its block size "
            f"({block_size})"
        )
    shape = (
        config.num_hidden_layers,
        config.num_key_value_heads,
        blocks,
        block_size,
        config.head_dim,
    )
    return PagedKVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        mask=jnp.zeros((batch_size, max_len), bool),
        table=jnp.full((batch_size, max_len // block_size), blocks, jnp.int32),
    )


def page_slots(
    table: Array, start: Array, seq: int, block_size: int, blocks: int
) -> tuple[Array, Array]:
    """``(block, offset)``, each ``[B, seq]``: where row ``b``'s logical slots ``start[b] + i``
    lie in a pool of ``blocks`` blocks through ``table`` (``[B, W]``). Slots before 0, past
    ``W * block_size`` or in unmapped blocks get block ``blocks`` (a write there drops)."""
    batch = table.shape[0]
    slots = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (batch,))[:, None]
    slots = slots + jnp.arange(seq, dtype=jnp.int32)  # [B, S]
    logical = slots // block_size
    inside = (slots >= 0) & (logical < table.shape[1])
    block = jnp.take_along_axis(table, jnp.clip(logical, 0, table.shape[1] - 1), axis=1)
    return jnp.where(inside, block, blocks), slots % block_size


def write_pages(
    pool: Array, new: Array, layer_index: Any, cache_index: Array, table: Array
) -> Array:
    """Writes ``new: [B, S, K, H]`` at logical slots ``[cache_index, cache_index + S)`` of each
    row, through ``table`` (``[B, S_max // P]``), into ``pool`` (``[L, K, N, P, H]`` with
    ``layer_index``, else ``[K, N, P, H]``). Unmapped blocks and slots outside
    ``[0, S_max)`` drop (a negative ``cache_index`` writes only the tail of ``new``)."""
    block, offset = page_slots(table, cache_index, new.shape[1], pool.shape[-2], pool.shape[-3])
    new = new.astype(pool.dtype)
    if layer_index is None:  # adjacent advanced indices stay in place: the value is [K, B, S, H]
        return pool.at[:, block, offset].set(new.transpose(2, 0, 1, 3), mode="drop")
    # Advanced indices split by a slice go first: the value is [B, S, K, H].
    return pool.at[layer_index, :, block, offset].set(new, mode="drop")


def read_pages(pool: Array, table: Array) -> Array:
    """Row ``b``'s logical slots from a layer's ``pool: [K, N, P, H]``: ``[K, B, S_max, H]``
    (a block-table gather; unmapped entries read a clamped block, hidden by the mask)."""
    batch, width = table.shape
    blocks = jnp.take(pool, table, axis=1, mode="clip")  # [K, B, S_max / P, P, H]
    kv_heads, _, _, block_size, head_dim = blocks.shape
    return blocks.reshape(kv_heads, batch, width * block_size, head_dim)


def paged_attention_implementation(seq: int, dtype: Any, head_dim: int, block_size: int) -> str:
    """How ``paged_cache_attention`` attends: ``"kernel"`` (JAX's Pallas TPU paged-attention
    kernel) on TPU for one query per row over a bf16 pool with ``head_dim % 128 == 0`` and
    ``block_size % 16 == 0`` (its tiles; the kernel loads blocks as bf16, so an f32 pool keeps
    its precision through the gather), else ``"gather"`` (an XLA block-table gather, then
    ``cache_attention``). A layer with a sliding window or attention sinks always gathers (the
    kernel reads every slot before the query and has no sinks; the gather's mask holds the
    window and ``cache_attention`` takes the sinks: ``paged_cache_attention``)."""
    from jaxrl_llm.parallel.mesh import current_platform  # noqa: PLC0415

    tiles = head_dim % 128 == 0 and block_size % 16 == 0
    if seq == 1 and tiles and jnp.dtype(dtype) == jnp.bfloat16:
        return "kernel" if current_platform()[0] == "tpu" else "gather"
    return "gather"


def paged_cache_attention(
    pools: tuple[Array, Array],
    new: tuple[Array, Array],
    q: Array,
    mask: Array,
    *,
    layer_index: Any,
    cache_index: Array,
    table: Array,
    scale: float,
    key_valid: Array,
    logit_softcap: float | None = None,
    windowed: bool = False,
    sinks: Array | None = None,
) -> tuple[tuple[Array, Array], Array]:
    """Writes this call's keys and values (``new``, each ``[B, S, K, H]``) into a paged cache's
    pools and attends ``q: [B, S, N, H]`` over each row's slots: ``(pools, [B, S, N, H])``.

    ``logit_softcap``: the scores' soft cap (Gemma 2; both paths apply it). ``windowed``: the
    layer may have a sliding window, which ``mask`` then holds; the gather path runs (the
    kernel has no window). ``sinks``: ``[N]`` the heads' attention-sink logits (gpt-oss;
    ``cache_attention``'s ``sinks``), or None; the gather path runs (the kernel has none).

    ``paged_attention_implementation`` picks the kernel (one query per row; rows packed from
    slot 0, so slots ``[0, cache_index + 1)``, none for a row whose newest slot ``key_valid``
    (``[B, S_max]``, the slots holding real tokens after this call's write) marks invalid: a
    finished or empty engine slot) or the gather (``mask: [B, 1, S, S_max]``, which lets every
    query see its own slot, so it cannot tell a dead row).
    On a mesh whose batch axes split the rows (and for the kernel, an opaque custom call, on
    any multi-device mesh) this runs per device under ``jax.shard_map``: the table's ids are
    local to the batch shard's part of the pool (see ``sampling.paging``) and the heads split
    over the ``kv_heads`` axes.
    """
    from jaxrl_llm.models.attention import cache_attention  # noqa: PLC0415
    from jaxrl_llm.models.attention_backends import (  # noqa: PLC0415
        _mapped_axes,
        _paged_kernel_attention,
    )
    from jaxrl_llm.parallel.rules import spec_entry  # noqa: PLC0415

    seq = q.shape[1]
    implementation = "gather"
    if not windowed and sinks is None:
        implementation = paged_attention_implementation(
            seq, pools[0].dtype, q.shape[-1], pools[0].shape[-2]
        )
    kernel = implementation == "kernel"

    lengths = jnp.broadcast_to(cache_index + seq, (q.shape[0],))
    if kernel:
        # A row whose newest slot holds no real token (a finished or empty engine slot), or
        # lies past its table, reads nothing: the kernel skips rows of length 0 (their
        # output, ignored, is unset).
        slots = key_valid.shape[-1]
        newest = jnp.take_along_axis(
            key_valid, jnp.clip(lengths - 1, 0, slots - 1)[:, None], axis=1
        )[:, 0]
        lengths = jnp.where(newest & (lengths <= slots), lengths, 0)

    def local(pools, new, q, mask, layer_index, cache_index, table, lengths, sinks=None):
        pools = tuple(
            write_pages(c, n, layer_index, cache_index, table) for c, n in zip(pools, new)
        )
        layer = pools if layer_index is None else tuple(layer_slice(c, layer_index) for c in pools)
        if kernel:
            capped = {} if logit_softcap is None else {"logit_softcap": logit_softcap}
            out = _paged_kernel_attention(q[:, 0], *layer, lengths, table, scale=scale, **capped)
            return pools, out[:, None]
        k, v = (read_pages(c, table) for c in layer)
        return pools, cache_attention(
            q, k, v, mask, scale=scale, kv_major=True, logit_softcap=logit_softcap, sinks=sinks
        )

    mesh = jax.sharding.get_abstract_mesh()
    batch = () if mesh.empty else _mapped_axes(mesh, "batch", (table.shape[0], pools[0].shape[-3]))
    if not batch and (mesh.empty or mesh.size == 1 or not kernel):
        return local(pools, new, q, mask, layer_index, cache_index, table, lengths, sinks)
    spec = jax.sharding.PartitionSpec
    kv_heads, heads = new[0].shape[2], q.shape[2]
    rows = spec_entry(batch)
    head = spec_entry(_mapped_axes(mesh, "kv_heads", (kv_heads, heads)))
    pool = spec(head, rows, None, None)
    pool = pool if layer_index is None else spec(None, *pool)
    manual = set(getattr(mesh, "manual_axes", ()))
    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(
            (pool, pool),
            (spec(rows, None, head, None),) * 2,
            spec(rows, None, head, None),
            spec(rows, None, None, None),
            None if layer_index is None else spec(),
            spec(rows) if jnp.ndim(cache_index) == 1 else spec(),
            spec(rows, None),
            spec(rows),
            None if sinks is None else spec(head),
        ),
        out_specs=((pool, pool), spec(rows, None, head, None)),
        axis_names=frozenset(a for a in mesh.axis_names if a not in manual),
        check_vma=False,
    )
    return mapped(
        tuple(pools),
        tuple(new),
        q,
        mask,
        layer_index,
        jnp.asarray(cache_index),
        table,
        lengths,
        sinks,
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
    if isinstance(cache, PagedKVCache):
        _check_paged(cache, (layers, kv_heads, head_dim), batch, max_len)
    elif got_k != want or got_v != want:
        raise ValueError(
            f"cache k/v must have shape [L, B, K, S_max, H]={want} for tokens {token_shape}, "
            f"got k{got_k} v{got_v} mask{tuple(cache.mask.shape)}"
        )
    if seq > max_len:
        raise ValueError(f"{seq} tokens do not fit a cache of {max_len} slots")


def _check_paged(
    cache: PagedKVCache, model: tuple[int, int, int], batch: int, max_len: int
) -> None:
    layers, kv_heads, head_dim = model
    got_k, got_v = _cache_shape(cache.k), _cache_shape(cache.v)
    ok = got_k == got_v and len(got_k) == 5
    ok = ok and (got_k[0], got_k[1], got_k[4]) == (layers, kv_heads, head_dim)
    block_size = got_k[3] if ok else -1
    table = tuple(jnp.shape(cache.table))
    if not ok or table != (batch, max_len // max(block_size, 1)) or max_len % block_size:
        raise ValueError(
            f"a paged cache needs k/v [L, K, N, P, H] with (L, K, H)={model}, a [B, S_max] mask "
            f"and a [B, S_max // P] table for tokens of batch {batch}; got k{got_k} v{got_v} "
            f"mask{tuple(cache.mask.shape)} table{table}"
        )


def _cache_shape(x: Any) -> tuple[Any, ...]:
    """``[L, B, K, S, H]`` of a stacked cache array or of a tuple of ``L`` per-layer arrays."""
    if not isinstance(x, tuple):
        return tuple(jnp.shape(x))
    shapes = {tuple(jnp.shape(a)) for a in x}
    return (len(x), *shapes.pop()) if len(shapes) == 1 else (len(x), *sorted(shapes))
