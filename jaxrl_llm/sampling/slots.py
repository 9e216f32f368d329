"""The continuous-batching engine's device side: the slot state and its jitted programs.

``init_state`` makes ``S`` empty slots; ``refill`` admits requests (``prefill`` runs their
prompts through the model, ``admit`` moves them into slots); ``burst`` decodes up to ``K`` tokens
in every live slot; ``take_slots`` keeps some slots (a smaller program for the drain);
``resize`` cuts a contiguous cache to the slots the next burst's live rows need. The host loop
that drives them is ``jaxrl_llm.sampling.engine.Engine``.

With a routing buffer (``init_state(..., record_routing=True)``, mixture-of-experts models) the
programs also keep the experts every layer chose for each fed token, in the contiguous cache's
layout whatever the cache: a slot's prompt right-aligned to end at column ``P - 1``, its
completion token ``n`` at column ``P + n``. ``admit`` rewrites a slot's whole row (the prefill's
ids, or the prompt columns of the live slot whose prompt it reuses), so a preempted request
recomputed in any slot carries only its new prefill's ids.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm.models import (
    CACHE_AXES,
    PAGED_CACHE_AXES,
    KVCache,
    PagedKVCache,
    cast_params,
    forward,
    init_cache,
    init_paged_cache,
    unembed,
)
from jaxrl_llm.models.kv_cache import page_slots
from jaxrl_llm.sampling import layout, strategies
from jaxrl_llm.sampling.admission import Admission
from jaxrl_llm.sampling.generate import NO_EXPERT, routing_dtype
from jaxrl_llm.sampling.paging import blocks_for
from jaxrl_llm.sampling.state import SamplingParams

Array = jax.Array


class EngineState(NamedTuple):
    """The slots on device (S slots, T = max_new_tokens, W = P + T cache slots a row; a paged
    cache rounds W up to whole blocks, a contiguous one may be cut shorter by ``resize``).

    Attributes:
      cache: ``KVCache`` with k, v ``[L, S, K, W, H]`` (or ``L`` per-layer arrays), mask
        ``[S, W]``; a slot's prompt ends at cache slot ``P - 1``, its completion starts at ``P``.
        Or a ``PagedKVCache`` of ``W`` logical slots a row in a pool of blocks (``paging``),
        each row packed from slot 0: its prompt, then its completion.
      logits: ``[S, V]`` f32 next-token logits.
      next_slot: ``[S]`` int32 cache slot the next fed token goes to.
      position: ``[S]`` int32 RoPE position of the next fed token.
      count: ``[S]`` int32 tokens sampled so far.
      limit: ``[S]`` int32 the request's ``max_new_tokens``.
      done: ``[S]`` bool, finished (or empty): the slot samples nothing.
      request: ``[S]`` int32 request id (its sampling stream).
      tokens: ``[S, T]`` int32 sampled tokens; logprobs: ``[S, T]`` f32.
      prompt_hidden: ``[S, D]`` the final hidden state at the slot's last prompt token (the
        compute dtype): a later sample of the prompt, admitted while this slot holds it,
        takes its first-token logits from it instead of prefilling the prompt again.
      routing: ``[S, P + T, L, k]`` (``generate.routing_dtype``) the experts each of the ``L``
        mixture-of-experts layers chose for every fed token (prompt ending at column ``P - 1``,
        completion token ``n`` at ``P + n``; ``NO_EXPERT`` elsewhere), or None (not recorded).
    """

    cache: KVCache | PagedKVCache
    logits: Array
    next_slot: Array
    position: Array
    count: Array
    limit: Array
    done: Array
    request: Array
    tokens: Array
    logprobs: Array
    prompt_hidden: Array
    routing: Array | None = None


def init_state(
    config: Any,
    *,
    slots: int,
    prompt_width: int,
    max_new_tokens: int,
    cache_dtype: Any,
    pad_id: int,
    unstacked: bool,
    paged: tuple[int, int] | None = None,
    hidden_dtype: Any = None,
    record_routing: bool = False,
) -> EngineState:
    """``slots`` empty (done) slots with a ``prompt_width + max_new_tokens``-slot cache each
    (``paged=(blocks, block_size)``: in a pool of blocks, every table entry unmapped);
    ``hidden_dtype``: the dtype of the model's hidden states (``generate.hidden_dtype``; default
    ``cache_dtype``); ``record_routing``: with a ``[S, P + T, L, k]`` routing buffer of
    ``NO_EXPERT`` (a mixture-of-experts ``config``)."""
    width = prompt_width + max_new_tokens
    routing = None
    if record_routing:
        shape = (slots, width, config.num_hidden_layers, config.num_experts_per_tok)
        routing = jnp.full(shape, NO_EXPERT, routing_dtype(config.num_experts))
    if paged is None:
        cache = init_cache(config, slots, width, dtype=cache_dtype)
    else:
        blocks, size = paged
        width = blocks_for(width, size) * size
        cache = init_paged_cache(
            config, slots, width, blocks=blocks, block_size=size, dtype=cache_dtype
        )
    if unstacked:
        cache = layout.unstack_cache(cache)

    def zeros() -> Array:  # a buffer per field: the state is donated
        return jnp.zeros((slots,), jnp.int32)

    return EngineState(
        cache=cache,
        logits=jnp.zeros((slots, config.vocab_size), jnp.float32),
        next_slot=zeros(),
        position=zeros(),
        count=zeros(),
        limit=zeros(),
        done=jnp.ones((slots,), bool),
        request=zeros(),
        tokens=jnp.full((slots, max_new_tokens), pad_id, jnp.int32),
        logprobs=jnp.zeros((slots, max_new_tokens), jnp.float32),
        prompt_hidden=jnp.zeros(
            (slots, config.hidden_size), cache_dtype if hidden_dtype is None else hidden_dtype
        ),
        routing=routing,
    )


def state_axes(state: EngineState) -> EngineState:
    """Logical axes of every state leaf (slots are the ``batch`` axis)."""
    cache_axes = PAGED_CACHE_AXES if isinstance(state.cache, PagedKVCache) else CACHE_AXES
    if isinstance(state.cache.k, tuple):  # per-layer arrays drop the layers axis
        layers = len(state.cache.k)
        cache_axes = cache_axes._replace(
            k=(cache_axes.k[1:],) * layers, v=(cache_axes.v[1:],) * layers
        )
    row = ("batch",)
    return EngineState(
        cache=cache_axes,
        logits=("batch", "vocab"),
        next_slot=row,
        position=row,
        count=row,
        limit=row,
        done=row,
        request=row,
        tokens=("batch", None),
        logprobs=("batch", None),
        prompt_hidden=("batch", None),
        routing=None if state.routing is None else ("batch", None, None, None),
    )


def shardings(state: EngineState, mesh: Any) -> Any:
    """The state's ``NamedSharding`` s under ``SAMPLING_RULES`` (slots over data x fsdp)."""
    from jaxrl_llm.parallel import SAMPLING_RULES, logical_to_sharding  # noqa: PLC0415

    return logical_to_sharding(state_axes(state), mesh, SAMPLING_RULES, shapes=state)


