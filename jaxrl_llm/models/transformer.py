"""Decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3) in Flax NNX.

The NNX ``Transformer`` holds its decoder layers stacked along a leading ``layers`` axis
(built with ``nnx.vmap``) and runs them with one ``jax.lax.scan``, so compile time does not
grow with depth. Jitted code works on a plain nested dict of arrays: ``init_params`` and
``load_pretrained`` return one, and ``forward`` merges it with a graphdef cached per config
inside the traced function, so optax, orbax and the sharding layer see an ordinary pytree.

``forward`` also takes the layers and the KV cache split into per-layer arrays (see
``jaxrl_llm.sampling.layout``) and then runs the layers as an unrolled loop: the sampler does so
on CPU, where XLA copies a layer's slice out of a stacked array before every matmul reading it.

Every parameter carries logical axis names (``nnx.Param`` ``out_sharding`` metadata) from
{batch, embed, mlp, heads, kv_heads, head_dim, vocab, layers, cache_seq};
``logical_axes(config)`` reads them back as a pytree matching the params.

Shapes: B batch, S sequence, D hidden, N query heads, K key/value heads, H head dim,
F MLP width, V vocabulary, L layers.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm._checks import check_choice, check_rank
from jaxrl_llm.models.config import ModelConfig, rope_inv_freq

Array = jax.Array
Params = dict[str, Any]

REMAT_POLICIES = ("none", "layer")
_INIT_STD = 0.02


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


CACHE_AXES = KVCache(
    k=("layers", "batch", "kv_heads", "cache_seq", "head_dim"),
    v=("layers", "batch", "kv_heads", "cache_seq", "head_dim"),
    mask=("batch", "cache_seq"),
)


def _param(value: Array, axes: tuple[str | None, ...]) -> nnx.Param:
    # eager_sharding=False: logical names are not mesh axes; the parallel layer maps them.
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: Any) -> Array:
    return (_INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def rms_norm(x: Array, scale: Array, eps: float) -> Array:
    """``y = x / sqrt(mean(x^2) + eps) * scale`` (Zhang & Sennrich 2019), statistics in f32.

    Like transformers, the normalised value is cast back to ``x.dtype`` before the scale.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return scale * normed.astype(x.dtype)


def rope_angles(config: ModelConfig, positions: Array) -> tuple[Array, Array]:
    """``cos, sin`` of ``positions * inv_freq``: ``[B, S]`` int -> two ``[B, S, H/2]`` f32."""
    inv_freq = jnp.asarray(rope_inv_freq(config))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


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


