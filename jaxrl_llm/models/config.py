"""Model configuration read from (and written to) a Hugging Face ``config.json``.

Supported: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` and
``Qwen3ForCausalLM`` with grouped-query attention, ``head_dim`` overrides, RoPE (``default``,
``linear``, ``llama3`` and ``yarn`` scalings, written the transformers-4 way with ``rope_theta`` /
``rope_scaling`` or the transformers-5 way with ``rope_parameters``), attention biases, Qwen3
q/k norms and tied embeddings; their mixture-of-experts siblings ``Qwen3MoeForCausalLM``,
``Qwen2MoeForCausalLM`` (with its shared expert) and ``MixtralForCausalLM`` when every layer is
sparse (``models.moe``); and the Gemma family: ``GemmaForCausalLM``, ``Gemma2ForCausalLM`` and
``Gemma3ForCausalLM`` (``gemma3_text``), with their GeGLU MLP, ``(1 + w)`` RMSNorms, embeddings
scaled by ``sqrt(D)``, sandwich norms (2, 3), ``query_pre_attn_scalar``, attention and final
logit soft-capping, sliding-window layers beside global ones (``layer_types``) and, for
Gemma 3, a RoPE base of their own on the sliding layers (``rope_local_base_freq``); and
``GptOssForCausalLM`` (gpt-oss): a mixture of experts with biased q/k/v/o projections, a learned
attention sink per head, sliding-window layers beside global ones, a biased router whose
softmax runs over the top-k logits, biased experts with a clamped SwiGLU, YaRN RoPE, and MXFP4
expert weights that the loader dequantises (``models.mxfp4``). The multimodal
``Gemma3ForConditionalGeneration`` (Gemma 3 4B / 12B / 27B) parses as its language model
(``language_model_dict``), for text-only training and sampling. Everything else that would
change the computation (sliding windows outside Gemma and gpt-oss, dense and sparse layers
mixed, other RoPE types, other activations, bidirectional attention, quantised weights other
than gpt-oss's MXFP4 experts) is refused with a ``ValueError`` rather than silently run as
something else: the keys and values each model type refuses are one table, ``ALLOWANCES``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "GptOssForCausalLM": "gpt_oss",
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
COMPUTE_DTYPES = ("float32", "bfloat16")
# MLP activations: SiLU (SwiGLU: Llama, Qwen, Mistral) and GELU with the tanh approximation
# (GeGLU: Gemma; transformers' ``gelu_pytorch_tanh``).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Attention layer kinds (transformers' ``layer_types``).
LAYER_TYPES = ("full_attention", "sliding_attention")
GEMMA_MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")
# Gemma 2 and 3: post-attention and post-feedforward norms beside the pre-norms.
_SANDWICH_MODEL_TYPES = ("gemma2", "gemma3_text")

_MODEL_TYPES = {v: k for k, v in ARCHITECTURES.items()}
# Vision-language wrappers whose language model loads (and trains) alone: architecture -> the
# text model's architecture (``language_model_dict``; the checkpoint side: ``models.checkpoint``).
MULTIMODAL_ARCHITECTURES = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
_MULTIMODAL_MODEL_TYPES = {"gemma3": "Gemma3ForConditionalGeneration"}
# transformers' ``Gemma3TextConfig`` defaults for the keys a released Gemma 3 ``text_config``
# leaves out (the others have their defaults where they are read).
_GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
# Keys whose presence (with a truthy value) means a mixture-of-experts model.
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
# Mixture-of-experts model type -> the dense family whose attention it shares.
# gpt-oss has no dense sibling: its own family.
_DENSE_FAMILY = {
    "qwen2_moe": "qwen2",
    "qwen3_moe": "qwen3",
    "mixtral": "mistral",
    "gpt_oss": "gpt_oss",
}
MOE_MODEL_TYPES = tuple(_DENSE_FAMILY)


# LoRA targets by projection name (as PEFT's ``target_modules`` for these architectures).
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Low-rank adapters on the decoder layers' projections (Hu et al. 2021, LoRA).

    Each targeted weight ``W`` computes ``x W + s · (dropout(x) A) B`` with ``A: [in, rank]``
    (PEFT's default init: uniform ``±1/sqrt(in)``) and ``B: [rank, out]`` (zeros, so a fresh
    adapter leaves the model unchanged); ``s = alpha / rank``, or ``alpha / sqrt(rank)`` with
    ``rslora`` (rank-stabilised LoRA, Kalajdzievski 2023: the update's scale stays put as the
    rank grows; PEFT's ``use_rslora``).

    Attributes:
      rank: r, the adapters' inner width.
      alpha: the scale numerator (scale = alpha / rank, PEFT's ``lora_alpha``).
      targets: projection names from ``LORA_TARGETS`` (q, k, v, o, gate, up, down), kept in
        that order.
      dropout: dropout probability on the adapter path's input while training.
      rslora: scale by ``alpha / sqrt(rank)`` instead of ``alpha / rank``.
    """

    rank: int
    alpha: float
    targets: tuple[str, ...] = LORA_TARGETS
    dropout: float = 0.0
    rslora: bool = False

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"lora rank must be a positive int, got {self.rank!r}")
        if (
            isinstance(self.alpha, bool)
            or not isinstance(self.alpha, (int, float))
            or not (self.alpha > 0)
        ):
            raise ValueError(f"lora alpha must be a number > 0, got {self.alpha!r}")
        if not isinstance(self.targets, tuple) or not self.targets:
            raise ValueError(f"lora targets must be a non-empty tuple, got {self.targets!r}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or len(set(self.targets)) != len(self.targets):
            raise ValueError(
                f"lora targets must be distinct names from {LORA_TARGETS}, got {self.targets!r}"
            )
        if isinstance(self.dropout, bool) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.rslora, bool):
            raise ValueError(f"lora rslora must be true or false, got {self.rslora!r}")
        # One canonical order, so equal adapters compare (and hash, as a jit static) equal.
        object.__setattr__(self, "targets", tuple(t for t in LORA_TARGETS if t in self.targets))

    @property
    def scale(self) -> float:
        """``alpha / rank``, or ``alpha / sqrt(rank)`` with ``rslora``."""
        return float(self.alpha) / (math.sqrt(self.rank) if self.rslora else self.rank)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static description of a decoder-only transformer (hashable: usable as a jit static).

    Field names follow transformers so code written against HF configs reads naturally.

    Attributes:
      architecture: one of ``ARCHITECTURES`` (e.g. ``"Qwen3ForCausalLM"``).
      vocab_size: V.
      hidden_size: D, the residual width.
      intermediate_size: F, the MLP width.
      num_hidden_layers: L.
      num_attention_heads: N query heads.
      num_key_value_heads: K key/value heads (GQA); must divide N.
      head_dim: H (may differ from D / N, e.g. Qwen3).
      max_position_embeddings: longest context the checkpoint was configured for.
      rms_norm_eps: epsilon of every RMSNorm.
      rope_theta: RoPE base.
      rope_type: ``"default" | "linear" | "llama3" | "yarn"``.
      rope_factor: frequency divisor (``linear``, ``llama3``, ``yarn``).
      rope_low_freq_factor: ``llama3`` only.
      rope_high_freq_factor: ``llama3`` only.
      rope_original_max_position_embeddings: ``llama3`` and ``yarn`` (pre-training context
        length).
      rope_beta_fast: ``yarn``: rotations at which the extrapolated band ends (default 32).
      rope_beta_slow: ``yarn``: rotations at which the interpolated band starts (default 1).
      rope_truncate: ``yarn``: round the band's edges to whole dimensions (transformers'
        ``truncate``, default True).
      rope_attention_factor: ``yarn``: the factor ``cos`` and ``sin`` are multiplied by, or
        None for YaRN's ``0.1 ln(factor) + 1`` (``rope_attention_scaling``).
      qkv_bias: q/k/v projections carry a bias (Qwen2; Llama/Qwen3 ``attention_bias``).
      o_bias: the output projection carries a bias (Llama/Qwen3 ``attention_bias``).
      qk_norm: per-head RMSNorm on queries and keys before RoPE (Qwen3).
      tie_word_embeddings: the unembedding is the transposed input embedding.
      bos_token_id: beginning-of-sequence id or None.
      eos_token_ids: end-of-sequence ids (a tuple: several are allowed).
      pad_token_id: padding id or None.
      compute_dtype: dtype of the matmuls and activations (``"bfloat16"``, ``"float32"``),
        or None to compute in the parameters' own dtype. The model casts its
        floating parameters to it at the start of each forward, so f32 master weights train
        through bf16 compute (the gradient of the cast is the cast back to f32); log-softmax,
        log-probs, norms' statistics and losses stay f32. Not part of the HF ``config.json``.
      lora: low-rank adapters on the layers' projections (``LoraSpec``), or None. The params
        then hold ``layers/<weight>_lora_a`` / ``_lora_b`` beside the base weights
        (``models.lora``). Not part of the HF ``config.json``. On a mixture-of-experts model
        only the attention projections (q, k, v, o) can be adapted.
      num_experts: E routed experts per layer (every layer sparse); 0 = a dense model.
      num_experts_per_tok: k, the experts each token is sent to (top-k routing).
      moe_intermediate_size: F_e, each expert's SwiGLU width (Mixtral: its
        ``intermediate_size``). ``intermediate_size`` stays the (unused) dense width of the
        Qwen MoE configs, written back as read.
      norm_topk_prob: renormalise the top-k router probabilities to sum to 1 (always on for
        Mixtral, where it is the softmax over the top-k logits).
      shared_expert_intermediate_size: width of the always-on shared expert (Qwen2-MoE), 0 for
        none.
      router_aux_loss_coef: the HF weight of the load-balancing loss; the model only carries
        it for its caller (``models.moe.load_balancing_loss``) and back to ``config.json``.
      hidden_act: the gated MLP's activation, ``"silu"`` (SwiGLU) or ``"gelu_pytorch_tanh"``
        (GeGLU with the tanh approximation of GELU; Gemma).
      query_pre_attn_scalar: the attention scale is ``query_pre_attn_scalar ** -0.5`` (Gemma 2,
        3), or ``head_dim ** -0.5`` when None.
      attn_logit_softcapping: ``c`` of the attention scores' soft cap ``c tanh(s / c)``, applied
        after the scale and before the mask (Gemma 2), or None.
      final_logit_softcapping: ``c`` of the logits' soft cap ``c tanh(z / c)`` (Gemma 2), or
        None.
      sliding_window: ``W``: a sliding-window layer's query at slot ``i`` sees the keys at
        slots ``j`` with ``i - W < j <= i`` (transformers' rule); None when no layer slides.
      layer_types: one of ``LAYER_TYPES`` per layer (``"sliding_attention"`` layers use
        ``sliding_window``), or None: every layer global.
      rope_local_theta: RoPE base of the sliding-window layers (Gemma 3's
        ``rope_local_base_freq``; no scaling there), or None: every layer uses ``rope_theta``
        and the configured scaling (which Gemma 3 applies to its global layers only).
      swiglu_limit: gpt-oss's expert clamp ``l`` (``swiglu_limit``), None elsewhere: the gate
        is clamped to ``<= l`` and the up projection to ``[-l, l]``.
      swiglu_alpha: gpt-oss's expert sigmoid gain ``a`` (``swiglu_alpha``, 1.702), None
        elsewhere: ``(up + 1) · gate · sigmoid(a · gate)``.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int | None = None
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_attention_factor: float | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    compute_dtype: str | None = None
    lora: LoraSpec | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.0
    hidden_act: str = "silu"
    query_pre_attn_scalar: int | float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None

    def __post_init__(self):
        if self.lora is not None and not isinstance(self.lora, LoraSpec):
            raise ValueError(f"lora must be a LoraSpec or None, got {self.lora!r}")
        if self.compute_dtype is not None and self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"compute_dtype must be None or one of {COMPUTE_DTYPES}, got {self.compute_dtype!r}"
            )
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"expected one of {tuple(ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unknown rope type {self.rope_type!r}; expected one of {ROPE_TYPES}")
        if not self.rope_theta > 0 or not self.rope_factor > 0 or not self.rms_norm_eps > 0:
            raise ValueError(
                f"rope_theta, rope factor and rms_norm_eps must be > 0, got {self.rope_theta}, "
                f"{self.rope_factor}, {self.rms_norm_eps}"
            )
        self._check_experts()
        self._check_gemma()
        self._check_gpt_oss()
        if self.rope_type == "llama3":
            if self.rope_original_max_position_embeddings is None:
                raise ValueError("llama3 rope needs original_max_position_embeddings")
            if not self.rope_high_freq_factor > self.rope_low_freq_factor > 0:
                raise ValueError(
                    "llama3 rope needs high_freq_factor > low_freq_factor > 0, got "
                    f"{self.rope_high_freq_factor} and {self.rope_low_freq_factor}"
                )
        self._check_yarn()

    def _check_yarn(self) -> None:
        yarn_fields = {
            "rope_beta_fast": self.rope_beta_fast != 32.0,
            "rope_beta_slow": self.rope_beta_slow != 1.0,
            "rope_truncate": self.rope_truncate is not True,
            "rope_attention_factor": self.rope_attention_factor is not None,
        }
        if self.rope_type != "yarn":
            set_fields = [name for name, on in yarn_fields.items() if on]
            if set_fields:
                raise ValueError(
                    f"{set_fields} are yarn RoPE fields, but rope_type is {self.rope_type!r}"
                )
            return
        if self.rope_original_max_position_embeddings is None:
            raise ValueError("yarn rope needs original_max_position_embeddings")
        for name in ("rope_beta_fast", "rope_beta_slow"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if not isinstance(self.rope_truncate, bool):
            raise ValueError(f"rope_truncate must be true or false, got {self.rope_truncate!r}")
        factor = self.rope_attention_factor
        if factor is not None and (
            isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0
        ):
            raise ValueError(f"rope_attention_factor must be None or a number > 0, got {factor!r}")

    def _check_gpt_oss(self) -> None:
        gpt_oss = self.model_type == "gpt_oss"
        for name in ("swiglu_limit", "swiglu_alpha"):
            value = getattr(self, name)
            if (value is None) == gpt_oss:
                raise ValueError(
                    f"{name} must be set exactly for GptOssForCausalLM, got {value!r} for "
                    f"{self.architecture}"
                )
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
            ):
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if gpt_oss and self.qk_norm:
            raise ValueError("GptOssForCausalLM has no q/k norms: qk_norm must be False")
        if gpt_oss and self.qkv_bias != self.o_bias:
            raise ValueError(
                "GptOssForCausalLM biases all of q/k/v/o or none (attention_bias): qkv_bias and "
                f"o_bias must agree, got {self.qkv_bias} and {self.o_bias}"
            )

    def _check_experts(self) -> None:
        counts = (
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
        )
        for name in counts:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.model_type not in MOE_MODEL_TYPES:
            set_fields = [name for name in counts if getattr(self, name)]
            if set_fields:
                raise ValueError(f"{self.architecture} is dense; {set_fields} must be 0")
            return
        if self.num_experts < 1 or self.moe_intermediate_size < 1:
            raise ValueError(
                f"{self.architecture} needs num_experts >= 1 and moe_intermediate_size >= 1, "
                f"got {self.num_experts} and {self.moe_intermediate_size}"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got "
                f"{self.num_experts_per_tok}"
            )
        renormalised = ("mixtral", "gpt_oss")  # the softmax over the top-k logits
        if self.model_type in renormalised and not self.norm_topk_prob:
            raise ValueError(
                f"{self.architecture} always renormalises its top-k: norm_topk_prob must be True"
            )
        if self.model_type in renormalised and self.moe_intermediate_size != self.intermediate_size:
            raise ValueError(
                f"{self.architecture}'s experts are intermediate_size wide: "
                "moe_intermediate_size must equal it, got "
                f"{self.moe_intermediate_size} and {self.intermediate_size}"
            )
        if (self.model_type == "qwen2_moe") != (self.shared_expert_intermediate_size > 0):
            raise ValueError(
                "shared_expert_intermediate_size must be > 0 exactly for Qwen2-MoE, got "
                f"{self.shared_expert_intermediate_size} for {self.architecture}"
            )
        if not self.router_aux_loss_coef >= 0:
            raise ValueError(f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")
        if self.lora is not None:
            on_experts = [t for t in self.lora.targets if t in ("gate", "up", "down")]
            if on_experts:
                raise ValueError(
                    f"LoRA targets {on_experts} would adapt the expert weights of "
                    f"{self.architecture}, which is not supported: use targets from (q, k, v, o)"
                )

    def _check_gemma(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")
        for name in (
            "query_pre_attn_scalar",
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "rope_local_theta",
        ):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
            ):
                raise ValueError(f"{name} must be None or a number > 0, got {value!r}")
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool)):
            raise ValueError(f"sliding_window must be None or a positive int, got {window!r}")
        if window is not None and window < 1:
            raise ValueError(f"sliding_window must be None or a positive int, got {window!r}")
        types = self.layer_types
        if types is not None:
            if not isinstance(types, tuple) or len(types) != self.num_hidden_layers:
                raise ValueError(
                    f"layer_types must be a tuple of num_hidden_layers={self.num_hidden_layers} "
                    f"names, got {types!r}"
                )
            unknown = sorted({t for t in types if t not in LAYER_TYPES})
            if unknown:
                raise ValueError(
                    f"unknown layer_types {unknown}; expected names from {LAYER_TYPES}"
                )
        if any(self.sliding_layers) and window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
        if self.model_type in GEMMA_MODEL_TYPES:
            if self.model_type == "gemma":  # Gemma 1 has none of the later features
                later = ("query_pre_attn_scalar", "attn_logit_softcapping")
                later += ("final_logit_softcapping", "rope_local_theta")
                set_fields = [name for name in later if getattr(self, name) is not None]
                if set_fields or any(self.sliding_layers):
                    raise ValueError(
                        f"GemmaForCausalLM has no {set_fields or 'sliding_attention layers'}"
                    )
            if self.qk_norm != (self.model_type == "gemma3_text"):
                raise ValueError(f"qk_norm must be {not self.qk_norm} for {self.architecture}")
            if (self.rope_local_theta is None) == (self.model_type == "gemma3_text"):
                raise ValueError(
                    "rope_local_theta (rope_local_base_freq) must be set exactly for Gemma 3, "
                    f"got {self.rope_local_theta!r} for {self.architecture}"
                )
            return
        # The other families: SwiGLU, head_dim ** -0.5, no caps; global attention but for
        # gpt-oss's sliding-window layers.
        gemma_only = {
            "hidden_act": self.hidden_act != "silu",
            "query_pre_attn_scalar": self.query_pre_attn_scalar is not None,
            "attn_logit_softcapping": self.attn_logit_softcapping is not None,
            "final_logit_softcapping": self.final_logit_softcapping is not None,
            "sliding_attention layers": any(self.sliding_layers) and self.model_type != "gpt_oss",
            "rope_local_theta": self.rope_local_theta is not None,
        }
        set_fields = [name for name, on in gemma_only.items() if on]
        if set_fields:
            where = "Gemma and gpt-oss" if set_fields == ["sliding_attention layers"] else "Gemma"
            raise ValueError(f"{set_fields} are only supported on {where}, not {self.architecture}")

    @property
    def model_type(self) -> str:
        """The HF ``model_type`` (``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``qwen2_moe``,
        ``qwen3_moe``, ``mixtral``, ``gemma``, ``gemma2``, ``gemma3_text``, ``gpt_oss``)."""
        return ARCHITECTURES[self.architecture]

    @property
    def attention_sinks(self) -> bool:
        """Each attention head has a learned sink logit ``σ_n`` in its softmax's denominator
        (gpt-oss): ``p_j = exp(s_j) / (sum_k exp(s_k) + exp(σ_n))``."""
        return self.model_type == "gpt_oss"

    @property
    def expert_biases(self) -> bool:
        """The router and the experts' projections carry biases (gpt-oss)."""
        return self.model_type == "gpt_oss"

    @property
    def norm_in_f32(self) -> bool:
        """RMSNorms multiply by their scale in f32 and round once at the end (Gemma's ``1 + w``
        and gpt-oss), instead of rounding the normalised value before the scale (Llama)."""
        return self.is_gemma or self.model_type == "gpt_oss"

    @property
    def rope_attention_scaling(self) -> float:
        """The factor RoPE's ``cos`` and ``sin`` are multiplied by (so the scores by its
        square): ``yarn``'s ``attention_factor``, by default ``0.1 ln(factor) + 1`` for a factor
        above 1 (Peng et al. 2023, YaRN, eq. 22; transformers' ``yarn_get_mscale``); 1 for the
        other RoPE types."""
        if self.rope_type != "yarn":
            return 1.0
        if self.rope_attention_factor is not None:
            return float(self.rope_attention_factor)
        return yarn_mscale(self.rope_factor)

    @property
    def is_gemma(self) -> bool:
        """Gemma's conventions: RMSNorm scales ``1 + w`` (computed in f32, zero-initialised) and
        the embeddings multiplied by ``sqrt(D)``."""
        return self.model_type in GEMMA_MODEL_TYPES

    @property
    def sandwich_norms(self) -> bool:
        """Each sub-block's output is RMSNorm-ed before the residual add (Gemma 2, 3)."""
        return self.model_type in _SANDWICH_MODEL_TYPES

    @property
    def embed_scale(self) -> float | None:
        """The embeddings' multiplier ``sqrt(D)`` (Gemma; rounded to the compute dtype where it
        is applied, as transformers does), or None."""
        return self.hidden_size**0.5 if self.is_gemma else None

    @property
    def attention_scale(self) -> float:
        """The attention scores' multiplier: ``query_pre_attn_scalar ** -0.5``, else
        ``head_dim ** -0.5``."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it attends over a sliding window of ``sliding_window`` keys."""
        types = self.layer_types or ("full_attention",) * self.num_hidden_layers
        return tuple(t == "sliding_attention" for t in types)

    @property
    def is_moe(self) -> bool:
        """Whether the layers' MLPs are mixtures of experts (``models.moe``)."""
        return self.num_experts > 0

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Parses a transformers ``config.json`` dict (transformers 4 or 5 layout).

        A ``Gemma3ForConditionalGeneration`` config (a vision tower beside a ``text_config``)
        parses as its language model, a ``Gemma3ForCausalLM`` (``language_model_dict``).

        Raises:
          ValueError: unknown architecture, MoE keys on a dense architecture, dense and sparse
            layers mixed, sliding windows outside Gemma and gpt-oss, unknown RoPE type, an
            activation other than SiLU (GELU-tanh on Gemma), quantised weights (but gpt-oss's
            MXFP4 experts), or malformed sizes; a multimodal wrapper
            (``MULTIMODAL_ARCHITECTURES``) whose language model cannot be loaded alone.
        """
        hf = language_model_dict(hf)
        architecture = _architecture(hf)
        model_type = ARCHITECTURES[architecture]
        refuse_unsupported(hf, model_type)
        family = _DENSE_FAMILY.get(model_type, model_type)
        gemma = model_type in GEMMA_MODEL_TYPES
        gpt_oss = model_type == "gpt_oss"
        hidden = _get_int(hf, "hidden_size")
        heads = _get_int(hf, "num_attention_heads")
        head_dim = hf.get("head_dim") or hidden // heads
        # gpt-oss biases its attention unless told otherwise (transformers' default there).
        bias = bool(hf.get("attention_bias", gpt_oss))
        if model_type == "gemma3_text":
            rope = _gemma3_rope(hf)
        elif gpt_oss:
            rope = _gpt_oss_rope(hf)
        else:
            rope = _rope(hf)
        eos = hf.get("eos_token_id")
        eos_ids = () if eos is None else tuple(int(e) for e in np.atleast_1d(eos))
        return cls(
            architecture=architecture,
            vocab_size=_get_int(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_get_int(hf, "intermediate_size"),
            num_hidden_layers=_get_int(hf, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(
                hf.get("max_position_embeddings", _DEFAULT_CONTEXT.get(model_type, 2048))
            ),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5 if gpt_oss else 1e-6)),
            qkv_bias=_qkv_bias(hf, model_type) if family == "qwen2" else bias,
            o_bias=False if family in ("qwen2", "mistral") else bias,
            qk_norm=family in ("qwen3", "gemma3_text"),
            # Gemma ties its embeddings unless told otherwise (transformers' default there).
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            bos_token_id=_optional_id(hf.get("bos_token_id")),
            eos_token_ids=eos_ids,
            pad_token_id=_optional_id(hf.get("pad_token_id")),
            **rope,
            **_experts(hf, model_type),
            **_gemma(hf, model_type),
            **_gpt_oss(hf, model_type),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict that transformers 4 and 5 both read back as this model.

        RoPE is written both ways: ``rope_parameters`` (transformers 5) and ``rope_theta`` +
        ``rope_scaling`` (transformers 4; ``rope_scaling`` is what transformers 5 prefers when
        both are present, so the two must agree).
        """
        scaling: dict[str, Any] | None = None
        if self.rope_type == "linear":
            scaling = {"rope_type": "linear", "factor": self.rope_factor}
        elif self.rope_type == "llama3":
            scaling = {
                "rope_type": "llama3",
                "factor": self.rope_factor,
                "low_freq_factor": self.rope_low_freq_factor,
                "high_freq_factor": self.rope_high_freq_factor,
                "original_max_position_embeddings": self.rope_original_max_position_embeddings,
            }
        elif self.rope_type == "yarn":
            scaling = {
                "rope_type": "yarn",
                "factor": self.rope_factor,
                "original_max_position_embeddings": self.rope_original_max_position_embeddings,
                "beta_fast": self.rope_beta_fast,
                "beta_slow": self.rope_beta_slow,
                "truncate": self.rope_truncate,
            }
            if self.rope_attention_factor is not None:
                scaling["attention_factor"] = self.rope_attention_factor
        rope_parameters = {"rope_type": "default"} if scaling is None else dict(scaling)
        rope_parameters["rope_theta"] = self.rope_theta
        eos: int | list[int] | None = list(self.eos_token_ids) or None
        if eos is not None and len(eos) == 1:
            eos = eos[0]
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": scaling,
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
        }
        family = _DENSE_FAMILY.get(self.model_type, self.model_type)
        if family in ("llama", "qwen3"):
            out["attention_bias"] = self.qkv_bias
        if family == "llama":
            out["mlp_bias"] = False
        if family in ("qwen2", "qwen3"):
            out["use_sliding_window"] = False
            out["layer_types"] = ["full_attention"] * self.num_hidden_layers
        if family in ("qwen2", "qwen3", "mistral"):
            out["sliding_window"] = None
        if self.is_moe:
            out.update(self._experts_hf_dict())
        if self.is_gemma:
            out.update(self._gemma_hf_dict(rope_parameters))
        if self.model_type == "gpt_oss":
            types = self.layer_types or ("full_attention",) * self.num_hidden_layers
            out.update(
                attention_bias=self.qkv_bias,
                layer_types=list(types),
                sliding_window=self.sliding_window,
                swiglu_limit=self.swiglu_limit,
                swiglu_alpha=self.swiglu_alpha,
            )
        return out

    def _gemma_hf_dict(self, rope_parameters: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "hidden_act": self.hidden_act,
            "hidden_activation": self.hidden_act,
            "attention_bias": self.qkv_bias,
        }
        if self.model_type == "gemma":
            return out
        types = self.layer_types or ("full_attention",) * self.num_hidden_layers
        out.update(
            query_pre_attn_scalar=self.query_pre_attn_scalar,
            attn_logit_softcapping=self.attn_logit_softcapping,
            final_logit_softcapping=self.final_logit_softcapping,
            sliding_window=self.sliding_window,
            layer_types=list(types),
            use_bidirectional_attention=False,
        )
        # transformers before layer_types existed derives them from a pattern (Gemma 3).
        pattern = _sliding_pattern(self.sliding_layers)
        if pattern is not None:
            out["sliding_window_pattern"] = pattern
        if self.model_type == "gemma3_text":
            local = self.rope_local_theta
            out["rope_local_base_freq"] = local
            out["rope_parameters"] = {
                "full_attention": rope_parameters,
                "sliding_attention": {"rope_type": "default", "rope_theta": local},
            }
        return out

    def _experts_hf_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "num_experts_per_tok": self.num_experts_per_tok,
            "router_aux_loss_coef": self.router_aux_loss_coef,
            "output_router_logits": False,
        }
        if self.model_type == "mixtral":
            out["num_local_experts"] = self.num_experts
            out["router_jitter_noise"] = 0.0
            return out
        if self.model_type == "gpt_oss":
            out["num_local_experts"] = self.num_experts
            return out
        out.update(
            num_experts=self.num_experts,
            moe_intermediate_size=self.moe_intermediate_size,
            norm_topk_prob=self.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        if self.model_type == "qwen2_moe":
            out["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
            out["qkv_bias"] = self.qkv_bias
        return out


def _sliding_pattern(sliding: tuple[bool, ...]) -> int | None:
    """The ``p`` with layer ``i`` sliding iff ``(i + 1) % p`` (transformers' Gemma rule) that
    gives ``sliding``, or None."""
    for pattern in range(2, len(sliding) + 2):
        if all(s == bool((i + 1) % pattern) for i, s in enumerate(sliding)):
            return pattern
    return None


def rope_inv_freq(config: ModelConfig, *, local: bool = False) -> np.ndarray:
    """RoPE inverse frequencies ``[H/2]`` (float32), with the configured scaling.

    ``inv_freq_i = theta^(-2i/H)``; ``linear`` divides by ``factor``; ``llama3`` divides the
    low-frequency band by ``factor`` and interpolates the middle band (Meta, Llama 3.1, 2024),
    exactly as transformers' ``_compute_llama3_parameters``; ``yarn`` (Peng et al. 2023, YaRN,
    "NTK-by-parts") blends ``inv_freq_i / factor`` and ``inv_freq_i`` with a linear ramp
    ``r_i = clip((i - lo) / (hi - lo), 0, 1)`` over the dimension band whose wavelengths fit
    ``beta_fast`` to ``beta_slow`` turns in the pre-training context
    (``lo, hi = H ln(L_0 / (2 pi beta)) / (2 ln theta)``, floored / ceiled with ``truncate``):
    ``inv_freq_i (1 - r_i) + inv_freq_i / factor · r_i``, as transformers'
    ``_compute_yarn_parameters``. YaRN also scales ``cos`` and ``sin``
    (``ModelConfig.rope_attention_scaling``, applied by ``attention.rope_angles``).

    ``local``: the sliding-window layers' frequencies when they have a base of their own
    (``config.rope_local_theta``, Gemma 3): unscaled, ``rope_local_theta^(-2i/H)``.
    """
    dim = config.head_dim
    if local and config.rope_local_theta is not None:
        exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
        return (1.0 / (config.rope_local_theta**exponents)).astype(np.float32)
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if config.rope_type == "linear":
        inv_freq = inv_freq / config.rope_factor
    elif config.rope_type == "llama3":
        factor = config.rope_factor
        low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
        old_len = config.rope_original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = np.where(is_medium, smoothed, scaled)
    elif config.rope_type == "yarn":
        inv_freq = _yarn_inv_freq(config, inv_freq)
    return inv_freq.astype(np.float32)


def _yarn_inv_freq(config: ModelConfig, inv_freq: np.ndarray) -> np.ndarray:
    """``rope_inv_freq``'s ``yarn`` blend of ``inv_freq [H/2]`` (float64)."""
    dim, base = config.head_dim, config.rope_theta
    context = config.rope_original_max_position_embeddings

    def correction_dim(turns: float) -> float:  # the dimension that turns ``turns`` times
        return dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(config.rope_beta_fast), correction_dim(config.rope_beta_slow)
    if config.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return inv_freq / config.rope_factor * ramp + inv_freq * (1.0 - ramp)


def is_multimodal(hf: Mapping[str, Any]) -> bool:
    """Whether ``hf`` is the config of a vision-language wrapper (``MULTIMODAL_ARCHITECTURES``,
    or its ``model_type`` where ``architectures`` is absent)."""
    archs = hf.get("architectures") or []
    if archs:
        return len(archs) == 1 and archs[0] in MULTIMODAL_ARCHITECTURES
    return hf.get("model_type") in _MULTIMODAL_MODEL_TYPES


def language_model_dict(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text-only ``config.json`` dict of a multimodal wrapper's language model; any other
    config is returned as is.

    ``Gemma3ForConditionalGeneration`` (model_type ``gemma3``): its ``text_config`` (model_type
    ``gemma3_text``) over transformers' ``Gemma3TextConfig`` defaults for the sizes a released
    ``text_config`` leaves out, as a ``Gemma3ForCausalLM``; the wrapper's own token ids (its
    ``eos_token_id`` lists the end-of-turn id too) and ``quantization_config`` take precedence.
    On text-only input the wrapper computes exactly this language model (its image-token
    embedding swap and bidirectional image masks need images), except that it never applies
    ``final_logit_softcapping``, so a ``text_config`` setting it is refused, as are untied
    embeddings (the wrapper's ``lm_head`` is the tied embedding).

    Raises:
      ValueError: no ``text_config`` mapping, a ``text_config`` of another model type, untied
        embeddings, or a final logit soft cap (each named).
    """
    if not is_multimodal(hf):
        return hf
    wrapper = (hf.get("architectures") or [_MULTIMODAL_MODEL_TYPES[hf.get("model_type")]])[0]
    text = hf.get("text_config")
    if not isinstance(text, Mapping):
        raise ValueError(f"{wrapper} config needs a text_config mapping, got {text!r}")
    text_type = text.get("model_type", "gemma3_text")
    if text_type != "gemma3_text":
        raise ValueError(
            f"{wrapper} text_config has model_type {text_type!r}; only 'gemma3_text' is supported"
        )
    out = {**_GEMMA3_TEXT_DEFAULTS, **text}
    out.update(architectures=[MULTIMODAL_ARCHITECTURES[wrapper]], model_type="gemma3_text")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "quantization_config"):
        if hf.get(key) is not None:
            out[key] = hf[key]
    for where, tied in (
        ("tie_word_embeddings", hf.get("tie_word_embeddings", True)),
        ("text_config.tie_word_embeddings", text.get("tie_word_embeddings", True)),
    ):
        if not tied:
            raise ValueError(
                f"{where}={tied!r} is not supported on {wrapper} (its lm_head is the tied "
                "embedding)"
            )
    cap = out.get("final_logit_softcapping")
    if cap is not None:
        raise ValueError(
            f"text_config.final_logit_softcapping={cap} is not supported on {wrapper} "
            "(transformers does not apply it there)"
        )
    return out


def _architecture(hf: Mapping[str, Any]) -> str:
    archs = hf.get("architectures") or []
    if archs:
        if len(archs) != 1 or archs[0] not in ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {archs!r}; expected one of {tuple(ARCHITECTURES)}"
            )
        return archs[0]
    model_type = hf.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r} (and no 'architectures'); expected one of "
            f"{tuple(_MODEL_TYPES)}"
        )
    return _MODEL_TYPES[model_type]


def _num_experts(hf: Mapping[str, Any], model_type: str) -> int:
    # Mixtral names it num_local_experts; the Qwen MoE configs num_experts (which transformers 5
    # writes back as num_local_experts).
    if model_type == "mixtral":
        keys: tuple[str, ...] = ("num_local_experts",)
    elif model_type == "gpt_oss":  # transformers maps num_experts onto num_local_experts
        keys = ("num_local_experts", "num_experts")
    else:
        keys = ("num_experts", "num_local_experts")
    for key in keys:
        if key in hf:
            return int(hf[key] or 0)
    return 0


def _qkv_bias(hf: Mapping[str, Any], model_type: str) -> bool:
    # Qwen2 always biases q/k/v; Qwen2-MoE's config (transformers 5) makes it a key.
    return bool(hf.get("qkv_bias", True)) if model_type == "qwen2_moe" else True


def _experts(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The mixture-of-experts fields of ``ModelConfig`` (none for a dense model type)."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    out = {
        "num_experts": _num_experts(hf, model_type),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok") or 0),
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
    }
    if model_type in ("mixtral", "gpt_oss"):
        out.update(moe_intermediate_size=_get_int(hf, "intermediate_size"), norm_topk_prob=True)
        return out
    out.update(
        moe_intermediate_size=_get_int(hf, "moe_intermediate_size"),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    )
    if model_type == "qwen2_moe":
        out["shared_expert_intermediate_size"] = _get_int(hf, "shared_expert_intermediate_size")
    return out


# transformers' default ``max_position_embeddings`` of the Gemma and gpt-oss configs.
_DEFAULT_CONTEXT = {"gemma": 8192, "gemma2": 8192, "gemma3_text": 131072, "gpt_oss": 131072}
# Gemma 2 / 3 defaults of transformers' configs where config.json leaves a key out.
_GEMMA_DEFAULTS = {
    "gemma2": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "pattern": 2},
    "gemma3_text": {"attn_logit_softcapping": None, "final_logit_softcapping": None, "pattern": 6},
}


def _gemma_activation(hf: Mapping[str, Any], model_type: str) -> str:
    # Gemma 1 reads hidden_act ("gelu" in the original releases means the tanh approximation,
    # as transformers rewrites it); Gemma 2 and 3 read hidden_activation.
    if model_type == "gemma":
        act = hf.get("hidden_act") or "gelu_pytorch_tanh"
        return "gelu_pytorch_tanh" if act == "gelu" else act
    return hf.get("hidden_activation") or "gelu_pytorch_tanh"


def _gemma(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The Gemma fields of ``ModelConfig`` (none for the other families)."""
    if model_type not in GEMMA_MODEL_TYPES:
        return {}
    act = _gemma_activation(hf, model_type)
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_activation {act!r}; expected one of {ACTIVATIONS}")
    out: dict[str, Any] = {"hidden_act": act}
    if model_type == "gemma":
        return out
    defaults = _GEMMA_DEFAULTS[model_type]
    layers = _get_int(hf, "num_hidden_layers")
    types = hf.get("layer_types")
    if not types:
        # transformers' rule: layer i slides unless (i + 1) is a multiple of the pattern.
        pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern")
        pattern = int(pattern or defaults["pattern"])
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
    types = tuple(types)
    if len(types) != layers:
        raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
    sliding = "sliding_attention" in types
    window = hf.get("sliding_window", 4096)
    if sliding and window is None:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is null")
    caps = {}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = hf.get(key, defaults[key])
        caps[key] = None if cap is None else float(cap)
    out.update(
        # Kept as read: transformers types it int (and refuses a float when reading back).
        query_pre_attn_scalar=_number(hf.get("query_pre_attn_scalar", 256)),
        sliding_window=int(window) if sliding else None,
        layer_types=types if sliding else None,
        **caps,
    )
    return out


def _gemma3_rope(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 3's RoPE: the global layers' (``rope_theta``, default 1e6, with any scaling) and
    the sliding layers' base (``rope_local_base_freq``, default 1e4, never scaled), from either
    transformers layout (5: ``rope_parameters`` per layer type; 4: flat keys), merged the way
    transformers 5 merges them (``rope_scaling`` updates the global layers' parameters)."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"rope_parameters must be a mapping, got {params!r}")
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full, local = dict(params), {}
    scaling = hf.get("rope_scaling")
    if scaling:
        full.update(scaling)
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    local_type = local.get("rope_type", local.get("type", "default"))
    if local_type != "default":
        raise ValueError(
            f"RoPE scaling on the sliding-window layers is not supported (rope type {local_type!r})"
        )
    rope = _rope({**hf, "rope_scaling": None, "rope_parameters": full})
    rope["rope_local_theta"] = float(local["rope_theta"])
    return rope


@dataclasses.dataclass(frozen=True)
class Allowance:
    """One ``config.json`` key's supported values, as a row of :data:`ALLOWANCES`.

    ``refused(value, hf, model_type)`` is true for a value that would change the computation
    into something not implemented; ``value`` is ``hf.get(key, default)``. The error is
    ``message`` formatted with ``key``, ``value``, ``shown`` (``show(value)``, or ``value``),
    ``model_type`` and any other name as ``hf.get(name)``: one line naming the key and value.
    """

    key: str
    refused: Callable[[Any, Mapping[str, Any], str], bool]
    message: str
    default: Any = None
    show: Callable[[Any], Any] | None = None


class _MessageFields(dict):
    """``str.format_map`` fields: the given ones, then the config's keys (None if absent)."""

    def __init__(self, hf: Mapping[str, Any], **fields: Any):
        super().__init__(fields)
        self._hf = hf

    def __missing__(self, name: str) -> Any:
        return self._hf.get(name)


def _is_set(value: Any, *_: Any) -> bool:
    return bool(value)


def _quant_method(value: Any) -> Any:
    return value.get("quant_method") if isinstance(value, Mapping) else None


def _unknown_layer_types(value: Any) -> list[str]:
    return sorted({t for t in value or () if t not in LAYER_TYPES})


def _non_full_layer_types(value: Any) -> list[str]:
    return sorted({t for t in value or () if t != "full_attention"})


def _window_in_use(window: Any, hf: Mapping[str, Any], _: str) -> bool:
    return window is not None and window < hf.get("max_position_embeddings", 2048)


_QUANTISED = Allowance(
    "quantization_config",
    _is_set,
    "quantised checkpoints are not supported (quantization_config is set)",
)
_MLP_BIAS = Allowance("mlp_bias", _is_set, "mlp_bias=True is not supported")
_PARTIAL_ROTARY = Allowance(
    "partial_rotary_factor",
    lambda value, *_: value is not None and value != 1.0,
    "partial_rotary_factor={value} is not supported (only 1.0)",
)
_KNOWN_LAYER_TYPES = Allowance(
    "layer_types",
    lambda value, *_: bool(_unknown_layer_types(value)),
    "unsupported layer_types {shown}; expected names from " + str(LAYER_TYPES),
    show=_unknown_layer_types,
)
_NO_JITTER = Allowance(
    "router_jitter_noise",
    _is_set,
    "router_jitter_noise={value} is not supported (only 0)",
    default=0.0,
)


def _has_experts(key: str) -> Allowance:
    return Allowance(
        key,
        lambda _, hf, model_type: not _num_experts(hf, model_type),
        "{model_type} config without experts (" + key + " is 0 or missing)",
    )


def _no_experts_keys(message: str) -> tuple[Allowance, ...]:
    return tuple(Allowance(key, _is_set, message) for key in _MOE_KEYS)


# The layers are stacked and scanned, so every layer of a mixture of experts must have the same
# (sparse) MLP.
_EXPERTS = (
    Allowance(
        "decoder_sparse_step",
        lambda value, *_: value != 1,
        "decoder_sparse_step={value} mixes dense and sparse layers, which is not supported "
        "(only every layer sparse: decoder_sparse_step=1)",
        default=1,
    ),
    Allowance(
        "mlp_only_layers",
        _is_set,
        "mlp_only_layers={shown} mixes dense and sparse layers, which is not supported "
        "(only every layer sparse: mlp_only_layers=[])",
        show=list,
    ),
    _has_experts("num_experts"),
    _NO_JITTER,
)
# Llama, Mistral, Qwen2, Qwen3 and their mixtures of experts (after ``_EXPERTS``).
_SWIGLU_GLOBAL = (
    _QUANTISED,
    Allowance(
        "hidden_act",
        lambda value, *_: value != "silu",
        "unsupported hidden_act {value!r}; only 'silu' is implemented",
        default="silu",
    ),
    _MLP_BIAS,
    _PARTIAL_ROTARY,
    Allowance(
        "use_sliding_window",
        _is_set,
        "sliding-window attention is not supported (use_sliding_window=True)",
    ),
    Allowance(
        "layer_types",
        lambda value, *_: bool(_non_full_layer_types(value)),
        "only full-attention layers are supported, got layer_types {shown}",
        show=_non_full_layer_types,
    ),
)
_DENSE = (
    *_no_experts_keys(
        "mixture-of-experts keys on dense model type {model_type!r} ({key}={value!r}); MoE is "
        "supported as " + str(MOE_MODEL_TYPES)
    ),
    *_SWIGLU_GLOBAL,
)
# Mistral and Mixtral: a window shorter than the context would slide.
_NO_WINDOW = Allowance(
    "sliding_window",
    _window_in_use,
    "sliding-window attention is not supported (sliding_window={value} < "
    "max_position_embeddings={max_position_embeddings})",
)
_GEMMA = (
    *_no_experts_keys("mixture-of-experts keys on a Gemma model ({key}={value!r})"),
    _QUANTISED,
    Allowance(
        "use_bidirectional_attention",
        _is_set,
        "use_bidirectional_attention=True is not supported (causal models only)",
    ),
    _MLP_BIAS,
    _PARTIAL_ROTARY,
    _KNOWN_LAYER_TYPES,
)
# gpt-oss: the hidden_act key is not read by transformers (its experts' activation is the
# clamped SwiGLU of swiglu_alpha / swiglu_limit), so it is not checked either; its MXFP4
# experts are dequantised at load.
_GPT_OSS = (
    Allowance(
        "quantization_config",
        lambda value, *_: bool(value) and _quant_method(value) != "mxfp4",
        "quantised checkpoints are not supported (quantization_config is set, quant_method "
        "{shown!r}); gpt-oss's 'mxfp4' experts are dequantised at load",
        show=_quant_method,
    ),
    _PARTIAL_ROTARY,
    _KNOWN_LAYER_TYPES,
    _has_experts("num_local_experts"),
    Allowance("router_jitter_noise", _is_set, "router_jitter_noise={value} is not supported"),
)
# model_type -> the config keys whose values it refuses, checked in order (the first refusal
# is the error).
ALLOWANCES: dict[str, tuple[Allowance, ...]] = {
    "llama": _DENSE,
    "qwen2": _DENSE,
    "qwen3": _DENSE,
    "mistral": (*_DENSE, _NO_WINDOW),
    "qwen2_moe": (*_EXPERTS, *_SWIGLU_GLOBAL),
    "qwen3_moe": (*_EXPERTS, *_SWIGLU_GLOBAL),
    "mixtral": (*_EXPERTS, *_SWIGLU_GLOBAL, _NO_WINDOW),
    "gemma": _GEMMA,
    "gemma2": _GEMMA,
    "gemma3_text": _GEMMA,
    "gpt_oss": _GPT_OSS,
}


def refuse_unsupported(
    hf: Mapping[str, Any], model_type: str, allowances: tuple[Allowance, ...] | None = None
) -> None:
    """Raises the first refusal of ``allowances`` (default ``ALLOWANCES[model_type]``) on the
    config dict ``hf``.

    Raises:
      ValueError: one line naming the refused key and its value.
    """
    for rule in ALLOWANCES[model_type] if allowances is None else allowances:
        value = hf.get(rule.key, rule.default)
        if rule.refused(value, hf, model_type):
            shown = value if rule.show is None else rule.show(value)
            fields = _MessageFields(
                hf, key=rule.key, value=value, shown=shown, model_type=model_type
            )
            raise ValueError(rule.message.format_map(fields))


# transformers' gpt-oss RoPE where config.json gives none (GptOssConfig's default): YaRN.
_GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
_GPT_OSS_THETA = 150_000.0


def _gpt_oss_rope(hf: Mapping[str, Any]) -> dict[str, Any]:
    """gpt-oss's RoPE: the configured one, or transformers' default (YaRN with factor 32 over
    a 4096-token pre-training context) when config.json has neither ``rope_scaling`` nor
    ``rope_parameters``; the base defaults to 150000."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or _GPT_OSS_ROPE)
    params.setdefault("rope_theta", hf.get("rope_theta", _GPT_OSS_THETA))
    return _rope({**hf, "rope_scaling": None, "rope_parameters": params})


def _gpt_oss(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The gpt-oss fields of ``ModelConfig`` (none for the other families): the expert
    clamp and gain, and the sliding-window layers (transformers' default: every other layer
    from layer 0, over 128 keys)."""
    if model_type != "gpt_oss":
        return {}
    layers = _get_int(hf, "num_hidden_layers")
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
    ]
    types = tuple(types)
    if len(types) != layers:
        raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
    sliding = "sliding_attention" in types
    window = hf.get("sliding_window", 128)
    if sliding and window is None:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is null")
    return {
        "sliding_window": int(window) if sliding else None,
        "layer_types": types if sliding else None,
        "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
        "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
    }


def _rope(hf: Mapping[str, Any]) -> dict[str, Any]:
    # transformers 4: rope_theta + rope_scaling; transformers 5: rope_parameters. When both are
    # present transformers 5 lets rope_scaling win, so do the same.
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, Mapping) or any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(f"per-layer-type RoPE parameters are not supported: {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unknown rope type {rope_type!r}; expected one of {ROPE_TYPES}")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    refuse_unsupported(params, "", (_PARTIAL_ROTARY,))
    out: dict[str, Any] = {"rope_theta": float(theta), "rope_type": rope_type}
    if rope_type == "yarn":
        out.update(_yarn(hf, params))
    if rope_type in ("linear", "llama3"):
        if "factor" not in params:
            raise ValueError(f"{rope_type} rope scaling needs a 'factor', got {params!r}")
        out["rope_factor"] = float(params["factor"])
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if key not in params:
                raise ValueError(f"llama3 rope scaling needs {key!r}, got {params!r}")
        out["rope_low_freq_factor"] = float(params["low_freq_factor"])
        out["rope_high_freq_factor"] = float(params["high_freq_factor"])
        out["rope_original_max_position_embeddings"] = int(
            params.get("original_max_position_embeddings")
            or hf.get("original_max_position_embeddings")
            or hf.get("max_position_embeddings", 2048)
        )
    return out


def _yarn(hf: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The YaRN fields of ``ModelConfig`` from a ``rope_type: yarn`` parameter dict, with
    transformers' defaults (``_compute_yarn_parameters``): the factor defaults to the context
    ratio, the betas to 32 and 1, ``truncate`` to True, and the attention factor to
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are given (else
    None: ``0.1 ln(factor) + 1``)."""
    original = int(
        params.get("original_max_position_embeddings")
        or hf.get("original_max_position_embeddings")
        or hf.get("max_position_embeddings", 2048)
    )
    factor = params.get("factor")
    if factor is None:
        factor = hf.get("max_position_embeddings", 2048) / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None and mscale and mscale_all_dim:
        attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ValueError(f"yarn rope truncate must be true or false, got {truncate!r}")
    return {
        "rope_factor": float(factor),
        "rope_original_max_position_embeddings": original,
        "rope_beta_fast": float(params.get("beta_fast") or 32.0),
        "rope_beta_slow": float(params.get("beta_slow") or 1.0),
        "rope_truncate": truncate,
        "rope_attention_factor": None if attention_factor is None else float(attention_factor),
    }


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 · mscale · ln(factor) + 1`` for ``factor > 1``, else 1
    (Peng et al. 2023, YaRN, eq. 22; transformers' ``yarn_get_mscale``)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def _number(value: Any) -> int | float:
    """An int stays an int (and an integral float becomes one), anything else a float."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    value = float(value)
    return int(value) if value.is_integer() else value


def _optional_id(value: Any) -> int | None:
    # A few configs store a list here; the first id is the one tokenizers use.
    if value is None:
        return None
    ids = np.atleast_1d(value)
    return int(ids[0]) if ids.size else None


def _get_int(hf: Mapping[str, Any], key: str) -> int:
    if key not in hf:
        raise ValueError(f"config.json is missing {key!r}")
    return int(hf[key])
