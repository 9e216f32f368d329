"""Batched autoregressive sampling: one jitted prefill, then one jitted ``lax.while_loop`` decode.

The prefill runs the whole left-padded prompt batch through the model once, writing the KV cache
slots ``[0, P)`` and keeping the last position's logits. With ``num_samples = G`` each prompt is
prefilled once and its cache repeated ``G`` times along the batch (rows ``g*G … g*G+G-1`` =
prompt ``g``, as the advantage estimators expect). The decode loop then samples one token per
step and feeds it back (cache slot ``P + step``) until every row has emitted an EOS or
``max_new_tokens`` columns are filled; it donates its state, so the cache is updated in place.

Prompt lengths are bucketed (powers of two ``>= 4`` by default; extra columns are left padding)
so a stream of batches compiles a handful of programs. Temperature, top-p, min-p, the EOS ids
and the pad id are traced: changing them does not recompile. ``top_k``, ``max_new_tokens``,
``num_samples``, the bucket and the batch size are static.

The decode state and its traced hyper-parameters (``SamplingState``, ``SamplingParams``) live in
``jaxrl_llm.sampling.state``, prompt checking and bucketing in ``jaxrl_llm.sampling.prompts``;
their public names are re-exported here.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm.models import cast_params, forward, init_cache, unembed
from jaxrl_llm.sampling import layout, strategies
from jaxrl_llm.sampling.prompts import MIN_BUCKET, bucket_length, check_prompts, pad_prompts
from jaxrl_llm.sampling.state import (
    SamplingOptions,
    SamplingParams,
    SamplingState,
    constrain_state,
    grow_cache,
    replicate,
    sampling_params,
)
from jaxrl_llm.types import Completion

Array = jax.Array


NO_EXPERT = -1  # the recorded routing of a padding slot (``forward`` routes it freely)


def routing_dtype(num_experts: int) -> Any:
    """The smallest signed int holding the expert ids ``[0, E)`` and ``NO_EXPERT``: the
    sampler's routing buffer (``[B, P + T, L, k]``, carried through the decode loop) in int8
    for ``E <= 127`` is a quarter of its int32 size. Returned to the host as int32."""
    for dtype in (jnp.int8, jnp.int16):
        if num_experts - 1 <= jnp.iinfo(dtype).max:
            return jnp.dtype(dtype)
    return jnp.dtype(jnp.int32)


@functools.partial(
    jax.jit,
    static_argnames=(
        "config",
        "max_new_tokens",
        "num_samples",
        "cache_dtype",
        "mesh",
        "record_routing",
    ),
)
def prefill_program(
    params: Any,
    prompt_tokens: Array,
    prompt_mask: Array,
    pad_id: Array,
    *,
    config: Any,
    max_new_tokens: int,
    num_samples: int,
    cache_dtype: Any,
    mesh: Any,
    record_routing: bool = False,
) -> SamplingState:
    num_prompts, prompt_len = prompt_tokens.shape
    params = cast_params(params, config)  # once, not per layer call
    # A P-slot cache keeps the prompt's attention P x P; the T decode slots are appended after.
    cache = init_cache(config, num_prompts, prompt_len, dtype=cache_dtype)
    hidden, cache, *chosen = forward(
        params,
        config,
        prompt_tokens,
        attention_mask=prompt_mask,
        cache=cache,
        cache_index=jnp.int32(0),
        outputs=("routing",) if record_routing else (),
    )
    routing = None
    if record_routing:  # [L, N, P, k] -> [N * G, P + T, L, k], -1 on padding and after P
        ids = jnp.where(prompt_mask[:, :, None, None], jnp.moveaxis(chosen[0], 0, 2), NO_EXPERT)
        ids = jnp.repeat(ids, num_samples, axis=0)
        widths = ((0, 0), (0, max_new_tokens), (0, 0), (0, 0))
        routing = jnp.pad(ids, widths, constant_values=NO_EXPERT)
        routing = routing.astype(routing_dtype(config.num_experts))
    # Left padding puts every row's last real token in the last column.
    logits = unembed(params, config, hidden[:, -1])
    rows = num_prompts * num_samples
    state = SamplingState(
        step=jnp.int32(0),
        tokens=jnp.full((rows, max_new_tokens), pad_id, jnp.int32),
        logprobs=jnp.zeros((rows, max_new_tokens), jnp.float32),
        mask=jnp.zeros((rows, max_new_tokens), bool),
        done=jnp.zeros((rows,), bool),
        positions=jnp.repeat(jnp.sum(prompt_mask, axis=1, dtype=jnp.int32), num_samples),
        logits=jnp.repeat(logits, num_samples, axis=0),
        cache=grow_cache(cache, num_samples, max_new_tokens),
        routing=routing,
    )
    return constrain_state(state, mesh)


def _decode_step(
    params: Any,
    state: SamplingState,
    key: Array,
    sampling: SamplingParams,
    *,
    config: Any,
    top_k: int,
    mesh: Any,
    prompt_len: int,
) -> SamplingState:
    sampled = strategies.sample_tokens(
        state.logits,
        jax.random.fold_in(key, state.step),
        temperature=sampling.temperature,
        top_k=top_k,
        top_p=sampling.top_p,
        min_p=sampling.min_p,
    )
    logprob = strategies.token_logprobs(state.logits, sampled, temperature=sampling.temperature)
    live = ~state.done
    token = jnp.where(live, sampled, sampling.pad_id)
    # The last iteration's forward is wasted (one per call); skipping it would need a cond
    # around the cache update, which risks copying the cache every step.
    hidden, cache, *chosen = forward(
        params,
        config,
        token[:, None],
        positions=state.positions[:, None],
        attention_mask=live[:, None],
        cache=state.cache,
        cache_index=prompt_len + state.step,
        outputs=("routing",) if state.routing is not None else (),
    )
    routing = state.routing
    if routing is not None:  # this token's experts, [L, B, 1, k] -> slot P + step of [B, S, L, k]
        ids = jnp.where(live[:, None, None, None], jnp.moveaxis(chosen[0], 0, 2), NO_EXPERT)
        routing = jax.lax.dynamic_update_slice_in_dim(
            routing, ids.astype(routing.dtype), prompt_len + state.step, axis=1
        )
    column = functools.partial(jax.lax.dynamic_update_slice_in_dim, start_index=state.step, axis=1)
    state = SamplingState(
        step=state.step + 1,
        tokens=column(state.tokens, token[:, None]),
        logprobs=column(state.logprobs, jnp.where(live, logprob, 0.0)[:, None]),
        mask=column(state.mask, live[:, None]),
        done=state.done | jnp.isin(token, sampling.eos_ids),
        positions=state.positions + 1,
        logits=unembed(params, config, hidden[:, 0]),
        cache=cache,
        routing=routing,
    )
    return constrain_state(state, mesh)


@functools.partial(
    jax.jit,
    static_argnames=("config", "top_k", "mesh", "unroll", "windows"),
    donate_argnames=("state",),
)
def decode_program(
    params: Any,
    state: SamplingState,
    key: Array,
    sampling: SamplingParams,
    *,
    config: Any,
    top_k: int,
    mesh: Any,
    unroll: bool,
    windows: tuple[int, ...] = (),
) -> SamplingState:
    max_new_tokens = state.tokens.shape[1]
    prompt_len = state.cache.mask.shape[1] - max_new_tokens
    windows = windows or (max_new_tokens,)
    if list(windows) != sorted(set(windows)) or windows[0] < 1 or windows[-1] != max_new_tokens:
        raise ValueError(f"windows must rise to max_new_tokens={max_new_tokens}, got {windows}")
    # Cast once per call: the loop then reads compute-dtype weights (the casts in forward are
    # no-ops on them).
    params = cast_params(params, config)

    if unroll:
        # Split once per call, outside the loop (see jaxrl_llm.sampling.layout):
        # every step then reads each layer's weights and cache where they lie.
        params = layout.unstack_layers(params)
        state = state._replace(cache=layout.unstack_cache(state.cache))
    body = functools.partial(
        _decode_step,
        params,
        key=key,
        sampling=sampling,
        config=config,
        top_k=top_k,
        mesh=mesh,
        prompt_len=prompt_len,
    )
    # One loop per window: the loop up to step ``end`` attends over (and carries) a cache of
    # its first ``P + end`` slots, all a step can read; the next window pads it, once.
    for end in windows:
        state = state._replace(cache=_window(state.cache, prompt_len + end))

        def not_finished(carry: SamplingState, end: int = end) -> Array:
            return (carry.step < end) & jnp.any(~carry.done)

        state = jax.lax.while_loop(not_finished, body, state)
    return state._replace(cache=layout.stack_cache(state.cache))


def _window(cache: Any, slots: int) -> Any:
    """The cache cut to its first ``slots`` slots, or padded with empty ones to ``slots``
    (k, v: the slot axis is the second last, stacked or per layer; mask: ``[B, S]``)."""
    size = cache.mask.shape[1]
    if size == slots:
        return cache

    def fit(x: Array, axis: int) -> Array:
        axis = axis % x.ndim
        if size > slots:
            return jax.lax.slice_in_dim(x, 0, slots, axis=axis)
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, slots - size)
        return jnp.pad(x, widths)

    return cache._replace(
        k=jax.tree.map(lambda x: fit(x, -2), cache.k),
        v=jax.tree.map(lambda x: fit(x, -2), cache.v),
        mask=fit(cache.mask, 1),
    )


def default_cache_dtype(params: Any, config: Any) -> Any:
    """``config.compute_dtype``, else the dtype of the largest floating parameter (bf16 weights
    give a bf16 cache)."""
    if config.compute_dtype is not None:
        return jnp.dtype(config.compute_dtype)
    leaves = [x for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    if not leaves:
        raise ValueError("params contain no floating-point arrays")
    return jnp.dtype(max(leaves, key=lambda x: x.size).dtype)


def hidden_dtype(params: Any, config: Any, *, rows: int = 1) -> Any:
    """The dtype of ``forward``'s final hidden states for these weights (traced, not run): the
    compute dtype, or what mixed parameter dtypes promote to without one (bf16 weights and an
    f32 final norm give f32). ``rows``: the traced batch (under a mesh, a multiple of its
    batch axes). Remembered per (config, parameter shapes and dtypes, rows): the RL loop asks
    once per step with the same weights' structure."""
    leaves, treedef = jax.tree.flatten(params)
    specs = tuple((x.shape, jnp.dtype(x.dtype), getattr(x, "sharding", None)) for x in leaves)
    return _remembered_hidden_dtype(config, treedef, specs, rows)


