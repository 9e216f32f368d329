"""The RL run's prompt task: the ``data`` section's checks, loading and prompt truncation.

``load_task`` reads the configured task (built-in arithmetic, JSONL, or a Hugging Face dataset
on disk, docs/datasets.md); ``train.rl.context.screen_prompts`` then measures every formatted
prompt as the rollout tokenises it and drops, refuses or truncates (``truncate_example``) the
ones over ``data.max_prompt_tokens``. Nothing here imports the config module (it imports
this one): sections are read by attribute.

On several processes every process loads the same examples in the same (seeded) order: the
trainer's sampler then draws the same global batch everywhere and each process feeds only its
own rows to the mesh (``train.setup.to_device``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from jaxrl_llm import data
from jaxrl_llm.data import carry_slips, coverage
from jaxrl_llm.data.datasets import Example, last_user_message

log = logging.getLogger("jaxrl_llm")

DATA_TASKS = ("arithmetic", "carry_slips", "jsonl", "hf")
OVERLONG_PROMPTS = ("filter", "error", "truncate")
TRUNCATION_SIDES = ("left", "right")


def data_keys(section: Any) -> tuple[str, str]:
    """``(prompt, answer)`` field names: ``prompt_key`` / ``answer_key`` where set, else
    ``prompt_field`` / ``answer_field``."""
    prompt = section.prompt_field if section.prompt_key is None else section.prompt_key
    answer = section.answer_field if section.answer_key is None else section.answer_key
    return prompt, answer


def _name(key: str, value: Any, *, optional: bool = False) -> None:
    if (value is None and optional) or (isinstance(value, str) and value):
        return
    raise ValueError(f"data.{key} must be a non-empty string{' or null' * optional}, got {value!r}")


def check_data(section: Any) -> None:
    """The ``data`` section's checks (part of ``train.rl.config.check_config``).

    Raises:
      ValueError: naming the key(s) of an invalid or inconsistent setting.
    """
    d = section
    for key, value, choices in (
        ("task", d.task, DATA_TASKS),
        ("overlong_prompts", d.overlong_prompts, OVERLONG_PROMPTS),
        ("truncation_side", d.truncation_side, TRUNCATION_SIDES),
    ):
        if value not in choices:
            raise ValueError(f"data.{key} must be one of {choices}, got {value!r}")
    if isinstance(d.max_prompt_tokens, bool) or not (
        isinstance(d.max_prompt_tokens, int) and d.max_prompt_tokens >= 1
    ):
        raise ValueError(f"data.max_prompt_tokens must be an int >= 1, got {d.max_prompt_tokens!r}")
    if not isinstance(d.shuffle, bool):
        raise ValueError(f"data.shuffle must be true or false, got {d.shuffle!r}")
    _name("prompt_field", d.prompt_field)
    _name("answer_field", d.answer_field)
    for key in ("prompt_key", "answer_key", "messages_key", "eval_split"):
        _name(key, getattr(d, key), optional=True)
    if d.task == "carry_slips":
        bad = [op for op in d.ops if op not in carry_slips.SLIP_OPS]
        if bad:
            raise ValueError(
                f"data.task=carry_slips takes data.ops from {carry_slips.SLIP_OPS}, got {bad}"
            )
        try:  # data.slip_rate where the section has one
            carry_slips.check_slip_rate(getattr(d, "slip_rate", carry_slips.SLIP_RATE))
        except ValueError as err:
            raise ValueError(f"data.{err}") from None
    if d.task == "jsonl":
        if d.train_path is None:
            raise ValueError("data.task=jsonl needs data.train_path")
        for key in ("path", "eval_split", "messages_key"):
            if getattr(d, key) is not None:
                raise ValueError(f"data.{key} is read by data.task=hf, not data.task=jsonl")
    if d.task != "hf":
        return
    if d.path is None:
        raise ValueError(
            "data.task=hf needs data.path: a save_to_disk directory, a .parquet / .json / "
            ".jsonl file or a directory of them"
        )
    for key in ("train_path", "eval_path"):
        if getattr(d, key) is not None:
            raise ValueError(f"data.{key} is read by data.task=jsonl; data.task=hf reads data.path")
    _name("split", d.split)
    if d.eval_split == d.split:
        raise ValueError(
            f"data.eval_split={d.eval_split!r} is the training split: hold out another split, or "
            "leave it null to split data.eval_size examples off"
        )
    if d.messages_key is not None and not d.chat_template:
        raise ValueError(
            "data.messages_key needs data.chat_template=true: the conversations are rendered "
            "through the tokenizer's chat template"
        )


def _exists(key: str, path: str, hint: str) -> None:
    if not os.path.isfile(path):
        raise ValueError(f"data.{key}: no such file {path!r}{hint}")


def load_task(section: Any, seed: int) -> tuple[list[Example], list[Example]]:
    """``(train, eval)`` examples of the ``data`` section's task (unscreened).

    ``eval`` holds at most ``eval_size`` examples: the held-out file's / split's first ones,
    or ``eval_size`` drawn from the training examples (``data.split_eval`` in ``seed``). The
    ``hf`` task shuffles with ``seed`` (``data.shuffle``) before either.
    """
    if section.task == "arithmetic":
        examples = data.arithmetic_examples(
            section.num_train + section.eval_size,
            seed=seed,
            digits=section.digits,
            ops=section.ops,
        )
        return examples[section.eval_size :], examples[: section.eval_size]
    if section.task == "carry_slips":  # the same prompts; the demonstrations slip
        examples = carry_slips.carry_slip_examples(
            section.num_train + section.eval_size,
            seed=seed,
            digits=section.digits,
            ops=section.ops,
            slip_rate=getattr(section, "slip_rate", carry_slips.SLIP_RATE),
        )
        return examples[section.eval_size :], examples[: section.eval_size]
    prompt_key, answer_key = data_keys(section)
    if section.task == "hf":

        def load(split: str) -> list[Example]:
            return data.load_hf_examples(
                section.path,
                split=split,
                prompt_key=prompt_key,
                answer_key=answer_key,
                messages_key=section.messages_key,
                shuffle_seed=seed if section.shuffle else None,
            )

        train = load(section.split)
        held_out = None if section.eval_split is None else load(section.eval_split)
    else:
        fields = {"prompt_field": prompt_key, "answer_field": answer_key}
        _exists("train_path", section.train_path, "")
        train = data.load_jsonl(section.train_path, **fields)
        held_out = None
        if section.eval_path is not None:
            _exists(
                "eval_path",
                section.eval_path,
                " (data.eval_path=null holds out data.eval_size examples of data.train_path)",
            )
            held_out = data.load_jsonl(section.eval_path, **fields)
    if held_out is not None:
        return train, held_out[: section.eval_size]
    if section.eval_size >= len(train) / 2 and section.eval_size < len(train):
        log.warning(
            "data: data.eval_size=%d holds out %d of the %d examples (%.0f%%), leaving %d to "
            "train on: lower data.eval_size or give a held-out set (%s)",
            section.eval_size,
            section.eval_size,
            len(train),
            100 * section.eval_size / len(train),
            len(train) - section.eval_size,
            "data.eval_split" if section.task == "hf" else "data.eval_path",
        )
    return data.split_eval(train, eval_size=section.eval_size, seed=seed)


#: The share of the data's characters a tokenizer may map to its unknown token.
UNKNOWN_SHARE = 0.02


def check_readable(tokenizer: Any, examples: list[Example], *, builtin: bool) -> None:
    """Refuses data the tokenizer cannot read: more than ``UNKNOWN_SHARE`` of the characters
    of the first 1000 examples' prompts and answers mapped to its unknown token
    (``data.coverage``). ``builtin``: the tokenizer is the built-in tiny model's.

    Raises:
      ValueError: naming the share, the commonest unknown characters and the fix.
    """
    sample = examples[:1000]
    found = coverage.unknown_characters(
        tokenizer, [text for ex in sample for text in (_prompt_text(ex), ex.answer)]
    )
    if found.share <= UNKNOWN_SHARE:
        return
    shown = ", ".join(repr(c) for c in found.examples)
    if builtin:
        alphabet = "".join(
            t for _, t in sorted((i, t) for t, i in tokenizer.get_vocab().items() if len(t) == 1)
        )
        fix = (
            f"the built-in tiny model's character tokenizer reads only {alphabet!r}: "
            "set model.path to a Hugging Face model whose tokenizer covers the data"
        )
    else:
        fix = "set model.path to a model whose tokenizer covers the data, or clean the data"
    raise ValueError(
        f"the tokenizer maps {100 * found.share:.0f}% of the data's characters to its unknown "
        f"token {tokenizer.unk_token!r}{f' (e.g. {shown})' if shown else ''}: {fix}"
    )


# --------------------------------------------------------------------------------------
# Prompt length and truncation
# --------------------------------------------------------------------------------------


def formatted_length(section: Any, tokenizer: Any, example: Example) -> tuple[str, int]:
    """``(text, tokens)``: the formatted prompt and its length, tokenised exactly as the
    rollout does (``data.encode_prompts``, special tokens only without the chat template)."""
    text = data.format_example(
        example, tokenizer, chat_template=section.chat_template, system_prompt=section.system_prompt
    )
    return text, len(tokenizer(text, add_special_tokens=not section.chat_template)["input_ids"])


def _prompt_text(example: Example) -> str:
    if example.messages is None:
        return example.prompt
    return example.messages[last_user_message(example.messages)]["content"]


def _with_text(example: Example, text: str) -> Example:
    """``example`` with its prompt text (its last user message) replaced by ``text``."""
    if example.messages is None:
        return dataclasses.replace(example, prompt=text)
    messages = [dict(m) for m in example.messages]
    messages[last_user_message(messages)]["content"] = text
    return dataclasses.replace(example, prompt=text, messages=tuple(messages))


def _cutter(tokenizer: Any, text: str, side: str):
    """``(n, cut)``: the text's token count and ``cut(k)``, its last (``left``) or first
    (``right``) ``k`` tokens as text: sliced at the tokens' character offsets (a fast
    tokenizer), else decoded."""
    try:
        spans = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)[
            "offset_mapping"
        ]
    except NotImplementedError:  # slow tokenizers have no offsets
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if side == "left":
            return len(ids), lambda k: tokenizer.decode(ids[len(ids) - k :])
        return len(ids), lambda k: tokenizer.decode(ids[:k])
    if side == "left":
        return len(spans), lambda k: text[spans[len(spans) - k][0] :]
    return len(spans), lambda k: text[: spans[k - 1][1]]


def truncate_example(
    section: Any, tokenizer: Any, example: Example, limit: int
) -> tuple[Example, int] | None:
    """``example`` with its prompt text cut so the formatted prompt fits ``limit`` tokens.

    Only the prompt's own text is cut (with chat messages, the last user message), at a token
    boundary: ``truncation_side: left`` keeps its last tokens, ``right`` its first. The chat
    template, system prompt and earlier turns stay whole. Each candidate is re-formatted and
    re-tokenised as the rollout will (``formatted_length``), so the result fits exactly,
    whatever merges the cut changes; it keeps as many tokens as fit (one more would not).

    Returns:
      ``(example, length)``: the fitted example and its formatted length (``example`` itself
      when it already fits), or None when even one token of text does not fit (the template,
      system prompt or earlier turns alone fill the limit).
    """
    _, length = formatted_length(section, tokenizer, example)
    if length <= limit:
        return example, length
    num_tokens, cut = _cutter(tokenizer, _prompt_text(example), section.truncation_side)

    def attempt(keep: int) -> tuple[Example, int] | None:
        text = cut(keep)
        if not text:
            return None
        candidate = _with_text(example, text)
        return candidate, formatted_length(section, tokenizer, candidate)[1]

    keep = num_tokens - (length - limit)
    while keep >= 1:
        fitted = attempt(keep)
        if fitted is not None and fitted[1] <= limit:
            # Merges across the cut can make a longer text fit too: keep all that fits.
            while keep + 1 < num_tokens:
                more = attempt(keep + 1)
                if more is None or more[1] > limit:
                    break
                keep, fitted = keep + 1, more
            return fitted
        keep -= 1 if fitted is None else max(1, fitted[1] - limit)
    return None
