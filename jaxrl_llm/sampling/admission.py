"""The continuous engine's admissions, host side: what ``slots.prefill`` runs through the model
and ``slots.admit`` copies into slots.

The requests admitted together are grouped by prompt (``paging.sharing_key``: the same prompt
and the same weight version). A prompt is prefilled once, in one row of a left-padded batch,
and its samples admitted with it take that row. A prompt that a live slot already holds (one
of its samples admitted earlier and still decoding, with the same weights) is not prefilled
again — vLLM's prefix caching, for the ``G`` samples an RL step draws per prompt, which a busy
engine admits a few at a time as slots free up: the request takes its first-token logits from
the holder's ``prompt_hidden`` and copies the holder's prompt keys and values (a contiguous
cache: the holder's prompt slots; a paged one: it shares the prompt's full blocks in the
holder's batch shard and copies the partial last block).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from jaxrl_llm.sampling.paging import BlockAllocator, sharing_key
from jaxrl_llm.sampling.prompts import bucket_length
from jaxrl_llm.sampling.requests import Request


class Admission(NamedTuple):
    """One admission's inputs (``slots.prefill``'s prompts, ``slots.admit``'s): requests ``j``
    (prompt ``owner[j]`` of the prefill) into slots ``slot[j]``; entries with ``slot[j] == S``
    are padding (dropped). Host NumPy arrays from :func:`admission`, device arrays in the
    programs.

    Attributes:
      prompt_tokens, prompt_mask: ``[U, p]`` left-padded prompts to prefill (None: every
        request comes from a live slot, nothing is prefilled).
      owner, slot, limit, request: ``[N]`` int32: the prefill row, the slot, the request's
        ``max_new_tokens`` and its id (its sampling stream).
      source: ``[N]`` int32 the live slot holding the request's prompt (``S``: none, it is
        prefilled), or None.
      length: ``[N]`` int32 each request's prompt length (needed with ``source``), or None.
      table: a paged cache's new ``[S, W / P]`` block table, or None.
      dest: a paged cache's prefill writes ``(source rows, blocks)``, or None.
      copies: a paged cache's ``(from, to)`` global block ids of the reused prompts' partial
        last blocks, or None.
    """

    prompt_tokens: Any
    prompt_mask: Any
    owner: Any
    slot: Any
    limit: Any
    request: Any
    source: Any = None
    length: Any = None
    table: Any = None
    dest: Any = None
    copies: Any = None


def pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``): the engine's program sizes."""
    return 1 << max(n - 1, 0).bit_length()


def holders(
    requests: list[Request], occupant: list[int | None], versions: list[int]
) -> dict[Any, list[int]]:
    """Sharing key -> the live slots holding that prompt (``versions``: each slot's weight
    version at its admission, which computed its prompt's keys and values)."""
    held: dict[Any, list[int]] = {}
    for s, r in enumerate(occupant):
        if r is not None:
            held.setdefault(sharing_key(requests[r], r, versions[s]), []).append(s)
    return held


def admission(
    requests: list[Request],
    admitted: list[int],
    slots: list[int],
    *,
    held: dict[Any, list[int]],
    version: int,
    engine_slots: int,
    entries: int | None = None,
    shards: int,
    pad_id: int,
    pager: BlockAllocator | None = None,
) -> tuple[Admission, dict[str, int]]:
    """The arrays of one ``slots.admit`` call (:class:`Admission`) admitting
    ``requests[admitted[j]]`` into ``slots[j]`` (``held``: ``holders`` of the live slots;
    ``pager``: a paged cache's allocator, updated here), and its counts (``prefill_rows``,
    ``reused_prompts``).

    Sizes are powers of two (the prefill's rows also a multiple of ``shards``, its width a
    ``bucket_length``), so a run compiles a handful of programs; padding entries go to slot
    ``engine_slots`` (dropped). ``entries``: every admission this many instead (the
    engine's slots where its cache takes several widths: one admission program a width).
    """
    rows: dict[Any, int] = {}  # sharing key -> row of the prefill batch
    prompts: list[np.ndarray] = []
    owner, source, writes, copies = [], [], [], []
    for r, slot in zip(admitted, slots):
        key = sharing_key(requests[r], r, version)
        holder = None
        if key not in rows:
            candidates = held.get(key, [])
            if pager is not None:  # its full blocks are shared within a batch shard
                candidates = [h for h in candidates if pager.shard(h) == pager.shard(slot)]
            holder = candidates[0] if candidates else None
            if holder is None:
                rows[key] = len(prompts)
                prompts.append(np.asarray(requests[r].prompt))
        owner.append(rows.get(key, 0))
        source.append(engine_slots if holder is None else holder)
        if pager is None:
            continue
        blocks = pager.admit(slot, key, len(requests[r].prompt))
        if blocks is None:
            continue
        if holder is None:
            writes.append((rows[key], slot, blocks))
        else:  # only the partial last block is written: copied from the holder's
            full = len(requests[r].prompt) // pager.block_size
            copies.append((pager.global_id(holder, full), pager.global_id(slot, full)))
    n = entries or pow2(len(admitted))
    pad = n - len(admitted)
    arrays = Admission(
        prompt_tokens=None,
        prompt_mask=None,
        owner=np.asarray(owner + [0] * pad, np.int32),
        slot=np.asarray(slots + [engine_slots] * pad, np.int32),
        limit=np.asarray([requests[r].max_new_tokens for r in admitted] + [1] * pad, np.int32),
        request=np.asarray(admitted + [0] * pad, np.int32),
        source=np.asarray(source + [engine_slots] * pad, np.int32),
        length=np.asarray([len(requests[r].prompt) for r in admitted] + [1] * pad, np.int32),
    )
    if prompts:
        width = bucket_length(max(len(p) for p in prompts))
        count = shards * pow2(-(-len(prompts) // shards))  # the prefill's rows split over shards
        tokens = np.full((count, width), pad_id, np.int32)
        mask = np.zeros((count, width), bool)
        for i in range(count):
            prompt = prompts[i] if i < len(prompts) else prompts[0]  # padding repeats a prompt
            tokens[i, width - len(prompt) :] = prompt
            mask[i, width - len(prompt) :] = True
        arrays = arrays._replace(prompt_tokens=tokens, prompt_mask=mask)
    if pager is not None:
        arrays = arrays._replace(table=pager.table.copy())
        if writes:
            arrays = arrays._replace(dest=pager.prefill_writes(writes))
        if copies:
            pairs = np.full((2, pow2(len(copies))), pager.blocks, np.int32)
            pairs[:, : len(copies)] = np.asarray(copies, np.int32).T
            arrays = arrays._replace(copies=(pairs[0], pairs[1]))
    reused = sum(s != engine_slots for s in source)
    return arrays, dict(prefill_rows=len(prompts), reused_prompts=reused)


__all__ = ["Admission", "admission", "holders", "pow2"]