@functools.lru_cache(maxsize=32)
def _remembered_hidden_dtype(config: Any, treedef: Any, specs: tuple, rows: int) -> Any:
    abstract = jax.tree.unflatten(
        treedef, [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d, sh in specs]
    )
    return _traced_hidden_dtype(abstract, config, rows)


def _traced_hidden_dtype(params: Any, config: Any, rows: int) -> Any:
    tokens = jax.ShapeDtypeStruct((rows, 1), jnp.int32)
    return jax.eval_shape(lambda p, t: forward(p, config, t)[0], params, tokens).dtype


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def prefill(
    params: Any,
    config: Any,
    prompt_tokens: Array,
    prompt_mask: Array,
    *,
    max_new_tokens: int,
    pad_id: int | Array,
    num_samples: int = 1,
    cache_dtype: Any = None,
    mesh: Any = None,
    record_routing: bool = False,
) -> SamplingState:
    """Runs the prompts through the model once and returns the initial decode state.

    ``cache[:, :, :P] = KV(prompt)``, ``logits = unembed(h[:, P - 1])``, both repeated ``G``
    times along the batch (rows ``g*G … g*G+G-1`` = prompt ``g``). Prompts are used at their
    given length (``generate`` buckets them first).

    Args:
      params, config: the model (``jaxrl_llm.models``).
      prompt_tokens: ``[N, P]`` int, left-padded; prompt_mask: ``[N, P]``.
      max_new_tokens: T (the cache holds ``P + T`` slots).
      pad_id: fills the token buffer.
      num_samples: G completions per prompt (static).
      cache_dtype: KV-cache dtype (default: ``config.compute_dtype``, else the parameters').
      mesh: optional ``jax.sharding.Mesh``; the state then follows ``SAMPLING_RULES``.
      record_routing: keep the experts every mixture-of-experts layer chooses for each prompt
        and completion token in ``state.routing`` (``[B, P + T, L, k]`` in ``routing_dtype``,
        -1 on padding and unfed slots; ``decode`` fills the completion's). Errors on a dense
        model.

    Returns:
      A ``SamplingState`` with ``B = N * G`` rows and ``step = 0``.
    """
    if record_routing and not config.is_moe:
        raise ValueError(
            f"record_routing needs a mixture-of-experts model, not {config.architecture}"
        )
    _check_positive_int("max_new_tokens", max_new_tokens)
    _check_positive_int("num_samples", num_samples)
    check_prompts(prompt_tokens, prompt_mask)
    return prefill_program(
        params,
        jnp.asarray(prompt_tokens, jnp.int32),
        jnp.asarray(prompt_mask).astype(bool),
        jnp.asarray(pad_id, jnp.int32),
        config=config,
        max_new_tokens=max_new_tokens,
        num_samples=num_samples,
        cache_dtype=jnp.dtype(cache_dtype or default_cache_dtype(params, config)),
        mesh=mesh,
        record_routing=record_routing,
    )


