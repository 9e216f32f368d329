"""Offline preference data: JSONL pairs and unpaired KTO records, tokenising, a toy pair set.

Two record shapes, both host-side Python:

- a :class:`PreferencePair` ``(prompt, chosen, rejected)`` for the DPO family, ORPO, SimPO,
  CPO and reward models (``{"prompt": ..., "chosen": ..., "rejected": ...}`` per JSONL line);
- an :class:`UnpairedExample` ``(prompt, completion, label)`` for KTO, whose data need not
  come in pairs (``{"prompt": ..., "completion": ..., "label": true}``).

``encode_pairs`` / ``encode_unpaired`` turn them into fixed-width NumPy arrays with the
library's layout (left-padded prompts, right-padded completions ending in EOS, masks). A
too-long prompt or completion is an error unless truncation is asked for, and then every
truncated row is counted. ``arithmetic_preference_pairs`` is a deterministic synthetic set on
the built-in arithmetic task (chosen = the correct answer, rejected = a wrong one), so
preference training runs with no file at all. ``IndexSampler`` draws dataset rows in a
resumable, seeded order.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxrl_llm.data.arithmetic import arithmetic_examples
from jaxrl_llm.data.datasets import Example, PromptSampler, jsonl_records


def _check_text(value: Any, name: str) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a str, got {type(value).__name__}: {value!r}")


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    """A prompt with a preferred (``chosen``) and a dispreferred (``rejected``) completion.

    Attributes:
      prompt: the text both completions answer (before any chat template).
      chosen: the preferred completion (EOS is appended when tokenising).
      rejected: the dispreferred completion.
      margin: how much more ``chosen`` is preferred (a reward model's Bradley-Terry margin,
        as TRL's ``margin`` column); 0 when the data has none.
      extra: every other field of the source record.
    """

    prompt: str
    chosen: str
    rejected: str
    margin: float = 0.0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for name in ("prompt", "chosen", "rejected"):
            _check_text(getattr(self, name), f"PreferencePair.{name}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int | float):
            raise ValueError(f"PreferencePair.margin must be a number, got {self.margin!r}")
        if not math.isfinite(self.margin):
            raise ValueError(f"PreferencePair.margin must be finite, got {self.margin!r}")


@dataclasses.dataclass(frozen=True)
class UnpairedExample:
    """One completion labelled desirable (``label=True``) or undesirable, for KTO.

    Attributes:
      prompt: the prompt text (before any chat template).
      completion: the completion (EOS is appended when tokenising).
      label: ``True`` for a desirable completion.
      extra: every other field of the source record.
    """

    prompt: str
    completion: str
    label: bool
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        _check_text(self.prompt, "UnpairedExample.prompt")
        _check_text(self.completion, "UnpairedExample.completion")
        if not isinstance(self.label, bool | np.bool_):
            raise ValueError(f"UnpairedExample.label must be a bool, got {self.label!r}")


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------


def _text_field(record: dict, field: str, where: str) -> str:
    value = record.pop(field)
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {field!r} must be a string, got {value!r}")
    return value


def load_preference_jsonl(
    path: str | os.PathLike,
    *,
    prompt_field: str = "prompt",
    chosen_field: str = "chosen",
    rejected_field: str = "rejected",
    margin_field: str | None = None,
) -> list[PreferencePair]:
    """Reads one :class:`PreferencePair` per non-blank line of a JSONL file.

    Args:
      path: the JSONL file (UTF-8).
      prompt_field, chosen_field, rejected_field: names of the three text fields.
      margin_field: name of a numeric per-pair margin field that every record must hold, or
        ``None`` (margins 0).

    Returns:
      The pairs in file order; other fields go to ``PreferencePair.extra``.

    Raises:
      FileNotFoundError: if ``path`` is not a file.
      ValueError: naming ``path:line`` for invalid JSON, a line that is not an object, a
        missing field or a field of the wrong type; or if the file holds no record.
    """
    fields = [prompt_field, chosen_field, rejected_field]
    if margin_field is not None:
        fields.append(margin_field)
    pairs = []
    for where, record in jsonl_records(path, fields):
        prompt = _text_field(record, prompt_field, where)
        chosen = _text_field(record, chosen_field, where)
        rejected = _text_field(record, rejected_field, where)
        margin = 0.0
        if margin_field is not None:
            margin = record.pop(margin_field)
            if isinstance(margin, bool) or not isinstance(margin, int | float):
                raise ValueError(
                    f"{where}: field {margin_field!r} must be a number, got {margin!r}"
                )
        try:
            pairs.append(PreferencePair(prompt, chosen, rejected, float(margin), record))
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err
    return pairs


def load_unpaired_jsonl(
    path: str | os.PathLike,
    *,
    prompt_field: str = "prompt",
    completion_field: str = "completion",
    label_field: str = "label",
) -> list[UnpairedExample]:
    """Reads one :class:`UnpairedExample` per non-blank line of a JSONL file (KTO data).

    The label must be a JSON boolean (``true`` = desirable); numbers and strings are refused
    rather than guessed at.

    Raises:
      FileNotFoundError: if ``path`` is not a file.
      ValueError: naming ``path:line`` for invalid JSON, a missing field or a field of the
        wrong type; or if the file holds no record.
    """
    examples = []
    for where, record in jsonl_records(path, [prompt_field, completion_field, label_field]):
        prompt = _text_field(record, prompt_field, where)
        completion = _text_field(record, completion_field, where)
        label = record.pop(label_field)
        if not isinstance(label, bool):
            raise ValueError(
                f"{where}: field {label_field!r} must be a JSON boolean (true / false), "
                f"got {label!r}"
            )
        examples.append(UnpairedExample(prompt, completion, label, record))
    return examples


def pairs_to_unpaired(pairs: Sequence[PreferencePair]) -> list[UnpairedExample]:
    """Paired data as KTO's unpaired data: every chosen desirable, then every rejected not.

    All chosen completions come first, so neighbours in the result (``i``, ``i + 1``) answer
    different prompts, which :func:`mismatched_partners` relies on.
    """
    chosen = [UnpairedExample(p.prompt, p.chosen, True, dict(p.extra)) for p in pairs]
    rejected = [UnpairedExample(p.prompt, p.rejected, False, dict(p.extra)) for p in pairs]
    return chosen + rejected


def mismatched_partners(num_rows: int) -> np.ndarray:
    """``j(i) = (i + 1) mod M``: the row whose completion pairs with prompt ``i`` for KTO's KL.

    KTO's reference point (Ethayarajh et al. 2024) estimates ``KL(π_θ‖π_ref)`` on prompts
    paired with another example's completion; TRL rotates completions by one inside each
    batch. Fixing the rotation over the whole dataset makes the partner of a row a
    property of the data, so its reference log-probs can be precomputed once.
    """
    if num_rows < 2:
        raise ValueError(f"KTO's mismatched pairs need at least 2 examples, got {num_rows}")
    return (np.arange(num_rows) + 1) % num_rows


# --------------------------------------------------------------------------------------
# The built-in synthetic preference set
# --------------------------------------------------------------------------------------


def arithmetic_preference_pairs(
    n: int,
    *,
    seed: int,
    digits: int | Sequence[int] = (1, 2),
    ops: Sequence[str] = ("+", "-"),
    max_offset: int = 9,
) -> list[PreferencePair]:
    """``n`` arithmetic pairs: ``chosen`` the correct answer, ``rejected`` a wrong one.

    The prompts are ``arithmetic_examples(n, seed=seed, digits=digits, ops=ops)`` (distinct,
    so slicing gives disjoint splits). The rule: ``rejected = answer + k`` with ``k`` drawn
    uniformly from ``{−max_offset, …, −1, 1, …, max_offset}`` by
    ``default_rng([seed, 1])``, redrawn while the result would be negative, so the rejected
    answer always looks like an answer and is never correct. Deterministic in all arguments.

    Returns:
      Pairs with ``extra = {"task": "arithmetic", "answer": "<correct answer>"}``.

    Raises:
      ValueError: on bad settings (see ``arithmetic_examples``) or ``max_offset < 1``.
    """
    if isinstance(max_offset, bool) or not isinstance(max_offset, int) or max_offset < 1:
        raise ValueError(f"max_offset must be an int >= 1, got {max_offset!r}")
    examples = arithmetic_examples(n, seed=seed, digits=digits, ops=ops)
    rng = np.random.default_rng([seed, 1])
    offsets = np.concatenate([np.arange(-max_offset, 0), np.arange(1, max_offset + 1)])
    pairs = []
    for ex in examples:
        answer = int(ex.answer)
        wrong = answer + int(rng.choice(offsets))
        while wrong < 0:
            wrong = answer + int(rng.choice(offsets))
        extra = {"task": "arithmetic", "answer": ex.answer}
        pairs.append(PreferencePair(ex.prompt, ex.answer, str(wrong), 0.0, extra))
    return pairs


# --------------------------------------------------------------------------------------
# Tokenising
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# Sampling rows
# --------------------------------------------------------------------------------------


class IndexSampler:
    """Batches of dataset row indices in a seeded, epoch-wise shuffled, resumable order.

    A :class:`~jaxrl_llm.data.PromptSampler` over one key per row: epoch ``e`` visits rows in
    the order ``default_rng([seed, e]).permutation(N)``, batches run on across epochs, and
    ``state()`` / ``restore()`` carry the position (refusing a different dataset, whose keys
    hash differently).

    Example:
      sampler = IndexSampler([p.prompt + p.chosen + p.rejected for p in pairs], seed=0)
      rows = sampler.next_indices(32)   # int64 [32]
    """

    def __init__(self, keys: Sequence[str], *, seed: int, shuffle: bool = True):
        """Creates a sampler at the start of epoch 0.

        Args:
          keys: one string per row identifying it (what the resume fingerprint hashes).
          seed: seed of the epoch permutations (a non-negative int).
          shuffle: permute each epoch; ``False`` keeps the dataset order.
        """
        rows = [Example(prompt=str(k), answer=str(i)) for i, k in enumerate(keys)]
        self._sampler = PromptSampler(rows, seed=seed, shuffle=shuffle)

    def __len__(self) -> int:
        return len(self._sampler)

    def next_indices(self, n: int) -> np.ndarray:
        """The next ``n`` row indices (``int64 [n]``)."""
        return np.array([int(ex.answer) for ex in self._sampler.next_batch(n)], np.int64)

    def state(self) -> dict[str, Any]:
        """The position as JSON (see ``PromptSampler.state``)."""
        return self._sampler.state()

    def restore(self, state: Mapping[str, Any]) -> None:
        """Moves to a saved position (see ``PromptSampler.restore``)."""
        self._sampler.restore(state)


def pair_keys(pairs: Sequence[PreferencePair]) -> list[str]:
    """One identifying string per pair, for :class:`IndexSampler`."""
    return [f"{p.prompt}\0{p.chosen}\0{p.rejected}" for p in pairs]


def unpaired_keys(examples: Sequence[UnpairedExample]) -> list[str]:
    """One identifying string per unpaired example, for :class:`IndexSampler`."""
    return [f"{e.prompt}\0{e.completion}\0{int(e.label)}" for e in examples]
