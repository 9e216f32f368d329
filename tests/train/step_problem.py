"""A tiny, deterministic policy-update problem shared by the in-process and two-process tests."""

from __future__ import annotations

import numpy as np

from jaxrl_llm import objectives
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.types import RolloutBatch

CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    tie_word_embeddings=False,
)
BATCH, PROMPT, COMPLETION, GROUP = 16, 6, 10, 4


def host_batch(seed: int = 0, *, batch: int = BATCH) -> RolloutBatch:
    """Left-padded prompts, right-padded ragged completions, log-probs near each other."""
    rng = np.random.default_rng(seed)
    prompt_len = rng.integers(2, PROMPT + 1, size=batch)
    prompt_mask = np.arange(PROMPT)[None, :] >= (PROMPT - prompt_len)[:, None]
    completion_len = rng.integers(1, COMPLETION + 1, size=batch)
    completion_len[1] = 0  # an empty completion row
    completion_mask = np.arange(COMPLETION)[None, :] < completion_len[:, None]
    prompt_tokens = np.where(prompt_mask, rng.integers(1, CONFIG.vocab_size, (batch, PROMPT)), 0)
    completion_tokens = np.where(
        completion_mask, rng.integers(1, CONFIG.vocab_size, (batch, COMPLETION)), 0
    )
    base = -np.log(CONFIG.vocab_size) + 0.3 * rng.standard_normal((batch, COMPLETION))
    old = np.where(completion_mask, base, 0.0).astype(np.float32)
    ref = np.where(completion_mask, base + 0.05 * rng.standard_normal(base.shape), 0.0)
    rewards = rng.integers(0, 2, size=batch).astype(np.float32)
    adv = np.asarray(objectives.advantages.grpo(rewards, group_size=GROUP), dtype=np.float32)
    return RolloutBatch(
        completion_mask=completion_mask,
        old_logprobs=old,
        advantages=adv,
        ref_logprobs=ref.astype(np.float32),
        prompt_tokens=prompt_tokens.astype(np.int32),
        prompt_mask=prompt_mask,
        completion_tokens=completion_tokens.astype(np.int32),
    )
