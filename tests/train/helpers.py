"""Pieces every training test shares: the configs folder, a persistent compilation cache,
metric rows without their wall-clock keys, a one-device environment for subprocess runs, and
``jaxrl-llm train`` across two processes or in one.

The jobs compile a sampler, log-prob programs and an optimizer step per run; most programs are
the same from one tiny run to the next, so the tests share a persistent compilation cache (in
the session's temporary directory) and only a run's own programs compile anew.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

from jaxrl_llm import cli
from tests.parallel import launcher

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"

# Wall-clock metrics (``time/<phase>``, ``tokens_per_s`` and ``tokens_per_s/<phase>``): they
# differ between otherwise identical runs.
TIMING_PREFIXES = ("time/", "tokens_per_s")


#: Names a compilation cache directory shared with a parent pytest session.
SHARED_CACHE_ENV = "JAXRL_TEST_JAX_CACHE"


@contextlib.contextmanager
def persistent_compilation_cache(
    directory: str | os.PathLike, *, min_compile_secs: float = 0.0
) -> Iterator[None]:
    """Enables JAX's on-disk compilation cache for every program (compiled in at least
    ``min_compile_secs``), then restores the settings.

    ``$JAXRL_TEST_JAX_CACHE`` overrides ``directory``: ``tests/conftest.py`` points it at one
    directory for the whole session (both xdist workers), and the mutation check's child pytest
    runs at the parent session's (a mutant that changes a program changes its key).
    """
    directory = os.environ.get(SHARED_CACHE_ENV) or directory
    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    previous = {name: getattr(jax.config, name) for name in names}
    jax.config.update("jax_compilation_cache_dir", os.fspath(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_secs)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        for name, value in previous.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


def cache_env(directory: str | os.PathLike) -> dict[str, str]:
    """Environment variables giving a subprocess the same compilation cache."""
    return {
        "JAX_COMPILATION_CACHE_DIR": os.fspath(directory),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def single_device_env() -> dict[str, str]:
    """The environment without the test session's 8 fake CPU devices (a user's one CPU) and
    its fast-compile flag: a user's flags."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    kept = [
        f
        for f in flags
        if not f.startswith("--xla_force_host_platform_device_count")
        and f != "--xla_backend_optimization_level=0"  # the test session's (tests/conftest.py)
    ]
    return {**os.environ, "XLA_FLAGS": " ".join(kept), "JAX_PLATFORMS": "cpu"}


# Only stops a hang (a process waiting for a peer that is gone); never a performance limit.
LAUNCH_TIMEOUT_S = 900


def train_in_two_processes(out: pathlib.Path, overrides: Sequence[str]) -> list[dict]:
    """``jaxrl-llm train *overrides run_dir=out/run`` as two processes of 4 CPU devices (gloo,
    ``tests.parallel.launcher``); the run's metric rows."""
    out.mkdir(parents=True)
    run_dir = out / "run"
    launcher.launch(
        "jaxrl_llm.cli",
        ["train", *overrides, f"run_dir={run_dir}"],
        log_dir=out,
        timeout_s=LAUNCH_TIMEOUT_S,
    )
    return read_jsonl(run_dir / "metrics.jsonl")


def train_in_one_process(
    out: pathlib.Path, overrides: Sequence[str], devices: int = 8
) -> list[dict]:
    """The same command as one process of ``devices`` CPU devices (the session's LLVM level,
    as the launcher gives the workers: the levels round differently); its metric rows."""
    run_dir = out / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl_llm.cli", "train", *overrides, f"run_dir={run_dir}"],
        env=launcher.single_process_env(devices),
        cwd=launcher.REPO,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_jsonl(run_dir / "metrics.jsonl")


def is_timing(key: str) -> bool:
    return key.startswith(TIMING_PREFIXES)


def without_timing(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metric rows without the wall-clock keys."""
    return [{k: v for k, v in row.items() if not is_timing(k)} for row in rows]


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_jsonl(path: str | os.PathLike) -> list[Any]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def assert_user_error(capsys, argv, message: str) -> str:
    """``jaxrl-llm ARGV`` exits 2 with one ``error:`` line matching ``message``; returns it."""
    capsys.readouterr()
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("error: "), lines[0]
    assert re.search(message, lines[0]), lines[0]
    return lines[0]