def decode(
    params: Any,
    config: Any,
    state: SamplingState,
    *,
    key: Array,
    sampling: SamplingParams,
    top_k: int = 0,
    mesh: Any = None,
    decode_layers: str = "auto",
) -> SamplingState:
    """Samples until every row is done or all ``T`` columns are filled (``state`` is donated).

    ``while step < T and any(~done)``: draw column ``step`` from ``state.logits`` with
    ``jax.random.fold_in(key, step)`` (``pad_id``, log-prob 0 and mask 0 on rows already done),
    mark rows whose token is an EOS, and feed the token at cache slot ``P + step`` to get the
    next logits.

    On CPU (``layout.worth_unstacking``; ``decode_layers``: ``auto``, ``stacked`` or
    ``per_layer``) the loop runs on per-layer copies of the weights and cache, made once per
    call, so that each step reads them in place; the returned cache is stacked again. There,
    with ``T >= 64``, it also runs as up to 4 loops over growing windows of the cache
    (``layout.decode_windows``), each attending over the slots filled by its last step only;
    the results are equal up to rounding (the attention sums run over fewer empty slots). A
    state already past step 0 decodes in one loop (a window would cut its filled slots).

    Returns:
      The final ``SamplingState``; ``state.step`` is the number of loop iterations run.
    """
    top_k = strategies.check_sampling_args(
        temperature=1.0, top_k=top_k, top_p=1.0, min_p=0.0, vocab_size=config.vocab_size
    )
    windows = layout.decode_windows(params, state.tokens.shape[1], decode_layers)
    traced = isinstance(state.step, jax.core.Tracer)
    if windows and not traced and int(state.step) != 0:  # CPU only: waiting on the prefill is cheap
        windows = ()
    return decode_program(
        params,
        state,
        key,
        sampling,
        config=config,
        top_k=top_k,
        mesh=mesh,
        unroll=layout.worth_unstacking(params, decode_layers),
        windows=windows,
    )


