"""Scoring in worker processes, overlapped with the step's log-prob forwards, vs waiting first.

The built-in task's GRPO run with a KL reference and two epochs (so the step runs both the
old-policy and the reference forward) scored by ``math_match`` through ``math-verify``
(``backend: math_verify``) in ``rollout.reward_workers`` processes. Two runs of the same
config and seed: ``overlapped`` (the trainer's default: the completions go to the workers, the
forwards are dispatched, then the trainer waits) and ``serial`` (``RLTrainer.defer_scoring =
False``: the trainer waits for the scores before dispatching the forwards). Both train the
same policy (their metrics other than times are checked equal); the table gives the median
over the steps after the first (compiles) of ``time/scoring`` (what the step waits for scores),
``time/logprobs`` and ``time/step``.

Run::

    python benchmarks/bench_scoring_overlap.py            # 6 steps each (about 2 min, 2 cores)
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile

import jax

from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.rl.config import TrainConfig
from jaxrl_llm.train.rl.trainer import RLTrainer

KEYS = ("time/scoring", "time/logprobs", "time/step")


def run(run_dir: str, *, steps: int, workers: int, defer: bool) -> list[dict]:
    cfg = load_config(
        TrainConfig,
        None,
        [
            f"run_dir={run_dir}",
            "sft_warmup.steps=300",
            f"trainer.max_steps={steps}",
            "trainer.epochs=2",
            "trainer.eval_every=0",
            "objective.overrides={kl_coef: 0.04}",
            "rewards=[{name: math_match, kwargs: {backend: math_verify}}]",
            f"rollout.reward_workers={workers}",
            "logging.progress=false",
            "logging.plots=false",
            "logging.tensorboard=false",
        ],
    )
    RLTrainer.defer_scoring = defer
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.run.scorer.close()
        RLTrainer.defer_scoring = True
    return read_metrics(run_dir)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, defer in (("serial", False), ("overlapped", True)):
            rows[name] = run(f"{tmp}/{name}", steps=args.steps, workers=args.workers, defer=defer)
    same = [
        {k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per_s"))}
        for r in rows["serial"]
    ] == [
        {k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per_s"))}
        for r in rows["overlapped"]
    ]
    print(
        f"default task, 16 x 8 completions a step, math_match (math-verify) in {args.workers} "
        f"workers, KL reference, 2 epochs; jax {jax.__version__}, "
        f"{platform.processor() or platform.machine()}; same metrics in both runs: {same}"
    )
    print("| run | " + " | ".join(f"{k} (median s)" for k in KEYS) + " |")
    print("|---|" + "---|" * len(KEYS))
    for name, metrics in rows.items():
        later = metrics[1:]
        cells = [f"{statistics.median(r[k] for r in later):.3f}" for k in KEYS]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
