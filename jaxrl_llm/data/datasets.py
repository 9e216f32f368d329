"""Prompt datasets: JSONL loading, a held-out split, a resumable sampler, prompt formatting.

Hugging Face ``datasets`` sources (saved datasets, parquet, JSON) load in ``data.hf``.

Everything here is host-side Python. The sampler's position is plain JSON (``state()`` /
``restore()``), so the training loop stores it in its checkpoint and a resumed run draws exactly
the prompts an uninterrupted run would have drawn.
"""

from __future__ import annotations

import dataclasses
import decimal
import hashlib
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt with its reference answer.

    Attributes:
      prompt: the text the policy is asked to complete (before any chat template); with
        ``messages``, the content of their last user message.
      answer: the reference answer the verifiers compare against.
      extra: every other field of the source record, kept for custom rewards.
      messages: optional chat conversation ``({"role": ..., "content": ...}, ...)`` ending
        where the policy answers; when set, ``format_example`` renders it through the chat
        template instead of the single user message ``prompt``.
    """

    prompt: str
    answer: str
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    messages: tuple[dict[str, Any], ...] | None = None

    def __post_init__(self):
        if not isinstance(self.prompt, str):
            raise ValueError(f"Example.prompt must be a str, got {type(self.prompt).__name__}")
        if not isinstance(self.answer, str):
            raise ValueError(f"Example.answer must be a str, got {type(self.answer).__name__}")
        if not isinstance(self.extra, Mapping):
            raise ValueError(f"Example.extra must be a mapping, got {type(self.extra).__name__}")
        if self.messages is not None:
            object.__setattr__(self, "messages", check_messages(self.messages))

    def to_dict(self) -> dict[str, Any]:
        """``{"prompt": ..., "answer": ..., **extra}`` (and ``"messages"`` when set): the
        record this example came from."""
        record = {"prompt": self.prompt, "answer": self.answer, **self.extra}
        if self.messages is not None:
            record["messages"] = [dict(m) for m in self.messages]
        return record


def check_messages(messages: Any, where: str = "messages") -> tuple[dict[str, Any], ...]:
    """A chat conversation as a tuple of ``{"role": str, "content": str, ...}`` dicts.

    Keys whose value is ``None`` are dropped (Arrow fills the keys other rows have with nulls).

    Raises:
      ValueError: naming ``where``, unless ``messages`` is a non-empty list of mappings each
        with a string ``role`` and ``content``, one of them a ``user`` message.
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"{where}: expected a non-empty list of chat messages, got {messages!r}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"{where}[{i}]: a message must be a mapping, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(f"{where}[{i}]: a message needs a string {key!r}, got {message!r}")
        checked.append(message)
    if not any(m["role"] == "user" for m in checked):
        raise ValueError(f"{where}: the conversation has no user message")
    return tuple(checked)


def last_user_message(messages: Sequence[Mapping[str, Any]]) -> int:
    """The index of the last ``user`` message (the one ``Example.prompt`` mirrors)."""
    return max(i for i, m in enumerate(messages) if m["role"] == "user")


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------


def answer_text(value: Any, where: str, field: str) -> str:
    """Answers may be numbers in the source (``"answer": 72``); bools and nulls are mistakes."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float):  # positional, never "1e-05": the answer parsers read no exponents
        if not math.isfinite(value):
            raise ValueError(f"{where}: field {field!r} must be a finite number, got {value!r}")
        return format(decimal.Decimal(repr(value)), "f")
    raise ValueError(f"{where}: field {field!r} must be a string or a number, got {value!r}")


def jsonl_records(path: str | os.PathLike, fields: Sequence[str]) -> Iterator[tuple[str, dict]]:
    """``(where, record)`` for every non-blank line, each a JSON object holding ``fields``.

    ``where`` is ``"path:line"``, for error messages about the record.

    Raises:
      FileNotFoundError: if ``path`` is not a file.
      ValueError: naming ``path:line`` for invalid JSON, a line that is not an object or a
        missing field; or if the file holds no record.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"JSONL dataset {path!r} does not exist or is not a file")
    count = 0
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{where}: invalid JSON ({err.msg} at column {err.colno})"
                ) from err
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            for field in fields:
                if field not in record:
                    raise ValueError(
                        f"{where}: missing field {field!r} (fields present: {sorted(record)})"
                    )
            count += 1
            yield where, record
    if count == 0:
        raise ValueError(f"JSONL dataset {path!r} holds no record")


