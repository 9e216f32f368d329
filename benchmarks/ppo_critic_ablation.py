"""PPO with its critic vs the same run with the critic's values zeroed (issue: does it help?).

Runs ``configs/ppo.yaml`` (the built-in arithmetic task) for each seed twice: as shipped, and
with the critic's rollout values replaced by zeros before GAE (``ppo.make_value_fn``
monkeypatched; the critic still trains, it just never reaches the advantages). Prints a
Markdown table: held-out greedy accuracy before / after RL and the critic's explained variance
over the last 10 steps. Nothing is tuned per arm: the same config, seeds and step count.

    python benchmarks/ppo_critic_ablation.py --seeds 0 1 --steps 60 [--out runs/ablation]
    python benchmarks/ppo_critic_ablation.py --seeds 0 1 --steps 60 --operator-offset 1.0

``--operator-offset W`` adds ``W`` to the reward of every completion of a ``+`` prompt and
subtracts it for a ``-`` prompt, whatever the completion: a per-prompt bias like a learned
reward model's, which carries no information about the completion. A critic can read it off
the prompt and take it out of the advantages; with zeroed values the batch-whitened returns
are dominated by it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import platform
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.rl import ppo
from jaxrl_llm.train.rl.config import TrainConfig
from jaxrl_llm.train.rl.run import trainer_for

CONFIG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "ppo.yaml"


@contextlib.contextmanager
def critic_values_zeroed():
    real = ppo.make_value_fn

    def make_value_fn(*args, **kwargs):
        fn = real(*args, **kwargs)
        return lambda params, seqs: jnp.zeros_like(fn(params, seqs))

    ppo.make_value_fn = make_value_fn
    try:
        yield
    finally:
        ppo.make_value_fn = real


def operator_offset(prompt: str, completion: str, example) -> float:
    """+1 for an addition prompt, -1 for a subtraction: independent of the completion."""
    del completion, example
    return 1.0 if "+" in prompt else -1.0


def run(seed: int, steps: int, run_dir: pathlib.Path, zeroed: bool, extra: list[str]) -> dict:
    cfg = load_config(
        TrainConfig,
        CONFIG,
        [
            f"seed={seed}",
            f"trainer.max_steps={steps}",
            f"run_dir={run_dir}",
            "logging.progress=false",
            "logging.plots=false",
            "logging.tensorboard=false",
            *extra,
        ],
    )
    start = time.perf_counter()
    with critic_values_zeroed() if zeroed else contextlib.nullcontext():
        summary = trainer_for(cfg).fit()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r["critic/explained_variance"] for r in rows[-10:] if "critic/explained_variance" in r]
    return {
        "seed": seed,
        "zeroed": zeroed,
        "before": summary["eval_before_rl"]["accuracy"],
        "after": summary["eval_after_rl"]["accuracy"],
        "explained_variance": statistics.fmean(last) if last else float("nan"),
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument(
        "--operator-offset", type=float, default=0.0, help="weight of the per-prompt reward bias"
    )
    parser.add_argument("overrides", nargs="*", help="extra config overrides for both arms")
    args = parser.parse_args()
    if args.operator_offset:
        args.overrides = [
            "rewards=[{name: math_match}, {name: 'ppo_critic_ablation:operator_offset', "
            f"weight: {args.operator_offset}}}]",
            *args.overrides,
        ]
    out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="ppo_ablation_"))
    results = []
    for seed in args.seeds:
        for zeroed in (False, True):
            name = f"seed{seed}_{'zeroed' if zeroed else 'critic'}"
            results.append(run(seed, args.steps, out / name, zeroed, args.overrides))
            print(json.dumps(results[-1]), flush=True)
    print(
        f"\n{platform.processor() or platform.machine()}, {jax.device_count()} "
        f"{jax.default_backend()} device(s), JAX {jax.__version__}, {args.steps} PPO steps, "
        f"overrides {args.overrides or 'none'}\n"
    )
    print(
        "| seed | critic values | accuracy before | accuracy after | expl. var. (last 10) | wall |"
    )
    print("|---:|---|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['seed']} | {'zeroed' if r['zeroed'] else 'critic'} | {r['before']:.1%} | "
            f"{r['after']:.1%} | {r['explained_variance']:+.3f} | {r['seconds']:.0f} s |"
        )
    for zeroed in (False, True):
        after = [r["after"] for r in results if r["zeroed"] == zeroed]
        print(f"mean after ({'zeroed' if zeroed else 'critic'}): {statistics.fmean(after):.1%}")


if __name__ == "__main__":
    main()
