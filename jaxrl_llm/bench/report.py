"""The benchmark table and its report: rows, machine and versions, Markdown results file."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import jax
import numpy as np

from jaxrl_llm.bench.timing import LossTiming


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


def num_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


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


RESULTS_SECTION = "## Loss presets"


def write_results(path: str | os.PathLike, report: str) -> None:
    """Writes ``report`` as the ``## Loss presets`` section of a Markdown results file: the
    section's current figures replace the previous run's (the rest of the file is kept; the
    section is added at the end when missing, the file created when it does not exist)."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    if not text.strip():
        text = "# Benchmark results\n"
    section = f"{RESULTS_SECTION}\n\n{report.strip()}\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == RESULTS_SECTION), None)
    if start is None:
        path.write_text(f"{text.rstrip()}\n\n{section}")
        return
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    after = "".join(lines[end:])
    path.write_text("".join(lines[:start]) + section + ("\n" + after if after else ""))
