"""Pod plans: ``jaxrl-llm plan`` for GRPO on real model sizes and Cloud TPU slices.

One command prints the "Pod plans" table (model x topology x mesh: fits, HBM per chip,
estimated RL step, update-step MFU, decode tokens/s) and writes each plan's JSON report::

    python benchmarks/pod_plans.py [--out DIR] [--only NAME ...] [--timeout S]

Every row is ``configs/grpo.yaml`` plus overrides: 256 sequences a step (``prompts_per_step
x group_size``), prompts padded to 512 tokens, ``model.remat=layer``, f32 master weights, bf16
compute, AdamW's moments in f32 (``-bf16-moments`` rows: bf16), the frozen reference of GRPO's
KL term, one epoch of one minibatch. The prompt count is the smallest the prefill's rows split
over the batch shards (32 on 16 chips, 64 on 64); the group size makes up 256 rows. ``/lora16``
rows train rank-16 LoRA adapters on all seven projections instead (``model.lora.rank=16``: the
base frozen in bf16, also the reference); ``-128rows``: 16 prompts a step (the rollout's KV
cache halved).

``trainer.micro_batches`` leaves a multiple of the batch shards per micro-batch: 4 rows a chip
on v5litepod-16 and v5litepod-8 (4 micro-batches on fsdp 16, 8 on fsdp 8 or fsdp 8 x tensor 2;
more do not lower the update's peak there, see benchmarks/RESULTS.md), 2 rows a chip on
v5p-128 (2), 1 row a chip for the 8k-token completions on v5p-8 (64; ``/per-layer``: decoded with
per-layer weights and cache, ``rollout.decode_layers=per_layer``). Each plan runs in its
own process (``jaxrl-llm plan ... --json``), so a large compile's memory is returned between
rows. Deviceless: needs libtpu, no TPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

CONFIG = "configs/grpo.yaml"
COMMON = (
    "data.max_prompt_tokens=512",
    "model.remat=layer",
    "trainer.max_steps=100",
)


@dataclasses.dataclass(frozen=True)
class Row:
    """One plan: a name, the model, the topology and the overrides that differ."""

    name: str
    model: str
    topology: str
    overrides: tuple[str, ...]
    target: str  # what the issue asks of this row ("" when nothing)


_1K = ("rollout.max_new_tokens=1024",)
_V5E16 = ("rollout.prompts_per_step=32", "rollout.group_size=8", *_1K)
_V5P128 = ("mesh.fsdp=64", "rollout.prompts_per_step=64", "rollout.group_size=4", *_1K)
_BF16_MOMENTS = ("trainer.optimizer_state_dtype=bfloat16",)
_TENSOR2 = ("mesh.fsdp=8", "mesh.tensor=2", "trainer.micro_batches=8")
_TARGET_7B = ">= 1.5 GiB headroom, update ICI <= compute, roofline MFU bound >= 55%"
# LoRA (issue 16): rank-16 adapters on all seven projections, the base frozen in bf16.
_LORA16 = ("model.lora.rank=16",)
_V5E8 = ("mesh.fsdp=8", "rollout.group_size=8", *_1K)
_TARGET_LORA = "LoRA fits (full training with f32 masters does not), roofline MFU bound reported"

ROWS = (
    Row(
        "qwen2.5-7b/v5litepod-16",
        "qwen2.5-7b",
        "v5litepod-16",
        ("mesh.fsdp=16", *_V5E16, "trainer.micro_batches=4"),
        _TARGET_7B,
    ),
    Row(
        "qwen2.5-7b/v5litepod-16/bf16-moments",
        "qwen2.5-7b",
        "v5litepod-16",
        ("mesh.fsdp=16", *_V5E16, "trainer.micro_batches=4", *_BF16_MOMENTS),
        _TARGET_7B,
    ),
    Row(
        "qwen2.5-7b/v5litepod-16/tensor2",
        "qwen2.5-7b",
        "v5litepod-16",
        (*_TENSOR2, *_V5E16),
        _TARGET_7B,
    ),
    Row(
        "qwen2.5-7b/v5litepod-16/tensor2-bf16-moments",
        "qwen2.5-7b",
        "v5litepod-16",
        (*_TENSOR2, *_V5E16, *_BF16_MOMENTS),
        _TARGET_7B,
    ),
    Row(
        "llama-3.1-8b/v5litepod-16",
        "llama-3.1-8b",
        "v5litepod-16",
        ("mesh.fsdp=16", *_V5E16, "trainer.micro_batches=4"),
        "",
    ),
    Row(
        "llama-3.1-8b/v5litepod-16/tensor2-bf16-moments",
        "llama-3.1-8b",
        "v5litepod-16",
        (*_TENSOR2, *_V5E16, *_BF16_MOMENTS),
        "",
    ),
    Row(
        "llama-3.1-8b/v5litepod-8",
        "llama-3.1-8b",
        "v5litepod-8",
        (*_V5E8, "rollout.prompts_per_step=32", "trainer.micro_batches=8"),
        "",
    ),
    Row(
        "llama-3.1-8b/v5litepod-8/lora16",
        "llama-3.1-8b",
        "v5litepod-8",
        (*_V5E8, "rollout.prompts_per_step=32", "trainer.micro_batches=8", *_LORA16),
        _TARGET_LORA,
    ),
    Row(
        "llama-3.1-8b/v5litepod-8/lora16-128rows",
        "llama-3.1-8b",
        "v5litepod-8",
        (*_V5E8, "rollout.prompts_per_step=16", "trainer.micro_batches=4", *_LORA16),
        _TARGET_LORA,
    ),
    Row(
        "qwen2.5-7b/v5litepod-16/lora16",
        "qwen2.5-7b",
        "v5litepod-16",
        ("mesh.fsdp=16", *_V5E16, "trainer.micro_batches=4", *_LORA16),
        "",
    ),
    Row(
        "qwen2.5-32b/v5p-128",
        "qwen2.5-32b",
        "v5p-128",
        (*_V5P128, "trainer.micro_batches=2"),
        "",
    ),
    Row(
        "llama-3.1-70b/v5p-128",
        "llama-3.1-70b",
        "v5p-128",
        (*_V5P128, "trainer.micro_batches=2"),
        "fits, roofline MFU bound >= 55%",
    ),
    Row(
        "qwen2.5-7b-8k/v5p-8",
        "qwen2.5-7b",
        "v5p-8",
        (
            "mesh.fsdp=4",
            "rollout.prompts_per_step=32",
            "rollout.group_size=8",
            "rollout.max_new_tokens=8192",
            "trainer.micro_batches=64",
        ),
        "fits",
    ),
    Row(
        "qwen2.5-7b-8k/v5p-8/per-layer",
        "qwen2.5-7b",
        "v5p-8",
        (
            "mesh.fsdp=4",
            "rollout.prompts_per_step=32",
            "rollout.group_size=8",
            "rollout.max_new_tokens=8192",
            "trainer.micro_batches=64",
            "rollout.decode_layers=per_layer",
        ),
        "",
    ),
)


def command(row: Row, json_path: pathlib.Path) -> list[str]:
    """The ``jaxrl-llm plan`` command line of a row."""
    return [
        sys.executable,
        "-m",
        "jaxrl_llm.cli",
        "plan",
        CONFIG,
        "--topology",
        row.topology,
        "--json",
        str(json_path),
        f"model.architecture={row.model}",
        *COMMON,
        *row.overrides,
    ]


def run_row(row: Row, out: pathlib.Path, timeout: float, reuse: bool = False) -> dict:
    """Runs one plan in a subprocess; returns its JSON report (plus wall time and exit code).

    ``reuse``: a report already in ``out`` is read instead (to rebuild the table).
    """
    json_path = out / f"{row.name.replace('/', '__')}.json"
    if reuse and json_path.exists():
        report = json.loads(json_path.read_text())
        return {"row": row, "exit": 0 if report["fits"] else 1, "wall_s": 0.0, "report": report}
    cmd = command(row, json_path)
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)  # noqa: S603
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        code, text = None, f"timed out after {timeout:.0f} s: {err}"
    wall = time.perf_counter() - start
    (out / f"{row.name.replace('/', '__')}.txt").write_text(
        " ".join(cmd[2:]) + "\n\n" + _clean(text), encoding="utf-8"
    )
    report = json.loads(json_path.read_text()) if code in (0, 1) and json_path.exists() else {}
    return {"row": row, "exit": code, "wall_s": wall, "report": report, "log": text}


_DTYPE_SHORT = {"float32": "f32", "bfloat16": "bf16"}


def _clean(text: str) -> str:
    """The plan's output without libtpu's start-up noise."""
    noise = ("WARNING", "E0000", "===", "learning/", "Failed to find host")
    return "\n".join(line for line in text.splitlines() if not line.startswith(noise))


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def table(results: list[dict]) -> str:
    """The markdown "Pod plans" table."""
    header = (
        "| model | topology (chips) | mesh | micro-batches | AdamW moments | fits | HBM/chip GiB "
        "(largest "
        "program) | headroom GiB | roofline RL step s | update MFU (roofline bound) | "
        "update ICI / compute | "
        "decode tok/s | decode / HBM roofline | sampler layout | dominant program | compile s |"
    )
    lines = [header, header_rule(header)]
    for result in results:
        row, report = result["row"], result["report"]
        if not report:
            lines.append(
                f"| {row.model} | {row.topology} | - | - | - | error (exit {result['exit']}) | "
                "- | - | - | - | - | - | - | - | - | - |"
            )
            continue
        mesh = "x".join(f"{k[0]}{v}" for k, v in report["mesh"].items() if v > 1) or "1"
        update = report["programs"]["update"]
        ici, compute = update["times"]["ici_s"], update["times"]["compute_s"]
        ratio = None if ici is None else ici / compute
        step = _fmt(report["est_step_s"], ".1f") + (
            " (≥, compute only)" if report["est_step_is_lower_bound"] else ""
        )
        dominant = report["dominant_program"]
        share = report["step_breakdown_s"][dominant] / report["est_step_s"]
        tokens = report["job"]["completion_len"]
        model = row.model if tokens == 1024 else f"{row.model}, {tokens // 1024}k completions"
        if report["model"].get("lora"):
            model += f", LoRA r{report['model']['lora']['rank']}, {report['job']['rows']} rows"
        lines.append(
            f"| {model} | {report['topology']} ({report['chips']}) | {mesh} | "
            f"{report['job']['micro_batches']} | "
            f"{_DTYPE_SHORT.get(report['model']['optimizer_state_dtype'], '?')} | "
            f"{'yes' if report['fits'] else '**no**'} | "
            f"{report['hbm_per_chip_gib']:.2f} ({report['largest_program']}) | "
            f"{report['headroom_gib']:.2f} | {step} | "
            f"{_fmt(report['roofline_mfu_bound'], '.1%')} | {_fmt(ratio, '.2f')} | "
            f"{_fmt(report['est_decode_tokens_per_s'], ',.0f')} | "
            f"{_fmt(report.get('est_decode_fraction_of_roofline'), '.0%')} | "
            f"{_sampler(report)} | "
            f"{dominant} ({share:.0%}) | {report['compile_s']:.0f} |"
        )
    return "\n".join(lines)


def _sampler(report: dict) -> str:
    """``d4xt4`` for a serving layout of data 4 x tensor 4, ``trainer`` for the trainer's."""
    layout = report.get("sampler_layout")
    if layout is None:
        return "-"
    if layout["is_trainer_layout"]:
        return "trainer"
    mesh = layout["mesh"]
    return f"d{mesh['data']}xt{mesh['tensor']}"