def generate(
    params: Any,
    config: Any,
    prompt_tokens: Array,
    prompt_mask: Array,
    *,
    key: Array,
    max_new_tokens: int,
    sampling: SamplingOptions,
    num_samples: int = 1,
    cache_dtype: Any = None,
    mesh: Any = None,
    decode_layers: str = "auto",
    record_routing: bool = False,
) -> Completion | tuple[Completion, Array]:
    """Samples ``num_samples`` completions per prompt with a KV cache.

    ``y_t ~ softmax(truncate(z_t / T))`` for ``t < max_new_tokens`` (greedy ``argmax z_t`` when
    ``T = 0``), stopping a row after its first token in ``eos_ids``. The returned log-prob of
    each token is under the temperature-scaled FULL distribution, ``log_softmax(z_t / T)[y_t]``
    (with ``T = 1`` for greedy), which is what
    ``jaxrl_llm.logprobs.completion_logprobs(..., temperature=T)`` recomputes. Truncation order
    and semantics: :func:`jaxrl_llm.sampling.strategies.truncate_logits`.

    Host-level function (not for use under ``jax.jit``): it checks the prompts, pads their
    length to a bucket (``pad_prompts``: powers of two ``>= 16``, so a handful of prompt widths
    compile), and calls the jitted prefill and decode programs.

    Args:
      params, config: the model, e.g. from ``jaxrl_llm.models.load_pretrained``.
      prompt_tokens: ``[N, P]`` int, left-padded; every row needs at least one real token.
      prompt_mask: ``[N, P]`` bool/int, 1 on real tokens.
      key: PRNG key; completion column ``t`` is drawn with ``jax.random.fold_in(key, t)``.
      max_new_tokens: T, the number of returned columns.
      sampling: the temperature ``T``, ``top_k``, ``top_p``, ``min_p``, the ``eos_ids`` that
        end a row and the ``pad_id`` written after it (``SamplingOptions``).
      num_samples: G completions per prompt; rows ``g*G … g*G+G-1`` belong to prompt ``g``.
      cache_dtype: KV-cache dtype (default: ``config.compute_dtype``, else the parameters').
      mesh: optional mesh; the sampling state is then sharded by ``SAMPLING_RULES``.
      decode_layers: the decode loop's weights and cache stacked or per layer (``decode``).
      record_routing: also return the routing of every prompt and completion token, for
        routing replay (mixture-of-experts models only; see Returns).

    Returns:
      ``Completion(tokens [N*G, T] int32, logprobs [N*G, T] f32, mask [N*G, T] bool)``; with
      ``record_routing``, ``(completion, routing)``: ``routing [N*G, P + T, L, k]`` int32 (a
      device array sharded over rows like the completion's; fetch it the same way), for each
      token of ``[prompt ; completion]`` (``P`` the given prompts' width) the
      ``k`` experts each of the ``L`` mixture-of-experts layers chose, -1 on prompt padding and
      completion padding (after EOS). ``jnp.moveaxis(routing, 2, 0)`` is the ``[L, B, S, k]``
      that ``models.forward(..., routing=)`` replays.
    """
    traced = sampling.traced()
    pad_id = sampling.pad_id
    tokens, mask = pad_prompts(prompt_tokens, prompt_mask, pad_id=pad_id)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        state = prefill(
            params,
            config,
            tokens,
            mask,
            max_new_tokens=max_new_tokens,
            pad_id=pad_id,
            num_samples=num_samples,
            cache_dtype=cache_dtype,
            mesh=mesh,
            record_routing=record_routing,
        )
        key, traced = replicate((key, traced), mesh)
        state = decode(
            params,
            config,
            state,
            key=key,
            sampling=traced,
            top_k=sampling.top_k,
            mesh=mesh,
            decode_layers=decode_layers,
        )
    completion = Completion(tokens=state.tokens, logprobs=state.logprobs, mask=state.mask)
    if not record_routing:
        return completion
    # The bucket's extra left columns dropped: the routing of the caller's P prompt columns.
    extra = tokens.shape[1] - jnp.shape(prompt_tokens)[1]
    return completion, state.routing[:, extra:].astype(jnp.int32)


__all__ = [
    "NO_EXPERT",
    "decode_program",
    "routing_dtype",
    "prefill_program",
    "MIN_BUCKET",
    "SamplingOptions",
    "SamplingParams",
    "SamplingState",
    "bucket_length",
    "decode",
    "generate",
    "pad_prompts",
    "prefill",
    "sampling_params",
]
