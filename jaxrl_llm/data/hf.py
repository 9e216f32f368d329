"""Prompt datasets stored with Hugging Face ``datasets``, read from disk (``data.task: hf``).

``load_hf_examples`` accepts what ``datasets`` writes or reads locally:

* a directory written by ``Dataset.save_to_disk`` (one dataset) or ``DatasetDict.save_to_disk``
  (named splits);
* one ``.parquet``, ``.json`` or ``.jsonl`` file (one dataset);
* a directory of such files (one format), split by file name as ``datasets.load_dataset``
  splits a Hub repository: ``train.jsonl``, ``data/test-00000-of-00001.parquet``, ... (files
  named after no split are all ``train``).

A source holding one dataset has no splits: it is the ``train`` split, and asking it for
another is an error naming what was found. Rows become ``Example`` s: the prompt column (or a
chat ``messages`` column), the answer column (numbers become their ``str``, as in JSONL) and
every other column in ``Example.extra``. ``datasets`` is an optional dependency, imported on
first use (``pip install "jaxrl-llm[datasets]"``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxrl_llm.data.datasets import Example, answer_text, check_messages, last_user_message

FILE_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json"}
INSTALL_HINT = 'pip install "jaxrl-llm[datasets]"'


def _import_datasets():
    try:
        import datasets
    except ImportError as err:
        raise ImportError(
            f"data.task: hf reads Hugging Face datasets and needs the `datasets` package: "
            f"{INSTALL_HINT}"
        ) from err
    return datasets


def _data_files(path: str) -> list[str]:
    """Every ``.parquet`` / ``.json`` / ``.jsonl`` file under the directory ``path``."""
    found = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [
            os.path.join(root, f)
            for f in sorted(files)
            if not f.startswith(".") and os.path.splitext(f)[1] in FILE_BUILDERS
        ]
    return found


def _load_files(datasets: Any, files: list[str], what: str) -> Any:
    builders = {FILE_BUILDERS[os.path.splitext(f)[1]] for f in files}
    if len(builders) > 1:
        raise ValueError(f"{what} mixes parquet and JSON files; keep one format per dataset")
    return datasets.load_dataset(builders.pop(), data_files=files, split="train")


def _check_unsplit(split: str, what: str) -> None:
    """A source holding one dataset is the ``train`` split and has no other."""
    if split != "train":
        raise ValueError(
            f"{what} holds one dataset without splits (it is the 'train' split), so it has no "
            f"split {split!r}; save a DatasetDict or name files by split (train.jsonl, "
            "test.jsonl) for several splits"
        )


def open_dataset(path: str | os.PathLike, split: str = "train") -> Any:
    """The ``split`` of the dataset at ``path`` as a ``datasets.Dataset`` (see the module
    docstring for the forms of ``path``).

    Raises:
      FileNotFoundError: if ``path`` does not exist.
      ValueError: naming what was found at ``path`` when it is no dataset, has no split
        ``split`` (listing those it has) or mixes file formats.
      ImportError: naming the ``datasets`` extra when the package is missing.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset path {path!r} does not exist")
    datasets = _import_datasets()
    if os.path.isfile(path):
        ext = os.path.splitext(path)[1]
        if ext not in FILE_BUILDERS:
            raise ValueError(
                f"dataset file {path!r} is neither parquet nor JSON/JSONL (extension {ext!r}); "
                f"expected one of {sorted(FILE_BUILDERS)} or a dataset directory"
            )
        what = f"the {FILE_BUILDERS[ext]} file {path!r}"
        _check_unsplit(split, what)
        return _load_files(datasets, [path], what)
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        splits = datasets.load_from_disk(path)
        if split not in splits:
            raise ValueError(
                f"the saved DatasetDict {path!r} has no split {split!r}; its splits: {list(splits)}"
            )
        return splits[split]
    if os.path.isfile(os.path.join(path, "state.json")):
        _check_unsplit(split, f"the saved Dataset {path!r}")
        return datasets.load_from_disk(path)
    files = _data_files(path)
    if not files:
        entries = sorted(os.listdir(path))[:10]
        raise ValueError(
            f"{path!r} is a directory but no dataset: no save_to_disk files (state.json, "
            f"dataset_dict.json) and no .parquet/.json/.jsonl file; it holds {entries}"
        )
    from datasets.data_files import DataFilesDict, get_data_patterns

    by_split = {}  # the Hub's split-by-file-name rules, on the data files only
    for name, found in DataFilesDict.from_patterns(get_data_patterns(path), path).items():
        found = sorted(f for f in found if os.path.splitext(f)[1] in FILE_BUILDERS)
        if found:
            by_split[str(name)] = found
    if split not in by_split:
        raise ValueError(
            f"the directory {path!r} has no {split!r} files; its splits by file name: "
            f"{sorted(by_split)} ({len(files)} data files)"
        )
    return _load_files(datasets, by_split[split], f"the {split!r} files of {path!r}")


