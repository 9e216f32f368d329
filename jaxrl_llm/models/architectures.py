"""Shipped Hugging Face ``config.json`` files of well-known models, and their parameter counts.

``configs/models/<name>.json`` holds the ``config.json`` of a public checkpoint (no weights), so
planning and random-init experiments can name a model without downloading anything::

    config = architecture_config("qwen2.5-7b")        # shipped name, case-insensitive
    config = architecture_config("/models/my-ckpt")   # a directory holding config.json
    config = architecture_config("ckpt/config.json")  # or the file itself
    param_count(config)                               # 7_615_616_512

Names are the file stems (``available_architectures()``); they are the base checkpoints of
``Qwen/Qwen2.5-*``, ``Qwen/Qwen3-*``, ``meta-llama/Llama-3.1-*`` and
``mistralai/Mistral-7B-v0.3``; the mixtures of experts ``Qwen/Qwen3-30B-A3B``,
``Qwen/Qwen3-235B-A22B``, ``Qwen/Qwen1.5-MoE-A2.7B`` and ``mistralai/Mixtral-8x7B-v0.1``; and
``google/gemma-2-{9b,27b}``, ``google/gemma-3-1b-pt`` and the text model of
``google/gemma-3-{4b,12b,27b}-pt`` (its ``text_config`` as a ``Gemma3ForCausalLM``: the vision
tower is not counted; the multimodal checkpoint itself loads as this text model, see
``models.checkpoint``); and ``openai/gpt-oss-{20b,120b}``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from jaxrl_llm.models.config import ModelConfig

ARCHITECTURE_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"
CONFIG_FILE = "config.json"


def available_architectures() -> tuple[str, ...]:
    """Names of the shipped configs (``configs/models/*.json`` stems), sorted."""
    return tuple(sorted(path.stem for path in ARCHITECTURE_DIR.glob("*.json")))


def architecture_config(name_or_path: str | os.PathLike) -> ModelConfig:
    """``ModelConfig`` of a shipped architecture or of any HF ``config.json``.

    A string without a path separator that does not end in ``.json`` is a shipped name, matched
    case-insensitively (``"Qwen2.5-7B"``); anything else (or an ``os.PathLike``) is a path to a
    ``config.json`` file or to a directory holding one. So a bare name never depends on the
    working directory: write ``./name`` for a local directory called ``name``.

    Raises:
      ValueError: an unknown name (the message lists the available ones), a file that is not
        valid JSON, or a config ``ModelConfig.from_hf_dict`` refuses (the message names the
        file).
      FileNotFoundError: the path, or the directory's ``config.json``, does not exist.
    """
    if isinstance(name_or_path, str) and not _looks_like_path(name_or_path):
        return _read(_shipped_file(name_or_path))
    path = Path(name_or_path).expanduser()
    file = path / CONFIG_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no model config file at {os.fspath(file)!r}")
    return _read(file)


def param_count(config: ModelConfig) -> int:
    """Exact number of parameters of ``Transformer(config)`` (tied embeddings counted once).

    With V vocab, D hidden, F MLP width, L layers, N query / K key-value heads of width H::

        layer = 2 D                      (attention and MLP RMSNorm scales)
              + D N H + 2 D K H + N H D  (q, k, v, o projections)
              + [N H + 2 K H]            (q/k/v biases, ``qkv_bias``)
              + [D]                      (output bias, ``o_bias``)
              + [2 H]                    (q/k RMSNorm scales, ``qk_norm``)
              + [2 D]                    (post-attention / -MLP norms, ``sandwich_norms``)
              + 3 D F                    (SwiGLU gate, up, down; dense models)
              + D E + 3 E D F_e          (router and E experts; mixture-of-experts models)
              + [3 D F_s + D]            (shared expert and its gate, Qwen2-MoE)
              + [N + E + 2 E F_e + E D]  (attention sinks, router and expert biases, gpt-oss)
        total = V D + L layer + D + [D V unless ``tie_word_embeddings``]

    This equals ``sum(x.size for x in jax.tree.leaves(param_shapes(config)))`` without building
    anything.
    """
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    n, k, h = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    layer = 2 * d + d * n * h + 2 * d * k * h + n * h * d
    if config.is_moe:
        e, shared = config.num_experts, config.shared_expert_intermediate_size
        layer += d * e + 3 * e * d * config.moe_intermediate_size
        layer += 3 * d * shared + (d if shared else 0)
        if config.expert_biases:
            layer += e + 2 * e * config.moe_intermediate_size + e * d
    else:
        layer += 3 * d * f
    if config.qkv_bias:
        layer += n * h + 2 * k * h
    if config.o_bias:
        layer += d
    if config.qk_norm:
        layer += 2 * h
    if config.sandwich_norms:
        layer += 2 * d
    if config.attention_sinks:
        layer += n
    unembed = 0 if config.tie_word_embeddings else d * v
    return v * d + config.num_hidden_layers * layer + d + unembed


def _looks_like_path(text: str) -> bool:
    separators = {os.sep, "/"} | ({os.altsep} if os.altsep else set())
    return any(sep in text for sep in separators) or text.lower().endswith(".json")


def _shipped_file(name: str) -> Path:
    key = name.strip().lower()
    available = available_architectures()
    if key not in available:
        raise ValueError(
            f"unknown architecture {name!r}; available: {', '.join(available)} "
            "(or give a path to a config.json file or to a directory holding one)"
        )
    return ARCHITECTURE_DIR / f"{key}.json"


def _read(file: Path) -> ModelConfig:
    try:
        with open(file) as f:
            hf = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{os.fspath(file)!r} is not valid JSON: {err}") from err
    if not isinstance(hf, dict):
        raise ValueError(f"{os.fspath(file)!r} must hold a JSON object, got {type(hf).__name__}")
    try:
        return ModelConfig.from_hf_dict(hf)
    except ValueError as err:
        raise ValueError(f"{os.fspath(file)!r}: {err}") from err