def _constrain(state: EngineState, mesh: Any) -> EngineState:
    if mesh is None:
        return state
    return jax.lax.with_sharding_constraint(state, shardings(state, mesh))


class Prefilled(NamedTuple):
    """``prefill``'s results for an admission's ``N`` requests (request ``j``: prompt
    ``owner[j]`` of the prefill's ``[U, p]``).

    Attributes:
      cache: the prompts' keys and values (``KVCache``; per-layer arrays when unstacked). For a
        contiguous cache (``prompt_width=P``) each request's row, ``[N, K, P, H]`` a layer, its
        prompt right-aligned to end at column ``P - 1``, mask ``[N, P]``; for a paged one the
        prefill's own rows, ``[U, K, p, H]``, mask ``[U, p]``.
      last: ``[N, D]`` the final hidden state at each request's last prompt token.
      length: ``[N]`` int32 each request's prompt length.
      ids: ``[N, w, L, k]`` the experts every layer chose for each prompt token, aligned as the
        cache's rows (``w``: ``P`` or ``p``; ``NO_EXPERT`` on padding), or None.
    """

    cache: KVCache
    last: Array
    length: Array
    ids: Array | None = None


@functools.partial(
    jax.jit, static_argnames=("config", "cache_dtype", "unstacked", "record", "prompt_width")
)
def prefill(
    params: Any,
    prompt_tokens: Array,
    prompt_mask: Array,
    owner: Array,
    *,
    config: Any,
    cache_dtype: Any,
    unstacked: bool,
    record: bool = False,
    prompt_width: int | None = None,
) -> Prefilled:
    """Runs an admission's ``[U, p]`` left-padded prompts through the model (``Prefilled``;
    ``record``: with the experts chosen; ``prompt_width``: rows laid out for a contiguous
    cache). Apart from ``admit``: its program does not depend on the engine's cache width, and
    with the contiguous layout ``admit``'s depends on neither ``U`` nor ``p``."""
    params = cast_params(params, config)
    num_prompts, width = prompt_tokens.shape
    cache = init_cache(config, num_prompts, width, dtype=cache_dtype)
    if unstacked:
        cache = layout.unstack_cache(cache)
    out, cache, *chosen = forward(
        params,
        config,
        prompt_tokens,
        attention_mask=prompt_mask,
        cache=cache,
        cache_index=0,
        outputs=("routing",) if record else (),
    )
    cache = cache._replace(mask=prompt_mask)
    ids = None
    if record:  # [L, U, p, k] -> [N, p, L, k]
        ids = jnp.where(prompt_mask[:, :, None, None], jnp.moveaxis(chosen[0], 0, 2), NO_EXPERT)
        ids = ids[owner]
    if prompt_width is not None:  # request j's row: its prompt's, left-padded to P columns
        pad = prompt_width - width
        batch_axis = 0 if unstacked else 1

        def place(x: Array) -> Array:
            rows = jnp.take(x, owner, axis=batch_axis)
            return jnp.pad(rows, [(0, 0)] * (x.ndim - 2) + [(pad, 0), (0, 0)])

        k, v = (jax.tree.map(place, x) for x in (cache.k, cache.v))
        cache = KVCache(k=k, v=v, mask=jnp.pad(prompt_mask[owner], ((0, 0), (pad, 0))))
        if record:
            ids = jnp.pad(ids, ((0, 0), (pad, 0), (0, 0), (0, 0)), constant_values=NO_EXPERT)
    lengths = jnp.sum(prompt_mask, axis=1, dtype=jnp.int32)
    # Left padding: the last column is every prompt's last real token.
    return Prefilled(cache=cache, last=out[owner, -1], length=lengths[owner], ids=ids)


