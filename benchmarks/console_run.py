"""One ``jaxrl-llm train`` run through the console script, as a user starts it, for the
default-task benchmarks (``async_default_task.py``, ``ppo_default_task.py``)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any


def train(
    overrides: Sequence[str], *, devices: int = 1, read: Callable[[pathlib.Path], Any] | None = None
) -> tuple[dict[str, Any], float, Any]:
    """``(summary, wall seconds, read(run_dir))`` of ``jaxrl-llm train *overrides`` on
    ``devices`` CPU devices in a temporary run directory (exits with the run's stderr tail if
    it fails)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    if devices > 1:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags)}
    script = pathlib.Path(sys.executable).parent / "jaxrl-llm"
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = pathlib.Path(tmp) / "run"
        started = time.perf_counter()
        result = subprocess.run(
            [str(script), "train", *overrides, f"run_dir={run_dir}", "logging.progress=false"],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        wall = time.perf_counter() - started
        if result.returncode:
            sys.exit(result.stderr[-5000:])
        return json.loads(result.stdout), wall, None if read is None else read(run_dir)
