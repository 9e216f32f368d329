"""The MATH benchmark (Hendrycks et al.) -> a Hugging Face dataset for ``data.task: hf``.

Reads either layout of MATH, problems with ``problem``, ``solution``, ``level`` and ``type``:

* the original release: a directory tree of one JSON file a problem
  (``MATH/train/algebra/1.json``, ...), every ``*.json`` under the directory given;
* the Hub's forms: a ``.parquet``, ``.jsonl`` or ``.json`` (a list of problems) file.

Each problem becomes ``prompt`` (the problem, plus ``--instruction`` if given), ``answer`` (the
content of the solution's last ``\\boxed{}``, via ``jaxrl_llm.rewards.math.extract_answer``) and
every other field as it was (``problem``, ``solution``, ``level``, ``type``; ``file``, the path
under the directory, for the original layout). Problems whose solution has no ``\\boxed{}`` (a
few in the original release) are skipped and counted.

    python examples/math_to_hf.py --train MATH/train --test MATH/test --out data/math

writes a ``DatasetDict`` with splits ``train`` / ``test`` (``--format parquet`` or ``jsonl``:
one ``<split>.<ext>`` file a split in ``--out``); train on it with

    data: {task: hf, path: data/math, split: train, eval_split: test}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence

from jaxrl_llm.rewards.math import extract_answer

FORMATS = ("arrow", "parquet", "jsonl")
FIELDS = ("problem", "solution")


def convert_record(record: dict, where: str, instruction: str | None = None) -> dict | None:
    """One MATH problem as a row (``prompt``, ``answer`` and the original fields), or None when
    its solution has no ``\\boxed{}`` / ``\\fbox{}`` answer.

    Raises:
      ValueError: naming ``where`` when ``problem`` or ``solution`` is missing.
    """
    for field in FIELDS:
        if not isinstance(record.get(field), str):
            raise ValueError(f"{where}: expected a string {field!r}, got fields {sorted(record)}")
    solution = record["solution"]
    if "\\boxed" not in solution and "\\fbox" not in solution:
        return None
    final = extract_answer(solution)
    if not final:
        return None
    prompt = record["problem"] if not instruction else f"{record['problem']}\n{instruction}"
    return {"prompt": prompt, "answer": final, **record}


def _records(path: str) -> Iterator[tuple[str, dict]]:
    """``(where, record)`` for every problem at ``path`` (any of the layouts above)."""
    if os.path.isdir(path):
        found = False
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for name in sorted(f for f in files if f.endswith(".json")):
                file = os.path.join(root, name)
                with open(file, encoding="utf-8") as handle:
                    record = json.load(handle)
                found = True
                yield file, {**record, "file": os.path.relpath(file, path)}
        if not found:
            raise ValueError(f"{path} holds no .json problem file")
        return
    ext = os.path.splitext(path)[1]
    if ext == ".parquet":
        import datasets

        table = datasets.load_dataset("parquet", data_files=path, split="train")
        for i, record in enumerate(table):
            yield f"{path} row {i}", record
    elif ext == ".jsonl":
        with open(path, encoding="utf-8") as handle:
            for line_no, line in enumerate(handle, start=1):
                if line.strip():
                    yield f"{path}:{line_no}", json.loads(line)
    elif ext == ".json":
        with open(path, encoding="utf-8") as handle:
            content = json.load(handle)
        for i, record in enumerate(content if isinstance(content, list) else [content]):
            yield f"{path}[{i}]", record
    else:
        raise ValueError(f"{path}: expected a directory, .parquet, .jsonl or .json, got {ext!r}")


def read_problems(path: str, instruction: str | None = None) -> tuple[list[dict], int]:
    """``(rows, skipped)``: the converted problems at ``path`` and how many had no boxed
    answer."""
    rows, skipped = [], 0
    for where, record in _records(path):
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        row = convert_record(record, where, instruction)
        if row is None:
            skipped += 1
        else:
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no problem with a boxed answer ({skipped} skipped)")
    return rows, skipped


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
        description="Convert MATH (Hendrycks) problems, per-problem JSON files or the Hub's "
        "parquet / JSONL form, into a Hugging Face dataset with prompt / answer columns for "
        "`data.task: hf`.",
    )
    parser.add_argument("--train", help="training problems: a directory, .parquet, .jsonl, .json")
    parser.add_argument("--test", help="test problems (split 'test'), same forms")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="arrow",
        help="arrow: a save_to_disk DatasetDict (default); parquet / jsonl: one file a split",
    )
    parser.add_argument(
        "--instruction",
        help="text appended to every problem on a new line, e.g. \"Let's think step by step "
        'and output the final answer within \\boxed{}."',
    )
    args = parser.parse_args(argv)
    if args.train is None and args.test is None:
        parser.error("give --train and/or --test")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    splits, skipped = {}, {}
    for name in ("train", "test"):
        path = getattr(args, name)
        if path is None:
            continue
        if not os.path.exists(path):
            print(f"error: --{name} {path!r} does not exist", file=sys.stderr)
            return 2
        try:
            splits[name], skipped[name] = read_problems(path, args.instruction)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
    write_splits(splits, args.out, args.format)
    counts = ", ".join(f"{len(rows)} {name}" for name, rows in splits.items())
    print(f"wrote {counts} rows to {args.out} ({args.format})")
    for name, count in skipped.items():
        if count:
            print(f"skipped {count} {name} problems without a \\boxed{{}} answer", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
