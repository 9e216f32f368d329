"""Hugging Face datasets on disk (``data.load_hf_examples``): every path form, field mapping,
chat messages, the seeded shuffle, shards, a resumed sampler and the errors.

Every dataset is built locally in the test (``Dataset.from_dict`` then ``save_to_disk`` /
``to_parquet`` / ``to_json``); ``datasets``' cache goes to the test's temporary directory.
"""

from __future__ import annotations

import json
import sys

import datasets
import numpy as np
import pytest

from jaxrl_llm.data import Example, PromptSampler, hf, load_hf_examples
from jaxrl_llm.data.hf import open_dataset, shard_indices

N = 10
COLUMNS = {
    "prompt": [f"q{i}" for i in range(N)],
    "answer": [str(i * i) for i in range(N)],
    "level": list(range(N)),
}


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    """``load_dataset`` (parquet / JSON) writes its Arrow cache here, not in ~/.cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def _dataset(columns=None):
    return datasets.Dataset.from_dict(COLUMNS if columns is None else columns)


def _prompts(examples):
    return [ex.prompt for ex in examples]


# --------------------------------------------------------------------------------------
# Path forms
# --------------------------------------------------------------------------------------


def test_a_saved_dataset_directory(tmp_path):
    _dataset().save_to_disk(tmp_path / "saved")
    examples = load_hf_examples(tmp_path / "saved")
    assert _prompts(examples) == COLUMNS["prompt"]
    assert examples[3] == Example(prompt="q3", answer="9", extra={"level": 3})
    with pytest.raises(ValueError, match=r"saved Dataset .* holds one dataset without splits"):
        load_hf_examples(tmp_path / "saved", split="test")


def test_a_saved_dataset_dict_and_its_splits(tmp_path):
    test = _dataset({"prompt": ["t0", "t1"], "answer": ["0", "1"], "level": [0, 1]})
    datasets.DatasetDict({"train": _dataset(), "test": test}).save_to_disk(tmp_path / "dd")
    assert len(load_hf_examples(tmp_path / "dd")) == N
    assert _prompts(load_hf_examples(tmp_path / "dd", split="test")) == ["t0", "t1"]
    with pytest.raises(ValueError, match=r"has no split 'validation'; its splits: \['train', 'te"):
        load_hf_examples(tmp_path / "dd", split="validation")


def test_single_files_parquet_json_and_jsonl(tmp_path):
    _dataset().to_parquet(tmp_path / "d.parquet")
    _dataset().to_json(tmp_path / "d.jsonl")  # JSON lines
    (tmp_path / "d.json").write_text(json.dumps(_dataset().to_list()))  # one JSON array
    for name in ("d.parquet", "d.jsonl", "d.json"):
        examples = load_hf_examples(tmp_path / name)
        assert _prompts(examples) == COLUMNS["prompt"], name
        assert examples[2].extra == {"level": 2}
    with pytest.raises(ValueError, match=r"the parquet file .* has no split 'test'"):
        load_hf_examples(tmp_path / "d.parquet", split="test")


def test_a_directory_of_files_is_split_by_file_name(tmp_path):
    (tmp_path / "data").mkdir()
    _dataset().to_parquet(tmp_path / "data" / "train-00000-of-00001.parquet")
    _dataset({"prompt": ["t"], "answer": ["1"], "level": [0]}).to_parquet(
        tmp_path / "data" / "test-00000-of-00001.parquet"
    )
    assert len(load_hf_examples(tmp_path)) == N
    assert _prompts(load_hf_examples(tmp_path, split="test")) == ["t"]
    with pytest.raises(ValueError, match=r"no 'dev' files; its splits by file name: \['test', 'tr"):
        load_hf_examples(tmp_path, split="dev")
    # Files named after no split are all the train split.
    (tmp_path / "plain").mkdir()
    _dataset().to_json(tmp_path / "plain" / "gsm8k.jsonl")
    (tmp_path / "plain" / "notes.txt").write_text("not data")
    assert len(load_hf_examples(tmp_path / "plain")) == N


# --------------------------------------------------------------------------------------
# Field mapping and chat messages
# --------------------------------------------------------------------------------------


def test_field_mapping_numbers_and_nested_answers(tmp_path):
    columns = {
        "question": ["a", "b"],
        "final": [72, 3],  # numbers become their str, as in JSONL
        "reward_model": [
            {"ground_truth": "7", "style": "rule"},
            {"ground_truth": "8", "style": "x"},
        ],
    }
    _dataset(columns).save_to_disk(tmp_path / "d")
    examples = load_hf_examples(tmp_path / "d", prompt_key="question", answer_key="final")
    assert [(ex.prompt, ex.answer) for ex in examples] == [("a", "72"), ("b", "3")]
    assert examples[0].extra == {"reward_model": {"ground_truth": "7", "style": "rule"}}
    # verl's layout: the answer nested in a column; the column stays in extra.
    nested = load_hf_examples(
        tmp_path / "d", prompt_key="question", answer_key="reward_model.ground_truth"
    )
    assert [ex.answer for ex in nested] == ["7", "8"]
    assert nested[1].extra == {"final": 3, "reward_model": {"ground_truth": "8", "style": "x"}}


def test_messages_key_makes_chat_examples(tmp_path):
    columns = {
        "prompt": [
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1?"}],
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "2+2?"},
            ],
        ],
        "answer": ["2", "4"],
        "source": ["x", "y"],
    }
    _dataset(columns).save_to_disk(tmp_path / "chat")
    examples = load_hf_examples(tmp_path / "chat", messages_key="prompt")
    # The prompt is the last user message; the conversation is kept whole.
    assert [ex.prompt for ex in examples] == ["1+1?", "2+2?"]
    assert examples[1].messages == tuple(columns["prompt"][1])
    assert examples[0].extra == {"source": "x"}
    # Read as plain prompts, a list of messages is a clear mistake.
    with pytest.raises(ValueError, match=r"row 0: field 'prompt' must be a string.*messages_key="):
        load_hf_examples(tmp_path / "chat")


# --------------------------------------------------------------------------------------
# Shuffle, shards, resume
# --------------------------------------------------------------------------------------


def test_the_shuffle_is_the_documented_seeded_permutation(tmp_path):
    _dataset().save_to_disk(tmp_path / "d")
    order = np.random.default_rng(7).permutation(N)
    shuffled = load_hf_examples(tmp_path / "d", shuffle_seed=7)
    assert _prompts(shuffled) == [f"q{i}" for i in order]
    assert _prompts(load_hf_examples(tmp_path / "d", shuffle_seed=7)) == _prompts(shuffled)
    assert _prompts(load_hf_examples(tmp_path / "d", shuffle_seed=8)) != _prompts(shuffled)
    assert _prompts(load_hf_examples(tmp_path / "d")) == COLUMNS["prompt"]


@pytest.mark.parametrize("num_shards", [1, 3, 4])
def test_shards_partition_the_shuffled_split(tmp_path, num_shards):
    _dataset().save_to_disk(tmp_path / "d")
    shards = [
        _prompts(
            load_hf_examples(tmp_path / "d", shuffle_seed=3, num_shards=num_shards, shard_index=i)
        )
        for i in range(num_shards)
    ]
    # Contiguous blocks of the shuffled order, sizes differing by at most one.
    assert sum(shards, []) == _prompts(load_hf_examples(tmp_path / "d", shuffle_seed=3))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_shard_arguments_are_checked():
    np.testing.assert_array_equal(shard_indices(7, 3, 0), [0, 1, 2])
    np.testing.assert_array_equal(shard_indices(7, 3, 2), [5, 6])
    for args, message in (
        ((5, 0, 0), "num_shards must be an int >= 1"),
        ((5, 2, 2), "shard_index must be < num_shards=2"),
        ((5, 2, -1), "shard_index must be an int >= 0"),
        ((5, True, 0), "num_shards must be an int"),
    ):
        with pytest.raises(ValueError, match=message):
            shard_indices(*args)


def test_a_resumed_run_draws_the_same_prompts(tmp_path):
    """The trainer stores ``PromptSampler.state()``; a new process reloads the dataset (same
    seeded shuffle) and restores it: the next batches equal an uninterrupted run's."""
    _dataset().save_to_disk(tmp_path / "d")
    uninterrupted = PromptSampler(load_hf_examples(tmp_path / "d", shuffle_seed=0), seed=0)
    reference = [_prompts(uninterrupted.next_batch(4)) for _ in range(6)]
    first = PromptSampler(load_hf_examples(tmp_path / "d", shuffle_seed=0), seed=0)
    for _ in range(2):
        first.next_batch(4)
    saved = json.loads(json.dumps(first.state()))
    resumed = PromptSampler(load_hf_examples(tmp_path / "d", shuffle_seed=0), seed=0)
    resumed.restore(saved)
    assert [_prompts(resumed.next_batch(4)) for _ in range(4)] == reference[2:]
    # Another load order is another dataset for the sampler: refused, not silently resumed.
    other = PromptSampler(load_hf_examples(tmp_path / "d", shuffle_seed=1), seed=0)
    with pytest.raises(ValueError, match="fingerprint"):
        other.restore(saved)


# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------


def test_paths_that_hold_no_dataset(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        load_hf_examples(tmp_path / "no-such-dir")
    (tmp_path / "d.csv").write_text("prompt,answer\na,1\n")
    with pytest.raises(ValueError, match=r"d.csv' is neither parquet nor JSON/JSONL \(extension"):
        load_hf_examples(tmp_path / "d.csv")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"directory but no dataset.*holds \['notes.txt'\]"):
        load_hf_examples(tmp_path / "empty")
    (tmp_path / "mixed").mkdir()
    _dataset().to_parquet(tmp_path / "mixed" / "train-0.parquet")
    _dataset().to_json(tmp_path / "mixed" / "train-1.jsonl")
    with pytest.raises(ValueError, match="mixes parquet and JSON files"):
        load_hf_examples(tmp_path / "mixed")


def test_missing_columns_and_bad_values_are_named(tmp_path, monkeypatch):
    _dataset().save_to_disk(tmp_path / "d")
    with pytest.raises(ValueError, match=r"no column 'question'; the columns are \['prompt', 'an"):
        load_hf_examples(tmp_path / "d", prompt_key="question")
    with pytest.raises(ValueError, match="no column 'final'"):
        load_hf_examples(tmp_path / "d", answer_key="final")
    with pytest.raises(ValueError, match="no column 'messages'"):
        load_hf_examples(tmp_path / "d", messages_key="messages")
    _dataset({"prompt": ["a", "b"], "answer": ["1", None]}).save_to_disk(tmp_path / "null")
    with pytest.raises(ValueError, match=r"\[train\] row 1: field 'answer' must be a string or"):
        load_hf_examples(tmp_path / "null")
    _dataset({"prompt": ["a"], "answer": [True]}).save_to_disk(tmp_path / "bool")
    with pytest.raises(ValueError, match="must be a string or a number, got True"):
        load_hf_examples(tmp_path / "bool")
    with pytest.raises(ValueError, match="shard 4 of 5 is empty"):
        load_hf_examples(tmp_path / "null", num_shards=5, shard_index=4)
    # (``datasets`` itself cannot reload an empty split it saved, so one is made in memory.)
    empty = _dataset({"prompt": ["a"], "answer": ["1"]}).select([])
    monkeypatch.setattr(hf, "open_dataset", lambda path, split: empty)
    with pytest.raises(ValueError, match="the split holds no row"):
        load_hf_examples(tmp_path / "none")


def test_without_datasets_the_error_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "answer": "1"}\n')
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(ImportError, match=r'pip install "jaxrl-llm\[datasets\]"'):
        open_dataset(tmp_path / "d.jsonl")
