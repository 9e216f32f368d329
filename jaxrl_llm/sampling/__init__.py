"""JAX-native sampling: KV-cache prefill + ``lax.while_loop`` decode, and sampling strategies.

``generate`` is the entry point for one static batch (how it samples: ``SamplingOptions``);
``prefill`` / ``decode`` expose its two compiled stages and the ``SamplingState`` they carry;
``engine`` is the continuous-batching engine (``Engine``, ``EngineSettings``, ``Request``: slots
refilled as completions finish; its device programs in ``slots``); ``strategies`` holds the
per-step temperature / top-k / top-p / min-p logic; ``layout`` the per-layer weight and cache
layout that CPU decoding runs on.
"""

from jaxrl_llm.sampling import engine, layout, strategies
from jaxrl_llm.sampling.engine import Engine, EngineSettings, EngineStats, Request, Result
from jaxrl_llm.sampling.generate import (
    MIN_BUCKET,
    SamplingOptions,
    SamplingParams,
    SamplingState,
    bucket_length,
    decode,
    generate,
    pad_prompts,
    prefill,
    sampling_params,
)
from jaxrl_llm.sampling.strategies import (
    categorical,
    sample_tokens,
    token_logprobs,
    truncate_logits,
)

__all__ = [
    "MIN_BUCKET",
    "Engine",
    "EngineSettings",
    "EngineStats",
    "Request",
    "Result",
    "SamplingOptions",
    "SamplingParams",
    "SamplingState",
    "bucket_length",
    "categorical",
    "decode",
    "engine",
    "generate",
    "layout",
    "pad_prompts",
    "prefill",
    "sample_tokens",
    "sampling_params",
    "strategies",
    "token_logprobs",
    "truncate_logits",
]