def header_rule(header: str) -> str:
    return "|" + "---|" * (header.count("|") - 1)


def environment() -> str:
    """Machine, versions and date for the results file."""
    import jax  # noqa: PLC0415
    import jaxlib  # noqa: PLC0415

    try:
        from importlib.metadata import version  # noqa: PLC0415

        libtpu = version("libtpu")
    except Exception:  # noqa: BLE001
        libtpu = "not installed"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = f"{names[0]} x {len(names)}" if names else cpu
    except OSError:
        pass
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"{now}; {cpu}, no accelerator; python {platform.python_version()}, jax {jax.__version__}, "
        f"jaxlib {jaxlib.__version__}, libtpu {libtpu}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/pod_plans", help="directory for the JSON reports")
    parser.add_argument("--only", nargs="*", help="row names (default: all)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per plan")
    parser.add_argument(
        "--reuse", action="store_true", help="read reports already in --out instead of planning"
    )
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for r in ROWS if not args.only or r.name in args.only]
    unknown = set(args.only or ()) - {r.name for r in ROWS}
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; rows: {[r.name for r in ROWS]}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    results = []
    for row in rows:
        print(f"planning {row.name} ...", flush=True)
        result = run_row(row, out, args.timeout, reuse=args.reuse)
        results.append(result)
        print(f"  exit {result['exit']}, {result['wall_s']:.0f} s wall", flush=True)
    print()
    print(table(results))
    print()
    for result in results:
        row = result["row"]
        print(
            f"- {row.name}: `jaxrl-llm plan {CONFIG} --topology {row.topology} "
            f"model.architecture={row.model} {' '.join((*COMMON, *row.overrides))}`"
            + (f"; target: {row.target}" if row.target else "")
        )
    print()
    print(environment())
    return 0


if __name__ == "__main__":
    sys.exit(main())
