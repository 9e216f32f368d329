"""The run's timeline: every step's phases as spans per lane, in ``timeline.jsonl``, drawn as
``plots/timeline.png`` (what ran beside what: with ``rollout.max_staleness`` the rollout lane
overlaps the trainer's update)."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence

FILE = "timeline.jsonl"
LANES = ("trainer", "rollout")


class Timeline:
    """Appends ``{"step", "lane", "phase", "start", "end"}`` rows (seconds since the first span
    this process wrote) to ``run_dir/timeline.jsonl``."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = pathlib.Path(run_dir) / FILE
        self.origin: float | None = None

    def truncate(self, step: int) -> None:
        """Drops the rows of steps after ``step`` (a resumed run rewrites them)."""
        if not self.path.exists():
            return
        rows = [r for r in read(self.path) if r["step"] <= step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def write(self, step: int, spans: Sequence[tuple[str, str, float, float]]) -> None:
        if not spans:
            return
        if self.origin is None:
            self.origin = min(start for _, _, start, _ in spans)
        with self.path.open("a") as f:
            for lane, phase, start, end in sorted(spans, key=lambda s: s[2]):
                row = {
                    "step": step,
                    "lane": lane,
                    "phase": phase,
                    "start": round(start - self.origin, 6),
                    "end": round(end - self.origin, 6),
                }
                f.write(json.dumps(row) + "\n")


def read(path: str | os.PathLike) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def overlap_seconds(rows: Sequence[dict], lane_a: str, phases_a, lane_b: str, phases_b) -> float:
    """Seconds during which a ``phases_a`` span of ``lane_a`` and a ``phases_b`` span of
    ``lane_b`` run at the same time."""
    a = [(r["start"], r["end"]) for r in rows if r["lane"] == lane_a and r["phase"] in phases_a]
    b = [(r["start"], r["end"]) for r in rows if r["lane"] == lane_b and r["phase"] in phases_b]
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def plot(run_dir: str | os.PathLike, last_steps: int = 6) -> str | None:
    """Draws the last ``last_steps`` steps' spans to ``plots/timeline.png``; its path, or None
    without a timeline."""
    path = pathlib.Path(run_dir) / FILE
    if not path.exists():
        return None
    rows = read(path)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted({r["step"] for r in rows})[-last_steps:]
    rows = [r for r in rows if r["step"] in steps]
    phases = sorted({r["phase"] for r in rows})
    colors = {p: plt.get_cmap("tab20")(i % 20) for i, p in enumerate(phases)}
    lanes = [lane for lane in LANES if any(r["lane"] == lane for r in rows)]
    lanes += sorted({r["lane"] for r in rows} - set(lanes))
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.8 * len(lanes)))
    for y, lane in enumerate(lanes):
        for r in (r for r in rows if r["lane"] == lane):
            ax.broken_barh(
                [(r["start"], r["end"] - r["start"])], (y - 0.35, 0.7), color=colors[r["phase"]]
            )
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("seconds")
    ax.set_title(f"timeline, steps {steps[0]}-{steps[-1]}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in phases]
    ax.legend(handles, phases, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    out = pathlib.Path(run_dir) / "plots" / "timeline.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return os.fspath(out)
