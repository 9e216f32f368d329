"""Tiny random transformers (PyTorch) checkpoints for parity tests; never downloads anything.

Weights are re-drawn at a larger scale than HF's 0.02 init (and norms/biases away from their
1/0 init) so that logits vary by O(1) and a wrong transpose, bias or norm cannot hide.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import transformers

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# One variant per architecture, each exercising a different feature (see module docstring).
VARIANTS = {
    "qwen2": (
        "Qwen2Config",
        dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}),
    ),
    "qwen3": (
        "Qwen3Config",
        dict(head_dim=32, attention_bias=True, tie_word_embeddings=False),
    ),
    "llama": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
            },
        ),
    ),
    "mistral": ("MistralConfig", dict(sliding_window=None, rope_parameters={"rope_theta": 1e6})),
    # Mixtures of experts: 8 experts, top-2, every layer sparse.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=80,
            norm_topk_prob=False,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=True),
    ),
}
MOE_VARIANTS = ("mixtral", "qwen2_moe", "qwen3_moe")

# The Gemma family (kept apart from VARIANTS: the tests parametrized over those assume Llama's
# layout). Four layers, head_dim 32 != D / N, a sliding window of 6 slots (tests run past it),
# soft caps small enough to bind, query_pre_attn_scalar != head_dim.
GEMMA_WINDOW = 6
GEMMA_VARIANTS = {
    "gemma": ("GemmaConfig", dict(num_hidden_layers=4, head_dim=32, attention_bias=True)),
    "gemma2": (
        "Gemma2Config",
        dict(
            num_hidden_layers=4,
            head_dim=32,
            query_pre_attn_scalar=20,
            sliding_window=GEMMA_WINDOW,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=8.0,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=4,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=GEMMA_WINDOW,
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        ),
    ),
}


def hf_config(name: str, **overrides) -> transformers.PretrainedConfig:
    """The transformers config of variant ``name`` (a key of ``VARIANTS`` or
    ``GEMMA_VARIANTS``)."""
    cls_name, extra = {**VARIANTS, **GEMMA_VARIANTS}[name]
    kwargs = {**TINY, **extra, **overrides}
    return getattr(transformers, cls_name)(**kwargs)


def build_model(name: str, *, seed: int = 0, **overrides) -> torch.nn.Module:
    """A float32 eager-attention ``*ForCausalLM`` with randomised weights."""
    config = hf_config(name, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if pname.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif pname.endswith("bias"):
                param.copy_(0.1 * noise)
            elif "embed_tokens" in pname or "lm_head" in pname:
                param.copy_(0.5 * noise)
            else:
                param.copy_(noise / np.sqrt(param.shape[-1]))
    return model


def save_model(model: torch.nn.Module, path: str, **save_kwargs) -> str:
    """``model.save_pretrained(path)``; returns ``path``."""
    model.save_pretrained(path, **save_kwargs)
    return path


def build_checkpoint(name: str, path: str, *, seed: int = 0, **overrides) -> torch.nn.Module:
    """Builds variant ``name`` and saves it to ``path``; returns the torch model."""
    model = build_model(name, seed=seed, **overrides)
    save_model(model, path)
    return model


def rewrite_config(path: str, update: dict, remove: tuple[str, ...] = ()) -> None:
    """Edits ``path/config.json`` in place."""
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    for key in remove:
        config.pop(key, None)
    config.update(update)
    with open(file, "w") as f:
        json.dump(config, f)


def hf_logits(
    model: torch.nn.Module, tokens: np.ndarray, mask: np.ndarray, *, double: bool = False
) -> np.ndarray:
    """transformers logits ``[B, S, V]`` with positions ``cumsum(mask) - 1`` (as HF generate).

    ``double=True`` runs a float64 copy of the model (an independent high-precision reference).
    """
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    run = model
    if double:
        run = type(model)(model.config).to(torch.float64).eval()
        run.load_state_dict(model.state_dict())
        run = run.to(torch.float64)
    with torch.no_grad():
        out = run(
            input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long),
            attention_mask=torch.as_tensor(np.asarray(mask), dtype=torch.long),
            position_ids=torch.as_tensor(positions, dtype=torch.long),
        )
    logits = out.logits
    return (logits.float() if logits.dtype == torch.bfloat16 else logits).numpy()


def padded_batch(
    rng: np.random.Generator, lengths: list[int], width: int, *, vocab: int, side: str
) -> tuple[np.ndarray, np.ndarray]:
    """Random tokens ``[B, width]`` (int32) and a 0/1 mask, padded on ``side`` with id 0."""
    tokens = np.zeros((len(lengths), width), np.int32)
    mask = np.zeros((len(lengths), width), np.int32)
    for row, length in enumerate(lengths):
        seq = rng.integers(3, vocab, size=length)
        cols = slice(width - length, width) if side == "left" else slice(0, length)
        tokens[row, cols] = seq
        mask[row, cols] = 1
    return tokens, mask
