"""Prompt and completion encoding: text ↔ padded token arrays, the stop-token rule and the
prompt format a policy was trained with.

Host-side NumPy, no JAX. Prompts are left-padded (generation appends on the right),
completions right-padded; masks are bool. One rule decides which ids end a completion, shared
by training rollouts and ``jaxrl-llm generate``: :func:`stop_token_ids`. A trained policy
carries its prompt format: the run writes a :class:`PromptFormat` (chat template or raw text,
system prompt) as ``prompt_format.json`` beside the weights in ``hf/`` (its stop tokens are in
``generation_config.json``), and ``jaxrl-llm generate`` and ``eval`` read it back.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np


def pad_id(tokenizer) -> int:
    """The tokenizer's pad id, else its EOS id (padding is masked out either way)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def stop_token_ids(tokenizer, model_config: Any = None, model_dir: str | None = None) -> tuple:
    """The ids that end a completion: the union of ``config.json``'s ``eos_token_id``,
    ``generation_config.json``'s ``eos_token_id`` (chat models list their end-of-turn token
    there, e.g. Qwen2.5's ``<|im_end|>``) and the tokenizer's EOS, in that order, deduplicated.

    Args:
      tokenizer: a Hugging Face tokenizer.
      model_config: a ``models.ModelConfig`` (its ``eos_token_ids``), or None.
      model_dir: the checkpoint directory holding ``generation_config.json``, or None.

    Raises:
      ValueError: no source defines any stop token, or ``generation_config.json`` is unreadable.
    """
    ids: list[int] = list(getattr(model_config, "eos_token_ids", None) or ())
    if model_dir is not None:
        path = os.path.join(os.fspath(model_dir), "generation_config.json")
        if os.path.exists(path):
            try:
                with open(path, encoding="utf-8") as f:
                    value = json.load(f).get("eos_token_id")
            except (OSError, json.JSONDecodeError) as err:
                raise ValueError(f"cannot read {path}: {err}") from None
            ids += [value] if isinstance(value, int) else list(value or ())
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError(
            "no stop token: neither config.json, generation_config.json nor the tokenizer "
            "defines an EOS id"
        )
    return tuple(dict.fromkeys(int(i) for i in ids))


#: The file in a Hugging Face checkpoint directory that records how its policy was prompted.
PROMPT_FORMAT_FILE = "prompt_format.json"


class PromptFormat(NamedTuple):
    """How a policy's prompts were written in training (``data.chat_template``,
    ``data.system_prompt``): through the tokenizer's chat template (with this system message)
    or as raw text."""

    chat_template: bool
    system_prompt: str | None = None

    def describe(self) -> str:
        """``with its chat template`` / ``without its chat template`` (notes' words)."""
        return f"{'with' if self.chat_template else 'without'} its chat template"


def write_prompt_format(directory, prompt_format: PromptFormat) -> None:
    """Writes ``directory/prompt_format.json`` (a checkpoint directory that exists)."""
    path = os.path.join(os.fspath(directory), PROMPT_FORMAT_FILE)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(prompt_format._asdict(), f, indent=2)
        f.write("\n")


def read_prompt_format(directory) -> PromptFormat | None:
    """The prompt format recorded in ``directory`` (None: no record, as in any checkpoint not
    written by a ``jaxrl-llm`` run).

    Raises:
      ValueError: an unreadable or malformed ``prompt_format.json``.
    """
    path = os.path.join(os.fspath(directory), PROMPT_FORMAT_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from None
    system_prompt = record.get("system_prompt") if isinstance(record, dict) else None
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("chat_template"), bool)
        or not (system_prompt is None or isinstance(system_prompt, str))
    ):
        raise ValueError(
            f"{path} must hold {{'chat_template': true|false, 'system_prompt': str|null}}, "
            f"got {record!r}"
        )
    return PromptFormat(record["chat_template"], system_prompt)


def encode_prompts(
    tokenizer, texts: Sequence[str], *, max_prompt_tokens: int, add_special_tokens: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded ``[N, P]`` int32 token ids and a bool mask.

    ``add_special_tokens=False`` for chat-templated text, which already holds its own BOS.

    Raises:
      ValueError: an empty prompt, or one longer than ``max_prompt_tokens`` (never truncated
        here; callers filter long prompts first).
    """
    ids = [tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"] for text in texts]
    for text, row in zip(texts, ids):
        if not row:
            raise ValueError(f"prompt {text!r} encodes to no tokens")
        if len(row) > max_prompt_tokens:
            raise ValueError(
                f"prompt of {len(row)} tokens exceeds data.max_prompt_tokens="
                f"{max_prompt_tokens}: {text[:80]!r}..."
            )
    width = max(len(row) for row in ids)
    tokens = np.full((len(ids), width), pad_id(tokenizer), np.int32)
    mask = np.zeros((len(ids), width), bool)
    for i, row in enumerate(ids):
        tokens[i, width - len(row) :] = row
        mask[i, width - len(row) :] = True
    return tokens, mask


def encode_completions(
    tokenizer, texts: Sequence[str], *, max_tokens: int, eos_id: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded ``[N, max_tokens]`` completion ids ending in EOS (demonstrations).

    ``eos_id`` defaults to the tokenizer's EOS.

    Raises:
      ValueError: a completion (with its EOS) longer than ``max_tokens``.
    """
    eos = tokenizer.eos_token_id if eos_id is None else eos_id
    tokens = np.full((len(texts), max_tokens), pad_id(tokenizer), np.int32)
    mask = np.zeros((len(texts), max_tokens), bool)
    for i, text in enumerate(texts):
        row = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
        if len(row) > max_tokens:
            raise ValueError(f"demonstration {text!r} is longer than {max_tokens} tokens")
        tokens[i, : len(row)] = row
        mask[i, : len(row)] = True
    return tokens, mask


def decode_completions(tokenizer, tokens: np.ndarray, mask: np.ndarray) -> list[str]:
    """Completion texts (special tokens such as EOS dropped)."""
    return [
        tokenizer.decode(row[: int(m.sum())].tolist(), skip_special_tokens=True)
        for row, m in zip(tokens, mask)
    ]


def prompt_lengths(tokenizer, texts: Sequence[str], *, add_special_tokens: bool = True) -> list:
    """Token count of each prompt (to filter prompts over the length limit up front)."""
    return [
        len(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]) for text in texts
    ]
