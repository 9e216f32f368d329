"""GSM8K's JSONL files -> a Hugging Face dataset for ``data.task: hf``.

GSM8K (github.com/openai/grade-school-math, or the Hub's ``openai/gsm8k`` saved as JSONL) has one
JSON object a line: ``question`` and ``answer``, the worked solution ending in ``#### N``. Each
row becomes ``prompt`` (the question, plus ``--instruction`` if given), ``answer`` (the final
answer after the last ``####``, via ``jaxrl_llm.rewards.math.extract_answer``), ``solution``
(the original worked answer) and every other field as it was (``question`` included).

    python examples/gsm8k_to_hf.py --train gsm8k/train.jsonl --test gsm8k/test.jsonl \\
        --out data/gsm8k

writes a ``DatasetDict`` with splits ``train`` / ``test`` (``--format parquet`` or ``jsonl``:
one ``<split>.<ext>`` file a split in ``--out``); train on it with

    data: {task: hf, path: data/gsm8k, split: train, eval_split: test}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from jaxrl_llm.rewards.math import extract_answer

FORMATS = ("arrow", "parquet", "jsonl")


def convert_record(record: dict, where: str, instruction: str | None = None) -> dict:
    """One GSM8K record as a row: ``prompt``, ``answer``, ``solution`` and the other fields.

    Raises:
      ValueError: naming ``where`` when a field is missing or the answer has no ``####`` line.
    """
    for field in ("question", "answer"):
        if not isinstance(record.get(field), str):
            raise ValueError(f"{where}: expected a string {field!r}, got fields {sorted(record)}")
    solution = record["answer"]
    final = extract_answer(solution) if "####" in solution else None
    if final is None:
        raise ValueError(f"{where}: the answer has no final '#### N' line: {solution[-80:]!r}")
    prompt = record["question"] if not instruction else f"{record['question']}\n{instruction}"
    row = {k: v for k, v in record.items() if k != "answer"}
    return {"prompt": prompt, "answer": final, "solution": solution, **row}


def read_jsonl(path: str, instruction: str | None = None) -> list[dict]:
    """The rows of one GSM8K JSONL file (blank lines skipped)."""
    rows = []
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if line.strip():
                where = f"{path}:{line_no}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{where}: invalid JSON ({err.msg})") from err
                rows.append(convert_record(record, where, instruction))
    if not rows:
        raise ValueError(f"{path} holds no record")
    return rows


def write_splits(splits: dict[str, list[dict]], out: str, fmt: str) -> None:
    """Writes ``{split: rows}``: a ``DatasetDict`` directory (``arrow``) or one
    ``<split>.parquet`` / ``<split>.jsonl`` file a split in the directory ``out``."""
    import datasets

    built = {name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}
    if fmt == "arrow":
        datasets.DatasetDict(built).save_to_disk(out)
        return
    os.makedirs(out, exist_ok=True)
    for name, dataset in built.items():
        if fmt == "parquet":
            dataset.to_parquet(os.path.join(out, f"{name}.parquet"))
        else:
            dataset.to_json(os.path.join(out, f"{name}.jsonl"))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Convert GSM8K JSONL files (question / answer ending in '#### N') into a "
        "Hugging Face dataset with prompt / answer columns for `data.task: hf`.",
    )
    parser.add_argument("--train", help="GSM8K training JSONL (split 'train')")
    parser.add_argument("--test", help="GSM8K test JSONL (split 'test')")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="arrow",
        help="arrow: a save_to_disk DatasetDict (default); parquet / jsonl: one file a split",
    )
    parser.add_argument(
        "--instruction",
        help="text appended to every question on a new line, e.g. \"Let's think step by step "
        "and output the final answer after '####'.\"",
    )
    args = parser.parse_args(argv)
    if args.train is None and args.test is None:
        parser.error("give --train and/or --test")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    splits = {}
    for name in ("train", "test"):
        path = getattr(args, name)
        if path is not None:
            if not os.path.isfile(path):
                print(f"error: --{name} {path!r} is not a file", file=sys.stderr)
                return 2
            try:
                splits[name] = read_jsonl(path, args.instruction)
            except ValueError as err:
                print(f"error: {err}", file=sys.stderr)
                return 1
    write_splits(splits, args.out, args.format)
    counts = ", ".join(f"{len(rows)} {name}" for name, rows in splits.items())
    print(f"wrote {counts} rows to {args.out} ({args.format})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
