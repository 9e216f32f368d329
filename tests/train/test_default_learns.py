"""``jaxrl-llm train`` with no config learns the built-in task (issue 7).

Runs the console command as a user would -- its own process on one CPU device (without the
test session's 8 fake devices), the default config, only ``run_dir`` set and at most
``MAX_STEPS`` RL steps -- and requires greedy accuracy on the held-out prompts to rise from
before RL to after it. The README reports the numbers of the full default run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxrl_llm.train.config import TrainConfig
from jaxrl_llm.train.metrics import read_metrics

pytestmark = pytest.mark.slow

# Caps the RL steps so the test stays within CI time should the default grow.
MAX_STEPS = 40


def _single_device_env() -> dict[str, str]:
    flags = os.environ.get("XLA_FLAGS", "").split()
    kept = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
    return {**os.environ, "XLA_FLAGS": " ".join(kept), "JAX_PLATFORMS": "cpu"}


def test_default_run_improves_held_out_accuracy(tmp_path):
    run_dir = tmp_path / "default"
    steps = min(TrainConfig().trainer.max_steps, MAX_STEPS)
    args = [f"run_dir={run_dir}", "logging.progress=false"]
    if steps < TrainConfig().trainer.max_steps:
        args.append(f"trainer.max_steps={steps}")
    result = subprocess.run(
        [sys.executable, "-m", "jaxrl_llm.cli", "train", *args],
        capture_output=True,
        text=True,
        timeout=1200,
        env=_single_device_env(),
    )
    assert result.returncode == 0, result.stderr[-5000:]

    summary = json.loads(result.stdout)
    assert len(read_metrics(run_dir)) == steps
    before = summary["eval_before_rl"]["accuracy"]
    after = summary["eval_after_rl"]["accuracy"]
    assert after > before, f"held-out accuracy went from {before} to {after} with RL: {summary}"