@functools.partial(
    jax.jit, static_argnames=("config", "prompt_width", "mesh"), donate_argnames=("state",)
)
def admit(
    params: Any,
    state: EngineState,
    admission: Admission,
    prefilled: Prefilled | None,
    pad_id: Array,
    *,
    config: Any,
    prompt_width: int,
    mesh: Any = None,
) -> EngineState:
    """Moves request ``j`` of an admission into slot ``slot[j]``; entries with ``slot[j] == S``
    are padding (dropped). The arrays are ``admission``'s (``sampling.admission.Admission``;
    its prompts are ``prefill``'s, not read here) and ``prefilled`` the prefill's results
    (``prompt_width`` set for a contiguous cache), or None when nothing was prefilled.

    Paged cache: ``table`` is the new ``[S, W / P]`` block table and ``dest = (source, blocks)``
    the prefill's writes: prompt row ``source[i]``'s keys and values go to its row's logical
    slots from 0 through the global block ids ``blocks[i]: [W / P]`` (``N``: not written).

    **Prompts already in a slot.** ``source[j] < S`` admits request ``j`` from the prompt live
    slot ``source[j]`` holds instead of from the prefill: its first-token logits from that
    slot's ``prompt_hidden``, and its prompt's keys and values copied — a contiguous cache
    copies the source row's prompt slots, a paged one shares the full blocks (``table``) and
    copies the partial last block, ``copies = (from, to)`` global block ids (``N``: none).
    ``length[j]``: request ``j``'s prompt length (needed with ``source``). With every request
    from a live slot, ``prompt_tokens``, ``prompt_mask`` and ``prefilled`` are None.

    With ``state.routing``, slot ``slot[j]``'s routing row is rewritten: its prefill row's
    experts right-aligned to column ``P - 1`` (``NO_EXPERT`` on padding), or those of the live
    slot it reuses the prompt of (its columns ``[0, P)``); ``NO_EXPERT`` from column ``P``."""
    _, _, _, slot, limit, request, source, length, table, dest, copies = admission
    params = cast_params(params, config)
    slots = state.done.shape[0]
    slot_count = state.cache.mask.shape[1]
    paged = isinstance(state.cache, PagedKVCache)
    unstacked = isinstance(params["layers"], tuple)
    batch_axis = 0 if unstacked else 1
    reused = jnp.zeros(slot.shape, bool) if source is None else source < slots
    from_slot = (
        jnp.zeros(slot.shape, jnp.int32) if source is None else jnp.minimum(source, slots - 1)
    )
    hidden = state.prompt_hidden[from_slot]
    k, v = state.cache.k, state.cache.v

    def each(fn: Any, *caches: Any) -> Any:  # over the layers' arrays when unstacked
        if unstacked:
            return tuple(fn(*xs) for xs in zip(*caches))
        return fn(*caches)

    rows_mask = jnp.zeros((slot.shape[0], slot_count), bool)
    record = state.routing is not None
    routing_rows = None
    if record:  # [N, P + T, L, k]: the reused prompts' columns [0, P), NO_EXPERT elsewhere
        route_prompt = state.routing.shape[1] - state.tokens.shape[1]
        empty = jnp.full((slot.shape[0], *state.routing.shape[1:]), NO_EXPERT, state.routing.dtype)
        prompt_cols = (jnp.arange(state.routing.shape[1]) < route_prompt)[None, :, None, None]
        held = reused[:, None, None, None] & prompt_cols
        routing_rows = jnp.where(held, state.routing[from_slot], empty)
    if prefilled is not None:
        cache = prefilled.cache
        width = cache.mask.shape[1]
        if record:  # request j's prompt at columns [P - width, P) of its row
            fresh = empty.at[:, route_prompt - width : route_prompt].set(
                prefilled.ids.astype(empty.dtype)
            )
            routing_rows = jnp.where(reused[:, None, None, None], routing_rows, fresh)
        hidden = jnp.where(reused[:, None], hidden, prefilled.last.astype(hidden.dtype))
        length = prefilled.length if length is None else length
        start = prompt_width - width  # contiguous: right-aligned, every completion at prompt_width
        into = jnp.where(reused, slots, slot)  # the prefilled requests' slots

        def put(big: Array, rows: Array) -> Array:
            index = (slice(None),) * batch_axis + (into, slice(None), slice(start, start + width))
            return big.at[index].set(rows, mode="drop")

        def page(pool: Array, small: Array) -> Array:
            # Packed rows: prefill column c of write i is its row's logical slot c - (width - len).
            rows_of, ids = dest
            lengths = jnp.sum(cache.mask, axis=1, dtype=jnp.int32)
            block, offset = page_slots(
                ids, lengths[rows_of] - width, width, pool.shape[-2], pool.shape[-3]
            )
            rows = jnp.take(small, rows_of, axis=batch_axis)
            rows = jnp.swapaxes(rows, batch_axis, batch_axis + 1)
            return pool.at[..., block, offset, :].set(rows.astype(pool.dtype), mode="drop")

        if paged and dest is None:
            raise ValueError("a paged cache's prefill needs dest (its block writes)")
        k, v = each(page if paged else put, k, cache.k), each(page if paged else put, v, cache.v)
        if not paged:
            rows_mask = rows_mask.at[:, start : start + width].set(cache.mask)
    if paged:  # the prompt in slots [0, len), the completion from len
        if copies is not None:  # the reused prompts' partial last blocks

            def copy(pool: Array) -> Array:
                return pool.at[..., copies[1], :, :].set(pool[..., copies[0], :, :], mode="drop")

            k, v = each(copy, k), each(copy, v)
        next_slot = length
        rows_mask = jnp.arange(slot_count)[None] < length[:, None]
    else:
        if source is not None:  # the reused prompts' slots [0, P) from their live rows

            def clone(big: Array) -> Array:
                head = (slice(None),) * batch_axis
                rows = big[(*head, from_slot, slice(None), slice(0, prompt_width))]
                index = (*head, jnp.where(reused, slot, slots), slice(None))
                return big.at[(*index, slice(0, prompt_width))].set(rows, mode="drop")

            k, v = each(clone, k), each(clone, v)
            prompt_slots = jnp.arange(slot_count)[None] < prompt_width
            source_mask = state.cache.mask[from_slot] & prompt_slots
            rows_mask = jnp.where(reused[:, None], source_mask, rows_mask)
        next_slot = jnp.full(slot.shape, prompt_width, jnp.int32)

    def set_rows(x: Array, value: Any) -> Array:
        return x.at[slot].set(value, mode="drop")

    return _constrain(
        EngineState(
            cache=state.cache._replace(
                k=k,
                v=v,
                mask=set_rows(state.cache.mask, rows_mask),
                **({"table": table} if paged else {}),
            ),
            logits=set_rows(state.logits, unembed(params, config, hidden)),
            next_slot=set_rows(state.next_slot, next_slot),
            position=set_rows(state.position, length),
            count=set_rows(state.count, 0),
            limit=set_rows(state.limit, limit),
            done=set_rows(state.done, False),
            request=set_rows(state.request, request),
            tokens=set_rows(state.tokens, pad_id),
            logprobs=set_rows(state.logprobs, 0.0),
            prompt_hidden=set_rows(state.prompt_hidden, hidden),
            routing=None if not record else set_rows(state.routing, routing_rows),
        ),
        mesh,
    )


