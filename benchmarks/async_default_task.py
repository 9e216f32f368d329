"""The default task learning one step off, on separate sampler devices (issue 14's target).

The whole default run (2000 SFT warm-up steps, 200 GRPO steps) through the ``jaxrl-llm``
console script on 8 fake CPU devices: the sampler on 4 (``mesh.rollout_devices=4``), the
trainer on the other 4, rollouts one step ahead of the update (``rollout.max_staleness=1``),
token-level truncated importance sampling correcting the stale behaviour log-probs. Prints the
held-out accuracy before and after RL, the staleness of every step and how long rollouts ran
beside the update. About 2.5 min on an idle 2-core CPU; a benchmark rather than a CI test (an
8-device subprocess of this length slowed the whole suite past its time budget).

Run::

    python benchmarks/async_default_task.py [--partial]

``--partial`` adds partial rollouts (``rollout.partial=true`` on the continuous engine): the
rollout in flight takes each update's weights between bursts; the share of stale tokens per
step is printed too.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import console_run  # noqa: E402

ASYNC = (
    "rollout.max_staleness=1",
    "mesh.rollout_devices=4",
    "objective.overrides={rollout_correction: {is_level: token, is_upper: 2.0}}",
)
PARTIAL = ("rollout.partial=true", "rollout.engine=continuous")


def _read(run_dir: pathlib.Path):
    from jaxrl_llm.train import timeline
    from jaxrl_llm.train.metrics import read_metrics

    return read_metrics(run_dir), timeline.read(run_dir / timeline.FILE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--partial", action="store_true", help="partial rollouts")
    partial = parser.parse_args().partial
    overrides = ASYNC + (PARTIAL if partial else ())
    summary, wall, (rows, spans) = console_run.train(overrides, devices=8, read=_read)
    from jaxrl_llm.train import timeline

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
                **(
                    {
                        "stale_token_frac_mean": sum(r["rollout/stale_token_frac"] for r in rows)
                        / len(rows)
                    }
                    if partial
                    else {}
                ),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
