"""Scoring in worker processes, overlapped with the step's log-prob forwards, vs waiting first.

A GRPO run on the built-in task with a KL reference and two epochs (so each step runs both the
old-policy and the reference forward), its completions scored in ``rollout.reward_workers``
processes by ``slow_math_match``: ``math_match`` after ``--verifier-ms`` of waiting per
completion, standing for a verifier whose cost is latency (a sandbox or judge service; a
CPU-heavy verifier would also compete with the forwards for this machine's 2 cores). The model
is widened (``--hidden``, ``--layers``) so the forwards take a measurable time, and starts
random (no warm-up: the timing does not need a trained policy). Two runs of the same config and
seed: ``overlapped`` (the trainer's default: the completions go to the workers, the forwards
are dispatched, then the trainer waits) and ``serial`` (``RLTrainer.defer_scoring = False``:
the trainer waits for the scores before dispatching the forwards). Both train the same policy
(their non-time metrics are checked equal); the table gives medians over the steps after the
first (compiles) of ``time/scoring`` (the step's wait for scores), ``time/logprobs`` and
``time/step``.

Run::

    python benchmarks/bench_scoring_overlap.py            # 6 steps each (about 2 min, 2 cores)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import jax

from jaxrl_llm import rewards
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.rl.config import TrainConfig
from jaxrl_llm.train.rl.trainer import RLTrainer

KEYS = ("time/scoring", "time/logprobs", "time/step")
VERIFIER_MS = float(os.environ.get("BENCH_VERIFIER_MS", "5"))
_MATCH = rewards.make_reward("math_match")


def slow_math_match(prompt: str, completion: str, example) -> float:
    """``math_match`` after ``BENCH_VERIFIER_MS`` milliseconds of waiting (a remote verifier)."""
    time.sleep(VERIFIER_MS / 1000.0)
    return _MATCH(rewards.RewardInput(prompt=prompt, completion=completion, example=example))


def run(run_dir: str, *, steps: int, workers: int, defer: bool, hidden: int, layers: int):
    cfg = load_config(
        TrainConfig,
        None,
        [
            f"run_dir={run_dir}",
            "sft_warmup.steps=0",
            f"model.tiny.hidden_size={hidden}",
            f"model.tiny.intermediate_size={3 * hidden}",
            f"model.tiny.num_hidden_layers={layers}",
            f"trainer.max_steps={steps}",
            "trainer.epochs=2",
            "trainer.eval_every=0",
            "objective.overrides={kl_coef: 0.04}",
            "rewards=[{name: 'bench_scoring_overlap:slow_math_match'}]",
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
    global VERIFIER_MS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--verifier-ms", type=float, default=5.0)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    os.environ["BENCH_VERIFIER_MS"] = str(args.verifier_ms)  # the workers read it at import
    VERIFIER_MS = args.verifier_ms
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the workers import us
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, defer in (("serial", False), ("overlapped", True)):
            rows[name] = run(
                f"{tmp}/{name}",
                steps=args.steps,
                workers=args.workers,
                defer=defer,
                hidden=args.hidden,
                layers=args.layers,
            )
    same = [
        {k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per_s"))}
        for r in rows["serial"]
    ] == [
        {k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per_s"))}
        for r in rows["overlapped"]
    ]
    print(
        f"built-in task, tiny model widened to hidden {args.hidden} x {args.layers} layers, "
        f"16 x 8 completions a step, math_match after {args.verifier_ms:g} ms a completion in "
        f"{args.workers} workers, KL reference, 2 epochs; jax {jax.__version__}, "
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
