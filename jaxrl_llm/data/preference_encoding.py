"""Tokenising preference data into fixed-width NumPy arrays (host-side, no JAX).

``encode_pairs`` (DPO-family pairs) and ``encode_unpaired`` (KTO examples) give the library's
layout: left-padded prompts, right-padded completions ending in EOS, boolean masks, one width
per dataset so every batch has the same shapes. A too-long prompt or completion is an error
unless truncation is asked for, and then every truncated row is counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np


class PreferenceArrays(NamedTuple):
    """Tokenised pairs (host NumPy arrays, one row per pair).

    Attributes:
      prompt_tokens: ``[N, P]`` int32, left-padded.
      prompt_mask: ``[N, P]`` bool.
      chosen_tokens: ``[N, T]`` int32, right-padded, EOS after the text (unless truncated).
      chosen_mask: ``[N, T]`` bool.
      rejected_tokens: ``[N, T]`` int32, right-padded like ``chosen_tokens``.
      rejected_mask: ``[N, T]`` bool.
      margins: ``[N]`` float32 per-pair margins.
    """

    prompt_tokens: np.ndarray
    prompt_mask: np.ndarray
    chosen_tokens: np.ndarray
    chosen_mask: np.ndarray
    rejected_tokens: np.ndarray
    rejected_mask: np.ndarray
    margins: np.ndarray


class UnpairedArrays(NamedTuple):
    """Tokenised unpaired examples (host NumPy arrays, one row per example).

    Attributes:
      prompt_tokens: ``[N, P]`` int32, left-padded.
      prompt_mask: ``[N, P]`` bool.
      completion_tokens: ``[N, T]`` int32, right-padded, EOS after the text (unless truncated).
      completion_mask: ``[N, T]`` bool.
      labels: ``[N]`` bool, true for desirable completions.
    """

    prompt_tokens: np.ndarray
    prompt_mask: np.ndarray
    completion_tokens: np.ndarray
    completion_mask: np.ndarray
    labels: np.ndarray


def _pad_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id
    return tokenizer.eos_token_id if pad is None else pad


def _limit(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


class _Encoder:
    """Token ids of prompts and completions under the length limits, counting truncations."""

    def __init__(self, tokenizer, max_prompt_tokens, max_completion_tokens, truncate, special):
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer defines no EOS token: completions must end in one")
        self.tokenizer = tokenizer
        self.max_prompt = _limit("max_prompt_tokens", max_prompt_tokens)
        self.max_completion = _limit("max_completion_tokens", max_completion_tokens)
        self.truncate = bool(truncate)
        self.special = bool(special)
        self.truncated_rows: set[int] = set()

    def prompt(self, row: int, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=self.special)["input_ids"]
        if not ids:
            raise ValueError(f"prompt {text[:80]!r} (row {row}) encodes to no tokens")
        if len(ids) <= self.max_prompt:
            return ids
        if not self.truncate:
            raise ValueError(
                f"prompt of row {row} has {len(ids)} tokens, over max_prompt_tokens="
                f"{self.max_prompt}: {text[:80]!r}... (allow truncation to cut it)"
            )
        self.truncated_rows.add(row)
        # Keep the end: the tokens right before the completion matter most (TRL's keep_end).
        return ids[-self.max_prompt :]

    def completion(self, row: int, text: str, what: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = [*ids, self.tokenizer.eos_token_id]
        if len(ids) <= self.max_completion:
            return ids
        if not self.truncate:
            raise ValueError(
                f"{what} completion of row {row} has {len(ids)} tokens with EOS, over "
                f"max_completion_tokens={self.max_completion}: {text[:80]!r}... (allow "
                "truncation to cut it)"
            )
        self.truncated_rows.add(row)
        return ids[: self.max_completion]


def _left_padded(rows: list[list[int]], pad: int) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(r) for r in rows)
    tokens = np.full((len(rows), width), pad, np.int32)
    mask = np.zeros((len(rows), width), bool)
    for i, r in enumerate(rows):
        tokens[i, width - len(r) :] = r
        mask[i, width - len(r) :] = True
    return tokens, mask


def _right_padded(rows: list[list[int]], pad: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.full((len(rows), width), pad, np.int32)
    mask = np.zeros((len(rows), width), bool)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
        mask[i, : len(r)] = True
    return tokens, mask


def _check_lengths(**columns: Sequence[Any]) -> int:
    sizes = {k: len(v) for k, v in columns.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"columns must have the same length, got {sizes}")
    n = next(iter(sizes.values()))
    if n == 0:
        raise ValueError("nothing to encode: the columns are empty")
    return n


def encode_pairs(
    tokenizer,
    prompts: Sequence[str],
    chosen: Sequence[str],
    rejected: Sequence[str],
    *,
    max_prompt_tokens: int,
    max_completion_tokens: int,
    truncate: bool = False,
    add_special_tokens: bool = True,
    margins: Sequence[float] | None = None,
) -> tuple[PreferenceArrays, int]:
    """Tokenises pairs into :class:`PreferenceArrays` of the dataset-wide widths.

    Prompts are left-padded to the longest prompt ``P``; chosen and rejected completions get
    EOS appended and are right-padded to one shared width ``T`` (the longest of either), so
    every batch drawn from the arrays has the same shapes (one compiled program).

    Args:
      tokenizer: a ``transformers`` tokenizer with an EOS token.
      prompts: ``N`` prompt texts, already formatted (e.g. by ``format_prompt``).
      chosen: ``N`` preferred completion texts.
      rejected: ``N`` dispreferred completion texts.
      max_prompt_tokens: longest prompt allowed.
      max_completion_tokens: longest completion allowed, EOS included.
      truncate: cut what is too long instead of raising: a prompt keeps its last
        ``max_prompt_tokens`` tokens, a completion its first ``max_completion_tokens``
        (its EOS is then cut too).
      add_special_tokens: let the tokenizer add its special tokens (BOS) to prompts; ``False``
        for chat-templated text, which holds its own.
      margins: ``N`` per-pair margins (default 0).

    Returns:
      ``(arrays, truncated)``: ``truncated`` is the number of pairs cut (0 without
      ``truncate``).

    Raises:
      ValueError: columns of different lengths, an empty prompt, or without ``truncate`` a
        prompt or completion over its limit (naming the row and the lengths).
    """
    n = _check_lengths(prompts=prompts, chosen=chosen, rejected=rejected)
    margins = np.zeros(n, np.float32) if margins is None else np.asarray(margins, np.float32)
    if margins.shape != (n,):
        raise ValueError(f"margins must have shape ({n},), got {margins.shape}")
    enc = _Encoder(
        tokenizer, max_prompt_tokens, max_completion_tokens, truncate, add_special_tokens
    )
    prompt_ids = [enc.prompt(i, t) for i, t in enumerate(prompts)]
    chosen_ids = [enc.completion(i, t, "chosen") for i, t in enumerate(chosen)]
    rejected_ids = [enc.completion(i, t, "rejected") for i, t in enumerate(rejected)]
    pad = _pad_id(tokenizer)
    width = max(len(r) for r in chosen_ids + rejected_ids)
    prompt_tokens, prompt_mask = _left_padded(prompt_ids, pad)
    chosen_tokens, chosen_mask = _right_padded(chosen_ids, pad, width)
    rejected_tokens, rejected_mask = _right_padded(rejected_ids, pad, width)
    arrays = PreferenceArrays(
        prompt_tokens=prompt_tokens,
        prompt_mask=prompt_mask,
        chosen_tokens=chosen_tokens,
        chosen_mask=chosen_mask,
        rejected_tokens=rejected_tokens,
        rejected_mask=rejected_mask,
        margins=margins,
    )
    return arrays, len(enc.truncated_rows)


def encode_unpaired(
    tokenizer,
    prompts: Sequence[str],
    completions: Sequence[str],
    labels: Sequence[bool],
    *,
    max_prompt_tokens: int,
    max_completion_tokens: int,
    truncate: bool = False,
    add_special_tokens: bool = True,
) -> tuple[UnpairedArrays, int]:
    """Tokenises unpaired examples into :class:`UnpairedArrays` (see :func:`encode_pairs`).

    Returns:
      ``(arrays, truncated)``, ``truncated`` the number of examples cut.

    Raises:
      ValueError: as :func:`encode_pairs`, or labels that are not booleans.
    """
    _check_lengths(prompts=prompts, completions=completions, labels=labels)
    if not all(isinstance(x, bool | np.bool_) for x in labels):
        raise ValueError("labels must be booleans (True = desirable)")
    enc = _Encoder(
        tokenizer, max_prompt_tokens, max_completion_tokens, truncate, add_special_tokens
    )
    prompt_ids = [enc.prompt(i, t) for i, t in enumerate(prompts)]
    completion_ids = [enc.completion(i, t, "the") for i, t in enumerate(completions)]
    pad = _pad_id(tokenizer)
    prompt_tokens, prompt_mask = _left_padded(prompt_ids, pad)
    width = max(len(r) for r in completion_ids)
    completion_tokens, completion_mask = _right_padded(completion_ids, pad, width)
    arrays = UnpairedArrays(
        prompt_tokens, prompt_mask, completion_tokens, completion_mask, np.asarray(labels, bool)
    )
    return arrays, len(enc.truncated_rows)
