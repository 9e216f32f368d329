"""Tiny random transformers (PyTorch) checkpoints for parity tests, their configs, batches and
logits, and local checkpoints with a character tokenizer for jobs; never downloads anything.

Weights are re-drawn at a larger scale than HF's 0.02 init (and norms/biases away from their
1/0 init) so that logits vary by O(1) and a wrong transpose, bias or norm cannot hide.
"""

from __future__ import annotations

import json
import os
import string

import jax.numpy as jnp
import numpy as np
import torch
import transformers

from jaxrl_llm import data
from jaxrl_llm.models import load_pretrained
from tests.reference import logprobs as logprobs_ref

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


# gpt-oss (kept apart from VARIANTS too): four layers (sliding, full, sliding, full) with a
# window of 6 slots, 8 experts top-2, YaRN RoPE over a 64-token "pre-training" context. Widths
# are multiples of 32 so the experts can be stored in MXFP4 blocks.
GPT_OSS_WINDOW = 6
GPT_OSS = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    sliding_window=GPT_OSS_WINDOW,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
        "rope_theta": 1000.0,
    },
)


def build_gpt_oss(*, seed: int = 0, **overrides) -> torch.nn.Module:
    """A float32 eager-attention ``GptOssForCausalLM`` of ``GPT_OSS`` (plus ``overrides``) with
    randomised weights (``randomise_weights``), then: the experts' gate/up projections 10x
    larger, so their pre-activations cross the ±7 clamp; attention sinks ``N(0, 1)``, near the
    scores, so a sink holds a fair share of each softmax."""
    config = transformers.GptOssConfig(**{**GPT_OSS, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config)
    randomise_weights(model.to(torch.float32).eval(), seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("experts.gate_up_proj"):
                param.mul_(10.0)
            elif name.endswith("self_attn.sinks"):
                param.copy_(torch.randn(param.shape, generator=gen))
    return model


# The ``architectures`` a released checkpoint's config.json names where it is not the config
# class's ``*ForCausalLM`` (Gemma 3 text checkpoints: the text-only ``Gemma3TextConfig``).
CAUSAL_LM = {"gemma3": "Gemma3ForCausalLM"}
# Printable ASCII without tabs and line breaks: a character tokenizer's alphabet that covers the
# configs' system prompts and any question a test writes.
PRINTABLE_ALPHABET = "".join(c for c in string.printable if c not in "\t\n\r\x0b\x0c")


def hf_config(name: str, **overrides) -> transformers.PretrainedConfig:
    """The transformers config of variant ``name`` (a key of ``VARIANTS`` or
    ``GEMMA_VARIANTS``)."""
    cls_name, extra = {**VARIANTS, **GEMMA_VARIANTS}[name]
    kwargs = {**TINY, **extra, **overrides}
    return getattr(transformers, cls_name)(**kwargs)


def hf_dict(name: str, **overrides) -> dict:
    """Variant ``name``'s config as a ``config.json`` dict, with the ``architectures`` entry a
    released checkpoint carries (``CAUSAL_LM``, else the config class's ``*ForCausalLM``)."""
    config = hf_config(name, **overrides)
    out = config.to_dict()
    default = type(config).__name__.replace("Config", "ForCausalLM")
    out["architectures"] = [CAUSAL_LM.get(name, default)]
    return out


def randomise_weights(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Redraws every parameter in place from ``torch.Generator().manual_seed(seed)``: norm
    scales ``1 + 0.2 N(0, 1)``, biases ``0.1 N(0, 1)``, embeddings and LM head ``0.5 N(0, 1)``,
    other matrices ``N(0, 1 / fan_in)`` (fan_in = last dim). Returns ``model``."""
    gen = torch.Generator().manual_seed(seed)
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


def build_model(name: str, *, seed: int = 0, **overrides) -> torch.nn.Module:
    """A float32 eager-attention ``*ForCausalLM`` with randomised weights."""
    config = hf_config(name, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return randomise_weights(model.to(torch.float32).eval(), seed + 1)


def save_model(model: torch.nn.Module, path: str, **save_kwargs) -> str:
    """``model.save_pretrained(path)``; returns ``path``."""
    model.save_pretrained(path, **save_kwargs)
    return path


def build_checkpoint(name: str, path: str, *, seed: int = 0, **overrides) -> torch.nn.Module:
    """Builds variant ``name`` and saves it to ``path``; returns the torch model."""
    model = build_model(name, seed=seed, **overrides)
    save_model(model, path)
    return model


def build_char_checkpoint(
    name: str, path: str | os.PathLike, alphabet: str, *, seed: int = 0
) -> torch.nn.Module:
    """Variant ``name`` saved at ``path`` beside the built-in character tokenizer of
    ``alphabet`` (``data.build_char_tokenizer``), its vocabulary and bos / eos / pad ids the
    tokenizer's: a local checkpoint a job loads as ``model.path``. Returns the torch model."""
    tokenizer = data.build_char_tokenizer(alphabet, save_dir=path)
    return build_checkpoint(
        name,
        os.fspath(path),
        seed=seed,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def load_variants(tmp_path_factory, names, *, first_seed: int, prefix: str = "") -> dict:
    """Each variant of ``names`` built (seed ``first_seed + i`` for the ``i``-th), saved in a
    fresh ``tmp_path_factory`` directory ``prefix + name`` and loaded in float32.

    Returns:
      ``name -> (torch model, ModelConfig, f32 params, checkpoint directory)``.
    """
    out = {}
    for i, name in enumerate(names):
        path = str(tmp_path_factory.mktemp(prefix + name))
        torch_model = build_checkpoint(name, path, seed=first_seed + i)
        config, params = load_pretrained(path, dtype=jnp.float32)
        out[name] = (torch_model, config, params, path)
    return out


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


def hf_completion_logprobs(
    model: torch.nn.Module,
    prompt: np.ndarray,
    prompt_mask: np.ndarray,
    completion: np.ndarray,
    completion_mask: np.ndarray,
) -> np.ndarray:
    """``log p(c_t | prompt, c_<t)`` ``[B, T]`` (0 at completion padding) from a float64
    transformers run of each row alone, unpadded (``prompt ; completion`` with the masks' real
    tokens only): the reference for log-probs of padded batches."""
    want = np.zeros(np.shape(completion))
    for row in range(len(prompt)):  # each row unpadded, as transformers reads one prompt
        real_prompt = prompt[row][prompt_mask[row] > 0]
        real_completion = completion[row][completion_mask[row] > 0]
        seq = np.concatenate([real_prompt, real_completion])[None]
        full = hf_logits(model, seq, np.ones_like(seq), double=True)
        n = len(real_completion)
        lp, _ = logprobs_ref.completion_logprobs(
            full, len(real_prompt), real_completion[None], np.ones((1, n)), temperature=1.0
        )
        want[row, :n] = lp[0]
    return want


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


# A tiny vision tower for Gemma 3's multimodal wrapper (transformers' SigLIP): one layer, 28x28
# images in 14x14 patches (4 patches; ``mm_tokens_per_image`` 4). The image token ids lie past the
# vocabulary, so text-only batches never hold one.
GEMMA3_VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)


def gemma3_multimodal_config(**text_overrides) -> transformers.Gemma3Config:
    """A ``Gemma3Config`` (``Gemma3ForConditionalGeneration``) whose ``text_config`` is the
    ``gemma3`` variant (plus ``text_overrides``) and whose vision tower is ``GEMMA3_VISION``."""
    text = hf_config("gemma3", **text_overrides).to_dict()
    return transformers.Gemma3Config(
        text_config=text,
        vision_config=transformers.SiglipVisionConfig(**GEMMA3_VISION).to_dict(),
        mm_tokens_per_image=4,
        boi_token_index=1000,
        eoi_token_index=1001,
        image_token_index=1002,
    )


def build_gemma3_multimodal(path: str, *, seed: int = 0, **text_overrides) -> torch.nn.Module:
    """A float32 eager-attention ``Gemma3ForConditionalGeneration`` of
    ``gemma3_multimodal_config`` with randomised weights (``randomise_weights``), saved at
    ``path`` by transformers; returns the torch model."""
    config = gemma3_multimodal_config(**text_overrides)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config)
    model.config._attn_implementation = "eager"
    model.config.text_config._attn_implementation = "eager"
    randomise_weights(model.to(torch.float32).eval(), seed + 1)
    model.save_pretrained(path)
    return model