def cache_attention(q: Array, k: Array, v: Array, mask: Array, *, scale: float) -> Array:
    """``o_i = sum_j softmax_j(scale * q_i . k_j) v_j`` over the cached slots ``j`` in ``mask``.

    Scaled dot-product attention (Vaswani et al. 2017) over a head-major cache; query head ``n``
    reads key/value head ``n // (N / K)`` (grouped-query attention, Ainslie et al. 2023). Both
    products are batched over (row, kv-head) with the cache as the right operand in its stored
    layout, so XLA reads it in place.

    Args:
      q: ``[B, S, N, H]`` queries (after RoPE).
      k, v: ``[B, K, S_kv, H]`` cached keys (after RoPE) and values.
      mask: ``[B, 1, S, S_kv]`` bool; every query must see at least one slot.
      scale: score multiplier, usually ``H ** -0.5``.

    Returns:
      ``[B, S, N, H]`` in ``q.dtype``.
    """
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)
    # Products in the cache's dtype (XLA:CPU has no bf16 x bf16 -> f32 batched matmul), as
    # jax.nn.dot_product_attention does; the softmax in f32.
    scores = jnp.einsum("bqkgh,bksh->bkgqs", grouped.astype(k.dtype), k).astype(jnp.float32)
    scores = jnp.where(mask[:, :, None], scores * scale, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgqs,bksh->bqkgh", probs.astype(v.dtype), v)
    return out.reshape(batch, seq, heads, head_dim).astype(q.dtype)


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x += Attn(RMSNorm(x)); x += W_down(silu(x W_gate) * x W_up)``.

    Llama architecture (Touvron et al. 2023) with grouped-query attention (Ainslie et al. 2023:
    K key/value heads shared by N/K query heads each), SwiGLU MLP (Shazeer 2020), optional
    q/k/v/o biases (Qwen2) and per-head q/k RMSNorm before RoPE (Qwen3).
    """

    def __init__(self, config: ModelConfig, *, dtype: Any, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        n, k, h = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.eps = config.rms_norm_eps
        self.scale = h**-0.5
        self.attn_norm = _param(jnp.ones((d,), dtype), ("embed",))
        self.wq = _param(_normal(rngs, (d, n, h), dtype), ("embed", "heads", "head_dim"))
        self.wk = _param(_normal(rngs, (d, k, h), dtype), ("embed", "kv_heads", "head_dim"))
        self.wv = _param(_normal(rngs, (d, k, h), dtype), ("embed", "kv_heads", "head_dim"))
        self.wo = _param(_normal(rngs, (n, h, d), dtype), ("heads", "head_dim", "embed"))
        # Optional parameters are assigned once (a Param or None) so NNX's data/static status
        # of each attribute is fixed per config.
        bias, qk_norm = config.qkv_bias, config.qk_norm
        self.bq = _param(jnp.zeros((n, h), dtype), ("heads", "head_dim")) if bias else None
        self.bk = _param(jnp.zeros((k, h), dtype), ("kv_heads", "head_dim")) if bias else None
        self.bv = _param(jnp.zeros((k, h), dtype), ("kv_heads", "head_dim")) if bias else None
        self.bo = _param(jnp.zeros((d,), dtype), ("embed",)) if config.o_bias else None
        self.q_norm = _param(jnp.ones((h,), dtype), ("head_dim",)) if qk_norm else None
        self.k_norm = _param(jnp.ones((h,), dtype), ("head_dim",)) if qk_norm else None
        self.mlp_norm = _param(jnp.ones((d,), dtype), ("embed",))
        self.w_gate = _param(_normal(rngs, (d, f), dtype), ("embed", "mlp"))
        self.w_up = _param(_normal(rngs, (d, f), dtype), ("embed", "mlp"))
        self.w_down = _param(_normal(rngs, (f, d), dtype), ("mlp", "embed"))

    def __call__(
        self,
        x: Array,
        *,
        cos: Array,
        sin: Array,
        query_slots: Array,
        key_valid: Array,
        kv: tuple[Array, Array] | None = None,
        layer_index: Array | None = None,
        cache_index: Array | None = None,
    ) -> tuple[Array, tuple[Array, Array] | None]:
        """One block on ``x: [B, S, D]``.

        Args:
          x: ``[B, S, D]`` residual stream.
          cos, sin: ``[B, S, H/2]`` RoPE angles of the S tokens.
          query_slots: ``[S]`` int32 slot (column) of each query among the keys.
          key_valid: ``[B, S_kv]`` bool, True on keys holding real tokens.
          kv: the caches ``(k, v)``: stacked ``[L, B, K, S_max, H]`` (with ``layer_index``),
            this layer's own ``[B, K, S_max, H]`` (``layer_index=None``), or None.
          layer_index: this layer's index into stacked caches (int32, may be traced).
          cache_index: first cache slot written by this call (traced int32).

        Returns:
          ``(x [B, S, D], kv)`` with this call's keys/values written into ``kv``.
        """
        h = rms_norm(x, self.attn_norm[...], self.eps)
        q = jnp.einsum("bsd,dnh->bsnh", h, self.wq[...])
        k = jnp.einsum("bsd,dkh->bskh", h, self.wk[...])
        v = jnp.einsum("bsd,dkh->bskh", h, self.wv[...])
        if self.bq is not None:
            q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm[...], self.eps)
            k = rms_norm(k, self.k_norm[...], self.eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Built here from [S] and [B, S_kv] inputs, not passed in as [B, 1, S, S_kv], so XLA
        # can fuse it into the attention instead of keeping an O(S^2) mask alive over the scan.
        mask = _attention_mask(key_valid, query_slots)
        if kv is None:
            attn = jax.nn.dot_product_attention(
                q, k, v, mask=mask, scale=self.scale, implementation=None
            )
        else:
            # Writing only this call's slots (not a whole layer slice) lets XLA update the
            # cache in place inside the sampler's while loop; attention then reads it back.
            kv = tuple(_write_slots(c, new, layer_index, cache_index) for c, new in zip(kv, (k, v)))
            layer_kv = kv if layer_index is None else (_layer(c, layer_index) for c in kv)
            attn = cache_attention(q, *layer_kv, mask, scale=self.scale)
        if kv is None:
            out = jnp.einsum("bsnh,nhd->bsd", attn, self.wo[...])
        else:
            # One [B, S, N*H] x [N*H, D] product: with the 4-D einsum XLA:CPU transposes the
            # weight to match the attention output's layout on every decode step.
            wo = self.wo[...]
            out = attn.reshape(*attn.shape[:2], -1) @ wo.reshape(-1, wo.shape[-1])
        if self.bo is not None:
            out = out + self.bo[...]
        x = x + out
        h = rms_norm(x, self.mlp_norm[...], self.eps)
        gate = jax.nn.silu(h @ self.w_gate[...])
        x = x + (gate * (h @ self.w_up[...])) @ self.w_down[...]
        return x, kv


def _write_slots(cache: Array, new: Array, layer_index: Any, cache_index: Array) -> Array:
    """Writes ``new: [B, S, K, H]`` at slots ``[cache_index, cache_index + S)`` of a cache."""
    new = new.swapaxes(1, 2).astype(cache.dtype)  # head-major [B, K, S, H]
    if layer_index is None:
        return jax.lax.dynamic_update_slice(cache, new, (0, 0, cache_index, 0))
    return jax.lax.dynamic_update_slice(cache, new[None], (layer_index, 0, 0, cache_index, 0))


def _layer(stacked: Array, index: Any) -> Array:
    return jax.lax.dynamic_index_in_dim(stacked, index, 0, keepdims=False)


class Transformer(nnx.Module):
    """Embedding, ``L`` stacked decoder layers scanned with ``lax.scan``, final RMSNorm.

    ``__call__`` returns the final-norm hidden states; ``unembed`` maps them to logits.
    Params (``nnx.to_pure_dict``): ``embed [V, D]``, ``layers/*`` stacked ``[L, ...]``,
    ``final_norm [D]``, and ``lm_head [D, V]`` unless embeddings are tied.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32):
        self.config = config
        v, d = config.vocab_size, config.hidden_size
        self.embed = _param(_normal(rngs, (v, d), dtype), ("vocab", "embed"))

        @nnx.split_rngs(splits=config.num_hidden_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(config, dtype=dtype, rngs=rngs)

        self.layers = make_layers(rngs)
        self.final_norm = _param(jnp.ones((d,), dtype), ("embed",))
        tied = config.tie_word_embeddings
        self.lm_head = None if tied else _param(_normal(rngs, (d, v), dtype), ("embed", "vocab"))

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
    ) -> tuple[Array, KVCache | None]:
        """See ``forward``; ``unstacked_layers`` holds the layers' values (``unstack_layers``)."""
        config = self.config
        check_choice("remat", remat, REMAT_POLICIES)
        check_rank("tokens", tokens, 2)
        batch, seq = tokens.shape
        attention_mask = _check_optional("attention_mask", attention_mask, tokens.shape)
        positions = _check_optional("positions", positions, tokens.shape)
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
            _check_cache(config, cache, tokens.shape, cache_index)
            cache_index = jnp.asarray(cache_index, jnp.int32)
            key_valid = jax.lax.dynamic_update_slice(cache.mask, attention_mask, (0, cache_index))
            query_slots = cache_index + jnp.arange(seq)
            before = jnp.arange(cache.mask.shape[1]) < cache_index
            offset = jnp.sum(cache.mask & before, axis=1, keepdims=True, dtype=jnp.int32)
            kv = (cache.k, cache.v)
        if positions is None:
            counts = jnp.cumsum(attention_mask.astype(jnp.int32), axis=1)
            positions = jnp.maximum(offset + counts - 1, 0)
        cos, sin = rope_angles(config, positions)

        x = self.embed[...][tokens]
        layer_def, layer_state = nnx.split(self.layers)

        def body(carry, xs):
            x, kv = carry
            state, layer_index = xs
            layer = nnx.merge(layer_def, state)
            x, kv = layer(
                x,
                cos=cos,
                sin=sin,
                query_slots=query_slots,
                key_valid=key_valid,
                kv=kv,
                layer_index=layer_index,
                cache_index=cache_index,
            )
            return (x, kv), None

        if remat == "layer":
            body = jax.checkpoint(body, prevent_cse=False)
        if unstacked_layers is None:
            layer_ids = jnp.arange(config.num_hidden_layers, dtype=jnp.int32)
            (x, kv), _ = jax.lax.scan(body, (x, kv), (layer_state, layer_ids))
        else:  # per-layer weights and cache arrays: unrolled, each layer reads its own
            written = []
            for i, state in enumerate(unstacked_layers):
                layer_kv = None if kv is None else (kv[0][i], kv[1][i])
                (x, layer_kv), _ = body((x, layer_kv), (state, None))
                written.append(layer_kv)
            kv = None if kv is None else tuple(zip(*written))
        hidden = rms_norm(x, self.final_norm[...], config.rms_norm_eps)
        new_cache = None if cache is None else KVCache(k=kv[0], v=kv[1], mask=key_valid)
        return hidden, new_cache


def _attention_mask(key_valid: Array, query_slots: Array) -> Array:
    """``[B, 1, S, S_kv]``: key slot j visible to query slot i iff j <= i and j is real.

    A query always sees its own slot, so pad queries get a finite (ignored) output instead of
    attending to nothing; for real queries this changes nothing since their own slot is real.
    """
    key_slots = jnp.arange(key_valid.shape[1])
    causal = key_slots[None, :] <= query_slots[:, None]
    own = key_slots[None, :] == query_slots[:, None]
    mask = (causal[None] & key_valid[:, None, :]) | own[None]
    return mask[:, None]


def _check_optional(name: str, x: Array | None, shape: tuple[int, ...]) -> Array | None:
    if x is not None and tuple(jnp.shape(x)) != tuple(shape):
        raise ValueError(f"{name} must have the tokens' shape {tuple(shape)}, got {jnp.shape(x)}")
    return x


def _check_cache(
    config: ModelConfig, cache: KVCache, token_shape: tuple[int, ...], cache_index: Any
) -> None:
    if cache_index is None:
        raise ValueError("a cache needs cache_index (the first slot this call writes)")
    if jnp.ndim(cache_index) != 0:
        raise ValueError(f"cache_index must be a scalar, got shape {jnp.shape(cache_index)}")
    batch, seq = token_shape
    layers, kv_heads, head_dim = (
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
    )
    max_len = cache.mask.shape[-1] if jnp.ndim(cache.mask) == 2 else -1
    want = (layers, batch, kv_heads, max_len, head_dim)
    got_k, got_v = _cache_shape(cache.k), _cache_shape(cache.v)
    if got_k != want or got_v != want:
        raise ValueError(
            f"cache k/v must have shape [L, B, K, S_max, H]={want} for tokens {token_shape}, "
            f"got k{got_k} v{got_v} mask{tuple(cache.mask.shape)}"
        )
    if seq > max_len:
        raise ValueError(f"{seq} tokens do not fit a cache of {max_len} slots")


def _cache_shape(x: Any) -> tuple[Any, ...]:
    """``[L, B, K, S, H]`` of a stacked cache array or of a tuple of ``L`` per-layer arrays."""
    if not isinstance(x, tuple):
        return tuple(jnp.shape(x))
    shapes = {tuple(jnp.shape(a)) for a in x}
    return (len(x), *shapes.pop()) if len(shapes) == 1 else (len(x), *sorted(shapes))


@functools.lru_cache(maxsize=64)
def _abstract(config: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """Graphdef and abstract (shape-only) state of the model, cached per config."""
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
) -> tuple[Array, KVCache | None]:
    """Hidden states after the final norm, optionally reading and writing a KV cache.

    ``h = RMSNorm(Block_L(... Block_1(E[tokens])))`` with RoPE at ``positions``
    (default ``cumsum(attention_mask) - 1`` clipped at 0, plus the number of real cache slots
    before ``cache_index`` when a cache is given), so left padding does not shift positions.

    Without a cache each query attends causally to real keys of this call. With a cache of
    ``S_max`` slots, this call's keys/values go to slots ``[cache_index, cache_index + S)``,
    ``cache.mask`` there becomes ``attention_mask``, and the query at slot ``cache_index + s``
    attends to slots ``j <= cache_index + s`` whose mask is True. Prefill = the left-padded
    prompt at ``cache_index=0``; decode = ``S=1`` calls with explicit positions.

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
      cache_index: scalar int32 (may be traced); required with a cache.
      remat: ``"none"`` or ``"layer"`` (``jax.checkpoint`` each scanned layer).

    Returns:
      ``(hidden [B, S, D] in the params' dtype, new cache or None)``.
    """
    unstacked = None
    if isinstance(params.get("layers"), tuple):
        unstacked = _check_unstacked(params["layers"], config)
        params = {**params, "layers": param_shapes(config)["layers"]}  # structure only
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


def unembed(params: Params, config: ModelConfig, hidden: Array) -> Array:
    """``logits = h W_U`` in f32 (``W_U = E^T`` when tied): ``[..., D] -> [..., V]``."""
    if config.tie_word_embeddings:
        return jnp.einsum(
            "...d,vd->...v", hidden, params["embed"], preferred_element_type=jnp.float32
        )
    return jnp.einsum(
        "...d,dv->...v", hidden, params["lm_head"], preferred_element_type=jnp.float32
    )


def logits(
    params: Params, config: ModelConfig, tokens: Array, *, attention_mask: Array | None = None
) -> Array:
    """Next-token logits ``[B, S, V]`` in f32 (materialises all of them; see ``logprobs``)."""
    hidden, _ = forward(params, config, tokens, attention_mask=attention_mask)
    return unembed(params, config, hidden)