def _get(record: Mapping[str, Any], key: str) -> tuple[bool, Any]:
    """``record[key]``, or for a dotted ``key`` (``reward_model.ground_truth``) the nested
    value when no column has the dotted name itself; ``(found, value)``."""
    if key in record:
        return True, record[key]
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _row_example(
    record: dict[str, Any], where: str, prompt_key: str, answer_key: str, messages_key: str | None
) -> Example:
    answer = answer_text(_get(record, answer_key)[1], where, answer_key)
    messages = None
    if messages_key is not None:
        messages = check_messages(_get(record, messages_key)[1], f"{where}: {messages_key!r}")
        prompt = messages[last_user_message(messages)]["content"]
    else:
        prompt = _get(record, prompt_key)[1]
        if not isinstance(prompt, str):
            hint = ""
            if isinstance(prompt, list):
                hint = f" (chat messages? set messages_key={prompt_key!r})"
            raise ValueError(
                f"{where}: field {prompt_key!r} must be a string, got {prompt!r}{hint}"
            )
    # A nested answer (``reward_model.ground_truth``) leaves its parent column in ``extra``.
    used = {answer_key, prompt_key if messages_key is None else messages_key}
    extra = {k: v for k, v in record.items() if k not in used}
    return Example(prompt=prompt, answer=answer, extra=extra, messages=messages)


def shard_indices(num_rows: int, num_shards: int, shard_index: int) -> np.ndarray:
    """Rows of shard ``shard_index`` of ``num_shards``: contiguous blocks whose sizes differ by
    at most one (the first ``num_rows % num_shards`` shards hold one more), as
    ``np.array_split`` and ``datasets.Dataset.shard(contiguous=True)`` cut them."""
    for name, value, low in (("num_shards", num_shards, 1), ("shard_index", shard_index, 0)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if shard_index >= num_shards:
        raise ValueError(f"shard_index must be < num_shards={num_shards}, got {shard_index}")
    return np.array_split(np.arange(num_rows), num_shards)[shard_index]


def load_hf_examples(
    path: str | os.PathLike,
    *,
    split: str = "train",
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    messages_key: str | None = None,
    shuffle_seed: int | None = None,
    num_shards: int = 1,
    shard_index: int = 0,
) -> list[Example]:
    """Reads one split of a Hugging Face dataset on disk as ``Example`` s.

    The rows are put in the order ``np.random.default_rng(shuffle_seed).permutation(N)``
    (file order when ``shuffle_seed`` is None), then cut into ``num_shards`` contiguous shards
    of which shard ``shard_index`` is returned: the shards of one seed partition the split, and
    every caller with the same seed agrees on them. Only the shard's rows are read into Python
    (Arrow memory-maps the rest).

    Args:
      path: a ``save_to_disk`` directory (Dataset or DatasetDict), a ``.parquet`` /
        ``.json`` / ``.jsonl`` file or a directory of such files (module docstring).
      split: the split to read; a source holding one dataset is the ``train`` split.
      prompt_key: the prompt column (a string per row).
      answer_key: the reference-answer column (string or number); a dotted key such as
        ``reward_model.ground_truth`` reads a nested field.
      messages_key: a column of chat conversations (``[{"role", "content"}, ...]``) used as the
        prompt through the chat template instead of ``prompt_key``; ``Example.prompt`` is then
        the content of the last user message.
      shuffle_seed: seed of the row permutation; None keeps the stored order.
      num_shards: how many shards to cut the (shuffled) split into.
      shard_index: which shard to return, in ``[0, num_shards)``.

    Returns:
      The shard's examples, every column other than the prompt / messages and answer ones in
      ``Example.extra``.

    Raises:
      FileNotFoundError: if ``path`` does not exist.
      ValueError: on a path that holds no dataset or lacks ``split``, a missing column (naming
        the columns present), a value of the wrong type (naming its row), an empty split or
        shard, or bad shard arguments.
      ImportError: naming the ``datasets`` extra when the package is missing.
    """
    dataset = open_dataset(path, split)
    where = f"{os.fspath(path)} [{split}]"
    columns = list(dataset.column_names)
    wanted = [answer_key, prompt_key if messages_key is None else messages_key]
    for key in wanted:
        if key not in columns and key.split(".")[0] not in columns:
            raise ValueError(f"{where}: no column {key!r}; the columns are {columns}")
    if len(dataset) == 0:
        raise ValueError(f"{where}: the split holds no row")
    order = np.arange(len(dataset))
    if shuffle_seed is not None:
        order = np.random.default_rng(shuffle_seed).permutation(len(dataset))
    rows = order[shard_indices(len(dataset), num_shards, shard_index)]
    if rows.size == 0:
        raise ValueError(
            f"{where}: shard {shard_index} of {num_shards} is empty ({len(dataset)} rows)"
        )
    records = dataset.select(rows.tolist()).to_list()
    examples = []
    for row, record in zip(rows.tolist(), records):
        found, _ = _get(record, answer_key)
        if not found:
            raise ValueError(f"{where} row {row}: no field {answer_key!r} in {sorted(record)}")
        examples.append(
            _row_example(record, f"{where} row {row}", prompt_key, answer_key, messages_key)
        )
    return examples