def refill(
    params: Any,
    state: EngineState,
    admission: Admission,
    pad_id: Array,
    *,
    config: Any,
    prompt_width: int,
    mesh: Any = None,
) -> EngineState:
    """An admission: its prompts through ``prefill`` (laid out for a contiguous cache), then
    ``admit``. Two programs, so that the prefill's does not depend on the cache's width; under
    ``jax.jit`` one (``jaxrl-llm plan`` lowers it so)."""
    prefilled = None
    if admission.prompt_tokens is not None:
        paged = isinstance(state.cache, PagedKVCache)
        prefilled = prefill(
            params,
            admission.prompt_tokens,
            admission.prompt_mask,
            admission.owner,
            config=config,
            cache_dtype=jax.tree.leaves(state.cache.k)[0].dtype,
            unstacked=isinstance(params["layers"], tuple),
            record=state.routing is not None,
            prompt_width=None if paged else prompt_width,
        )
    return admit(
        params,
        state,
        admission._replace(prompt_tokens=None, prompt_mask=None),  # the prefill's shapes
        prefilled,
        pad_id,
        config=config,
        prompt_width=prompt_width,
        mesh=mesh,
    )


@functools.partial(jax.jit, static_argnames=("config", "top_k", "mesh"), donate_argnames=("state",))
def burst(
    params: Any,
    state: EngineState,
    steps: Array,
    key: Array,
    sampling: SamplingParams,
    stops: Array,
    table: Array | None = None,
    *,
    config: Any,
    top_k: int,
    mesh: Any = None,
) -> tuple[EngineState, Array]:
    """Decodes up to ``steps`` tokens in every live slot; returns the state and steps run.

    ``table``: a paged cache's block table for this burst (its slots' blocks mapped for every
    token it may write).

    A slot finishes on an EOS id, at its ``limit``, or when its completion ends with one of
    ``stops``: ``[N, L]`` int32 token sequences, each right-aligned and left-padded with -1
    (a row of -1 never matches).
    """
    params = cast_params(params, config)  # once per call, not per step
    if table is not None:
        state = state._replace(cache=state.cache._replace(table=table))
    slots, max_new = state.tokens.shape
    rows = jnp.arange(slots)
    record = state.routing is not None
    route_prompt = 0 if not record else state.routing.shape[1] - max_new

    def draw(logits: Array, request: Array, count: Array) -> Array:
        row_key = jax.random.fold_in(jax.random.fold_in(key, request), count)
        return strategies.sample_tokens(
            logits,
            row_key,
            temperature=sampling.temperature,
            top_k=top_k,
            top_p=sampling.top_p,
            min_p=sampling.min_p,
        )

    def live_left(carry: tuple[Array, EngineState]) -> Array:
        step, st = carry
        return (step < steps) & jnp.any(~st.done)

    def body(carry: tuple[Array, EngineState]) -> tuple[Array, EngineState]:
        step, st = carry
        sampled = jax.vmap(draw)(st.logits, st.request, st.count)
        logprob = strategies.token_logprobs(st.logits, sampled, temperature=sampling.temperature)
        live = ~st.done
        token = jnp.where(live, sampled, sampling.pad_id)
        hidden, cache, *chosen = forward(
            params,
            config,
            token[:, None],
            positions=st.position[:, None],
            attention_mask=live[:, None],
            cache=st.cache,
            cache_index=st.next_slot,
            outputs=("routing",) if record else (),
        )
        column = jnp.where(live, st.count, max_new)  # out of range for dead slots: dropped
        routing = st.routing
        if record:  # the fed token's experts [L, S, 1, k] -> column P + count of [S, P + T, L, k]
            ids = jnp.moveaxis(chosen[0], 0, 2)[:, 0].astype(routing.dtype)
            routing = routing.at[rows, route_prompt + column].set(ids, mode="drop")
        count = st.count + live
        tokens = st.tokens.at[rows, column].set(token, mode="drop")
        finished = live & (
            jnp.isin(token, sampling.eos_ids)
            | (count >= st.limit)
            | _ends_with_stop(tokens, count, stops)
        )
        st = st._replace(
            cache=cache,
            logits=unembed(params, config, hidden[:, 0]),
            next_slot=st.next_slot + live,
            position=st.position + live,
            count=count,
            done=st.done | finished,
            tokens=tokens,
            logprobs=st.logprobs.at[rows, column].set(logprob, mode="drop"),
            routing=routing,
        )
        return step + 1, _constrain(st, mesh)

    steps_run, state = jax.lax.while_loop(live_left, body, (jnp.int32(0), state))
    return state, steps_run


