"""Preference data on the host: records from the config, tokenised splits, batches of rows.

Pairs are encoded once, with dataset-wide widths (one compiled program for every batch);
KTO's labelled completions carry each row's mismatched partner for the KL estimate.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any, NamedTuple

import numpy as np

from jaxrl_llm import data
from jaxrl_llm.train.preference.config import PreferenceConfig
from jaxrl_llm.train.preference.losses import UnpairedBatch
from jaxrl_llm.types import PreferenceBatch

log = logging.getLogger("jaxrl_llm")


def load_records(cfg: PreferenceConfig) -> tuple[list, list]:
    """``(train, eval)`` records of ``cfg.data``: ``PreferencePair``s, or for KTO
    ``UnpairedExample``s (paired data is split into desirable and undesirable completions).

    Raises:
      FileNotFoundError / ValueError: from the JSONL loaders, naming the file and line.
    """
    d = cfg.data
    if d.task == "arithmetic":
        pairs = data.arithmetic_preference_pairs(
            d.num_train + d.eval_size,
            seed=cfg.seed,
            digits=d.digits,
            ops=d.ops,
            max_offset=d.max_offset,
        )
        train, evaluation = pairs[d.eval_size :], pairs[: d.eval_size]
    else:
        if d.unpaired:
            fields = {"completion_field": d.completion_field, "label_field": d.label_field}
            load = functools.partial(data.load_unpaired_jsonl, **fields)
        else:
            fields = {"chosen_field": d.chosen_field, "rejected_field": d.rejected_field}
            load = functools.partial(
                data.load_preference_jsonl, margin_field=d.margin_field, **fields
            )
        train = load(d.train_path, prompt_field=d.prompt_field)
        if d.eval_path is not None:
            evaluation = load(d.eval_path, prompt_field=d.prompt_field)[: d.eval_size]
        else:
            train, evaluation = data.split_eval(train, eval_size=d.eval_size, seed=cfg.seed)
    if cfg.loss.name == "kto" and not d.unpaired:
        train, evaluation = data.pairs_to_unpaired(train), data.pairs_to_unpaired(evaluation)
    return train, evaluation


def is_scalar_model(path: str | None) -> bool:
    """Whether ``path`` holds a ``*ForSequenceClassification`` checkpoint (a reward model)."""
    if path is None:
        return False
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        return False
    with open(config_file, encoding="utf-8") as f:
        archs = json.load(f).get("architectures") or []
    return any(a.endswith("ForSequenceClassification") for a in archs)


class Split(NamedTuple):
    """One encoded split: its arrays and, for KTO, each row's mismatched partner."""

    arrays: Any  # PreferenceArrays or UnpairedArrays (host)
    partners: np.ndarray | None  # KTO: the row whose completion pairs with each prompt


def take(split: Split, rows: np.ndarray, ref: dict | None, unpaired: bool):
    """The host batch of ``rows`` (with their precomputed reference log-probs, if any)."""
    a = split.arrays
    ref_first = None if ref is None else ref["first"][rows]
    ref_second = None if ref is None else ref["second"][rows]
    if unpaired:
        partner = split.partners[rows]
        return UnpairedBatch(
            a.prompt_tokens[rows],
            a.prompt_mask[rows],
            a.completion_tokens[rows],
            a.completion_mask[rows],
            a.labels[rows],
            a.completion_tokens[partner],
            a.completion_mask[partner],
            ref_first,
            ref_second,
        )
    return PreferenceBatch(
        a.prompt_tokens[rows],
        a.prompt_mask[rows],
        a.chosen_tokens[rows],
        a.chosen_mask[rows],
        a.rejected_tokens[rows],
        a.rejected_mask[rows],
        ref_first,
        ref_second,
    )


def encode_splits(
    cfg: PreferenceConfig, tokenizer, train: list, evaluation: list
) -> tuple[Split, Split, int, np.ndarray]:
    """Tokenises both splits with one set of widths (they share compiled programs).

    Returns:
      ``(train, eval, truncated, keys)``: the splits, the number of records cut to the length
      limits, and the training rows' grouping keys for the ``IndexSampler``.
    """
    d = cfg.data
    unpaired = cfg.loss.name == "kto"
    records = train + evaluation
    prompts = [
        data.format_prompt(
            r.prompt,
            tokenizer,
            chat_template=d.chat_template,
            system_prompt=d.system_prompt,
        )
        for r in records
    ]
    limits = {
        "max_prompt_tokens": d.max_prompt_tokens,
        "max_completion_tokens": d.max_completion_tokens,
        "truncate": d.truncate,
        "add_special_tokens": not d.chat_template,
    }
    # Both splits in one encoding: the same widths, so they share compiled programs.
    if unpaired:
        completions = [r.completion for r in records]
        labels = [r.label for r in records]
        arrays, truncated = data.encode_unpaired(tokenizer, prompts, completions, labels, **limits)
        keys = data.unpaired_keys(train)
    else:
        chosen, rejected = [r.chosen for r in records], [r.rejected for r in records]
        margins = [r.margin for r in records]
        arrays, truncated = data.encode_pairs(
            tokenizer, prompts, chosen, rejected, margins=margins, **limits
        )
        keys = data.pair_keys(train)
    if truncated:
        log.warning("%d of %d records were truncated to the length limits", truncated, len(records))
    splits = []
    for rows in (np.arange(len(train)), len(train) + np.arange(len(evaluation))):
        part = type(arrays)(*(x[rows] for x in arrays))
        splits.append(Split(part, data.mismatched_partners(len(rows)) if unpaired else None))
    return splits[0], splits[1], truncated, keys
