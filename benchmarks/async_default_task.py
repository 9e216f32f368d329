"""The default task learning one step off, on separate sampler devices (issue 14's target).

The whole default run (2000 SFT warm-up steps, 200 GRPO steps) through the ``jaxrl-llm``
console script on 8 fake CPU devices: the sampler on 4 (``mesh.rollout_devices=4``), the
trainer on the other 4, rollouts one step ahead of the update (``rollout.max_staleness=1``),
token-level truncated importance sampling correcting the stale behaviour log-probs. Prints the
held-out accuracy before and after RL, the staleness of every step and how long rollouts ran
beside the update. About 2.5 min on an idle 2-core CPU; a benchmark rather than a CI test (an
8-device subprocess of this length slowed the whole suite past its time budget).

Run::

    python benchmarks/async_default_task.py
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ASYNC = (
    "rollout.max_staleness=1",
    "mesh.rollout_devices=4",
    "objective.overrides={rollout_correction: {is_level: token, is_upper: 2.0}}",
)


def main() -> None:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": " ".join([*flags, "--xla_force_host_platform_device_count=8"]),
    }
    script = pathlib.Path(sys.executable).parent / "jaxrl-llm"
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = pathlib.Path(tmp) / "async"
        started = time.perf_counter()
        result = subprocess.run(
            [str(script), "train", f"run_dir={run_dir}", "logging.progress=false", *ASYNC],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        wall = time.perf_counter() - started
        if result.returncode:
            sys.exit(result.stderr[-5000:])
        summary = json.loads(result.stdout)
        from jaxrl_llm.train import timeline
        from jaxrl_llm.train.metrics import read_metrics

        rows = read_metrics(run_dir)
        spans = timeline.read(run_dir / timeline.FILE)
    overlap = timeline.overlap_seconds(
        spans, "trainer", {"logprobs", "update"}, "rollout", {"rollout"}
    )
    print(
        json.dumps(
            {
                "accuracy_before_rl": summary["eval_before_rl"]["accuracy"],
                "accuracy_after_rl": summary["eval_after_rl"]["accuracy"],
                "steps": len(rows),
                "staleness": sorted({r["rollout/staleness"] for r in rows}),
                "rollout_corr/kl_mean": sum(r["rollout_corr/kl"] for r in rows) / len(rows),
                "rollout_overlapping_update_s": round(overlap, 2),
                "wall_s": round(wall, 1),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
