"""The continuous engine's paged KV cache, host side: which blocks each slot's rows use.

The device keeps a pool of ``N`` blocks of ``P`` cache slots (``models.PagedKVCache``) and a
block table per slot; this allocator decides the table (vLLM's block manager, Kwon et al.
2023, in its simplest form):

* **Prompts.** A slot's row is packed from cache slot 0: its prompt's real tokens, then its
  completion (the layout of the TPU paged-attention kernel, which reads slots ``[0, length)``
  of a row). A prompt's full blocks are allocated once per distinct prompt: the ``G``
  samples of a prompt that are in the engine at the same time share them
  (reference-counted; freed with the last sharer). Its partial last block, where the
  completion goes on, is each sample's own (written from the prefill, or copied from a live
  sharer's when the prompt is not prefilled again: ``sampling.admission``), as vLLM shares
  only full blocks.
* **Completions.** Blocks are allocated as a slot's row grows, before each burst for the
  tokens that burst may write, and freed when the request finishes.
* **Preemption.** When a burst's blocks do not fit, the most recently admitted requests are
  preempted (their blocks freed, the requests put back at the head of the queue) and later
  recomputed from their prompts: their tokens are drawn from the same per-request streams,
  so with fixed weights the result does not depend on the preemption (vLLM's recompute
  preemption; requests are served first come, first served, the newest preempted first). An
  admission keeps the live slots' blocks for their next burst free, so it does not preempt
  at once. With weights updated in flight, prompts share blocks within one weight version.

Capacity is set in blocks: with ``N`` smaller than ``slots * W / P`` the engine runs more slots
than a contiguous cache of the same size would hold.

**On a mesh that splits the slots** (``data x fsdp`` batch shards) the pool splits the same way:
batch shard ``j`` holds slots ``[j S/D, (j+1) S/D)`` and blocks ``[j N/D, (j+1) N/D)``, its
tables hold shard-local block ids (``models.kv_cache.read_pages`` runs per shard under
``jax.shard_map``), every shard has its own free list, and a prompt is shared within a shard.
An admitted request goes to the free slot of the shard where it costs the fewest blocks (its
prompt's samples together), among the shards with room: a full shard does not hold up the
queue while another has room.
"""

from __future__ import annotations

