"""The decoder block (pre-norm attention + SwiGLU / GeGLU MLP or mixture of experts, with
Gemma's sandwich norms, soft caps and sliding windows, and gpt-oss's attention sinks and biased
experts), RMSNorm, and parameter creation.

Every parameter carries logical axis names (``nnx.Param`` ``out_sharding`` metadata) from
{batch, embed, mlp, heads, kv_heads, head_dim, vocab, layers, cache_seq, expert}.

Shapes: B batch, S sequence, D hidden, N query heads, K key/value heads, H head dim,
F MLP (or expert) width, L layers, E experts.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm.models import context_parallel
from jaxrl_llm.models.attention import (
    apply_rope,
    attention_mask,
    cache_attention,
    dot_product_attention,
    window_limit,
)
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.kv_cache import (
    LayerCache,
    layer_slice,
    paged_cache_attention,
    write_slots,
)
from jaxrl_llm.models.matmul import dense
from jaxrl_llm.models.moe import ClampedSwiGLU, ExpertBiases, SharedExpert, sparse_mlp
from jaxrl_llm.parallel.rules import ACTIVATION_RULES, PARAM_RULES, with_logical_constraint

Array = jax.Array

_INIT_STD = 0.02


def param(value: Array, axes: tuple[str | None, ...]) -> nnx.Param:
    """An ``nnx.Param`` holding ``value`` with one logical axis name per dimension."""
    # eager_sharding=False: logical names are not mesh axes; the parallel layer maps them.
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def constrain(x: Array, *axes: str | None) -> Array:
    """Pins an activation's sharding by logical axes (``ACTIVATION_RULES``; a no-op without a
    mesh in context). The residual stream is ``("batch", None, "embed")`` with ``embed``
    unsharded, so on an fsdp mesh the compiler gathers each layer's weights and keeps the
    activations batch-sharded (FSDP) instead of sharding the contracting width and all-reducing
    activations."""
    return with_logical_constraint(x, axes, ACTIVATION_RULES)


def gathered(w: Array, *axes: str | None) -> Array:
    """A weight in its stored layout (``PARAM_RULES``: fsdp shards ``embed``) moved to its
    use layout (``ACTIVATION_RULES``: gathered over fsdp, still tensor-split). No-op without
    a mesh in context.

    Pinning both ends makes the FSDP pattern explicit where the weight is used (per layer,
    inside the layer scan): an all-gather forward and, since the cotangent is pinned the same
    way in reverse, a reduce-scatter of its gradient backward, instead of a full all-reduce
    of every layer's gradient after the loop.
    """
    w = with_logical_constraint(w, axes, PARAM_RULES)
    return with_logical_constraint(w, axes, ACTIVATION_RULES)


# Logical axes of the decoder layer's parameters (its weights are created and used with these).
LAYER_AXES = {
    "attn_norm": ("embed",),
    "wq": ("embed", "heads", "head_dim"),
    "wk": ("embed", "kv_heads", "head_dim"),
    "wv": ("embed", "kv_heads", "head_dim"),
    "wo": ("heads", "head_dim", "embed"),
    "bq": ("heads", "head_dim"),
    "bk": ("kv_heads", "head_dim"),
    "bv": ("kv_heads", "head_dim"),
    "bo": ("embed",),
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
    # gpt-oss: each query head's attention-sink logit.
    "sinks": ("heads",),
    "mlp_norm": ("embed",),
    # Gemma 2 / 3: norms of the attention's and the MLP's outputs, before the residual adds.
    "post_attn_norm": ("embed",),
    "post_mlp_norm": ("embed",),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
    # Mixture-of-experts layers (``models.moe``) instead of w_gate / w_up / w_down.
    "router": ("embed", "expert"),
    "expert_w_gate": ("expert", "embed", "mlp"),
    "expert_w_up": ("expert", "embed", "mlp"),
    "expert_w_down": ("expert", "mlp", "embed"),
    # gpt-oss: the router's and the experts' biases.
    "router_bias": ("expert",),
    "expert_b_gate": ("expert", "mlp"),
    "expert_b_up": ("expert", "mlp"),
    "expert_b_down": ("expert", "embed"),
    "shared_w_gate": ("embed", "mlp"),
    "shared_w_up": ("embed", "mlp"),
    "shared_w_down": ("mlp", "embed"),
    "shared_expert_gate": ("embed", None),
}
# The parameters of a sparse layer's MLP, by config: routed experts, and Qwen2-MoE's shared one.
EXPERT_WEIGHTS = ("router", "expert_w_gate", "expert_w_up", "expert_w_down")
EXPERT_BIASES = ("router_bias", "expert_b_gate", "expert_b_up", "expert_b_down")
SHARED_EXPERT_WEIGHTS = ("shared_w_gate", "shared_w_up", "shared_w_down", "shared_expert_gate")

# LoRA: target name -> (weight, input axes it contracts); ``A`` takes the weight's input axes
# and an unsharded rank axis, ``B`` the rank axis and the weight's output axes.
LORA_WEIGHTS = {
    "q": ("wq", 1),
    "k": ("wk", 1),
    "v": ("wv", 1),
    "o": ("wo", 2),
    "gate": ("w_gate", 1),
    "up": ("w_up", 1),
    "down": ("w_down", 1),
}
_LORA_ORDER = tuple(weight for weight, _ in LORA_WEIGHTS.values())
for _weight, _contract in LORA_WEIGHTS.values():
    LAYER_AXES[f"{_weight}_lora_a"] = (*LAYER_AXES[_weight][:_contract], None)
    LAYER_AXES[f"{_weight}_lora_b"] = (None, *LAYER_AXES[_weight][_contract:])


def normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: Any) -> Array:
    """Initial weights ``w ~ N(0, 0.02^2)`` of ``shape``, drawn in f32 and cast to ``dtype``."""
    return (_INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def lora_init(
    key: Array, shape: tuple[int, ...], contract: int, rank: int, dtype: Any
) -> tuple[Array, Array]:
    """``(A, B)`` for a weight of ``shape`` contracting its first ``contract`` axes: ``A``
    uniform in ``±1/sqrt(fan_in)`` (PEFT's ``kaiming_uniform_(a=sqrt(5))``), ``B`` zeros."""
    fan_in = math.prod(shape[:contract])
    bound = 1.0 / math.sqrt(fan_in)
    a = jax.random.uniform(key, (*shape[:contract], rank), jnp.float32, -bound, bound)
    return a.astype(dtype), jnp.zeros((rank, *shape[contract:]), dtype)


def rms_norm(
    x: Array, scale: Array, eps: float, *, plus_one: bool = False, in_f32: bool = False
) -> Array:
    """``y = x / sqrt(mean(x^2) + eps) * scale`` (Zhang & Sennrich 2019), statistics in f32.

    Like transformers, the normalised value is cast back to ``x.dtype`` before the scale.
    ``plus_one`` (Gemma): ``y = x / sqrt(mean(x^2) + eps) * (1 + scale)``, all of it in f32 and
    only the product cast to ``x.dtype`` (transformers' ``GemmaRMSNorm``). ``in_f32``
    (gpt-oss): the product ``scale * normed`` in f32, cast once (``GptOssRMSNorm``).
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    if plus_one:
        return (normed * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
    if in_f32:
        return (normed * scale.astype(jnp.float32)).astype(x.dtype)
    return scale * normed.astype(x.dtype)


def norm_init(shape: tuple[int, ...], dtype: Any, config: ModelConfig) -> Array:
    """An RMSNorm scale that starts as the identity: ones, or zeros for Gemma's ``1 + w``."""
    return (jnp.zeros if config.is_gemma else jnp.ones)(shape, dtype)


def activation(x: Array, name: str) -> Array:
    """The gated MLP's activation: ``silu`` (SwiGLU) or ``gelu_pytorch_tanh`` (GeGLU: GELU's
    tanh approximation ``x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``)."""
    if name == "silu":
        return jax.nn.silu(x)
    if name == "gelu_pytorch_tanh":
        return jax.nn.gelu(x, approximate=True)
    raise ValueError(f"unknown activation {name!r}")


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x += Attn(RMSNorm(x)); x += W_down(silu(x W_gate) * x W_up)``.

    Llama architecture (Touvron et al. 2023) with grouped-query attention (Ainslie et al. 2023:
    K key/value heads shared by N/K query heads each), SwiGLU MLP (Shazeer 2020), optional
    q/k/v/o biases (Qwen2) and per-head q/k RMSNorm before RoPE (Qwen3). In a
    mixture-of-experts model (``config.is_moe``) the MLP is ``E`` routed SwiGLU experts, plus a
    sigmoid-gated shared expert for Qwen2-MoE (``models.moe``).

    Gemma (Gemma Team 2024): GeGLU (``config.hidden_act``), RMSNorms scaling by ``1 + w``;
    Gemma 2 and 3 also norm each sub-block's output before its residual add
    (``x += RMSNorm(Attn(RMSNorm(x)))``, the same around the MLP), scale the scores by
    ``query_pre_attn_scalar ** -0.5``, soft-cap them (``attn_logit_softcapping``), and let
    ``sliding_attention`` layers see only a window of ``sliding_window`` keys.

    gpt-oss (OpenAI 2025): q/k/v/o biases, a learned sink logit per query head in every
    softmax's denominator (``sinks``), sliding-window layers beside global ones, and a mixture
    of experts with a biased router and biased experts under a clamped SwiGLU
    (``models.moe.ClampedSwiGLU``).
    """

    def __init__(self, config: ModelConfig, *, dtype: Any, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        n, k, h = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.eps = config.rms_norm_eps
        self.scale = config.attention_scale
        self.plus_one = config.is_gemma
        self.norm_in_f32 = config.norm_in_f32
        self.act = config.hidden_act
        self.logit_softcap = config.attn_logit_softcapping
        self.sliding_window = config.sliding_window if any(config.sliding_layers) else None
        self.attn_norm = param(norm_init((d,), dtype, config), LAYER_AXES["attn_norm"])
        self.wq = param(normal(rngs, (d, n, h), dtype), LAYER_AXES["wq"])
        self.wk = param(normal(rngs, (d, k, h), dtype), LAYER_AXES["wk"])
        self.wv = param(normal(rngs, (d, k, h), dtype), LAYER_AXES["wv"])
        self.wo = param(normal(rngs, (n, h, d), dtype), LAYER_AXES["wo"])
        # Optional parameters are assigned once (a Param or None) so NNX's data/static status
        # of each attribute is fixed per config.
        bias, qk_norm = config.qkv_bias, config.qk_norm
        self.bq = param(jnp.zeros((n, h), dtype), LAYER_AXES["bq"]) if bias else None
        self.bk = param(jnp.zeros((k, h), dtype), LAYER_AXES["bk"]) if bias else None
        self.bv = param(jnp.zeros((k, h), dtype), LAYER_AXES["bv"]) if bias else None
        self.bo = param(jnp.zeros((d,), dtype), LAYER_AXES["bo"]) if config.o_bias else None
        self.q_norm = (
            param(norm_init((h,), dtype, config), LAYER_AXES["q_norm"]) if qk_norm else None
        )
        self.k_norm = (
            param(norm_init((h,), dtype, config), LAYER_AXES["k_norm"]) if qk_norm else None
        )
        self.sinks = (
            param(normal(rngs, (n,), dtype), LAYER_AXES["sinks"])
            if config.attention_sinks
            else None
        )
        self.mlp_norm = param(norm_init((d,), dtype, config), LAYER_AXES["mlp_norm"])
        sandwich = config.sandwich_norms
        for name in ("post_attn_norm", "post_mlp_norm"):
            value = param(norm_init((d,), dtype, config), LAYER_AXES[name]) if sandwich else None
            setattr(self, name, value)
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.clamp = None
        if config.swiglu_limit is not None:
            self.clamp = ClampedSwiGLU(alpha=config.swiglu_alpha, limit=config.swiglu_limit)
        # Dense: the SwiGLU MLP; sparse: router and experts (and Qwen2-MoE's shared expert, or
        # gpt-oss's biases).
        mlp_weights = ("w_gate", "w_up", "w_down", *EXPERT_WEIGHTS, *SHARED_EXPERT_WEIGHTS)
        shapes: dict[str, tuple[int, ...] | None] = dict.fromkeys(mlp_weights)
        biases: dict[str, tuple[int, ...] | None] = dict.fromkeys(EXPERT_BIASES)
        if not config.is_moe:
            shapes.update(w_gate=(d, f), w_up=(d, f), w_down=(f, d))
        else:
            e, fe = config.num_experts, config.moe_intermediate_size
            shapes.update(router=(d, e), expert_w_gate=(e, d, fe), expert_w_up=(e, d, fe))
            shapes["expert_w_down"] = (e, fe, d)
            fs = config.shared_expert_intermediate_size
            if fs:
                shapes.update(shared_w_gate=(d, fs), shared_w_up=(d, fs), shared_w_down=(fs, d))
                shapes["shared_expert_gate"] = (d, 1)
            if config.expert_biases:
                biases.update(router_bias=(e,), expert_b_gate=(e, fe), expert_b_up=(e, fe))
                biases["expert_b_down"] = (e, d)
        for name, shape in shapes.items():
            value = None if shape is None else param(normal(rngs, shape, dtype), LAYER_AXES[name])
            setattr(self, name, value)
        for name, shape in biases.items():  # zeros, as the attention's biases
            value = None if shape is None else param(jnp.zeros(shape, dtype), LAYER_AXES[name])
            setattr(self, name, value)
        lora = config.lora
        self.lora_scale = None if lora is None else lora.scale
        self.lora_dropout = 0.0 if lora is None else lora.dropout
        for target, (weight, contract) in LORA_WEIGHTS.items():
            a = b = None
            if lora is not None and target in lora.targets:
                shape = getattr(self, weight).shape
                a_init, b_init = lora_init(rngs.params(), shape, contract, lora.rank, dtype)
                a = param(a_init, LAYER_AXES[f"{weight}_lora_a"])
                b = param(b_init, LAYER_AXES[f"{weight}_lora_b"])
            setattr(self, f"{weight}_lora_a", a)
            setattr(self, f"{weight}_lora_b", b)

    def _use(self, name: str) -> Array:
        """Parameter ``name`` as used by the matmuls: gathered over fsdp (see ``gathered``)."""
        return gathered(getattr(self, name)[...], *LAYER_AXES[name])

    def _project(
        self,
        name: str,
        x: Array,
        contract: int = 1,
        *,
        flat: bool = False,
        key=None,
        seq: str | None = None,
    ) -> Array:
        """``x W`` for weight ``name``, plus its LoRA path ``scale · (dropout(x) A) B`` when
        adapted (dropout only with a ``key``: training).

        ``flat``: one ``[B, S, N*H] x [N*H, D]`` product (the decode path's output projection:
        with the 4-D einsum XLA:CPU transposes the weight on every decode step). ``seq``: the
        logical axis of the positions (``"sequence"`` under context parallelism).
        """
        w = self._use(name)
        if flat:
            out = x.reshape(*x.shape[:2], -1) @ w.reshape(-1, w.shape[-1])
        else:
            out = dense(x, w, contract)
        if getattr(self, f"{name}_lora_a") is None:
            return out
        a, b = self._use(f"{name}_lora_a"), self._use(f"{name}_lora_b")
        if self.lora_dropout and key is not None:
            key = jax.random.fold_in(key, _LORA_ORDER.index(name))
            keep = jax.random.bernoulli(key, 1.0 - self.lora_dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.lora_dropout), 0).astype(x.dtype)
        low = constrain(dense(x, a, contract), "batch", seq, None)
        return out + (self.lora_scale * dense(low, b)).astype(out.dtype)

    def __call__(
        self,
        x: Array,
        *,
        rope: tuple[Array, Array],
        query_slots: Array,
        key_valid: Array,
        cache: LayerCache | None = None,
        dropout_key: Array | None = None,
        local: Any = False,
        segment_ids: Array | None = None,
        routing: Array | None = None,
        context: bool = False,
    ) -> tuple[Array, tuple[Array, Array] | None, Array | None]:
        """One block on ``x: [B, S, D]``.

        Args:
          x: ``[B, S, D]`` residual stream.
          rope: ``(cos, sin)``, each ``[B, S, H/2]``: RoPE angles of the S tokens.
          query_slots: ``[S]`` or ``[B, S]`` int32 slot (column) of each query among the keys.
          key_valid: ``[B, S_kv]`` bool, True on keys holding real tokens.
          cache: the KV cache this call reads and writes (:class:`LayerCache`), or None.
          dropout_key: this layer's key for LoRA dropout (training), or None (no dropout).
          local: whether this is a sliding-window layer (``config.sliding_layers``): a Python
            bool, or a traced bool inside the layer scan.
          segment_ids: ``[B, S]`` int32 of packed rows (0 on padding; a query sees only its own
            segment), or None. Not with ``kv``.
          routing: ``[B, S, k]`` int expert ids to replay in a mixture-of-experts layer
            (``models.moe.replay_route``), or None: its own top-k.
          context: the positions are split over the ``sequence`` mesh axis
            (``models.context_parallel``; no ``kv``): ``query_slots`` is each position's
            ``[S]`` slot and attention gathers the keys and values over the axis.

        Returns:
          ``(x [B, S, D], kv, router_logits)`` with this call's keys/values written into
          ``cache.kv`` (None without a cache); ``router_logits`` is ``[B, S, E]`` f32 in a
          mixture-of-experts layer, else None.
        """
        if context and cache is not None:
            raise ValueError("context parallelism is for forwards without a KV cache")
        cos, sin = rope
        kv = None if cache is None else cache.kv
        seq = "sequence" if context else None
        x = constrain(x, "batch", seq, "embed")
        h = self._norm("attn_norm", x)
        q, k, v = (self._project(name, h, key=dropout_key, seq=seq) for name in ("wq", "wk", "wv"))
        if self.bq is not None:
            q, k, v = q + self._use("bq"), k + self._use("bk"), v + self._use("bv")
        q = constrain(q, "batch", seq, "heads", "head_dim")
        k = constrain(k, "batch", seq, "kv_heads", "head_dim")
        v = constrain(v, "batch", seq, "kv_heads", "head_dim")
        if self.q_norm is not None:
            q, k = self._norm("q_norm", q), self._norm("k_norm", k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        window = self.sliding_window if local is not False else None
        sinks = None if self.sinks is None else self._use("sinks")
        if context:
            attn = context_parallel.attention(
                q,
                k,
                v,
                key_valid=key_valid,
                slots=query_slots,
                segment_ids=segment_ids,
                scale=self.scale,
                logit_softcap=self.logit_softcap,
                sliding_window=window,
                window_active=local,
                sinks=sinks,
            )
        elif kv is None:
            # Fused per backend: the splash kernel on TPU and cuDNN on GPU (memory linear in S),
            # blocked causal einsums on CPU (see attention.dot_product_attention).
            attn = dot_product_attention(
                q,
                k,
                v,
                key_valid=key_valid,
                scale=self.scale,
                logit_softcap=self.logit_softcap,
                sliding_window=window,
                window_active=local,
                segment_ids=segment_ids,
                sinks=sinks,
            )
        else:
            if segment_ids is not None:
                raise ValueError("segment_ids (packed rows) cannot be used with a KV cache")
            # Built here from [S] and [B, S_kv] inputs, not passed in as [B, 1, S, S_kv], so XLA
            # can fuse it into the attention instead of keeping an O(S^2) mask alive.
            limit = window_limit(window, local, key_valid.shape[1])
            mask = attention_mask(key_valid, query_slots, window=limit)
            # Writing only this call's slots (not a whole layer slice) lets XLA update the
            # cache in place inside the sampler's while loop; attention then reads it back.
            layer_index, cache_index = cache.layer_index, cache.cache_index
            if cache.table is None:
                kv = tuple(
                    write_slots(c, new, layer_index, cache_index) for c, new in zip(kv, (k, v))
                )
                layer_kv = kv if layer_index is None else (layer_slice(c, layer_index) for c in kv)
                attn = cache_attention(
                    q,
                    *layer_kv,
                    mask,
                    scale=self.scale,
                    logit_softcap=self.logit_softcap,
                    sinks=sinks,
                )
            else:  # paged: written through the block table (a kernel on TPU, else a gather)
                kv, attn = paged_cache_attention(
                    kv,
                    (k, v),
                    q,
                    mask,
                    layer_index=layer_index,
                    cache_index=cache_index,
                    table=cache.table,
                    scale=self.scale,
                    key_valid=key_valid,
                    logit_softcap=self.logit_softcap,
                    windowed=limit is not None,
                    sinks=sinks,
                )
        attn = constrain(attn, "batch", seq, "heads", "head_dim")
        out = self._project("wo", attn, 2, flat=kv is not None, key=dropout_key, seq=seq)
        if self.bo is not None:
            out = out + self._use("bo")
        if self.post_attn_norm is not None:
            out = self._norm("post_attn_norm", out)
        x = constrain(x + out, "batch", seq, "embed")
        h = self._norm("mlp_norm", x)
        if self.router is not None:
            out, logits = self._experts(h, routing)
            return constrain(x + out, "batch", seq, "embed"), kv, logits
        gate = self._project("w_gate", h, key=dropout_key, seq=seq)
        gate = activation(constrain(gate, "batch", seq, "mlp"), self.act)
        up = constrain(self._project("w_up", h, key=dropout_key, seq=seq), "batch", seq, "mlp")
        out = self._project("w_down", gate * up, key=dropout_key, seq=seq)
        if self.post_mlp_norm is not None:
            out = self._norm("post_mlp_norm", out)
        return constrain(x + out, "batch", seq, "embed"), kv, None

    def _norm(self, name: str, x: Array) -> Array:
        """RMSNorm of ``x`` with the scale ``name`` (``1 + w`` for Gemma)."""
        return rms_norm(
            x, self._use(name), self.eps, plus_one=self.plus_one, in_f32=self.norm_in_f32
        )

    def _experts(self, h: Array, routing: Array | None = None) -> tuple[Array, Array]:
        """The sparse MLP (``models.moe.sparse_mlp``) on ``h: [B, S, D]``, replaying
        ``routing [B, S, k]`` when given: ``(out [B, S, D], router logits [B, S, E] f32)``."""
        shared = router_bias = biases = None
        if self.shared_w_gate is not None:
            shared = SharedExpert(*(self._use(name) for name in SHARED_EXPERT_WEIGHTS))
        if self.router_bias is not None:
            router_bias = self._use("router_bias")
            biases = ExpertBiases(*(self._use(name) for name in EXPERT_BIASES[1:]))
        return sparse_mlp(
            h,
            *(self._use(name) for name in EXPERT_WEIGHTS),
            top_k=self.top_k,
            normalize=self.norm_topk_prob,
            shared=shared,
            router_bias=router_bias,
            biases=biases,
            clamp=self.clamp,
            routing=routing,
        )
