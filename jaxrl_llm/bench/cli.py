"""``jaxrl-llm bench losses``: every preset at every shape, JAX against PyTorch eager."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from jaxrl_llm import objectives
from jaxrl_llm.bench.report import (
    BenchRow,
    environment,
    format_report,
    format_table,
    num_cores,
    write_results,
)
from jaxrl_llm.bench.timing import (
    copy_bandwidth,
    load_torch_impl,
    objective_batch,
    time_loss,
    time_torch_loss,
)

DEFAULT_SHAPES: tuple[tuple[int, int], ...] = ((64, 1024), (64, 4096), (256, 1024), (256, 4096))


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"64x1024,256x4096"`` -> ``[(64, 1024), (256, 4096)]``."""
    shapes = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        dims = item.lower().split("x")
        if len(dims) != 2 or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise ValueError(f"shape {item!r} is not BxT with positive integers (e.g. 64x1024)")
        shapes.append((int(dims[0]), int(dims[1])))
    if not shapes:
        raise ValueError(f"no shapes in {text!r}")
    return shapes


def loss_presets() -> list[str]:
    """The presets whose loss is a function of the ``[B, T]`` log-probs alone, which the loss
    benchmark times: every preset but those adding a distillation loss over the teacher's
    top-k distribution (``distill_gkd``: it takes the student's log-probs of those tokens)."""
    return [name for name in objectives.available() if objectives.make(name).distill.loss is None]


def parse_presets(text: str) -> list[str]:
    """``"grpo,dapo"`` -> ``["grpo", "dapo"]`` (``"all"``: every preset of :func:`loss_presets`).

    Raises:
      ValueError: an unknown preset, or one the loss benchmark cannot time (named).
    """
    names = [part.strip() for part in text.split(",") if part.strip()]
    if names == ["all"]:
        return loss_presets()
    unknown = [name for name in names if name not in objectives.PRESETS]
    if unknown or not names:
        raise ValueError(f"unknown preset(s) {unknown or text!r}; available: {loss_presets()}")
    other = [name for name in names if name not in loss_presets()]
    if other:
        raise ValueError(
            f"preset(s) {other} add a distillation loss over the teacher's top-k tokens, not a "
            f"loss of the [B, T] log-probs alone; the loss benchmark times {loss_presets()}"
        )
    return names


def run_losses(
    presets: Sequence[str],
    shapes: Sequence[tuple[int, int]],
    *,
    torch_impl: ModuleType | None = None,
    repeats: int | None = None,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> list[BenchRow]:
    """Times every preset at every ``(B, T)``: JAX, and PyTorch eager on the same arrays."""
    rows = []
    for B, T in shapes:
        copy_gbps = copy_bandwidth(4 * B * T)
        for name in presets:
            objective = objectives.make(name)
            data = objective_batch(objective, B=B, T=T, seed=seed)
            timing = time_loss(objective, B=B, T=T, repeats=repeats, data=data)
            torch_timing = None
            if torch_impl is not None:
                torch_timing = time_torch_loss(torch_impl, objective, data, repeats=repeats)
            row = BenchRow(name, B, T, timing, torch_timing, copy_gbps)
            rows.append(row)
            if log is not None:
                log(format_table([row], markdown=False).splitlines()[-1])
    return rows


def _parser(prog: str, defaults: dict[str, Any] | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Time loss presets under jax.jit.")
    sub = parser.add_subparsers(dest="what", metavar="WHAT", required=True)
    losses = sub.add_parser(
        "losses",
        help="loss + gradient of each preset, JAX vs PyTorch eager",
        description="Loss + gradient of each preset under jit, against PyTorch eager.",
    )
    options = {
        "--presets": dict(default="all", help="comma-separated preset names or 'all'"),
        "--shapes": dict(default=",".join(f"{b}x{t}" for b, t in DEFAULT_SHAPES), help="BxT,..."),
        "--torch": dict(
            action=argparse.BooleanOptionalAction,
            help="time the PyTorch eager formulation too (default: when torch is installed)",
        ),
        "--torch-impl": dict(help="PyTorch formulation file (default: benchmarks/torch_losses.py)"),
        "--repeats": dict(type=int, help="timed calls per figure (default: ~1 s worth, 5-100)"),
        "--seed": dict(type=int, default=0, help="seed of the random batch"),
        "--markdown": dict(action="store_true", help="print a Markdown table"),
        "--results": dict(
            help="write the table as this Markdown file's 'Loss presets' section ('' = none)"
        ),
        "--quiet": dict(action="store_true", help="no per-row progress on stderr"),
    }
    for flag, kwargs in options.items():
        losses.add_argument(flag, **kwargs)
    losses.set_defaults(**(defaults or {}))
    return parser


def bench_main(
    argv: list[str] | None = None,
    *,
    prog: str = "jaxrl-llm bench",
    defaults: dict[str, Any] | None = None,
    command: str | None = None,
) -> int:
    """``jaxrl-llm bench losses [--presets grpo,dapo] [--shapes 64x1024,256x4096]
    [--torch/--no-torch] [--repeats N] [--markdown] [--results FILE]``.

    Prints the table (machine, device kind and versions above it); with ``--results``
    writes it as a Markdown file's ``Loss presets`` section (replacing the previous run's).

    Args:
      argv: arguments after ``bench`` (``sys.argv[1:]`` when None).
      prog: program name shown in help and recorded as the command.
      defaults: overrides of the ``losses`` option defaults (used by
        ``benchmarks/bench_losses.py``).
      command: the command line recorded with the figures (default: ``prog`` + ``argv``).

    Returns:
      The exit status (0 on success; invalid options exit with status 2).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser(prog, defaults)
    args = parser.parse_args(argv)
    try:
        presets = parse_presets(args.presets)
        shapes = parse_shapes(args.shapes)
        if args.repeats is not None and args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    except ValueError as err:
        parser.error(str(err))
    torch_impl = None
    if args.torch is not False:
        torch_impl, reason = load_torch_impl(args.torch_impl)
        if torch_impl is None:
            if args.torch:
                parser.error(f"--torch: {reason}")
            print(f"PyTorch column n/a: {reason}", file=sys.stderr)
        else:
            # Same cores for both: XLA's CPU client uses every core by default.
            torch_impl.torch.set_num_threads(num_cores())
    env = environment(torch_impl)
    log = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    rows = run_losses(
        presets, shapes, torch_impl=torch_impl, repeats=args.repeats, seed=args.seed, log=log
    )
    command = command or shlex.join([*prog.split(), *argv])
    env["load average (1 min) at end"] = f"{os.getloadavg()[0]:.2f}"
    if max(os.getloadavg()[0], float(env["load average (1 min) at start"])) > num_cores():
        env["warning"] = (
            f"the load average exceeded the {num_cores()} cores: other processes competed for the "
            "CPU, so these figures (PyTorch's OpenMP threads most) are unreliable; rerun idle"
        )
        print(f"warning: {env['warning']}", file=sys.stderr)
    print(format_report(env, rows, command=command, markdown=args.markdown))
    if args.results:
        report = format_report(env, rows, command=command, markdown=True)
        write_results(args.results, report)
    return 0