import numbers
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_llm.sampling.requests import Request


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` slots."""
    return -(-max(tokens, 0) // block_size)


class BlockAllocator:
    """Block tables of ``slots`` slots over a pool of ``blocks`` blocks of ``block_size`` slots,
    both split into ``shards`` equal parts (the mesh's batch shards; see the module docstring).

    Table entries are shard-local block ids; ``unmapped`` (``blocks / shards``) is no block.

    Args:
      blocks: N, blocks in the pool.
      block_size: P, cache slots a block.
      slots: decode slots (table rows).
      prompt_width: the longest prompt.
      max_new_tokens: the longest completion.
      shards: D, batch shards; must divide ``blocks`` and ``slots``.

    Raises:
      ValueError: a bad size, or a shard's pool that cannot hold one request of the longest
        prompt and completion.
    """

    def __init__(
        self,
        blocks: int,
        block_size: int,
        slots: int,
        prompt_width: int,
        max_new_tokens: int,
        shards: int = 1,
    ):
        if blocks % shards or slots % shards:
            raise ValueError(
                f"kv_blocks={blocks} and slots={slots} must be multiples of the mesh's {shards} "
                "batch shards (each shard has its own pool)"
            )
        self.block_size, self.blocks, self.shards = block_size, blocks, shards
        self.unmapped = blocks // shards
        width = blocks_for(prompt_width + max_new_tokens, block_size)
        if self.unmapped < width:
            per_shard = f" ({self.unmapped} a batch shard)" if shards > 1 else ""
            raise ValueError(
                f"kv_blocks={blocks}{per_shard} cannot hold one request: a {prompt_width}-token "
                f"prompt and {max_new_tokens} new tokens need {width} blocks of "
                f"{block_size} slots"
            )
        # Popped from the end: low ids first.
        self.free = [list(range(self.unmapped - 1, -1, -1)) for _ in range(shards)]
        self.table = np.full((slots, width), self.unmapped, np.int32)
        self.prompt_of: list[Any] = [None] * slots  # prompt key per slot
        self.length = [0] * slots  # prompt tokens per slot
        self.own: list[list[int]] = [[] for _ in range(slots)]  # blocks after the shared ones
        self.prompts: dict[Any, tuple[list[int], int]] = {}  # (shard, key) -> (blocks, sharers)
        self.peak = 0

    @property
    def used(self) -> int:
        return self.blocks - sum(map(len, self.free))

    def shard(self, slot: int) -> int:
        """The batch shard of ``slot``."""
        return slot * self.shards // len(self.prompt_of)

    def _take(self, shard: int, n: int) -> list[int]:
        taken = [self.free[shard].pop() for _ in range(n)]
        self.peak = max(self.peak, self.used)
        return taken

    def admission_cost(
        self, slot: int, key: Any, prompt_len: int, pending: set, tokens: int = 1
    ) -> int:
        """Blocks admitting a request into ``slot`` needs for its first ``tokens`` completion
        tokens: its prompt's full blocks (unless resident in the slot's shard or in ``pending``,
        this admission's new prompts) and its own blocks (the partial last prompt block and
        the completion's, at least one)."""
        shared = (self.shard(slot), key)
        shared = shared in self.prompts or shared in pending
        full = prompt_len // self.block_size
        own = blocks_for(prompt_len + max(tokens, 1), self.block_size) - full
        return (0 if shared else full) + own

    def admit(self, slot: int, key: Any, prompt_len: int) -> list[int] | None:
        """Maps ``slot`` to prompt ``key``'s full blocks (allocated in its shard unless
        resident) and a block of its own for the partial last one and its first completion
        token; returns the table row the prefill writes through (local ids; unmapped where
        nothing is written: resident blocks), or None when it writes nothing."""
        full = prompt_len // self.block_size
        shard = self.shard(slot)
        fresh = (shard, key) not in self.prompts
        if fresh:
            self.prompts[shard, key] = (self._take(shard, full), 0)
        owned, sharers = self.prompts[shard, key]
        self.prompts[shard, key] = (owned, sharers + 1)
        row = self.table[slot]
        row[:] = self.unmapped
        row[:full] = owned
        self.prompt_of[slot], self.length[slot], self.own[slot] = key, prompt_len, []
        self.grow(slot, 1)
        writes = row.copy()
        if not fresh:
            writes[:full] = self.unmapped
        if prompt_len % self.block_size == 0:  # its own block holds no prompt slot
            writes[full] = self.unmapped
        return None if (writes == self.unmapped).all() else writes.tolist()

    def prefill_writes(
        self, writes: list[tuple[int, int, list[int]]]
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(source, dest)`` of a prefill: for each ``(row, slot, table row)`` of ``writes``
        (``admit``'s result for ``slot``, prefilled in ``row``), the prefill row and the table
        row as global block ids (unmapped: global id ``N``, dropped), padded to a power of two
        with writes of nothing."""
        count = 1 << max(len(writes) - 1, 0).bit_length()
        source = np.zeros(count, np.int32)
        dest = np.full((count, self.table.shape[1]), self.blocks, np.int32)
        for i, (row, slot, blocks) in enumerate(writes):
            local = np.asarray(blocks)
            offset = self.shard(slot) * self.unmapped
            source[i] = row
            dest[i] = np.where(local < self.unmapped, local + offset, self.blocks)
        return source, dest

    def global_id(self, slot: int, index: int) -> int:
        """The global id of the block at table entry ``index`` of ``slot`` (mapped)."""
        return int(self.table[slot, index]) + self.shard(slot) * self.unmapped

    def growth(self, slot: int, tokens: int) -> int:
        """Blocks ``slot`` still needs for ``tokens`` completion slots after its prompt."""
        mapped = self.length[slot] // self.block_size + len(self.own[slot])
        return max(blocks_for(self.length[slot] + tokens, self.block_size) - mapped, 0)

    def grow(self, slot: int, tokens: int) -> None:
        """Maps blocks for the first ``tokens`` completion slots of ``slot``."""
        new = self._take(self.shard(slot), self.growth(slot, tokens))
        start = self.length[slot] // self.block_size + len(self.own[slot])
        self.table[slot, start : start + len(new)] = new
        self.own[slot] += new

    def release(self, slot: int) -> None:
        """Frees ``slot``'s own blocks and its share of its prompt's."""
        key = self.prompt_of[slot]
        if key is None:
            return
        free = self.free[self.shard(slot)]
        free += reversed(self.own[slot])
        key = (self.shard(slot), key)
        owned, sharers = self.prompts[key]
        if sharers == 1:
            del self.prompts[key]
            free += reversed(owned)
        else:
            self.prompts[key] = (owned, sharers - 1)
        self.prompt_of[slot], self.length[slot], self.own[slot] = None, 0, []
        self.table[slot] = self.unmapped

    def admissible(
        self,
        requests: Sequence[Request],
        queue: deque,
        slots: list[int],
        live: tuple[list[int | None], Sequence[int], int],
        version: int = 0,
    ) -> list[tuple[int, int]]:
        """Pops the requests admitted now from ``queue``'s head and picks a free slot of
        ``slots`` for each: ``[(request, slot), ...]`` in queue order. Admitted are as many as
        the free blocks of some free slot's shard hold (new prompts' full blocks and each
        request's own blocks for its first burst) once the live slots' next burst is provided
        for (``live = (occupant, counts, burst)``: their blocks for ``burst`` more tokens are
        kept free), so an admission does not preempt at once. Each request goes to the shard
        where it costs the fewest blocks (its prompt resident there or admitted with it: the
        samples of a prompt share its blocks) among those with room, the first free slot's
        on a tie; the queue's head waits only when no shard has room (first come, first
        served). Prompts share blocks within ``version``."""
        occupant, counts, burst = live
        budget = [len(free) for free in self.free]
        for slot, request in enumerate(occupant):
            if request is not None:
                tokens = min(int(counts[slot]) + burst, requests[request].max_new_tokens)
                budget[self.shard(slot)] -= self.growth(slot, tokens)
        admitted: list[tuple[int, int]] = []
        pending: set = set()
        open_slots = list(slots)
        while queue and open_slots:
            request = requests[queue[0]]
            key = sharing_key(request, queue[0], version)
            first = min(burst, request.max_new_tokens)
            best, seen = None, set()  # (cost, slot) over each shard's first open slot
            for slot in open_slots:
                shard = self.shard(slot)
                if shard in seen:
                    continue
                seen.add(shard)
                cost = self.admission_cost(slot, key, len(request.prompt), pending, first)
                if cost <= budget[shard] and (best is None or cost < best[0]):
                    best = (cost, slot)
            if best is None:
                break
            cost, slot = best
            budget[self.shard(slot)] -= cost
            pending.add((self.shard(slot), key))
            open_slots.remove(slot)
            admitted.append((queue.popleft(), slot))
        return admitted

    def map_burst(
        self,
        requests: Sequence[Request],
        queue: deque,
        occupant: list[int | None],
        counts: Sequence[int],
        steps: int,
    ) -> list[int]:
        """Maps the blocks every live slot writes in a burst of ``steps`` tokens; while a
        shard's do not fit, preempts its newest request (the highest request id: requests are
        served first come, first served), which goes back to ``queue``'s head. Returns the
        preempted slots (to mark done on device)."""

        def tokens(slot: int) -> int:
            return min(int(counts[slot]) + steps, requests[occupant[slot]].max_new_tokens)

        live = sorted(
            (s for s, r in enumerate(occupant) if r is not None), key=occupant.__getitem__
        )
        evicted = []
        for shard in range(self.shards):
            mine = [s for s in live if self.shard(s) == shard]
            while sum(self.growth(s, tokens(s)) for s in mine) > len(self.free[shard]):
                evicted.append(mine.pop())
                self.release(evicted[-1])
        for victim in sorted(evicted, key=occupant.__getitem__, reverse=True):
            queue.appendleft(occupant[victim])  # the oldest at the head
            occupant[victim] = None
        for s in live:
            if occupant[s] is not None:
                self.grow(s, tokens(s))
        return evicted

    def drain(self, occupant: list[int | None]) -> list[int] | None:
        """The slots a smaller program keeps once the queue is empty (each shard's busy slots,
        then free ones, half or less of each shard's), or None when it would not shrink."""
        per_shard = len(occupant) // self.shards
        busy = [
            [s for s in range(j * per_shard, (j + 1) * per_shard) if occupant[s] is not None]
            for j in range(self.shards)
        ]
        size = 1 << max(max(map(len, busy)) - 1, 0).bit_length()
        if size > per_shard // 2:
            return None
        keep = []
        for j, mine in enumerate(busy):
            idle = [s for s in range(j * per_shard, (j + 1) * per_shard) if occupant[s] is None]
            keep += (mine + idle)[:size]
        return keep

    def keep(self, index: list[int]) -> None:
        """The slots ``index`` (in that order, each in its own shard) become the allocator's
        slots (the drain)."""
        new = len(index) // self.shards
        if any(self.shard(s) != i // new for i, s in enumerate(index)):
            raise ValueError("a paged cache's slots cannot move between batch shards")
        dropped = set(range(len(self.prompt_of))) - set(index)
        for slot in dropped:
            self.release(slot)
        self.table = self.table[index]
        self.prompt_of = [self.prompt_of[s] for s in index]
        self.length = [self.length[s] for s in index]
        self.own = [self.own[s] for s in index]


def sharing_key(request: Request, index: int, version: int) -> Any:
    """Requests with equal keys share a prefill and a paged cache's prompt blocks: the same
    prompt key (``Request.share_key``; ``index``: the request's position in its run) and the
    same weight ``version`` (keys and values computed by older weights are not reused)."""
    return version, request.share_key(index)


def paged_pool(
    block_size: Any, blocks: Any, slots: int, prompt_width: int, max_new_tokens: int
) -> tuple[int, int] | None:
    """``(blocks, block_size)`` of an engine's paged cache, or None (a contiguous cache).

    Default ``blocks``: every slot holds its longest request (never preempts).

    Raises:
      ValueError: bad sizes, or ``blocks`` without ``block_size``.
    """
    if block_size is None:
        if blocks is not None:
            raise ValueError("kv_blocks needs kv_block_size (a paged cache)")
        return None
    for name, value in (("kv_block_size", block_size), ("kv_blocks", blocks)):
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1
        if not (ok or (name == "kv_blocks" and value is None)):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    block_size = int(block_size)
    if blocks is None:
        blocks = slots * blocks_for(prompt_width + max_new_tokens, block_size)
    return int(blocks), block_size


__all__ = ["BlockAllocator", "blocks_for", "paged_pool", "sharing_key"]
