"""Decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3, Gemma / Gemma 2 / Gemma 3 and the
Qwen-MoE / Mixtral / gpt-oss mixtures of experts) in Flax NNX.

The NNX ``Transformer`` holds its decoder layers stacked along a leading ``layers`` axis
(built with ``nnx.vmap``) and runs them with one ``jax.lax.scan``, so compile time does not
grow with depth (on CPU the scan is unrolled: XLA:CPU's loop copies cost more there).
Jitted code works on a plain nested dict of arrays: ``init_params`` and ``load_pretrained``
return one, and ``forward`` merges it with a graphdef cached per config
inside the traced function, so optax, orbax and the sharding layer see an ordinary pytree.

``forward`` also takes the layers and the KV cache split into per-layer arrays (see
``jaxrl_llm.sampling.layout``) and then runs the layers as an unrolled loop: the sampler does so
on CPU, where XLA copies a layer's slice out of a stacked array before every matmul reading it.

Every parameter carries logical axis names (``nnx.Param`` ``out_sharding`` metadata) from
{batch, embed, mlp, heads, kv_heads, head_dim, vocab, layers, cache_seq, expert};
``logical_axes(config)`` reads them back as a pytree matching the params.

Gemma's differences are data in ``ModelConfig`` read by the same modules: embeddings times
``sqrt(D)``, ``1 + w`` norms, GeGLU, sandwich norms, soft caps (``unembed`` caps the logits), and
sliding-window layers among global ones: each layer's kind (a Python bool when unrolled, a
traced one inside the scan) picks its window and, for Gemma 3, its RoPE base. gpt-oss's are
too: attention sinks (``sinks``), sliding-window layers, and biased, clamped experts.

The pieces live in their own modules, re-exported here: ``layers`` (the decoder block,
RMSNorm), ``attention`` (RoPE, masks, attention over a cache), ``kv_cache`` (``KVCache``) and
``moe`` (routing, grouped experts, router losses).

Shapes: B batch, S sequence, D hidden, N query heads, K key/value heads, H head dim,
F MLP width, V vocabulary, L layers.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxrl_llm._checks import check_choice, check_rank
from jaxrl_llm.models import context_parallel
from jaxrl_llm.models.attention import apply_rope, cache_attention, rope_angles, softcap
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.kv_cache import (
    CACHE_AXES,
    KVCache,
    LayerCache,
    check_cache,
    init_cache,
)
from jaxrl_llm.models.layers import (
    DecoderLayer,
    constrain,
    gathered,
    norm_init,
    normal,
    param,
    rms_norm,
)
from jaxrl_llm.models.matmul import dense
from jaxrl_llm.models.moe import replay_route, route
from jaxrl_llm.parallel.mesh import current_platform
from jaxrl_llm.parallel.vocab import embed_lookup, vocab_parallel_axis

Array = jax.Array
Params = dict[str, Any]

REMAT_POLICIES = ("none", "layer", "offload")
#: What ``forward`` can return after ``(hidden, cache)`` (its ``outputs``), in this order.
OUTPUTS = ("router_logits", "routing")
LAYER_INPUT = "decoder_layer_input"  # checkpoint_name of each layer's input (the residual stream)


def remat_policy(remat: str) -> Any:
    """The ``jax.checkpoint`` policy of ``remat`` (``REMAT_POLICIES``), None for ``"none"``.

    ``"layer"``: save nothing inside a layer (``nothing_saveable``): the backward pass keeps
    each layer's input ``x_l [B, S, D]`` (``L B S D`` values in all) and recomputes the layer.
    ``"offload"``: the same recompute, with each layer's input (named ``LAYER_INPUT``) moved
    to host memory (``pinned_host``) after the forward and back before its layer's backward,
    so device memory no longer holds the ``L`` residuals. On TPU and GPU XLA turns these into
    asynchronous device-host copies; on CPU JAX lowers the transfers as no-ops (device and
    host are one memory there), so it runs as ``"layer"``.
    """
    check_choice("remat", remat, REMAT_POLICIES)
    if remat == "none":
        return None
    if remat == "layer":
        return jax.checkpoint_policies.nothing_saveable
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=[LAYER_INPUT],
        offload_src="device",
        offload_dst="pinned_host",
    )


class Transformer(nnx.Module):
    """Embedding, ``L`` stacked decoder layers scanned with ``lax.scan``, final RMSNorm.

    ``__call__`` returns the final-norm hidden states; ``unembed`` maps them to logits.
    Params (``nnx.to_pure_dict``): ``embed [V, D]``, ``layers/*`` stacked ``[L, ...]``,
    ``final_norm [D]``, and ``lm_head [D, V]`` unless embeddings are tied.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32):
        self.config = config
        v, d = config.vocab_size, config.hidden_size
        self.embed = param(normal(rngs, (v, d), dtype), ("vocab", "embed"))

        @nnx.split_rngs(splits=config.num_hidden_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(config, dtype=dtype, rngs=rngs)

        self.layers = make_layers(rngs)
        self.final_norm = param(norm_init((d,), dtype, config), ("embed",))
        tied = config.tie_word_embeddings
        self.lm_head = None if tied else param(normal(rngs, (d, v), dtype), ("embed", "vocab"))

    def __call__(
        self,
        tokens: Array,
        *,
        positions: Array | None = None,
        attention_mask: Array | None = None,
        cache: KVCache | None = None,
        cache_index: Array | int | None = None,
        remat: str = "none",
        unstacked_layers: tuple[Params, ...] | None = None,
        dropout_key: Array | None = None,
        outputs: tuple[str, ...] = (),
        segment_ids: Array | None = None,
        routing: Array | None = None,
    ) -> tuple[Any, ...]:
        """See ``forward``; ``unstacked_layers`` holds the layers' values (``unstack_layers``)."""
        config = self.config
        check_choice("remat", remat, REMAT_POLICIES)
        outputs = check_outputs(outputs)
        return_routing = "routing" in outputs
        check_rank("tokens", tokens, 2)
        batch, seq = tokens.shape
        routing = check_routing(config, routing, tokens.shape)
        attention_mask = _check_optional("attention_mask", attention_mask, tokens.shape)
        positions = _check_optional("positions", positions, tokens.shape)
        if segment_ids is not None:
            _check_optional("segment_ids", segment_ids, tokens.shape)
            segment_ids, positions = _packed_rows(segment_ids, positions, attention_mask, cache)
            attention_mask = segment_ids > 0
        if attention_mask is None:
            attention_mask = jnp.ones((batch, seq), dtype=bool)
        attention_mask = attention_mask.astype(bool)
        if cache is None:
            if cache_index is not None:
                raise ValueError("cache_index was given without a cache")
            key_valid, query_slots = attention_mask, jnp.arange(seq)
            offset = jnp.zeros((batch, 1), jnp.int32)
            kv = None
        else:
            check_cache(config, cache, tokens.shape, cache_index)
            cache_index = jnp.asarray(cache_index, jnp.int32)
            if cache_index.ndim == 1:  # one first slot per row
                query_slots = cache_index[:, None] + jnp.arange(seq)  # [B, S]
                rows = jnp.arange(batch)[:, None]
                key_valid = cache.mask.at[rows, query_slots].set(attention_mask, mode="drop")
                before = jnp.arange(cache.mask.shape[1])[None] < cache_index[:, None]
            else:
                key_valid = jax.lax.dynamic_update_slice(
                    cache.mask, attention_mask, (0, cache_index)
                )
                query_slots = cache_index + jnp.arange(seq)
                before = jnp.arange(cache.mask.shape[1]) < cache_index
            offset = jnp.sum(cache.mask & before, axis=1, keepdims=True, dtype=jnp.int32)
            kv = (cache.k, cache.v)
        table = getattr(cache, "table", None)  # a PagedKVCache's block table
        if positions is None:
            counts = jnp.cumsum(attention_mask.astype(jnp.int32), axis=1)
            positions = jnp.maximum(offset + counts - 1, 0)
        context = None  # context parallelism: the sequence split over the mesh's sequence axis
        if cache is None and context_parallel.shards() > 1:
            context = _context_layout(config, tokens, positions, attention_mask, segment_ids)
            tokens, positions, attention_mask, segment_ids, query_slots = context.arrays
            key_valid = attention_mask
            routing = context.arrange_routing(routing)
        rope = rope_angles(config, positions)
        # Gemma 3: the sliding-window layers rotate with a base of their own.
        local_rope = None
        if config.rope_local_theta is not None and any(config.sliding_layers):
            local_rope = rope_angles(config, positions, local=True)

        embedding = self.embed[...]
        if vocab_parallel_axis(*embedding.shape, batch) is not None:  # fsdp-only mesh
            x = embed_lookup(embedding, tokens)  # the table used split by vocabulary over fsdp
        else:  # gathered over fsdp once (vocab rows stay tensor-split), then looked up
            x = gathered(embedding, "vocab", "embed")[tokens]
        if config.embed_scale is not None:  # Gemma: sqrt(D), rounded to the compute dtype
            x = x * jnp.asarray(config.embed_scale, x.dtype)
        seq_axis = None if context is None else "sequence"
        x = constrain(x, "batch", seq_axis, "embed")
        layer_def, layer_state = nnx.split(self.layers)

        def body(carry, xs):
            x, kv = carry
            x = checkpoint_name(x, LAYER_INPUT)  # what remat="offload" moves to the host
            state, layer_index, layer_id, layer_routing = xs
            layer = nnx.merge(layer_def, state)
            local = _is_local(config, layer_id)
            angles = rope
            if local_rope is not None and local is True:
                angles = local_rope
            elif local_rope is not None and local is not False:  # traced: this layer's pair
                angles = tuple(
                    jnp.where(local, a, b) for a, b in zip(local_rope, rope, strict=True)
                )
            x, kv, router_logits = layer(
                x,
                rope=angles,
                query_slots=query_slots,
                key_valid=key_valid,
                cache=None if kv is None else LayerCache(kv, cache_index, layer_index, table),
                dropout_key=None
                if dropout_key is None
                else jax.random.fold_in(dropout_key, layer_id),
                local=local,
                segment_ids=segment_ids,
                routing=layer_routing,
                context=context is not None,
            )
            chosen = None
            if return_routing and router_logits is not None:
                chosen = _chosen_experts(config, router_logits, layer_routing)
            return (x, kv), (router_logits, chosen)

        if remat != "none":  # each layer (scanned or unrolled) recomputed in the backward
            body = jax.checkpoint(body, prevent_cse=False, policy=remat_policy(remat))
        if unstacked_layers is None:
            layer_ids = jnp.arange(config.num_hidden_layers, dtype=jnp.int32)
            # XLA:CPU runs a layer loop with per-iteration slice copies of the weights and
            # residuals (about a tenth of a 60M model's training step): unrolled there.
            unroll = config.num_hidden_layers if current_platform()[0] == "cpu" else 1
            (x, kv), (router_logits, chosen) = jax.lax.scan(
                lambda carry, xs: body(carry, (xs[0], xs[1], xs[1], xs[2])),
                (x, kv),
                (layer_state, layer_ids, routing),
                unroll=unroll,
            )
        else:  # per-layer weights and cache arrays: unrolled, each layer reads its own
            written, per_layer = [], []
            for i, state in enumerate(unstacked_layers):
                layer_kv = None if kv is None else (kv[0][i], kv[1][i])
                layer_routing = None if routing is None else routing[i]
                (x, layer_kv), outs = body((x, layer_kv), (state, None, i, layer_routing))
                written.append(layer_kv)
                per_layer.append(outs)
            kv = None if kv is None else tuple(zip(*written))
            router_logits = chosen = None
            if config.is_moe:
                router_logits = jnp.stack([logits for logits, _ in per_layer])
                if return_routing:
                    chosen = jnp.stack([ids for _, ids in per_layer])
        final = rms_norm(
            x,
            self.final_norm[...],
            config.rms_norm_eps,
            plus_one=config.is_gemma,
            in_f32=config.norm_in_f32,
        )
        if context is not None:  # back in slot order, the padding dropped
            final = context.restore(constrain(final, "batch", seq_axis, "embed"))
            router_logits = context.restore(router_logits, axis=2)
            chosen = context.restore(chosen, axis=2)
        hidden = constrain(final, "batch", None, "embed")
        new_cache = None if cache is None else cache._replace(k=kv[0], v=kv[1], mask=key_valid)
        extra = {"router_logits": router_logits, "routing": chosen}
        return (hidden, new_cache, *(extra[name] for name in outputs))


def check_outputs(outputs: Any) -> tuple[str, ...]:
    """``forward``'s ``outputs`` as a tuple of :data:`OUTPUTS` names, in their order there.

    Raises:
      ValueError: an unknown name, or a string instead of a tuple of names.
    """
    if isinstance(outputs, str):
        raise ValueError(f"outputs must be a tuple of names, got the string {outputs!r}")
    unknown = [name for name in outputs if name not in OUTPUTS]
    if unknown:
        raise ValueError(f"outputs: unknown {unknown[0]!r}; choose from {OUTPUTS}")
    return tuple(name for name in OUTPUTS if name in outputs)


def _chosen_experts(config: ModelConfig, logits: Array, given: Array | None) -> Array:
    """``[B, S, k]`` int32: the experts a layer used, its own top-k (``route``) or the
    replayed ids (``replay_route``: negative ones fall back to the top-k)."""
    batch, seq, num_experts = logits.shape
    flat = logits.reshape(batch * seq, num_experts)
    k, normalize = config.num_experts_per_tok, config.norm_topk_prob
    if given is None:
        _, experts = route(flat, top_k=k, normalize=normalize)
    else:
        _, experts = replay_route(flat, given.reshape(batch * seq, k), normalize=normalize)
    return experts.reshape(batch, seq, k)


def check_routing(config: ModelConfig, routing: Any, shape: tuple[int, ...]) -> Array | None:
    """``routing`` as int32 ``[L, B, S, k]`` after its checks (None passes through).

    Raises:
      ValueError: a dense model, another shape, a non-integer dtype, or (when the ids are
        concrete) an id ``>= E``.
    """
    if routing is None:
        return None
    if not config.is_moe:
        raise ValueError(
            f"routing replay needs a mixture-of-experts model, not {config.architecture}"
        )
    want = (config.num_hidden_layers, *shape, config.num_experts_per_tok)
    if tuple(jnp.shape(routing)) != want:
        raise ValueError(f"routing must be [L, B, S, k] = {want}, got {jnp.shape(routing)}")
    if not jnp.issubdtype(jnp.result_type(routing), jnp.integer):
        raise ValueError(f"routing must hold integer expert ids, got {jnp.result_type(routing)}")
    concrete = isinstance(routing, np.ndarray) or (
        isinstance(routing, jax.Array)
        and not isinstance(routing, jax.core.Tracer)
        and routing.is_fully_addressable
    )
    if concrete and np.size(routing):  # checked on the host: a jnp op here would be traced
        top = int(np.max(np.asarray(routing)))
        if top >= config.num_experts:
            raise ValueError(
                f"routing holds expert id {top}, past the {config.num_experts} experts"
            )
    return jnp.asarray(routing, jnp.int32)


def _is_local(config: ModelConfig, layer_id: Any) -> Any:
    """Whether layer ``layer_id`` has a sliding window: a Python bool when every layer agrees
    or the id is a Python int (unrolled layers), else a traced bool (inside the layer scan)."""
    sliding = config.sliding_layers
    if not any(sliding) or all(sliding):
        return all(sliding)
    if isinstance(layer_id, int):
        return sliding[layer_id]
    return jnp.asarray(sliding)[layer_id]


def _packed_rows(
    segment_ids: Array, positions: Array | None, attention_mask: Array | None, cache: Any
) -> tuple[Array, Array]:
    """``(segment_ids int32, positions)`` of packed rows after the checks; ``positions``
    defaults to each slot's offset in its segment (``i - first slot of segment[i]``)."""
    if cache is not None:
        raise ValueError(
            "segment_ids (packed rows) are for training and scoring forwards: they cannot be "
            "used with a KV cache"
        )
    if attention_mask is not None:
        raise ValueError("pass segment_ids (0 = padding) or attention_mask, not both")
    if not jnp.issubdtype(jnp.result_type(segment_ids), jnp.integer):
        raise ValueError(f"segment_ids must be integers, got {jnp.result_type(segment_ids)}")
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
    if positions is None:
        slots = jnp.broadcast_to(jnp.arange(segment_ids.shape[1]), segment_ids.shape)
        starts = jnp.concatenate(
            [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
            axis=1,
        )
        first = jax.lax.cummax(jnp.where(starts, slots, 0), axis=1)
        positions = jnp.where(segment_ids > 0, slots - first, 0)
    return segment_ids, positions


class _ContextLayout(NamedTuple):
    """A context-parallel forward's inputs padded and permuted (``context_parallel.zigzag``)."""

    arrays: tuple[Array, Array, Array, Array | None, Array]  # tokens, positions, mask, segs, slots
    order: np.ndarray
    length: int

    def restore(self, x: Array | None, axis: int = 1) -> Array | None:
        """``[.., T', ..]`` (positions on ``axis``) in permuted order -> ``[.., T, ..]`` in
        slot order (None stays None)."""
        if x is None:
            return None
        return jnp.take(x, np.argsort(self.order)[: self.length], axis=axis)

    def arrange_routing(self, routing: Array | None) -> Array | None:
        """Replayed ``[L, B, T, k]`` expert ids padded (``-1``: route freely) and permuted."""
        if routing is None:
            return None
        pad = ((0, 0), (0, 0), (0, self.order.shape[0] - self.length), (0, 0))
        return jnp.take(jnp.pad(routing, pad, constant_values=-1), self.order, axis=2)


def _context_layout(
    config: ModelConfig,
    tokens: Array,
    positions: Array,
    mask: Array,
    segment_ids: Array | None,
) -> _ContextLayout:
    """The sequence padded to whole load-balanced chunks (masked, segment 0) and put in zigzag
    order, with each position's slot (see ``models.context_parallel``)."""
    mesh = jax.sharding.get_abstract_mesh()
    if config.is_moe and dict(mesh.shape).get("expert", 1) > 1:
        raise ValueError(
            "context parallelism (mesh.sequence > 1) and expert parallelism (mesh.expert > 1) "
            "do not combine yet: use one of them"
        )
    count = context_parallel.shards()
    seq = tokens.shape[1]
    splash = context_parallel.uses_splash(
        config.compute_dtype or jnp.float32,
        config.head_dim,
        logit_softcap=config.attn_logit_softcapping,
        sliding_window=config.sliding_window if any(config.sliding_layers) else None,
        sinks=config.attention_sinks,
    )
    length = context_parallel.padded_length(seq, count, splash=splash)
    order = context_parallel.zigzag(length, count)

    def arrange(x: Array | None) -> Array | None:
        if x is None:
            return None
        return jnp.take(jnp.pad(x, ((0, 0), (0, length - seq))), order, axis=1)

    arrays = (
        arrange(tokens),
        arrange(positions),
        arrange(mask),
        arrange(segment_ids),
        jnp.asarray(order, jnp.int32),
    )
    return _ContextLayout(arrays, order, seq)


def _check_optional(name: str, x: Array | None, shape: tuple[int, ...]) -> Array | None:
    if x is not None and tuple(jnp.shape(x)) != tuple(shape):
        raise ValueError(f"{name} must have the tokens' shape {tuple(shape)}, got {jnp.shape(x)}")
    return x


@functools.lru_cache(maxsize=64)
def _abstract(config: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """Graphdef and abstract (shape-only) state of the model, cached per config."""
    # Outside any context mesh: nnx.eval_shape would read the logical axis names as mesh axes.
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    return nnx.split(model)


def param_shapes(config: ModelConfig, dtype: Any = jnp.float32) -> Params:
    """``jax.ShapeDtypeStruct`` pytree matching ``init_params(config, key, dtype=dtype)``."""
    _, state = _abstract(config)
    shapes = nnx.to_pure_dict(state)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype)), shapes)


def logical_axes(config: ModelConfig) -> Params:
    """Logical axis names of every parameter, read from the NNX variables' metadata.

    Returns:
      A nested dict with the structure of the params whose leaves are tuples of logical axis
      names, one per dimension, e.g. ``layers/wq: ("layers", "embed", "heads", "head_dim")``.
      Tuples are pytree nodes: map over it with ``is_leaf=lambda x: isinstance(x, tuple)``.
    """
    _, state = _abstract(config)
    axes = jax.tree.map(
        lambda v: tuple(v.get_metadata()["out_sharding"]),
        state,
        is_leaf=lambda v: isinstance(v, nnx.Variable),
    )
    return nnx.to_pure_dict(axes)


def init_params(config: ModelConfig, key: Array, *, dtype: Any = jnp.float32) -> Params:
    """Random parameters (normal(0.02) weights, unit norms, zero biases) as a plain dict.

    Jit-able with ``config`` and ``dtype`` static, e.g. under ``jax.jit(..., out_shardings=...)``
    so state is born sharded.
    """
    model = Transformer(config, rngs=nnx.Rngs(params=key), dtype=dtype)
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def merge(params: Params, config: ModelConfig) -> Transformer:
    """The NNX ``Transformer`` holding ``params`` (works on tracers inside jit)."""
    graphdef, state = _abstract(config)
    want = jax.tree.structure(nnx.to_pure_dict(state))
    got = jax.tree.structure(params)
    if got != want:
        raise ValueError(
            f"params do not match the model of {config.architecture}: expected structure "
            f"{want}, got {got}"
        )
    return nnx.merge(graphdef, params)


def forward(
    params: Params,
    config: ModelConfig,
    tokens: Array,
    *,
    positions: Array | None = None,
    attention_mask: Array | None = None,
    cache: KVCache | None = None,
    cache_index: Array | int | None = None,
    remat: str = "none",
    dropout_key: Array | None = None,
    outputs: tuple[str, ...] = (),
    segment_ids: Array | None = None,
    routing: Array | None = None,
) -> tuple[Any, ...]:
    """Hidden states after the final norm, optionally reading and writing a KV cache.

    ``h = RMSNorm(Block_L(... Block_1(E[tokens])))`` with RoPE at ``positions``
    (default ``cumsum(attention_mask) - 1`` clipped at 0, plus the number of real cache slots
    before ``cache_index`` when a cache is given), so left padding does not shift positions.

    Without a cache each query attends causally to real keys of this call. With a cache of
    ``S_max`` slots, this call's keys/values go to slots ``[cache_index, cache_index + S)``,
    ``cache.mask`` there becomes ``attention_mask``, and the query at slot ``cache_index + s``
    attends to slots ``j <= cache_index + s`` whose mask is True. Prefill = the left-padded
    prompt at ``cache_index=0``; decode = ``S=1`` calls with explicit positions. A ``[B]``
    ``cache_index`` gives each row its own slots (rows at different lengths, as in continuous
    batching). A sliding-window layer (``config.layer_types``, Gemma 2 / 3, gpt-oss) also drops
    the keys ``config.sliding_window`` or more slots before its query, with or without a cache.
    gpt-oss's attention sinks join every softmax on every path (prefill, packed rows, decode,
    paged decode).

    Args:
      params: plain nested dict from ``init_params`` / ``load_pretrained``, or with its layers
        split into a tuple of per-layer dicts (``jaxrl_llm.sampling.layout.unstack_layers``):
        they then run unrolled instead of scanned, and a cache must be split likewise.
      config: the model's ``ModelConfig`` (static).
      tokens: ``[B, S]`` int32.
      positions: ``[B, S]`` int32 RoPE positions, or None for the default above.
      attention_mask: ``[B, S]``, 1 on real tokens (default all ones).
      cache: ``KVCache`` with ``k, v: [L, B, K, S_max, H]`` (tuples of ``L`` per-layer arrays
        with split params), ``mask: [B, S_max]``, or None.
      cache_index: scalar or ``[B]`` int32 (may be traced); required with a cache.
      remat: ``"none"``, ``"layer"`` (``jax.checkpoint`` each layer, scanned or unrolled: the
        backward keeps only each layer's input and recomputes the layer) or ``"offload"``
        (as ``"layer"``, with those inputs kept in host memory on TPU / GPU; ``remat_policy``).
      dropout_key: a PRNG key for LoRA dropout (``config.lora.dropout``, training only), or
        None: no dropout.
      outputs: what to return after ``(hidden, cache)``, names of :data:`OUTPUTS`, always in
        that order: ``"router_logits"``, every layer's router logits ``[L, B, S, E]`` f32,
        from which ``models.moe.load_balancing_loss`` and ``models.moe.router_z_loss``
        compute the mixture-of-experts auxiliary losses; ``"routing"``, the expert ids every
        layer used, ``[L, B, S, k]`` int32 (the top-k of its f32 router logits as
        ``models.moe.route`` takes it, or the replayed ids): replaying them gives this
        forward's output bit for bit. Each is None for a dense model.
      segment_ids: ``[B, S]`` int32 for packed rows (several sequences per row,
        ``jaxrl_llm.packing``): ``k >= 1`` on the ``k``-th sequence of a row, 0 on padding. A
        token attends only to the tokens of its own segment before it (sliding windows count
        slots, which within a segment are its positions); ``positions`` then default to each
        token's offset in its segment (restarting at 0). Replaces ``attention_mask`` (real
        tokens = nonzero ids); training and scoring only: an error with a cache.
      routing: ``[L, B, S, k]`` int expert ids to replay (routing replay, "R3", Ma et al.
        2025), L the layers in stack order: layer ``l`` sends token ``(b, s)`` to experts
        ``routing[l, b, s]`` instead of its own top-k, with gate weights still computed from
        its own router logits at those ids (``models.moe.replay_route``: the softmax over the
        k chosen logits when ``config.norm_topk_prob``, else the full softmax's entries), so
        the router gets its gradient. A token whose ids hold a negative one (``-1``: padding
        of a recorded routing) routes freely. Mixture-of-experts models only; every path
        (padded, packed, cached, expert-parallel).

    Returns:
      ``(hidden [B, S, D] in config.compute_dtype (else the params' dtype), new cache or
      None, *outputs)``.
    """
    params = cast_params(params, config)
    unstacked = None
    if isinstance(params.get("layers"), tuple):
        unstacked = _check_unstacked(params["layers"], config)
        params = {**params, "layers": param_shapes(config)["layers"]}  # structure only
    if unstacked is not None and dropout_key is not None:
        raise ValueError("dropout_key is for training: params with split layers are for sampling")
    if cache is not None and isinstance(cache.k, tuple) != (unstacked is not None):
        raise ValueError(
            "a cache split into per-layer arrays goes with params whose layers are split, and "
            "a stacked cache with stacked layers (see jaxrl_llm.sampling.layout)"
        )
    return merge(params, config)(
        tokens,
        positions=positions,
        attention_mask=attention_mask,
        cache=cache,
        cache_index=cache_index,
        remat=remat,
        unstacked_layers=unstacked,
        dropout_key=dropout_key,
        outputs=outputs,
        segment_ids=segment_ids,
        routing=routing,
    )


def _check_unstacked(layers: tuple[Params, ...], config: ModelConfig) -> tuple[Params, ...]:
    want = jax.tree.map(lambda s: s.shape[1:], param_shapes(config)["layers"])
    got = tuple(jax.tree.map(jnp.shape, layer) for layer in layers)
    if got != (want,) * config.num_hidden_layers:
        raise ValueError(
            f"unstacked params do not match the model of {config.architecture}: expected "
            f"{config.num_hidden_layers} layers of shapes {want}, got {got}"
        )
    return layers


def cast_params(params: Params, config: ModelConfig) -> Params:
    """The floating parameters in ``config.compute_dtype`` (unchanged when it is None).

    Under jit the cast of f32 master weights to bf16 runs on each shard before any gather, so
    FSDP all-gathers move compute-dtype bytes; its gradient is the cast back to f32. A
    mixture-of-experts router (``layers/router``, ``[L, D, E]``, and gpt-oss's
    ``layers/router_bias``, small) keeps its own dtype: the router logits are computed in f32
    from its stored values. So do gpt-oss's attention sinks (``layers/sinks``, ``[L, N]``),
    which join the f32 softmax.
    """
    if config.compute_dtype is None:
        return params
    dtype = jnp.dtype(config.compute_dtype)
    keep = {jax.tree_util.DictKey(name) for name in ("router", "router_bias", "sinks")}

    def cast(path, x):
        if path[-1] in keep:
            return x
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree_util.tree_map_with_path(cast, params)


def unembedding(params: Params, config: ModelConfig) -> Array:
    """``W_U [D, V]`` in the compute dtype, gathered over fsdp (vocab stays tensor-split).

    Hoist it out of a loop over sequence chunks (as ``logprobs`` does) so the weight is gathered
    once per forward, not once per chunk.
    """
    params = cast_params(
        {k: params[k] for k in ("embed", "lm_head") if params.get(k) is not None}, config
    )
    if config.tie_word_embeddings:
        return gathered(params["embed"], "vocab", "embed").T
    return gathered(params["lm_head"], "embed", "vocab")


def unembed(
    params: Params, config: ModelConfig, hidden: Array, *, weight: Array | None = None
) -> Array:
    """``logits = h W_U`` in f32 (``W_U = E^T`` when tied): ``[..., D] -> [..., V]``, soft-capped
    to ``c tanh(logits / c)`` with ``config.final_logit_softcapping`` c (Gemma 2).

    ``weight``: a precomputed ``unembedding(params, config)`` (then ``params`` is unused).
    """
    if weight is None:
        weight = unembedding(params, config)
    out = dense(hidden, weight, preferred_element_type=jnp.float32)
    return softcap(out, config.final_logit_softcapping)


def logits(
    params: Params, config: ModelConfig, tokens: Array, *, attention_mask: Array | None = None
) -> Array:
    """Next-token logits ``[B, S, V]`` in f32 (materialises all of them; see ``logprobs``)."""
    hidden, _ = forward(params, config, tokens, attention_mask=attention_mask)
    return unembed(params, config, hidden)


__all__ = [
    "CACHE_AXES",
    "LAYER_INPUT",
    "OUTPUTS",
    "REMAT_POLICIES",
    "DecoderLayer",
    "KVCache",
    "Params",
    "Transformer",
    "apply_rope",
    "cache_attention",
    "cast_params",
    "check_routing",
    "forward",
    "init_cache",
    "init_params",
    "logical_axes",
    "logits",
    "merge",
    "param_shapes",
    "remat_policy",
    "rms_norm",
    "rope_angles",
    "unembed",
    "unembedding",
]
