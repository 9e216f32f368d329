"""The dataset converters under ``examples/`` (GSM8K and MATH -> ``data.task: hf``), run on tiny
fixtures written here, and their output read back with ``data.load_hf_examples``."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import datasets
import pytest

from jaxrl_llm.data import load_hf_examples
from jaxrl_llm.rewards import answers_match

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _script(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


GSM8K = [
    {
        "question": "Natalia sold clips to 48 friends in April and half as many in May. Total?",
        "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\n48+24 = <<48+24=72>>72\n#### 72",
    },
    {
        "question": "Weng earns $12 an hour. How much for 50 minutes?",
        "answer": "She earns 12/60 = $<<12/60=0.2>>0.2 a minute.\nSo 0.2 x 50 = $10.\n#### 10",
    },
]


def test_gsm8k_to_a_dataset_dict(tmp_path, capsys):
    gsm8k = _script("gsm8k_to_hf")
    train = _write_jsonl(tmp_path / "train.jsonl", GSM8K)
    test = _write_jsonl(tmp_path / "test.jsonl", GSM8K[:1])
    out = tmp_path / "gsm8k"
    argv = ["--train", str(train), "--test", str(test), "--out", str(out)]
    assert gsm8k.main([*argv, "--instruction", "Answer after ####."]) == 0
    assert "wrote 2 train, 1 test rows" in capsys.readouterr().out
    examples = load_hf_examples(out)
    assert [ex.answer for ex in examples] == ["72", "10"]
    assert examples[0].prompt == GSM8K[0]["question"] + "\nAnswer after ####."
    assert examples[0].extra == {"solution": GSM8K[0]["answer"], "question": GSM8K[0]["question"]}
    assert answers_match("so the answer is 72", examples[0].answer)
    assert len(load_hf_examples(out, split="test")) == 1


def test_gsm8k_to_parquet_files_and_errors(tmp_path, capsys):
    gsm8k = _script("gsm8k_to_hf")
    train = _write_jsonl(tmp_path / "train.jsonl", GSM8K)
    out = tmp_path / "pq"
    assert gsm8k.main(["--train", str(train), "--out", str(out), "--format", "parquet"]) == 0
    assert (out / "train.parquet").is_file()
    assert [ex.answer for ex in load_hf_examples(out)] == ["72", "10"]
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "no marker 5"}])
    assert gsm8k.main(["--train", str(bad), "--out", str(tmp_path / "x")]) == 1
    assert "bad.jsonl:1: the answer has no final '#### N' line" in capsys.readouterr().err
    assert gsm8k.main(["--test", str(tmp_path / "missing.jsonl"), "--out", "x"]) == 2
    with pytest.raises(SystemExit):
        gsm8k.main(["--out", str(tmp_path / "x")])  # neither --train nor --test
    with pytest.raises(SystemExit) as exit_info:
        gsm8k.main(["--help"])
    assert exit_info.value.code == 0 and "--instruction" in capsys.readouterr().out


MATH = [
    {
        "problem": "What is $\\frac{1}{2}+\\frac{1}{4}$?",
        "solution": "We get $\\frac{2}{4}+\\frac{1}{4}=\\boxed{\\frac{3}{4}}$.",
        "level": "Level 1",
        "type": "Prealgebra",
    },
    {
        "problem": "Solve $x^2=4$ for $x>0$.",
        "solution": "Try $\\boxed{3}$: no. So $x=\\boxed{2}$.",  # the last box is the answer
        "level": "Level 2",
        "type": "Algebra",
    },
    {"problem": "Prove it.", "solution": "No box here.", "level": "Level 5", "type": "Algebra"},
]


def test_math_per_problem_json_files(tmp_path, capsys):
    math = _script("math_to_hf")
    root = tmp_path / "MATH" / "train"
    for i, problem in enumerate(MATH):
        folder = root / problem["type"].lower()
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i}.json").write_text(json.dumps(problem), encoding="utf-8")
    out = tmp_path / "math"
    assert math.main(["--train", str(root), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "wrote 2 train rows" in captured.out
    assert "skipped 1 train problems without a \\boxed{} answer" in captured.err
    by_answer = {ex.answer: ex for ex in load_hf_examples(out)}
    assert sorted(by_answer) == ["2", "\\frac{3}{4}"]
    first = by_answer["\\frac{3}{4}"]
    assert first.prompt == MATH[0]["problem"]
    assert first.extra == {
        "problem": MATH[0]["problem"],
        "solution": MATH[0]["solution"],
        "level": "Level 1",
        "type": "Prealgebra",
        "file": "prealgebra/0.json",
    }
    assert answers_match("\\boxed{0.75}", first.answer)


@pytest.mark.parametrize("form", ["jsonl", "json", "parquet"])
def test_math_hub_forms(tmp_path, form):
    math = _script("math_to_hf")
    path = tmp_path / f"test.{form}"
    if form == "jsonl":
        _write_jsonl(path, MATH)
    elif form == "json":
        path.write_text(json.dumps(MATH), encoding="utf-8")
    else:
        datasets.Dataset.from_list(MATH).to_parquet(path)
    out = tmp_path / "out"
    assert math.main(["--test", str(path), "--out", str(out), "--format", "jsonl"]) == 0
    examples = load_hf_examples(out, split="test")
    assert [ex.answer for ex in examples] == ["\\frac{3}{4}", "2"]
    assert examples[1].extra["level"] == "Level 2"


def test_math_errors(tmp_path, capsys):
    math = _script("math_to_hf")
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "q"}])
    assert math.main(["--train", str(bad), "--out", str(tmp_path / "x")]) == 1
    assert "bad.jsonl:1: expected a string 'problem'" in capsys.readouterr().err
    unboxed = _write_jsonl(tmp_path / "unboxed.jsonl", MATH[2:])
    assert math.main(["--train", str(unboxed), "--out", str(tmp_path / "x")]) == 1
    assert "no problem with a boxed answer (1 skipped)" in capsys.readouterr().err
    assert math.main(["--train", str(tmp_path / "nope"), "--out", "x"]) == 2
