"""Loss + gradient of every objective preset under jit, against PyTorch eager (verl style).

For B in {64, 256} and T in {1024, 4096}: compile time, median step time (p10-p90 spread),
effective GB/s against a jitted copy measured in the same run, and the speed-up over the same
math in eager PyTorch (``benchmarks/torch_losses.py``) on the same arrays. Prints a Markdown
table and writes it, with the machine, device kind and versions, as the "Loss presets" section
of ``benchmarks/RESULTS.md`` (replacing the previous run's).

Usage::

    python benchmarks/bench_losses.py                      # all presets, the four shapes
    python benchmarks/bench_losses.py --presets grpo,dapo --shapes 256x4096 --repeats 20
    python benchmarks/bench_losses.py --results ''         # print only

Options are those of ``jaxrl-llm bench losses`` (see ``jaxrl_llm.bench.bench_main``).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from jaxrl_llm.bench import bench_main

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return bench_main(
        ["losses", *argv],
        prog="python benchmarks/bench_losses.py",
        defaults={
            "results": str(HERE / "RESULTS.md"),
            "torch_impl": str(HERE / "torch_losses.py"),
            "markdown": True,
        },
        command=shlex.join(["python", "benchmarks/bench_losses.py", *argv]),
    )


if __name__ == "__main__":
    sys.exit(main())