def load_jsonl(
    path: str | os.PathLike, *, prompt_field: str = "prompt", answer_field: str = "answer"
) -> list[Example]:
    """Reads one ``Example`` per non-blank line of a JSONL file.

    Each line is a JSON object holding ``prompt_field`` (a string) and ``answer_field`` (a
    string or a number, stored as its ``str``); all other fields go to ``Example.extra``.

    Args:
      path: the JSONL file (UTF-8).
      prompt_field: name of the prompt field.
      answer_field: name of the reference-answer field.

    Returns:
      The examples in file order.

    Raises:
      FileNotFoundError: if ``path`` is not a file.
      ValueError: naming ``path:line`` for invalid JSON, a line that is not an object, a
        missing field or a field of the wrong type; if the file holds no record; or if the two
        field names are equal.
    """
    examples = []
    if prompt_field == answer_field:
        raise ValueError(f"prompt_field and answer_field must differ, both are {prompt_field!r}")
    for where, record in jsonl_records(path, (prompt_field, answer_field)):
        prompt = record.pop(prompt_field)
        if not isinstance(prompt, str):
            raise ValueError(f"{where}: field {prompt_field!r} must be a string, got {prompt!r}")
        answer = answer_text(record.pop(answer_field), where, answer_field)
        examples.append(Example(prompt=prompt, answer=answer, extra=record))
    return examples


# --------------------------------------------------------------------------------------
# Held-out split
# --------------------------------------------------------------------------------------


def _eval_count(num_examples: int, eval_fraction: float | None, eval_size: int | None) -> int:
    if (eval_fraction is None) == (eval_size is None):
        raise ValueError("pass exactly one of eval_fraction and eval_size")
    if eval_fraction is not None:
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        eval_size = int(round(eval_fraction * num_examples))
    if isinstance(eval_size, bool) or not isinstance(eval_size, int | np.integer):
        raise ValueError(f"eval_size must be an int, got {eval_size!r}")
    if not 1 <= eval_size < num_examples:
        raise ValueError(
            f"the eval split must hold between 1 and {num_examples - 1} of the {num_examples} "
            f"examples, got {eval_size}"
        )
    return int(eval_size)


def split_eval(
    examples: Sequence[Example],
    *,
    eval_fraction: float | None = None,
    eval_size: int | None = None,
    seed: int = 0,
) -> tuple[list[Example], list[Example]]:
    """Splits off a held-out evaluation set, deterministically in ``seed``.

    ``round(eval_fraction * N)`` (or ``eval_size``) examples drawn uniformly without
    replacement go to the eval split; both splits keep the original order. The split is by
    position: duplicated records in the source can land on both sides.

    Args:
      examples: ``N`` examples.
      eval_fraction: share of the examples held out, in ``(0, 1)``.
      eval_size: number of examples held out (instead of ``eval_fraction``).
      seed: seed of the draw.

    Returns:
      ``(train, eval)``, disjoint, together all of ``examples``.

    Raises:
      ValueError: unless exactly one of ``eval_fraction`` / ``eval_size`` is given and both
        splits are non-empty.
    """
    num_examples = len(examples)
    count = _eval_count(num_examples, eval_fraction, eval_size)
    held_out = np.zeros(num_examples, bool)
    held_out[np.random.default_rng(seed).permutation(num_examples)[:count]] = True
    train = [ex for ex, out in zip(examples, held_out) if not out]
    evaluation = [ex for ex, out in zip(examples, held_out) if out]
    return train, evaluation


# --------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------


