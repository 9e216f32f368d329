"""Flax NNX decoder-only transformers (Llama / Mistral / Qwen2 / Qwen3, Gemma / Gemma 2 /
Gemma 3, and the Qwen2-MoE / Qwen3-MoE / Mixtral / gpt-oss mixtures of experts) and HF
checkpoints (gpt-oss's MXFP4 experts dequantised at load: ``mxfp4``; the multimodal Gemma 3
checkpoints loaded as, and saved back around, their language model)."""

from jaxrl_llm.models import context_parallel, lora, moe, mxfp4
from jaxrl_llm.models.architectures import (
    ARCHITECTURE_DIR,
    architecture_config,
    available_architectures,
    param_count,
)
from jaxrl_llm.models.checkpoint import load_config, load_pretrained, save_pretrained
from jaxrl_llm.models.config import (
    ARCHITECTURES,
    COMPUTE_DTYPES,
    LORA_TARGETS,
    ROPE_TYPES,
    LoraSpec,
    ModelConfig,
)
from jaxrl_llm.models.heads import (
    ScalarParams,
    init_scalar_params,
    load_scalar_model,
    read_scalar_config,
    save_scalar_model,
    scalar_logical_axes,
    scalar_param_shapes,
    sequence_scores,
    token_values,
)
from jaxrl_llm.models.kv_cache import PAGED_CACHE_AXES, PagedKVCache, init_paged_cache
from jaxrl_llm.models.tokenizer import load_tokenizer
from jaxrl_llm.models.transformer import (
    CACHE_AXES,
    LAYER_INPUT,
    REMAT_POLICIES,
    KVCache,
    Transformer,
    cast_params,
    forward,
    init_cache,
    init_params,
    logical_axes,
    logits,
    param_shapes,
    remat_policy,
    unembed,
    unembedding,
)

__all__ = [
    "COMPUTE_DTYPES",
    "ARCHITECTURES",
    "ARCHITECTURE_DIR",
    "CACHE_AXES",
    "LAYER_INPUT",
    "REMAT_POLICIES",
    "ROPE_TYPES",
    "KVCache",
    "LORA_TARGETS",
    "PAGED_CACHE_AXES",
    "PagedKVCache",
    "LoraSpec",
    "ModelConfig",
    "ScalarParams",
    "Transformer",
    "architecture_config",
    "available_architectures",
    "cast_params",
    "forward",
    "init_cache",
    "init_paged_cache",
    "init_params",
    "init_scalar_params",
    "load_config",
    "load_pretrained",
    "load_scalar_model",
    "read_scalar_config",
    "remat_policy",
    "load_tokenizer",
    "context_parallel",
    "lora",
    "moe",
    "mxfp4",
    "logical_axes",
    "logits",
    "param_count",
    "param_shapes",
    "save_pretrained",
    "save_scalar_model",
    "scalar_logical_axes",
    "scalar_param_shapes",
    "sequence_scores",
    "token_values",
    "unembed",
    "unembedding",
]
