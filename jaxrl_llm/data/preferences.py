"""Offline preference data: JSONL pairs and unpaired KTO records, tokenising, a toy pair set.

Two record shapes, both host-side Python:

- a :class:`PreferencePair` ``(prompt, chosen, rejected)`` for the DPO family, ORPO, SimPO,
  CPO and reward models (``{"prompt": ..., "chosen": ..., "rejected": ...}`` per JSONL line);
- an :class:`UnpairedExample` ``(prompt, completion, label)`` for KTO, whose data need not
  come in pairs (``{"prompt": ..., "completion": ..., "label": true}``).

``encode_pairs`` / ``encode_unpaired`` (``jaxrl_llm.data.preference_encoding``, re-exported
here) turn them into fixed-width NumPy arrays with the library's layout (left-padded prompts,
right-padded completions ending in EOS, masks). ``arithmetic_preference_pairs`` is a
deterministic synthetic set on the built-in arithmetic task (chosen = the correct answer,
rejected = a wrong one), so preference training runs with no file at all. ``IndexSampler``
draws dataset rows in a resumable, seeded order.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.data.arithmetic import arithmetic_examples
from jaxrl_llm.data.datasets import Example, PromptSampler, jsonl_records
from jaxrl_llm.data.preference_encoding import (
    PreferenceArrays,
    UnpairedArrays,
    encode_pairs,
    encode_unpaired,
)


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


__all__ = [
    "IndexSampler",
    "PreferenceArrays",
    "PreferencePair",
    "UnpairedArrays",
    "UnpairedExample",
    "arithmetic_preference_pairs",
    "encode_pairs",
    "encode_unpaired",
    "load_preference_jsonl",
    "load_unpaired_jsonl",
    "mismatched_partners",
    "pair_keys",
    "pairs_to_unpaired",
    "unpaired_keys",
]
