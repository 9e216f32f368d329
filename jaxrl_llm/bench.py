"""Timing harness for policy losses: loss + gradient under ``jax.jit``, against PyTorch eager.

A researcher times a preset, or any composition of the loss pieces, the same way the
``jaxrl-llm bench losses`` table does::

    from jaxrl_llm import bench, objectives
    bench.time_loss(objectives.make("dapo"), B=64, T=1024)
    bench.time_loss(lambda lp, batch: my_loss(lp, batch), B=64, T=1024)

Every figure excludes compilation (reported apart), waits on ``block_until_ready`` and is a
median over repeats. Effective bandwidth counts the bytes the step must move at least: the
input arrays read once plus the ``[B, T]`` gradient written once; it is compared with the
bandwidth of a plain jitted copy (``x + 1``) of one ``[B, T]`` float32 array measured in the
same run, so "% copy" is how close the loss comes to a single streaming pass.

The PyTorch column runs the formulations of ``benchmarks/torch_losses.py`` (verl
``core_algos.py`` style, eager, ``loss.backward()``) on the same arrays. PyTorch is optional:
without it (or without that file) the column says n/a.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import objectives
from jaxrl_llm.types import RolloutBatch

LossFn = Callable[[jax.Array, RolloutBatch], jax.Array]

DEFAULT_SHAPES: tuple[tuple[int, int], ...] = ((64, 1024), (64, 4096), (256, 1024), (256, 4096))
# Estimators whose advantages are per token ([B, T]); every other preset gets one per row.
TOKEN_ADVANTAGE_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline", "gae", "prime")
_DEFAULT_TORCH_IMPL = Path(__file__).resolve().parents[1] / "benchmarks" / "torch_losses.py"
# With repeats=None, sample for about this long (between the bounds below).
_TIME_BUDGET_S = 1.0
_MIN_REPEATS, _MAX_REPEATS, _WARMUP = 5, 100, 2


class LossTiming(NamedTuple):
    """Timing of one loss + gradient step (seconds; bandwidth in GB/s = 1e9 bytes/s).

    Attributes:
      compile_s: trace + lower + compile time (eager PyTorch: the first, warm-up call).
      median_s: median step time over the repeats.
      p10_s: 10th percentile of the step time (spread).
      p90_s: 90th percentile of the step time (spread).
      bytes: bytes the step must move: inputs read once + the gradient written once.
      gbps: effective bandwidth ``bytes / median_s / 1e9``.
    """

    compile_s: float
    median_s: float
    p10_s: float
    p90_s: float
    bytes: int
    gbps: float


class BenchRow(NamedTuple):
    """One line of the benchmark table.

    Attributes:
      name: preset (or variant) name.
      B: rows.
      T: completion width.
      jax: the jitted timing.
      torch: the PyTorch eager timing on the same data, or None (n/a).
      copy_gbps: copy bandwidth at one ``[B, T]`` float32 array, measured in the same run.
    """

    name: str
    B: int
    T: int
    jax: LossTiming
    torch: LossTiming | None
    copy_gbps: float

    @property
    def speedup(self) -> float | None:
        """PyTorch median / JAX median (None without a PyTorch timing)."""
        if self.torch is None:
            return None
        return self.torch.median_s / max(self.jax.median_s, 1e-12)


def _check_dims(B: int, T: int) -> None:
    for name, value in (("B", B), ("T", T)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def random_batch(
    *,
    B: int,
    T: int,
    seed: int = 0,
    token_advantages: bool = False,
    with_reference: bool = True,
    noise: float = 0.1,
) -> tuple[np.ndarray, RolloutBatch]:
    """A random rollout batch (host NumPy float32) that exercises every surrogate branch.

    ``lp = −Exp(1)``, ``old = lp + noise·t₃``, ``ref = lp + noise·t₃'`` with ``t₃`` Student-t
    (3 dof): mostly near each other, with the heavy tail reaching PPO's clip, the dual clip
    (``r > 3``) and CISPO's cap (``r > 5``) on a few tokens of a large batch. Completion
    lengths are ragged, uniform in ``[1, T]``; advantages are standard normal, ``[B]`` or
    (``token_advantages``) ``[B, T]`` zeroed on padding.

    Args:
      B: rows.
      T: completion width.
      seed: NumPy seed; the same seed gives the same arrays.
      token_advantages: ``[B, T]`` instead of ``[B]`` advantages.
      with_reference: include ``ref_logprobs``.
      noise: scale of the ``old`` / ``ref`` perturbation.

    Returns:
      ``(logprobs [B, T], RolloutBatch)`` with ``completion_mask`` as float32 0/1.
    """
    _check_dims(B, T)
    rng = np.random.default_rng(seed)
    logprobs = -rng.exponential(1.0, (B, T)).astype(np.float32)
    old = (logprobs + noise * rng.standard_t(3, (B, T))).astype(np.float32)
    ref = (logprobs + noise * rng.standard_t(3, (B, T))).astype(np.float32)
    lengths = rng.integers(1, T + 1, size=B)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    if token_advantages:
        advantages = (rng.standard_normal((B, T)) * mask).astype(np.float32)
    else:
        advantages = rng.standard_normal(B).astype(np.float32)
    batch = RolloutBatch(
        completion_mask=mask,
        old_logprobs=old,
        advantages=advantages,
        ref_logprobs=ref if with_reference else None,
    )
    return logprobs, batch


def objective_batch(
    objective: objectives.Objective, *, B: int, T: int, seed: int = 0, noise: float = 0.1
) -> tuple[np.ndarray, RolloutBatch]:
    """:func:`random_batch` holding what ``objective``'s loss reads: reference log-probs only
    when KL is in the loss, per-token advantages for the token-level estimators."""
    kl_in_loss = objective.kl_kind is not None and objective.kl_placement == "loss"
    return random_batch(
        B=B,
        T=T,
        seed=seed,
        token_advantages=objective.advantage in TOKEN_ADVANTAGE_ESTIMATORS,
        with_reference=kl_in_loss,
        noise=noise,
    )


def step_bytes(logprobs: np.ndarray, batch: RolloutBatch) -> int:
    """Bytes a loss + gradient step moves at least: every input array once + the gradient."""
    inputs = [logprobs, *(leaf for leaf in batch if leaf is not None)]
    return int(sum(np.asarray(x).nbytes for x in inputs) + np.asarray(logprobs).nbytes)


def sample_times(
    step: Callable[[], Any], *, repeats: int | None = None
) -> tuple[float, np.ndarray]:
    """Wall-clock times of ``step()`` (which must return only when its work is done).

    Args:
      step: one synchronous step.
      repeats: timed calls after the warm-up; None: as many as fit in about a second
        (5 to 100).

    Returns:
      ``(first_call_s, times_s)``: the first warm-up call and the timed calls.
    """
    if repeats is not None and (not isinstance(repeats, int) or repeats < 1):
        raise ValueError(f"repeats must be a positive int or None, got {repeats!r}")
    warmup = []
    for _ in range(_WARMUP):
        start = time.perf_counter()
        step()
        warmup.append(time.perf_counter() - start)
    if repeats is None:
        estimate = max(min(warmup), 1e-6)
        repeats = int(np.clip(_TIME_BUDGET_S / estimate, _MIN_REPEATS, _MAX_REPEATS))
    times = np.empty(repeats)
    for i in range(repeats):
        start = time.perf_counter()
        step()
        times[i] = time.perf_counter() - start
    return warmup[0], times


def timing_from_samples(times: np.ndarray, *, compile_s: float, num_bytes: int) -> LossTiming:
    """Summarises step times: median, 10th / 90th percentiles, effective GB/s."""
    median = float(np.median(times))
    p10, p90 = (float(v) for v in np.percentile(times, [10, 90]))
    return LossTiming(
        compile_s=float(compile_s),
        median_s=median,
        p10_s=p10,
        p90_s=p90,
        bytes=int(num_bytes),
        gbps=num_bytes / max(median, 1e-12) / 1e9,
    )


def _loss_fn(objective_or_fn: objectives.Objective | LossFn) -> LossFn:
    if isinstance(objective_or_fn, objectives.Objective):
        objective = objective_or_fn
        return lambda logprobs, batch: objectives.policy_loss(objective, logprobs, batch).loss
    if not callable(objective_or_fn):
        raise ValueError(
            "time_loss needs an Objective or a callable fn(logprobs, batch) -> scalar loss, "
            f"got {type(objective_or_fn).__name__}"
        )

    def scalar_loss(logprobs, batch):
        loss = objective_or_fn(logprobs, batch)
        if jnp.shape(loss) != ():
            raise ValueError(f"the loss function must return a scalar, got shape {jnp.shape(loss)}")
        return loss

    return scalar_loss


def time_loss(
    objective_or_fn: objectives.Objective | LossFn,
    *,
    B: int,
    T: int,
    repeats: int | None = None,
    seed: int = 0,
    data: tuple[np.ndarray, RolloutBatch] | None = None,
) -> LossTiming:
    """Times ``jax.jit(jax.value_and_grad(loss))`` on a random ``[B, T]`` batch.

    The step returns the scalar loss and its ``[B, T]`` gradient w.r.t. the log-probs;
    compilation is timed apart (lower + compile), then two warm-up calls, then ``repeats``
    timed calls, each waiting on ``block_until_ready``.

    Args:
      objective_or_fn: an :class:`~jaxrl_llm.objectives.Objective` (its ``policy_loss``) or
        a callable ``fn(logprobs [B, T], batch: RolloutBatch) -> scalar``; a callable gets
        reference log-probs and ``[B]`` advantages.
      B: rows.
      T: completion width.
      repeats: timed calls; None: as many as fit in about a second (5 to 100).
      seed: seed of :func:`random_batch`.
      data: ``(logprobs, batch)`` to time on instead of a random batch (B, T must match).

    Returns:
      :class:`LossTiming`.

    Raises:
      ValueError: on non-positive sizes or repeats, a non-callable, a non-scalar loss, or
        ``data`` whose shape is not ``[B, T]``.
    """
    _check_dims(B, T)
    loss_fn = _loss_fn(objective_or_fn)
    if data is None:
        if isinstance(objective_or_fn, objectives.Objective):
            data = objective_batch(objective_or_fn, B=B, T=T, seed=seed)
        else:
            data = random_batch(B=B, T=T, seed=seed)
    logprobs, batch = data
    if np.shape(logprobs) != (B, T):
        raise ValueError(f"data logprobs have shape {np.shape(logprobs)}, expected {(B, T)}")
    num_bytes = step_bytes(logprobs, batch)
    logprobs, batch = jax.device_put((logprobs, batch))

    step = jax.jit(jax.value_and_grad(loss_fn))
    start = time.perf_counter()
    compiled = step.lower(logprobs, batch).compile()
    compile_s = time.perf_counter() - start
    _, times = sample_times(
        lambda: jax.block_until_ready(compiled(logprobs, batch)), repeats=repeats
    )
    return timing_from_samples(times, compile_s=compile_s, num_bytes=num_bytes)


def copy_bandwidth(num_bytes: int = 1 << 26, *, repeats: int = 20) -> float:
    """Bandwidth of a jitted streaming pass ``y = x + 1`` over ``num_bytes`` of float32, GB/s.

    Counts ``2·num_bytes`` (one read, one write): the roofline a memory-bound loss step of
    arrays this size can approach on this machine.

    Args:
      num_bytes: size of the array copied (rounded down to whole float32, at least one).
      repeats: timed calls (median taken).

    Returns:
      GB/s (1e9 bytes per second).
    """
    if not isinstance(num_bytes, int) or num_bytes < 4:
        raise ValueError(f"num_bytes must be an int >= 4, got {num_bytes!r}")
    x = jnp.zeros((num_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0).lower(x).compile()
    _, times = sample_times(lambda: jax.block_until_ready(copy(x)), repeats=repeats)
    return 2 * x.nbytes / max(float(np.median(times)), 1e-12) / 1e9


def load_torch_impl(path: str | os.PathLike | None = None) -> tuple[ModuleType | None, str]:
    """Loads the PyTorch formulations (``benchmarks/torch_losses.py`` by default).

    Returns:
      ``(module, "")``, or ``(None, reason)`` when PyTorch or the file is unavailable.
    """
    path = Path(_DEFAULT_TORCH_IMPL if path is None else path)
    if not path.is_file():
        return None, f"no PyTorch formulation file at {path}"
    if importlib.util.find_spec("torch") is None:
        return None, "torch is not installed"
    spec = importlib.util.spec_from_file_location(f"_jaxrl_llm_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, ""


def num_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def time_torch_loss(
    torch_impl: ModuleType,
    objective: objectives.Objective,
    data: tuple[np.ndarray, RolloutBatch],
    *,
    repeats: int | None = None,
) -> LossTiming:
    """Times the eager PyTorch formulation (forward + ``loss.backward()``) on ``data``."""
    logprobs, batch = data
    step = torch_impl.make_step(objective, logprobs, batch)
    first, times = sample_times(step, repeats=repeats)
    return timing_from_samples(times, compile_s=first, num_bytes=step_bytes(logprobs, batch))


def environment(torch_impl: ModuleType | None = None) -> dict[str, str]:
    """Machine and versions written next to every table."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    device = jax.devices()[0]
    versions = [f"python {platform.python_version()}", f"jax {jax.__version__}"]
    versions += [f"jaxlib {importlib.metadata.version('jaxlib')}", f"numpy {np.__version__}"]
    if torch_impl is not None:
        versions.append(f"torch {torch_impl.torch.__version__}")
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu}, {num_cores()} cores",
        "device": f"{device.platform} ({device.device_kind}), {jax.device_count()} device(s)",
        "load average (1 min) at start": f"{os.getloadavg()[0]:.2f}",
        "threads": f"XLA: all {num_cores()} cores; torch: "
        + (f"{torch_impl.torch.get_num_threads()}" if torch_impl is not None else "n/a"),
        "versions": ", ".join(versions),
    }