def _ends_with_stop(tokens: Array, count: Array, stops: Array) -> Array:
    """``[S]`` bool: row ``s``'s first ``count[s]`` tokens end with a row of ``stops``."""
    length = stops.shape[1]
    real = stops >= 0  # [N, L]
    need = jnp.sum(real, axis=1)  # [N]
    # The last L tokens of each row (columns count - L ... count - 1; before 0: -2).
    cols = count[:, None] - length + jnp.arange(length)  # [S, L]
    tail = jnp.take_along_axis(tokens, jnp.clip(cols, 0, tokens.shape[1] - 1), axis=1)
    tail = jnp.where(cols >= 0, tail, -2)
    same = (tail[:, None, :] == stops[None]) | ~real[None]  # [S, N, L]
    hit = jnp.all(same, axis=2) & (need[None] > 0) & (count[:, None] >= need[None])
    return jnp.any(hit, axis=1)


@functools.partial(jax.jit, static_argnames=("mesh",))  # no donation: the result is smaller
def take_slots(state: EngineState, index: Array, *, mesh: Any = None) -> EngineState:
    """The slots ``index`` (in that order) of ``state``: a smaller (or reordered) engine."""

    def take(x: Array, axis: int) -> Array:
        return jnp.take(x, index, axis=axis)

    cache = state.cache
    if isinstance(cache, PagedKVCache):  # the pool stays; the rows' tables and masks move
        cache = cache._replace(mask=take(cache.mask, 0), table=take(cache.table, 0))
    elif isinstance(cache.k, tuple):
        k, v = (tuple(take(x, 0) for x in xs) for xs in (cache.k, cache.v))
        cache = KVCache(k=k, v=v, mask=take(cache.mask, 0))
    else:
        cache = KVCache(k=take(cache.k, 1), v=take(cache.v, 1), mask=take(cache.mask, 0))
    rest = {
        name: None if getattr(state, name) is None else take(getattr(state, name), 0)
        for name in EngineState._fields
        if name != "cache"
    }
    return _constrain(EngineState(cache=cache, **rest), mesh)


