"""Plots of a run's metrics: one PNG per metric under ``run_dir/plots/``.

Written at every evaluation and at the end of every job (matplotlib is a dependency).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence

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


def plot(run_dir: str | os.PathLike, keys: Sequence[str] = DEFAULT_PLOT_KEYS) -> list[str]:
    """Plots ``keys`` of ``metrics.jsonl`` against the step, one PNG each under ``plots/``.

    Keys absent from every row (or never finite) are skipped.

    Args:
      run_dir: the run directory holding ``metrics.jsonl``.
      keys: metric names; ``/`` in a name becomes ``_`` in the file name.

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
        points = [
            (row["step"], row[key])
            for row in rows
            if isinstance(row.get(key), int | float) and math.isfinite(row[key])
        ]
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
