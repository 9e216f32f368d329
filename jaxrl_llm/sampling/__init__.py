"""JAX-native sampling: KV-cache prefill + ``lax.while_loop`` decode, and sampling strategies.

``generate`` is the entry point; ``prefill`` / ``decode`` expose its two compiled stages and the
``SamplingState`` they carry; ``strategies`` holds the per-step temperature / top-k / top-p /
min-p logic; ``layout`` the per-layer weight and cache layout that CPU decoding runs on.
"""

from jaxrl_llm.sampling import layout, strategies
from jaxrl_llm.sampling.generate import (
    MIN_BUCKET,
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
    "SamplingParams",
    "SamplingState",
    "bucket_length",
    "categorical",
    "decode",
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
