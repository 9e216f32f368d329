"""Plots of a run's metrics: one PNG per metric under ``run_dir/plots/``.

Written at every evaluation and at the end of every job (matplotlib is a dependency).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence

from jaxrl_llm.train.metrics import read_metrics

log = logging.getLogger(__name__)

PLOTS_DIR = "plots"
RL_PLOT_KEYS = (
    "reward_mean",
    "accuracy",
    "eval/accuracy",
    "kl",
    "entropy",
    "completion_length_mean",
    "clip_frac",
    "time/step",
)
PREFERENCE_PLOT_KEYS = (
    "loss",
    "rewards/accuracies",
    "rewards/margins",
    "eval/rewards/accuracies",
    "time/step",
)
DEFAULT_PLOT_KEYS = RL_PLOT_KEYS


def curve(
    rows: Sequence[Mapping[str, float]], key: str, extra: Sequence[tuple[int, float]] = ()
) -> list[tuple[int, float]]:
    """``key``'s finite ``(step, value)`` points, by step: the rows' and ``extra``'s (a row's
    value wins at a step both have)."""
    found = {
        step: value
        for step, value in [*extra, *((row["step"], row.get(key)) for row in rows)]
        if isinstance(value, int | float) and math.isfinite(value)
    }
    return sorted(found.items())


def plot(
    run_dir: str | os.PathLike,
    keys: Sequence[str] = DEFAULT_PLOT_KEYS,
    *,
    extra: Mapping[str, Sequence[tuple[int, float]]] | None = None,
) -> list[str]:
    """Plots ``keys`` of ``metrics.jsonl`` against the step, one PNG each under ``plots/``.

    Keys absent from every row (or never finite) are skipped.

    Args:
      run_dir: the run directory holding ``metrics.jsonl``.
      keys: metric names; ``/`` in a name becomes ``_`` in the file name.
      extra: ``(step, value)`` points of keys beyond the rows (the evaluations before and
        after training as ``eval/accuracy`` at step 0 and the last step); a row's own value
        at the same step wins.

    Returns:
      The paths of the PNGs written.

    Raises:
      FileNotFoundError: ``run_dir`` has no ``metrics.jsonl``.
    """
    rows = read_metrics(run_dir)
    import matplotlib  # noqa: PLC0415  (imported only when a run draws)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    out_dir = os.path.join(os.fspath(run_dir), PLOTS_DIR)
    written = []
    for key in keys:
        points = curve(rows, key, (extra or {}).get(key, ()))
        if not points:
            continue
        os.makedirs(out_dir, exist_ok=True)
        steps, values = zip(*points)
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, values, marker="." if len(points) < 50 else None)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.set_title(key)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = os.path.join(out_dir, key.replace("/", "_") + ".png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
