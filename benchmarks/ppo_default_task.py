"""PPO with a critic learning the built-in task: ``jaxrl-llm train configs/ppo.yaml``.

The whole run as a user starts it (2000 SFT warm-up steps, then 60 PPO steps of 32 prompts x 8
completions, the critic initialised from the policy, 5 critic-only warm-up steps), through the
console script on one CPU device. Prints the held-out greedy accuracy before and after RL and
the critic's mean explained variance. About 1.5 min on an idle 2-core CPU; a benchmark rather
than a CI test (the suite's time budget). ``benchmarks/ppo_critic_ablation.py`` compares it
with the critic's values zeroed.

Run::

    python benchmarks/ppo_default_task.py
"""

from __future__ import annotations

import json
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import console_run  # noqa: E402

CONFIG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "ppo.yaml"


def main() -> None:
    from jaxrl_llm.train.metrics import read_metrics

    summary, wall, rows = console_run.train([str(CONFIG)], read=read_metrics)
    variance = [r["critic/explained_variance"] for r in rows]
    before = summary["eval_before_rl"]["accuracy"]
    after = summary["eval_after_rl"]["accuracy"]
    print(
        json.dumps(
            {
                "accuracy_before_rl": before,
                "accuracy_after_rl": after,
                "gain_points": round(100 * (after - before), 1),
                "steps": len(rows),
                "explained_variance_mean": sum(variance) / len(variance),
                "all_finite": all(math.isfinite(v) for v in variance),
                "wall_s": round(wall, 1),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