def _fingerprint(examples: Sequence[Example]) -> str:
    """A short hash of the prompts, so a checkpoint cannot resume on a different dataset."""
    digest = hashlib.sha256()
    for ex in examples:
        digest.update(ex.prompt.encode("utf-8"))
        if ex.messages is not None:
            digest.update(json.dumps(ex.messages, sort_keys=True, default=str).encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()[:16]


class PromptSampler:
    """Epoch-wise deterministic batches of examples with a resumable position.

    Epoch ``e`` visits the examples in the order ``default_rng([seed, e]).permutation(N)``
    (identity when ``shuffle=False``); batches run on across epoch boundaries, so every example
    is drawn once per epoch. The position is ``(epoch, index)`` into that order, which makes
    the whole stream a pure function of ``seed`` and the dataset.

    Example:
      sampler = PromptSampler(train, seed=0)
      batch = sampler.next_batch(16)
      saved = sampler.state()          # JSON: store it with the checkpoint
      ...
      sampler.restore(saved)           # the next batches equal an uninterrupted run's
    """

    def __init__(self, examples: Sequence[Example], *, seed: int, shuffle: bool = True):
        """Creates a sampler at the start of epoch 0.

        Args:
          examples: the ``N >= 1`` examples to draw from.
          seed: seed of the epoch permutations (a non-negative int).
          shuffle: permute each epoch; ``False`` keeps the dataset order.

        Raises:
          ValueError: on an empty dataset or a negative / non-int seed.
        """
        if len(examples) == 0:
            raise ValueError("PromptSampler needs at least one example")
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self._examples = list(examples)
        self._seed = int(seed)
        self._shuffle = bool(shuffle)
        self._fingerprint = _fingerprint(self._examples)
        self._epoch = 0
        self._index = 0
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self._examples)

    @property
    def epoch(self) -> int:
        """Epochs completed so far (the epoch the next example comes from)."""
        return self._epoch

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self._shuffle:
            return np.arange(len(self._examples))
        return np.random.default_rng([self._seed, epoch]).permutation(len(self._examples))

    def next_batch(self, n: int) -> list[Example]:
        """The next ``n`` examples of the stream (``n`` may exceed the dataset size).

        Raises:
          ValueError: if ``n`` is not a positive int.
        """
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
            raise ValueError(f"batch size must be a positive int, got {n!r}")
        batch = []
        while len(batch) < n:
            take = min(n - len(batch), len(self._examples) - self._index)
            rows = self._order[self._index : self._index + take]
            batch.extend(self._examples[i] for i in rows)
            self._index += take
            if self._index == len(self._examples):
                self._epoch, self._index = self._epoch + 1, 0
                self._order = self._epoch_order(self._epoch)
        return batch

    def state(self) -> dict[str, Any]:
        """The position as a JSON-serialisable dict.

        ``epoch`` and ``index`` locate the next example; ``seed``, ``shuffle``, ``num_examples``
        and ``fingerprint`` let ``restore`` refuse a different dataset or seed.
        """
        return {
            "epoch": self._epoch,
            "index": self._index,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "num_examples": len(self._examples),
            "fingerprint": self._fingerprint,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Moves to a position saved by ``state()``.

        Raises:
          ValueError: if a key is missing or out of range, or if the state was saved by a
            sampler with another seed, shuffle flag or dataset.
        """
        missing = [k for k in ("epoch", "index") if k not in state]
        if missing:
            raise ValueError(f"sampler state lacks {missing}; got keys {sorted(state)}")
        epoch, index = state["epoch"], state["index"]
        for name, value in (("epoch", epoch), ("index", index)):
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
                raise ValueError(f"sampler state {name} must be a non-negative int, got {value!r}")
        if index >= len(self._examples):
            raise ValueError(
                f"sampler state index {index} is out of range for {len(self._examples)} examples"
            )
        expected = {
            "seed": self._seed,
            "shuffle": self._shuffle,
            "num_examples": len(self._examples),
            "fingerprint": self._fingerprint,
        }
        for key, value in expected.items():
            if key in state and state[key] != value:
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]!r} but this sampler has "
                    f"{key}={value!r}: resuming would draw different prompts"
                )
        self._epoch, self._index = int(epoch), int(index)
        self._order = self._epoch_order(self._epoch)


# --------------------------------------------------------------------------------------
# Prompt formatting
# --------------------------------------------------------------------------------------


def format_prompt(
    example_prompt: str,
    tokenizer: Any,
    *,
    chat_template: bool,
    system_prompt: str | None = None,
    messages: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The text the policy conditions on.

    With ``chat_template=True`` the prompt becomes the user message (after an optional system
    message) rendered by ``tokenizer.apply_chat_template(..., add_generation_prompt=True,
    tokenize=False)``, so the text ends where the assistant's reply starts. Otherwise the
    prompt is returned unchanged (a base model completes it directly).

    Args:
      example_prompt: the raw prompt (``Example.prompt``).
      tokenizer: a ``transformers`` tokenizer (only used with ``chat_template=True``).
      chat_template: render through the tokenizer's chat template.
      system_prompt: system message; needs ``chat_template=True``. With ``messages`` that
        open with their own system message, theirs is kept and this one is not added.
      messages: a whole conversation to render instead of the single user message
        ``example_prompt`` (``Example.messages``); needs ``chat_template=True``.

    Returns:
      The prompt text. Chat templates usually write the BOS token themselves: tokenise the
      result with ``add_special_tokens=False`` when the tokenizer would add it again.

    Raises:
      ValueError: if the tokenizer has no chat template, or a system prompt or messages are
        given without the chat template.
    """
    if not isinstance(example_prompt, str):
        raise ValueError(f"prompt must be a str, got {type(example_prompt).__name__}")
    if not chat_template:
        if system_prompt is not None:
            raise ValueError("system_prompt needs chat_template=True (a raw prompt has no roles)")
        if messages is not None:
            raise ValueError("chat messages need chat_template=True (a raw prompt has no roles)")
        return example_prompt
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"{type(tokenizer).__name__} has no chat template; set chat_template=False or use a "
            "tokenizer that defines one"
        )
    if messages is None:
        messages = [{"role": "user", "content": example_prompt}]
    conversation = [dict(m) for m in check_messages(messages)]
    if system_prompt is not None and conversation[0]["role"] != "system":
        conversation.insert(0, {"role": "system", "content": system_prompt})
    return tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)


def format_example(
    example: Example, tokenizer: Any, *, chat_template: bool, system_prompt: str | None = None
) -> str:
    """``format_prompt`` of an example: its ``messages`` when it has them, else its prompt."""
    return format_prompt(
        example.prompt,
        tokenizer,
        chat_template=chat_template,
        system_prompt=system_prompt,
        messages=example.messages,
    )