def _cells(row: BenchRow) -> list[str]:
    jx, th = row.jax, row.torch
    pct = 100.0 * jx.gbps / row.copy_gbps if row.copy_gbps > 0 else float("nan")
    cells = [row.name, str(row.B), str(row.T), f"{jx.compile_s:.2f}", f"{jx.median_s * 1e3:.3f}"]
    cells += [f"{jx.p10_s * 1e3:.2f}–{jx.p90_s * 1e3:.2f}", f"{jx.gbps:.2f}"]
    cells += [f"{row.copy_gbps:.2f}", f"{pct:.0f}%"]
    if th is None:
        return [*cells, "n/a", "n/a", "n/a"]
    torch_cells = [f"{th.median_s * 1e3:.2f}", f"{th.p10_s * 1e3:.1f}–{th.p90_s * 1e3:.1f}"]
    return [*cells, *torch_cells, f"{row.speedup:.1f}×"]


_HEADERS = (
    "preset", "B", "T", "compile s", "JAX ms", "p10–p90 ms", "GB/s", "copy GB/s", "% copy",
    "torch ms", "torch p10–p90", "speed-up",
)  # fmt: skip


def format_table(rows: Sequence[BenchRow], *, markdown: bool = True) -> str:
    """The benchmark table: one line per :class:`BenchRow`.

    Columns: compile time, JAX median and p10–p90 spread (ms), effective GB/s, the copy
    bandwidth and the percentage of it reached, the PyTorch eager median and spread (ms) and
    the speed-up ``torch / JAX`` (n/a without PyTorch).

    Args:
      rows: the lines.
      markdown: a Markdown pipe table; otherwise space-aligned plain text.
    """
    body = [_cells(row) for row in rows]
    if markdown:
        lines = ["| " + " | ".join(_HEADERS) + " |"]
        lines.append("|---|" + "---:|" * (len(_HEADERS) - 1))
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(c[i]) for c in body)) for i, h in enumerate(_HEADERS)]

    def aligned(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    return "\n".join(aligned(cells) for cells in [_HEADERS, *body])


def format_report(
    env: dict[str, str], rows: Sequence[BenchRow], *, command: str, markdown: bool
) -> str:
    """The table with the machine, device kind and versions above it."""
    header = [f"{key}: {value}" for key, value in [("command", command), *env.items()]]
    note = (
        "loss + gradient w.r.t. the log-probs; JAX ms = median of jax.jit(value_and_grad) "
        "(compile excluded); GB/s = (inputs read + gradient written) / median; copy GB/s = "
        "jitted x + 1 over one [B, T] f32 array; speed-up = PyTorch eager median / JAX median."
    )
    if markdown:
        header = [f"- {line}" for line in header]
    return "\n".join([*header, "", format_table(rows, markdown=markdown), "", note])


def append_results(path: str | os.PathLike, report: str, *, date: str) -> None:
    """Appends a dated section holding ``report`` to a Markdown file (created if missing)."""
    path = Path(path)
    text = "" if not path.exists() else path.read_text()
    if not text:
        text = "# Benchmark results\n\nFigures appended by `jaxrl-llm bench` runs, newest last.\n"
    path.write_text(f"{text.rstrip()}\n\n## Loss presets — {date}\n\n{report}\n")


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


def parse_presets(text: str) -> list[str]:
    """``"grpo,dapo"`` -> ``["grpo", "dapo"]`` (``"all"``: every preset)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if names == ["all"]:
        return list(objectives.available())
    unknown = [name for name in names if name not in objectives.PRESETS]
    if unknown or not names:
        raise ValueError(
            f"unknown preset(s) {unknown or text!r}; available: {objectives.available()}"
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
        "--results": dict(help="append a dated section to this Markdown file ('' = none)"),
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
    appends it as a dated section to a Markdown file.

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
        append_results(args.results, report, date=env["date"])
    return 0
