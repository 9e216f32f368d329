"""The bake-off's report: what a sweep's runs learned, per variant, from their own files.

Each run directory holds ``summary.json`` (held-out accuracy after the SFT warm-up,
``eval_before_rl``, and after RL, ``eval_after_rl``) and ``metrics.jsonl`` (one row per RL
step: ``eval/accuracy`` every ``trainer.eval_every`` steps, ``entropy``, ``grad_norm``,
``clip_frac``, ``time/step``). Per run:

* ``gain = acc_after − acc_before`` (held-out accuracy, in points);
* ``steps_to_threshold``: the first evaluated step ``s > 0`` with
  ``acc(s) ≥ acc_before + threshold`` (``None``: never); evaluations happen every
  ``trainer.eval_every`` steps and after the last, so it is a multiple of ``eval_every`` or the
  last step;
* ``step_time``: the median of ``time/step`` (the first steps' compilation does not move it);
* ``entropy_ratio = entropy(last step) / entropy(first step)`` (well under 1: the policy's
  entropy collapsed);
* ``grad_spikes``: the number of steps with ``grad_norm > 5 × median(grad_norm)``;
* ``clip_frac``: the mean of ``clip_frac`` over the steps (``None`` where the surrogate reports
  none);
* ``fractions``: the means of the stabilisers' own token fractions where the run reports them
  (:data:`FRACTION_KEYS`: KL-Cov's and Clip-Cov's ``cov_frac``, the tokens the M2PO and
  off-policy masks drop, the top-entropy share kept).

Per variant (its runs over seeds): the mean gain with a 95% Student-t interval
``ḡ ± t_{0.975, n−1}·s/√n`` (``s``: the sample standard deviation; no interval from one seed),
the median of the seeds' steps to threshold among those that reached it (and how many did), the
median of their step times, and the means of the stability signals. A run that failed is
counted, not averaged.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl_llm.train.metrics import SUMMARY_FILE, read_metrics

#: A step whose gradient norm exceeds this multiple of its run's median is a spike.
SPIKE_FACTOR = 5.0
#: Coverage of the interval over seeds.
LEVEL = 0.95
#: The stabilisers' token fractions (metric -> its name in the table).
FRACTION_KEYS = {
    "cov_frac": "cov",
    "m2po_masked_frac": "m2po masked",
    "off_policy_masked_frac": "off-policy masked",
    "top_entropy_frac": "top-entropy kept",
}
TABLE_FILE = "sweep.md"
JSON_FILE = "sweep.json"
PLOT_FILE = "sweep_accuracy.png"


def finished_summary(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """A run's ``summary.json`` if the run finished (its summary holds the evaluation after
    RL), else None."""
    path = pathlib.Path(run_dir) / SUMMARY_FILE
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None
    if not isinstance(summary, dict) or "eval_after_rl" not in summary:
        return None
    return summary


def _values(rows: Sequence[Mapping[str, Any]], key: str) -> list[tuple[int, float]]:
    """``key``'s finite ``(step, value)`` pairs by step (a step repeated after a resume: its
    last row wins)."""
    found = {}
    for row in rows:
        value = row.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            found[int(row["step"])] = float(value)
    return sorted(found.items())


def accuracy_curve(summary: Mapping[str, Any], rows) -> list[tuple[int, float]]:
    """Held-out accuracy by step: step 0 (after the warm-up), the ``eval/accuracy`` rows, and
    the evaluation after RL at the last step where no row has one."""
    points = dict(_values(rows, "eval/accuracy"))
    points[0] = float(summary["eval_before_rl"]["accuracy"])
    points.setdefault(int(summary["steps"]), float(summary["eval_after_rl"]["accuracy"]))
    return sorted(points.items())


def run_stats(summary: Mapping[str, Any], rows, *, threshold: float) -> dict[str, Any]:
    """One finished run's numbers (module docstring); ``threshold`` in accuracy points.

    Raises:
      ValueError: a summary without held-out accuracies (not an RL run's).
    """
    try:
        before = float(summary["eval_before_rl"]["accuracy"])
        after = float(summary["eval_after_rl"]["accuracy"])
    except (KeyError, TypeError) as err:
        raise ValueError(f"summary.json has no held-out accuracy ({err!r} missing)") from None
    curve = accuracy_curve(summary, rows)
    target = before + threshold / 100.0
    reached = [step for step, acc in curve if step > 0 and acc >= target - 1e-12]
    times = [v for _, v in _values(rows, "time/step")]
    entropy = [v for _, v in _values(rows, "entropy")]
    grads = [v for _, v in _values(rows, "grad_norm")]
    clips = [v for _, v in _values(rows, "clip_frac")]
    spikes = None
    if grads:
        median = statistics.median(grads)
        spikes = sum(g > SPIKE_FACTOR * median for g in grads)
    return {
        "before": 100 * before,
        "after": 100 * after,
        "gain": 100 * (after - before),
        "steps_to_threshold": reached[0] if reached else None,
        "step_time": statistics.median(times) if times else None,
        "entropy_ratio": entropy[-1] / entropy[0] if entropy and entropy[0] > 0 else None,
        "grad_spikes": spikes,
        "clip_frac": statistics.fmean(clips) if clips else None,
        "fractions": {
            key: statistics.fmean(v for _, v in _values(rows, key))
            for key in FRACTION_KEYS
            if _values(rows, key)
        },
        "curve": [[step, 100 * acc] for step, acc in curve],
    }


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (SciPy's)."""
    from scipy import stats  # noqa: PLC0415  (only a report with two seeds or more needs it)

    return float(stats.t.ppf(p, df))


def mean_interval(values: Sequence[float]) -> tuple[float, float | None, float | None]:
    """``(mean, low, high)``: the mean and its 95% t-interval ``x̄ ± t·s/√n`` (``None`` bounds
    for fewer than two values).

    Raises:
      ValueError: no values.
    """
    if not values:
        raise ValueError("mean_interval needs at least one value")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None, None
    half = t_quantile(0.5 + LEVEL / 2, len(values) - 1) * statistics.stdev(values)
    half /= math.sqrt(len(values))
    return mean, mean - half, mean + half


def _mean(values) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.fmean(kept) if kept else None


def variant_stats(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A variant's row from its runs' ``run_stats`` (``None`` for a run that failed)."""
    done = [r for r in runs if r is not None]
    row: dict[str, Any] = {"runs": len(runs), "failed": len(runs) - len(done)}
    if not done:
        return row
    mean, low, high = mean_interval([r["gain"] for r in done])
    reached = [r["steps_to_threshold"] for r in done if r["steps_to_threshold"] is not None]
    times = [r["step_time"] for r in done if r["step_time"] is not None]
    row.update(
        gain=mean,
        gain_low=low,
        gain_high=high,
        before=_mean(r["before"] for r in done),
        after=_mean(r["after"] for r in done),
        steps_to_threshold=statistics.median(reached) if reached else None,
        reached=len(reached),
        step_time=statistics.median(times) if times else None,
        entropy_ratio=_mean(r["entropy_ratio"] for r in done),
        grad_spikes=_mean(r["grad_spikes"] for r in done),
        clip_frac=_mean(r["clip_frac"] for r in done),
        fractions={
            key: _mean(r["fractions"].get(key) for r in done)
            for key in FRACTION_KEYS
            if any(key in r["fractions"] for r in done)
        },
    )
    return row


def build_report(
    cells: Mapping[str, Mapping[int, str | os.PathLike]], *, threshold: float
) -> dict[str, Any]:
    """The report of a sweep: ``cells`` maps each variant to ``{seed: run_dir}``.

    Returns:
      ``{"threshold": ..., "level": 0.95, "interval": "student-t", "variants": {variant:
      {...variant_stats, "seeds": {seed: run_stats or None}}}}`` (JSON-able).
    """
    variants = {}
    for variant, seeds in cells.items():
        per_seed = {}
        for seed, run_dir in seeds.items():
            summary = finished_summary(run_dir)
            if summary is None:
                per_seed[seed] = None
                continue
            metrics = pathlib.Path(run_dir) / "metrics.jsonl"
            rows = read_metrics(metrics) if metrics.is_file() else []
            per_seed[seed] = run_stats(summary, rows, threshold=threshold)
        variants[variant] = {**variant_stats(list(per_seed.values())), "seeds": per_seed}
    return {"threshold": threshold, "level": LEVEL, "interval": "student-t", "variants": variants}


def _num(value, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def markdown_table(report: Mapping[str, Any]) -> str:
    """The report as a Markdown table, one row per variant."""
    threshold = report["threshold"]
    lines = [
        f"| variant | seeds | after warm-up (%) | after RL (%) | gain (points, 95% t-interval) "
        f"| steps to +{threshold:g} | s / step (median) | entropy last/first "
        "| grad-norm spikes / run | clip frac | stabiliser fractions |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, row in report["variants"].items():
        seeds = f"{row['runs'] - row['failed']}/{row['runs']}"
        if "gain" not in row:
            lines.append(f"| `{variant}` | {seeds} (all failed) |" + " — |" * 9)
            continue
        gain = f"{row['gain']:+.1f}"
        if row["gain_low"] is not None:
            gain += f" [{row['gain_low']:+.1f}, {row['gain_high']:+.1f}]"
        done = row["runs"] - row["failed"]
        steps = "not reached"
        if row["steps_to_threshold"] is not None:
            steps = f"{row['steps_to_threshold']:g} ({row['reached']}/{done})"
        cells = [
            f"`{variant}`",
            seeds,
            _num(row["before"], ".1f"),
            _num(row["after"], ".1f"),
            gain,
            steps,
            _num(row["step_time"], ".3f"),
            _num(row["entropy_ratio"], ".2f"),
            _num(row["grad_spikes"], ".1f"),
            _num(row["clip_frac"], ".3f"),
            ", ".join(f"{FRACTION_KEYS[k]} {v:.3f}" for k, v in row["fractions"].items()) or "—",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def mean_curve(curves: Sequence[Sequence[Sequence[float]]]):
    """``(steps, mean, low, high)`` over the steps every curve has (min and max for the
    band); empty lists when none is shared."""
    shared = set.intersection(*(set(step for step, _ in c) for c in curves)) if curves else set()
    steps = sorted(shared)
    at = [dict((step, acc) for step, acc in c) for c in curves]
    values = [[a[step] for a in at] for step in steps]
    return (
        steps,
        [statistics.fmean(v) for v in values],
        [min(v) for v in values],
        [max(v) for v in values],
    )


def plot_report(report: Mapping[str, Any], path: str | os.PathLike) -> str:
    """Held-out accuracy against the step, one line per variant (mean over its seeds, shaded
    between their min and max); a PNG at ``path``."""
    import matplotlib  # noqa: PLC0415  (imported only when a report is drawn)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = plt.get_cmap("tab20")  # a bake-off has more variants than the default 10 colours
    for i, (variant, row) in enumerate(report["variants"].items()):
        curves = [r["curve"] for r in row["seeds"].values() if r is not None]
        steps, mean, low, high = mean_curve(curves)
        if not steps:
            continue
        color = colors(i % colors.N)
        marker = "." if len(steps) < 30 else None
        ax.plot(steps, mean, marker=marker, color=color, label=variant)
        if len(curves) > 1:
            ax.fill_between(steps, low, high, color=color, alpha=0.12)
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title("held-out accuracy: mean over seeds, min-max shaded")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return os.fspath(path)


def write_report(
    out_dir: str | os.PathLike,
    cells: Mapping[str, Mapping[int, str | os.PathLike]],
    *,
    threshold: float,
) -> dict[str, Any]:
    """Writes ``sweep.md``, ``sweep.json`` and ``sweep_accuracy.png`` under ``out_dir``;
    returns the report."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = build_report(cells, threshold=threshold)
    (out / JSON_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / TABLE_FILE).write_text(markdown_table(report), encoding="utf-8")
    plot_report(report, out / PLOT_FILE)
    return report


__all__ = [
    "FRACTION_KEYS",
    "JSON_FILE",
    "PLOT_FILE",
    "SPIKE_FACTOR",
    "TABLE_FILE",
    "accuracy_curve",
    "build_report",
    "finished_summary",
    "markdown_table",
    "mean_curve",
    "mean_interval",
    "plot_report",
    "run_stats",
    "t_quantile",
    "variant_stats",
    "write_report",
]
