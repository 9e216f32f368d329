"""Continuous batching: ``S`` decode slots fed from a queue of requests.

``generate`` runs one static batch: every row waits for the slowest, and RL completion lengths
are long-tailed (with geometric lengths and 32 rows, the longest is about 4x the mean), so most
row-steps of a static batch produce padding. The engine instead keeps ``S`` slots busy:

* **Admit.** Free slots take the next requests from the queue. Their distinct prompts are
  prefilled in one batch (the ``G`` samples of a prompt share one prefill) and each request's
  prompt keys/values are copied into its slot's row of the cache, right-aligned so that every
  slot's completion starts at cache slot ``P`` (``P`` = the bucketed longest prompt). A prompt
  that a live slot already holds is not prefilled again: its keys/values and first-token
  logits come from that slot (``sampling.admission``).
* **Burst.** One jitted ``lax.while_loop`` decodes up to ``K`` tokens in every live slot
  (``burst``; EOS and each request's own ``max_new_tokens`` checked on device; fewer when every
  live slot's budget ends sooner), the rows at different cache slots (``forward`` with a
  ``[S]`` ``cache_index``).
* **Cache width.** A decode step attends over every slot's whole row of a contiguous cache,
  filled or not, and on CPU it is bound by reading them. There (per-layer decoding, ``T >= 64``)
  the cache is cut to, or padded back out to, the narrowest of up to ``layout.ENGINE_WIDTHS``
  widths ``P + ceil(T * i / n)`` (``layout.decode_windows``) that holds every live slot's writes
  in the next burst: past the furthest live slot's next write no live slot reads anything (a
  finished slot's row is rewritten when it is admitted again). Long-tailed lengths keep most
  bursts well short of ``P + T``. Each width is another burst and admission program to compile
  (the prefill's does not depend on it); the drain runs on the whole cache, so its programs do
  not multiply by the widths. ``EngineStats.resizes`` counts the cuts and pads.
* **Harvest.** The host reads which slots finished, fetches their tokens and log-probs, and
  the slots are admitted again.
* **Drain.** Once the queue is empty, the remaining requests move to a program of half the
  slots whenever they fit one (``S/2``, ``S/4``, ...), so the longest completions do not keep
  ``S`` rows running.

``engine="static"`` runs the same programs as one static batch would: it admits only into an
empty engine and decodes until every slot has finished, which is what the continuous engine is
measured against (``benchmarks/bench_engine.py``).

Sampling is per request: completion token ``n`` of request ``r`` is drawn with
``fold_in(fold_in(key(seed), r), n)``, so a request's tokens do not depend on its slot, on the
other requests or on ``S``. The returned log-probs are the temperature-scaled full-distribution
log-probs of ``generate`` (what the trainer recomputes).

**Weight updates in flight** (partial rollouts, ``run(updates=...)``): between bursts the
engine polls a :class:`WeightUpdates` box the trainer publishes into; newer weights are decoded
from the next burst on, in every live slot (the cache keeps the keys and values the earlier
weights computed, as an in-flight request on a serving engine does), and every token is
tagged with the version of the weights that sampled it (``Result.versions``). The log-probs are
the sampling distribution's, version by version: what an off-policy correction needs.

The cache is ``[L, S, K, P + T, H]`` (per-layer arrays on CPU, as ``generate``'s decode uses):
capacity is set in slots, not in requests. With ``kv_block_size`` it is paged instead
(``sampling.paging``): a pool of ``kv_blocks`` blocks, rows packed from slot 0, a prompt's full
blocks shared by its samples in flight, blocks mapped as a row grows, the newest requests
preempted (and later recomputed, with the same tokens) when the pool runs out. On TPU a bf16
pool's decode attention runs JAX's Pallas paged-attention kernel (``models.kv_cache``), else an
XLA block-table gather.

**Routing replay** (``record_routing=True``, mixture-of-experts models): the programs also keep
the experts every layer chose for each prompt and completion token, in a ``[S, P + T, L, k]``
buffer of ``generate.routing_dtype`` (int8 up to 128 experts); an admission rewrites its slot's
row (the prefill's ids, or a live holder's prompt ids with its keys and values), so refilled
and preempted-then-recomputed slots carry no earlier request's ids, and the drain carries the
buffer with the slots. Each ``Result.routing`` is its ``[p + n, L, k]``; ``batch_routing``
lays a run's out as ``generate(..., record_routing=True)`` does.

Programs compiled per run: one burst per cache width and drain size; one prefill per (distinct
prompts, admitted requests, prompt bucket) size class, each a power of two; one admission per
admitted-requests size (a contiguous cache of several widths: every admission the size of the
slots, one admission a width).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.sampling import layout, strategies
from jaxrl_llm.sampling.admission import admission, holders, pow2
from jaxrl_llm.sampling.generate import default_cache_dtype, hidden_dtype
from jaxrl_llm.sampling.paging import BlockAllocator, paged_pool
from jaxrl_llm.sampling.prompts import bucket_length
from jaxrl_llm.sampling.requests import (
    FINISH_REASONS,
    EngineStats,
    Request,
    Result,
    WeightUpdates,
    batch_routing,
    check_requests,
    harvest,
)
from jaxrl_llm.sampling.slots import (
    EngineState,
    burst,
    evict,
    init_state,
    refill,
    resize,
    shardings,
    take_slots,
)
from jaxrl_llm.sampling.state import SamplingOptions, replicate

Array = jax.Array

ENGINES = ("continuous", "static")


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """How an :class:`Engine` decodes (``rollout.*``'s engine settings).

    Attributes:
      slots: S, decode slots (rows of the decode batch).
      burst: K, decode steps per host round trip (fewer when every live slot's budget ends
        sooner).
      engine: ``"continuous"`` (refill slots as they finish) or ``"static"`` (admit only into
        an empty engine, decode until every slot has finished).
      decode_layers: the bursts' weights and cache stacked or per layer
        (``sampling.layout.worth_unstacking``).
      kv_block_size: a paged cache of blocks of this many slots (``sampling.paging``); None: a
        contiguous ``P + T`` slots a row.
      kv_blocks: the paged cache's blocks (default: every slot's longest request, which never
        preempts); fewer save memory at the cost of preemptions.
    """

    slots: int
    burst: int = 8
    engine: str = "continuous"
    decode_layers: str = "auto"
    kv_block_size: int | None = None
    kv_blocks: int | None = None


class Engine:
    """Continuous-batching sampler over ``settings.slots`` decode slots (see the module
    docstring).

    Args:
      params, config: the model (``jaxrl_llm.models``); params are not modified.
      settings: the slots, bursts, engine kind, layer layout and paged cache
        (:class:`EngineSettings`).
      max_new_tokens: T, the longest completion any request may ask for.
      max_prompt_len: the longest prompt this engine will see (bucketed to ``P``).
      sampling: the distribution and the EOS and pad ids (``SamplingOptions``), as in
        ``sampling.generate``.
      cache_dtype: KV-cache dtype (default: ``config.compute_dtype``, else the parameters').
      stop_sequences: token-id sequences that end a completion (kept in it, like an EOS), as
        matched on device after every token.
      mesh: the mesh the weights live on (slots split over its batch shards), or None.
      record_routing: each ``Result`` also carries the experts every mixture-of-experts layer
        chose for its prompt and completion tokens (``Result.routing``, ``[p + n, L, k]``
        int32; ``batch_routing`` makes ``generate``'s ``[B, P + T, L, k]`` of them), for
        routing replay. Kept on device in a ``[S, P + T, L, k]`` buffer of
        ``generate.routing_dtype`` (int8 up to 128 experts). Errors on a dense model.
    """

    def __init__(
        self,
        params: Any,
        config: Any,
        *,
        settings: EngineSettings,
        max_new_tokens: int,
        max_prompt_len: int,
        sampling: SamplingOptions,
        cache_dtype: Any = None,
        stop_sequences: Sequence[Sequence[int]] = (),
        mesh: Any = None,
        record_routing: bool = False,
    ):
        if record_routing and not config.is_moe:
            raise ValueError(
                f"record_routing needs a mixture-of-experts model, not {config.architecture}"
            )
        slots, burst, engine = settings.slots, settings.burst, settings.engine
        for name, value in (
            ("slots", slots),
            ("max_new_tokens", max_new_tokens),
            ("max_prompt_len", max_prompt_len),
            ("burst", burst),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        self.top_k = strategies.check_sampling_args(
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            min_p=sampling.min_p,
            vocab_size=config.vocab_size,
        )
        eos_ids, pad_id = sampling.eos_ids, sampling.pad_id
        self.eos = set(np.atleast_1d(np.asarray(eos_ids if eos_ids is not None else (), int)))
        self.stop_sequences = [tuple(int(t) for t in s) for s in stop_sequences]
        if any(not s or min(s) < 0 for s in self.stop_sequences):
            raise ValueError(
                f"stop_sequences must be non-empty sequences of token ids, got {stop_sequences!r}"
            )
        # [N, L] right-aligned, -1 padded; both sizes powers of two (few compiled programs).
        longest = max(map(len, self.stop_sequences), default=1)
        stops = np.full((pow2(max(len(self.stop_sequences), 1)), pow2(longest)), -1, np.int32)
        for i, s in enumerate(self.stop_sequences):
            stops[i, stops.shape[1] - len(s) :] = s
        self.config, self.pad_id = config, int(pad_id)
        self.slots, self.max_new_tokens, self.burst, self.engine = (
            slots,
            max_new_tokens,
            burst,
            engine,
        )
        self.prompt_width = bucket_length(max_prompt_len)
        self.paged = paged_pool(
            settings.kv_block_size, settings.kv_blocks, slots, self.prompt_width, max_new_tokens
        )
        self.mesh, self.shards = mesh, 1
        if mesh is not None:
            from jaxrl_llm.parallel import batch_shards  # noqa: PLC0415

            self.shards = batch_shards(mesh)
            if slots % self.shards:
                raise ValueError(
                    f"slots={slots} must be a multiple of the mesh's {self.shards} batch shards "
                    f"(data x fsdp)"
                )
        if self.paged is not None:
            self._allocator(*self.paged)  # refuses a pool too small for one request
        unstacked = layout.worth_unstacking(params, settings.decode_layers)
        # Under the engine's mesh: the caller's may be another (a sampler on devices of its
        # own, called from a thread under the trainer's mesh).
        with self._mesh_context(params):
            self.params = layout.unstack_layers(params) if unstacked else params
            self.sampling = replicate(sampling.traced(), mesh)
            self.stops = replicate(jnp.asarray(stops), mesh)
            hidden = hidden_dtype(params, config, rows=slots)
        if cache_dtype is None:
            cache_dtype = default_cache_dtype(params, config)
        self._state_args = dict(
            slots=slots,
            prompt_width=self.prompt_width,
            max_new_tokens=max_new_tokens,
            cache_dtype=jnp.dtype(cache_dtype),
            pad_id=self.pad_id,
            unstacked=unstacked,
            paged=self.paged,
            hidden_dtype=hidden,
            record_routing=bool(record_routing),
        )
        # The contiguous cache's widths: each burst runs on the narrowest that holds every live
        # slot's writes (CPU, per-layer decoding: ``layout.decode_windows``).
        ends = layout.decode_windows(
            params, max_new_tokens, settings.decode_layers, most=layout.ENGINE_WIDTHS
        )
        self.widths = () if self.paged else tuple(self.prompt_width + e for e in ends)

    def _mesh_context(self, params: Any) -> Any:
        """The engine's mesh; a paged engine without one runs under a one-device mesh on its
        weights' device (not a caller's, which would split its pool)."""
        if self.mesh is not None:
            return jax.set_mesh(self.mesh)
        if self.paged is None:
            return contextlib.nullcontext()
        from jaxrl_llm.parallel import make_mesh  # noqa: PLC0415

        leaf = jax.tree.leaves(params)[0]
        devices = list(leaf.devices()) if isinstance(leaf, jax.Array) else jax.devices()[:1]
        if len(devices) > 1:
            raise ValueError(
                f"a paged engine's weights on {len(devices)} devices need the engine's mesh= "
                "(the one they are sharded over)"
            )
        return jax.set_mesh(make_mesh(1, 1, 1, devices=devices))

    def _allocator(self, blocks: int, size: int) -> BlockAllocator:
        return BlockAllocator(
            blocks, size, self.slots, self.prompt_width, self.max_new_tokens, self.shards
        )

    def run(
        self,
        requests: Sequence[Request],
        *,
        seed: int = 0,
        key: Array | None = None,
        progress: Any = None,
        updates: WeightUpdates | None = None,
        version: int = 0,
    ) -> tuple[list[Result], EngineStats]:
        """Samples every request; results in request order, and the run's ``EngineStats``.

        ``key``: the PRNG key of the run (default ``jax.random.key(seed)``); request ``r``'s
        token ``n`` is drawn with ``fold_in(fold_in(key, r), n)``. ``progress``: an object
        with ``update(n)`` (e.g. a ``tqdm`` bar), called with the number of requests each
        harvest finishes. ``version``: the version of the engine's weights; ``updates``: newer
        weights taken between bursts (``WeightUpdates``), the run's ``updates`` stat counting
        them.
        """
        requests = check_requests(requests, self.max_new_tokens)
        longest = max((len(r.prompt) for r in requests), default=0)
        if longest > self.prompt_width:
            raise ValueError(
                f"a prompt of {longest} tokens exceeds the engine's max_prompt_len bucket "
                f"({self.prompt_width})"
            )
        start = time.perf_counter()
        with self._mesh_context(self.params):
            key = replicate(jax.random.key(seed) if key is None else key, self.mesh)
            results, counts = self._run(requests, key, progress, updates, version)
        done = [r for r in results if r is not None]
        stats = EngineStats(
            requests=len(requests),
            tokens=int(sum(len(r.tokens) for r in done)),
            seconds=time.perf_counter() - start,
            **counts,
        )
        return done, stats

    def _run(
        self,
        requests: list[Request],
        key: Array,
        progress: Any,
        updates: WeightUpdates | None = None,
        version: int = 0,
    ) -> tuple[list[Result | None], dict[str, int]]:
        state = init_state(self.config, **self._state_args)
        if self.mesh is not None:
            state = jax.device_put(state, shardings(state, self.mesh))
        queue = deque(range(len(requests)))
        occupant: list[int | None] = [None] * self.slots  # request id per slot, on the host
        host_count = np.zeros(self.slots, np.int64)  # tokens sampled per slot, last read
        # Per slot: (token index, version) where the weights of that version took over.
        marks: list[list[tuple[int, int]]] = [[] for _ in range(self.slots)]
        results: list[Result | None] = [None] * len(requests)
        counts = dict(
            decode_steps=0, slot_steps=0, bursts=0, admissions=0, prefill_rows=0, shrinks=0
        )
        counts.update(reused_prompts=0)
        counts.update(updates=0, preemptions=0, resizes=0)
        pager = None if self.paged is None else self._allocator(*self.paged)
        params = self.params
        prompt_lengths = [len(r.prompt) for r in requests]
        while queue or any(r is not None for r in occupant):
            newer = None if updates is None else updates.newer(version)
            if newer is not None:  # decode on with them; the counts are this moment's
                version, params = newer[0], self._layout(newer[1])
                counts["updates"] += 1
                for s, r in enumerate(occupant):
                    if r is not None:  # its next token comes from logits the old weights made
                        marks[s].append((int(host_count[s]) + 1, version))
            free = [s for s, r in enumerate(occupant) if r is None]
            if not queue and self.engine == "continuous":
                # The drain: decode the remaining slots in a smaller program (S/2, S/4, ...),
                # so the long tail does not keep running S rows.
                if pager is not None:  # a paged slot stays in its batch shard
                    keep = pager.drain(occupant)
                else:
                    busy = [s for s, r in enumerate(occupant) if r is not None]
                    size = self.shards * pow2(-(-len(busy) // self.shards))
                    keep = busy + free[: size - len(busy)] if size <= len(occupant) // 2 else None
                if keep is not None:
                    if self.widths:  # a program per drain size, not per width too
                        state = self._fit(state, self.widths[-1], counts)
                    state = take_slots(state, jnp.asarray(keep, jnp.int32), mesh=self.mesh)
                    occupant = [occupant[s] for s in keep]
                    host_count = host_count[keep]
                    marks = [marks[s] for s in keep]
                    if pager is not None:
                        pager.keep(keep)
                    counts["shrinks"] += 1
                    free = [s for s, r in enumerate(occupant) if r is None]
            if queue and free and (self.engine == "continuous" or len(free) == self.slots):
                # Blocks an admission provides for: the next burst, or a static batch's whole
                # run (its requests are not refilled, nor should they be preempted at once).
                reserve = self.burst if self.engine == "continuous" else self.max_new_tokens
                pairs = (
                    [(queue.popleft(), s) for s in free[: len(queue)]]
                    if pager is None
                    else pager.admissible(
                        requests, queue, free, (occupant, host_count, reserve), version
                    )
                )
                admitted, into = [r for r, _ in pairs], [s for _, s in pairs]
                if admitted:  # none when the paged cache's free blocks hold none
                    live = (occupant, [m[0][1] if m else version for m in marks])
                    state = self._admit(
                        params, state, requests, (admitted, into), live, counts, pager, version
                    )
                for s, r in zip(into, admitted):
                    occupant[s] = r
                    host_count[s] = 0
                    marks[s] = [(0, version)]
            steps = self.max_new_tokens
            if self.engine == "continuous":
                # No step past the soonest budget end: that slot can be refilled right then.
                left = [
                    requests[r].max_new_tokens - host_count[s]
                    for s, r in enumerate(occupant)
                    if r is not None
                ]
                steps = max(1, min(self.burst, *left)) if left else self.burst
            table = None
            if self.widths and len(occupant) == self.slots:  # the drain keeps the whole cache
                # The furthest live slot writes cache slot P + count + steps - 1.
                live = [int(host_count[s]) for s, r in enumerate(occupant) if r is not None]
                reach = self.prompt_width + max(live, default=0) + steps
                state = self._fit(state, next(w for w in self.widths if w >= reach), counts)
            if pager is not None:
                evicted = pager.map_burst(requests, queue, occupant, host_count, steps)
                if evicted:
                    counts["preemptions"] += len(evicted)
                    state = evict(state, jnp.asarray(evicted, jnp.int32), mesh=self.mesh)
                table = jnp.asarray(pager.table)
            state, steps_run = burst(
                params,
                state,
                jnp.int32(steps),
                key,
                self.sampling,
                self.stops,
                table,
                config=self.config,
                top_k=self.top_k,
                mesh=self.mesh,
            )
            counts["decode_steps"] += int(steps_run)
            counts["slot_steps"] += int(steps_run) * len(occupant)
            counts["bursts"] += 1
            finished, host_count = harvest(
                state, occupant, results, marks, self.eos, self.stop_sequences, prompt_lengths
            )
            if pager is not None:  # the finished slots' blocks (a no-op on empty slots)
                for s in (s for s, r in enumerate(occupant) if r is None):
                    pager.release(s)
            if progress is not None and finished:
                progress.update(finished)
        if pager is not None:
            counts["peak_blocks"] = pager.peak
        return results, counts

    def _fit(self, state: EngineState, width: int, counts: dict) -> EngineState:
        """``state`` with its contiguous cache cut or padded to ``width`` slots a row."""
        if width == state.cache.mask.shape[1]:
            return state
        counts["resizes"] += 1
        return resize(state, width=width, mesh=self.mesh)

    def _layout(self, params: Any) -> Any:
        """Weights in the engine's layout (unstacked layers where it decodes them so)."""
        return layout.unstack_layers(params) if self._state_args["unstacked"] else params

    def _admit(
        self,
        params: Any,
        state: EngineState,
        requests: list[Request],
        pairs: tuple[list[int], list[int]],
        live: tuple[list[int | None], list[int]],
        counts: dict,
        pager: BlockAllocator | None = None,
        version: int = 0,
    ) -> EngineState:
        """Admits requests ``pairs[0]`` into slots ``pairs[1]`` (``live``: the occupants and
        each slot's weight version at its admission, whose prompts are not prefilled again)."""
        arrays, admitted = admission(
            requests,
            *pairs,
            held=holders(requests, *live),
            version=version,
            engine_slots=self.slots,
            entries=self.slots if self.widths else None,
            shards=self.shards,
            pad_id=self.pad_id,
            pager=pager,
        )
        counts["admissions"] += 1
        for name, value in admitted.items():
            counts[name] += value
        return refill(
            params,
            state,
            jax.tree.map(jnp.asarray, arrays),
            jnp.asarray(self.pad_id, jnp.int32),
            config=self.config,
            prompt_width=self.prompt_width,
            mesh=self.mesh,
        )


def generate_requests(
    params: Any,
    config: Any,
    requests: Sequence[Request],
    *,
    settings: EngineSettings,
    max_new_tokens: int,
    sampling: SamplingOptions,
    seed: int = 0,
    progress: Any = None,
    **options: Any,
) -> tuple[list[Result], EngineStats]:
    """One-shot ``Engine(...).run(requests)`` (``max_prompt_len``: the longest prompt's);
    ``options`` are the engine's other arguments."""
    requests = list(requests)
    longest = max((len(np.atleast_1d(r.prompt)) for r in requests), default=1)
    engine = Engine(
        params,
        config,
        settings=settings,
        max_new_tokens=max_new_tokens,
        max_prompt_len=max(longest, 1),
        sampling=sampling,
        **options,
    )
    return engine.run(requests, seed=seed, progress=progress)


__all__ = [
    "ENGINES",
    "FINISH_REASONS",
    "Engine",
    "EngineSettings",
    "EngineState",
    "EngineStats",
    "Request",
    "Result",
    "WeightUpdates",
    "batch_routing",
    "generate_requests",
    "init_state",
]
