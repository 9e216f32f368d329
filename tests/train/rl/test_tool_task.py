"""The built-in tool task (``configs/tool_calculator.yaml``, issue 15): with the calculator
tool the tiny model answers 3-4 digit multiplications it cannot do in its head.

Runs the installed ``jaxrl-llm`` console script twice, as a user would, on a shortened
schedule (700 SFT warm-up steps, 2 GRPO steps, 32 held-out prompts; about 2 min on 2 cores):
the config as shipped, and the same task without the tool (``env.name=null``: the
demonstrations are the bare answers, 10 tokens). The tool-using policy's held-out accuracy
must beat the no-tool policy's by ``MIN_GAIN``. The full config (1500 warm-up steps, 40 GRPO
steps, 128 prompts) gives 100% → 99.2% with the tool and 0% → 0% without
(benchmarks/RESULTS.md).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from tests.train.helpers import CONFIGS, single_device_env

pytestmark = pytest.mark.slow

MIN_GAIN = 0.20
SHORT = (
    "sft_warmup.steps=700",
    "trainer.max_steps=2",
    "trainer.eval_every=0",
    "data.eval_size=32",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "logging.progress=false",
    "logging.plots=false",
    "logging.tensorboard=false",
)


def _train(run_dir: pathlib.Path, *overrides: str) -> dict:
    script = pathlib.Path(sys.executable).parent / "jaxrl-llm"
    assert script.is_file(), f"{script} missing: install the package (pip install -e .) first"
    result = subprocess.run(
        [
            str(script),
            "train",
            str(CONFIGS / "tool_calculator.yaml"),
            *SHORT,
            f"run_dir={run_dir}",
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        env=single_device_env(),
    )
    assert result.returncode == 0, result.stderr[-5000:]
    return json.loads(result.stdout)


def test_the_tool_using_policy_beats_the_no_tool_policy(tmp_path):
    tool = _train(tmp_path / "tool")
    plain = _train(tmp_path / "no_tool", "env.name=null", "rollout.max_new_tokens=10")
    with_tool = tool["eval_after_rl"]["accuracy"]
    without = plain["eval_after_rl"]["accuracy"]
    assert with_tool - without >= MIN_GAIN, (tool, plain)
    # The episodes really went through the tool: a call, its response, then the answer.
    row = json.loads((tmp_path / "tool" / "samples.jsonl").read_text().splitlines()[-1])
    assert row["completion"].startswith('<tool_call>{"name":"calc","arguments":{"expr":"')
    assert "<tool_response>" in row["completion"]
    metrics = [json.loads(line) for line in (tmp_path / "tool" / "metrics.jsonl").open()]
    assert all(m["env/tool_calls"] > 0 for m in metrics)
