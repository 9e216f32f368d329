"""Data a run cannot learn from is said before training (issue 46, item 2): a tokenizer that
cannot read the data is refused with one line naming the share, examples and the fix; a
held-out split taking most of a small file is warned."""

from __future__ import annotations

import json
import logging

import pytest

from jaxrl_llm import data
from jaxrl_llm.data.datasets import Example
from jaxrl_llm.train import cli
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.rl import tasks
from jaxrl_llm.train.rl.config import TrainConfig
from tests.train.rl import rl_helpers


def _examples(prompt: str, n: int = 10) -> list[Example]:
    return [Example(prompt=prompt, answer="7") for _ in range(n)]


def test_check_readable_passes_up_to_the_share_and_refuses_above():
    tok = data.build_char_tokenizer(data.ARITHMETIC_ALPHABET)
    # 98 readable characters and 2 unknown a prompt + its 1-character answer: 2 / 100 passes.
    tasks.check_readable(tok, _examples("1" * 97 + "ab"), builtin=True)
    with pytest.raises(ValueError) as info:  # 3 / 100
        tasks.check_readable(tok, _examples("1" * 96 + "abc"), builtin=True)
    assert str(info.value) == (
        "the tokenizer maps 3% of the data's characters to its unknown token '<unk>' (e.g. 'a', "
        "'b', 'c'): the built-in tiny model's character tokenizer reads only '0123456789+-*=': "
        "set model.path to a Hugging Face model whose tokenizer covers the data"
    )
    with pytest.raises(ValueError, match="set model.path to a model whose tokenizer covers"):
        tasks.check_readable(tok, _examples("hello"), builtin=False)


def test_answers_count_too():
    tok = data.build_char_tokenizer(data.ARITHMETIC_ALPHABET)
    with pytest.raises(ValueError, match=r"maps 50% .* \(e.g. 'P'"):
        tasks.check_readable(tok, [Example(prompt="1+1=", answer="PPPP")], builtin=True)


def _jsonl(path, n):
    path.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": f"{i + 1}"}) + "\n" for i in range(n))
    )
    return path


@pytest.mark.parametrize(("eval_size", "warned"), [(128, True), (16, False)])
def test_a_held_out_split_taking_most_of_a_small_file_is_warned(
    tmp_path, caplog, eval_size, warned
):
    cfg = load_config(
        TrainConfig,
        None,
        [
            "data.task=jsonl",
            f"data.train_path={_jsonl(tmp_path / 'd.jsonl', 200)}",
            f"data.eval_size={eval_size}",
        ],
    )
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm"):
        train, held_out = tasks.load_task(cfg.data, seed=0)
    assert (len(train), len(held_out)) == (200 - eval_size, eval_size)
    messages = [r.getMessage() for r in caplog.records]
    expected = (
        "data: data.eval_size=128 holds out 128 of the 200 examples (64%), leaving 72 to train "
        "on: lower data.eval_size or give a held-out set (data.eval_path)"
    )
    assert messages == ([expected] if warned else [])


def test_train_refuses_text_the_tiny_model_cannot_read(tmp_path, capsys):
    rows = tmp_path / "text.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"prompt": "Capital of France?", "answer": "Paris"}) + "\n"
            for _ in range(40)
        )
    )
    run_dir = tmp_path / "run"
    code = cli.train_main(
        [
            *rl_helpers.TINY,
            "data.task=jsonl",
            f"data.train_path={rows}",
            "data.eval_size=8",
            f"run_dir={run_dir}",
        ]
    )
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and not run_dir.exists()
    assert [line for line in err if line.startswith("error:")] == [
        "error: the tokenizer maps 100% of the data's characters to its unknown token '<unk>' "
        "(e.g. 'a', 'i', ' ', 'r', 'C', 'p', 't', 'l'): the built-in tiny model's character "
        "tokenizer reads only '0123456789+-*=': set model.path to a Hugging Face model whose "
        "tokenizer covers the data"
    ]


def test_missing_files_name_their_key_and_the_fix(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", 20)
    for overrides, message in (
        (["data.train_path=nowhere.jsonl"], "data.train_path: no such file 'nowhere.jsonl'"),
        (
            [f"data.train_path={train}", "data.eval_path=data/test.jsonl"],
            "data.eval_path: no such file 'data/test.jsonl' (data.eval_path=null holds out "
            "data.eval_size examples of data.train_path)",
        ),
    ):
        cfg = load_config(TrainConfig, None, ["data.task=jsonl", *overrides])
        with pytest.raises(ValueError) as info:
            tasks.load_task(cfg.data, seed=0)
        assert str(info.value) == message