@functools.partial(jax.jit, static_argnames=("width", "mesh"))
def resize(state: EngineState, *, width: int, mesh: Any = None) -> EngineState:
    """A contiguous cache's rows cut to their first ``width`` slots, or padded with empty ones.

    A burst's writes must fit: ``width > next_slot + steps - 1`` on every live slot (a done
    slot's writes past the width are dropped). Not donated: the result has another shape."""
    cache = state.cache

    def fit(x: Array, axis: int) -> Array:
        have = x.shape[axis]
        if width <= have:
            return jax.lax.slice_in_dim(x, 0, width, axis=axis)
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, width - have)
        return jnp.pad(x, pad)

    k, v = (
        tuple(fit(x, 2) for x in xs) if isinstance(xs, tuple) else fit(xs, 3)
        for xs in (cache.k, cache.v)
    )
    cache = KVCache(k=k, v=v, mask=fit(cache.mask, 1))
    return _constrain(state._replace(cache=cache), mesh)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnames=("state",))
def evict(state: EngineState, slots: Array, *, mesh: Any = None) -> EngineState:
    """Marks ``slots`` done (preempted requests): they sample nothing more."""
    return _constrain(state._replace(done=state.done.at[slots].set(True, mode="drop")), mesh)


__all__ = [
    "EngineState",
    "Prefilled",
    "admit",
    "burst",
    "prefill",
    "refill",
    "resize",
    "evict",
    "init_state",
    "shardings",
    "state_axes",
    "take_slots",
]
