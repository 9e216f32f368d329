"""Sequence packing: several sequences per row, so forwards do not run over padding.

A padded batch ``[B, S]`` holds one sequence per row (a left-padded prompt then a right-padded
completion: the real tokens of a row are one contiguous run). A :class:`PackingPlan` moves the
real tokens into ``R = shards * rows_per_shard`` packed rows of width ``W = S``, sequence after
sequence, each with a segment id (``k >= 1`` for the ``k``-th sequence of a packed row, 0 on the
padding at a row's end) and its own positions ``0, 1, ..`` (so RoPE sees what it sees padded).
The model takes ``segment_ids`` and ``positions`` (``models.forward``) and attends within a
segment only; ``pack`` / ``unpack`` move any per-token array between the two layouts.

Planner (host side, NumPy): first-fit decreasing (Johnson 1973) bins of capacity ``W`` **per
data shard**: the ``B`` rows are split into ``shards`` contiguous blocks, as the batch is
sharded, and a shard's packed rows hold only its own sequences, so packing and unpacking never
move tokens between devices. Every shard gets the same number of packed rows: the largest
count any shard needs, rounded up to a bucket (``bucket_rows``: four sizes per doubling by
default) and never more than ``B / shards``, so a training run compiles for a handful of
shapes only.

The plan's arrays are ``[shards, rows_per_shard, W]`` (the leading axis is the shard, so the
shard count is static in the shapes and the gathers stay per shard); ``pack`` returns
``[R, W, ...]`` rows in shard order, which shard over the batch axes like the padded rows.

Shapes: B padded rows, S padded width, R packed rows, W packed width (= S).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


class PackingPlan(NamedTuple):
    """Where each packed slot comes from.

    Attributes:
      source: ``[shards, rows_per_shard, W]`` int32, the flat index ``b * S + s`` of the slot's
        token in the padded ``[B, S]`` layout; -1 on padding slots.
      segment_ids: ``[shards, rows_per_shard, W]`` int32, ``k >= 1`` on the ``k``-th sequence
        of the packed row, 0 on padding slots.
      positions: ``[shards, rows_per_shard, W]`` int32, the slot's position in its sequence
        (0 at its first real token), 0 on padding slots.
    """

    source: Array
    segment_ids: Array
    positions: Array

    @property
    def shards(self) -> int:
        """The data shards the plan was made for (static)."""
        return self.source.shape[0]

    @property
    def rows(self) -> int:
        """``R``: packed rows in all (static)."""
        return self.source.shape[0] * self.source.shape[1]

    def flat(self, name: str) -> Array:
        """Field ``name`` as ``[R, W]`` (the packed rows' layout: what the model takes)."""
        x = getattr(self, name)
        return x.reshape(-1, x.shape[-1])


def sequence_mask(prompt_mask: Any, completion_mask: Any) -> np.ndarray:
    """``[B, P + T]`` bool mask of the real tokens of ``[prompt ; completion]`` (NumPy).

    Raises:
      ValueError: a prompt mask that is not left-padded (its ones a suffix of the row) or a
        completion mask that is not right-padded (its ones a prefix of the row): packing moves
        one contiguous run of tokens per row.
    """
    prompt_mask = np.asarray(prompt_mask).astype(bool)
    completion_mask = np.asarray(completion_mask).astype(bool)
    if prompt_mask.ndim != 2 or completion_mask.ndim != 2:
        raise ValueError(
            f"prompt_mask {prompt_mask.shape} and completion_mask {completion_mask.shape} must "
            f"be [B, P] and [B, T]"
        )
    if prompt_mask.shape[0] != completion_mask.shape[0]:
        raise ValueError(
            f"prompt_mask {prompt_mask.shape} and completion_mask {completion_mask.shape} "
            f"differ in B"
        )
    # Left-padded: once True, True to the end; right-padded: once False, False to the end.
    bad = np.flatnonzero(np.any(prompt_mask[:, :-1] & ~prompt_mask[:, 1:], axis=1))
    if bad.size:
        raise ValueError(f"prompt_mask row {bad[0]} is not left-padded (real tokens then padding)")
    bad = np.flatnonzero(np.any(~completion_mask[:, :-1] & completion_mask[:, 1:], axis=1))
    if bad.size:
        raise ValueError(
            f"completion_mask row {bad[0]} is not right-padded (a gap before a real token)"
        )
    return np.concatenate([prompt_mask, completion_mask], axis=1)


def _runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(first, length)`` ``[B]`` of each row's run of True; an error if a row has two."""
    lengths = mask.sum(axis=1)
    first = np.where(lengths > 0, np.argmax(mask, axis=1), 0)
    slots = np.arange(mask.shape[1])[None]
    expected = (slots >= first[:, None]) & (slots < (first + lengths)[:, None])
    bad = np.flatnonzero(np.any(expected != mask, axis=1))
    if bad.size:
        raise ValueError(
            f"mask row {bad[0]} is not one contiguous run of real tokens (packing needs "
            f"left-padded prompts and right-padded completions)"
        )
    return first, lengths


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices: items by decreasing length (ties: lower index first), each into
    the first open bin with room, else a new bin. Zero-length items go in no bin.

    Raises:
      ValueError: an item longer than ``capacity``.
    """
    lengths = [int(n) for n in lengths]
    if any(n > capacity for n in lengths):
        raise ValueError(f"an item of length {max(lengths)} exceeds the capacity {capacity}")
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def balance_rows(lengths: Sequence[int], *, shards: int = 1, micro_batches: int = 1) -> np.ndarray:
    """An order of ``n`` rows that gives every data shard, and every micro-batch within it,
    about the same tokens (verl's sequence-length balancing; Graham's longest-processing-time
    rule with equal row counts).

    The rows are laid out as the step reads them: ``shards`` contiguous blocks of ``n / shards``
    rows (the batch's sharding), micro-batch ``k`` of block ``d`` its rows ``k, k + K, ..``
    (``K = micro_batches``, the step's strided micro-batches). Each of the ``shards x K`` cells
    holds ``n / (shards x K)`` rows. Rows are taken longest first (ties: lower index first),
    each into the cell with the fewest tokens so far that still has room (ties: the lower
    cell); a cell's rows sit longest first, so a block with ``K = 1`` read in strided
    micro-batches of another count deals its rows out round-robin.

    Args:
      lengths: ``[n]`` tokens per row (what a packed row holds of it).
      shards: the batch's data shards.
      micro_batches: ``K``, the step's micro-batches (1: balance the shards only).

    Returns:
      ``[n]`` int64, a permutation of ``range(n)``: position ``p`` of the laid-out batch holds
      row ``order[p]``.

    Raises:
      ValueError: ``shards x micro_batches`` that does not divide ``n``, or negative lengths.
    """
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    rows = lengths.size
    for name, value in (("shards", shards), ("micro_batches", micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    cells = shards * micro_batches
    if rows % cells:
        raise ValueError(
            f"{shards} shards x {micro_batches} micro-batches do not divide the batch's {rows} rows"
        )
    if (lengths < 0).any():
        raise ValueError(f"row lengths must be >= 0, got {int(lengths.min())}")
    per_cell = rows // cells
    load = np.zeros(cells, np.int64)
    room = np.full(cells, per_cell)
    members: list[list[int]] = [[] for _ in range(cells)]
    for row in sorted(range(rows), key=lambda i: (-lengths[i], i)):
        cell = int(np.argmin(np.where(room > 0, load, np.iinfo(np.int64).max)))
        members[cell].append(row)
        load[cell] += lengths[row]
        room[cell] -= 1
    # Cell (d, k) -> positions d n / shards + k + K j, j = 0 .. per_cell - 1.
    order = np.empty(rows, np.int64)
    block = rows // shards
    for cell, held in enumerate(members):
        d, k = divmod(cell, micro_batches)
        order[d * block + k + micro_batches * np.arange(per_cell)] = held
    return order


def bucket_rows(needed: int, limit: int, buckets: Sequence[int] | None = None) -> int:
    """The packed rows per shard for ``needed`` bins: the smallest bucket ``>= needed``, capped
    at ``limit`` (the shard's padded rows); at least 1.

    Default buckets: 1, 2, 3, then ``m * 2^e`` with ``m`` in 4..7 (4, 5, 6, 7, 8, 10, 12, 14, 16,
    20, ..): four shapes per doubling, at most 25% of the rows wasted (powers of two waste up to
    half, and then so would the packed forward).
    """
    needed = max(1, needed)
    if buckets is None:
        step = 1 << max(0, needed.bit_length() - 3)
        choice = -(-needed // step) * step
    else:
        fitting = [b for b in buckets if b >= needed]
        choice = min(fitting) if fitting else limit
    return min(max(choice, needed), limit)


def plan_packing(
    mask: Any, *, shards: int = 1, buckets: Sequence[int] | None = None
) -> PackingPlan:
    """A :class:`PackingPlan` (NumPy arrays) for the padded rows of ``mask``.

    Rows ``[d B / shards, (d + 1) B / shards)`` form shard ``d``; each shard's sequences (the
    runs of ``mask``) go into bins of capacity ``S`` by ``first_fit_decreasing``, one packed
    row per bin, sequences in bin order with segment ids ``1, 2, ..``. Every shard gets
    ``bucket_rows(max bins over shards, B / shards, buckets)`` rows (rows past its bins are all
    padding). Rows without real tokens take no slot (``unpack`` gives them zeros).

    Args:
      mask: ``[B, S]`` bool/0-1, one contiguous run of real tokens per row (see
        ``sequence_mask`` for ``[prompt ; completion]``).
      shards: data shards the batch is split into (``B % shards == 0``).
      buckets: allowed rows per shard (default: ``bucket_rows``'s).

    Raises:
      ValueError: a mask that is not ``[B, S]``, a row that is not one run, or ``shards`` that
        does not divide ``B``.
    """
    mask = np.asarray(mask).astype(bool)
    if mask.ndim != 2:
        raise ValueError(f"mask must be [B, S], got shape {mask.shape}")
    batch, width = mask.shape
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1 or batch % shards:
        raise ValueError(f"shards must be a positive int dividing B={batch}, got {shards!r}")
    first, lengths = _runs(mask)
    per_shard = batch // shards
    shard_bins = [
        first_fit_decreasing(lengths[d * per_shard : (d + 1) * per_shard], width)
        for d in range(shards)
    ]
    rows = bucket_rows(max(len(bins) for bins in shard_bins), per_shard, buckets)
    source = np.full((shards, rows, width), -1, np.int32)
    segment_ids = np.zeros((shards, rows, width), np.int32)
    positions = np.zeros((shards, rows, width), np.int32)
    for d, bins in enumerate(shard_bins):
        for r, members in enumerate(bins):
            offset = 0
            for k, local in enumerate(members, start=1):
                b, n = d * per_shard + local, lengths[d * per_shard + local]
                slots = slice(offset, offset + n)
                source[d, r, slots] = b * width + first[b] + np.arange(n)
                segment_ids[d, r, slots] = k
                positions[d, r, slots] = np.arange(n)
                offset += n
    return PackingPlan(source, segment_ids, positions)


def plan_sequences(
    prompt_mask: Any,
    completion_mask: Any,
    *,
    shards: int = 1,
    buckets: Sequence[int] | None = None,
) -> PackingPlan:
    """``plan_packing(sequence_mask(prompt_mask, completion_mask), ...)``: the plan of a
    ``Sequences`` batch's ``[prompt ; completion]`` rows (width ``P + T``)."""
    return plan_packing(sequence_mask(prompt_mask, completion_mask), shards=shards, buckets=buckets)


def _local_index(plan: PackingPlan, batch: int, width: int) -> tuple[Array, Array, Array]:
    """``(row, column, valid)`` ``[shards, rows_per_shard, W]``: each slot's source row within
    its shard's ``B / shards`` rows (0 on padding), its source column, whether it holds a token.
    """
    shards = plan.shards
    if batch % shards:
        raise ValueError(f"the plan has {shards} shards, which do not divide B={batch}")
    if plan.source.shape[-1] != width:
        raise ValueError(f"the plan's width {plan.source.shape[-1]} is not the batch's S={width}")
    source = jnp.asarray(plan.source)
    valid = jnp.asarray(plan.segment_ids) > 0
    first_row = (jnp.arange(shards, dtype=jnp.int32) * (batch // shards))[:, None, None]
    row = jnp.where(valid, source // width - first_row, 0)
    column = jnp.where(valid, source % width, 0)
    return row, column, valid


def pack(x: Array, plan: PackingPlan) -> Array:
    """``[B, S, ...] -> [R, W, ...]``: packed slot ``(r, w)`` holds ``x`` at its source, zero
    on padding slots. Jittable; the gather runs per shard (batched over the shard axis, so a
    batch-sharded ``x`` needs no collective), and its gradient scatters back."""
    x = jnp.asarray(x)
    batch, width = x.shape[:2]
    row, column, valid = _local_index(plan, batch, width)
    shards, rest = plan.shards, x.shape[2:]
    local = x.reshape(shards, batch // shards, width, *rest)
    out = jax.vmap(lambda rows, r, c: rows[r, c])(local, row, column)
    out = jnp.where(valid.reshape(*valid.shape, *(1,) * len(rest)), out, jnp.zeros((), x.dtype))
    return out.reshape(plan.rows, width, *rest)


def unpack(y: Array, plan: PackingPlan, shape: tuple[int, int]) -> Array:
    """``[R, W, ...] -> [B, S, ...]`` (``shape = (B, S)``): each token back at its source,
    zeros where no packed slot maps (padding). The inverse of ``pack`` on real tokens;
    jittable, per shard, differentiable (its gradient is ``pack``)."""
    y = jnp.asarray(y)
    batch, width = shape
    row, column, valid = _local_index(plan, batch, width)
    shards, rest = plan.shards, y.shape[2:]
    if y.shape[:2] != (plan.rows, width):
        raise ValueError(
            f"packed array {tuple(y.shape)} must be [R, W, ...] = {(plan.rows, width)} of the plan"
        )
    rows = batch // shards
    packed = y.reshape(shards, -1, width, *rest)
    row = jnp.where(valid, row, rows)  # padding slots scatter out of bounds: dropped

    def scatter(values: Array, r: Array, c: Array) -> Array:
        return jnp.zeros((rows, width, *rest), y.dtype).at[r, c].add(values, mode="drop")

    return jax.vmap(scatter)(packed, row, column).reshape(batch, width, *rest)


__all__ = [
    "PackingPlan",
    "balance_rows",
    "bucket_rows",
    "first_fit_decreasing",
    "pack",
    "plan_packing",
    "plan_sequences",
    "sequence_mask",
    "unpack",
]
