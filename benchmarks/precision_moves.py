"""Do bf16-compute RL steps at a tiny learning rate move the master weights?

Runs the RL trainer (GRPO on the built-in task, or any config) for a few steps at
``trainer.learning_rate=1e-6`` from the same initial weights under three precision settings and
reports the fraction of the policy's weights that changed:

- ``param f32 / compute bf16`` (the accelerator default: f32 masters, bf16 matmuls);
- ``param bf16 / compute bf16`` (what ``model.dtype: bfloat16`` used to mean: the updates round
  away in bf16 storage);
- ``param f32 / compute f32`` (the reference).

    python benchmarks/precision_moves.py [--steps 3] [CONFIG] [overrides ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile

import jax
import numpy as np

from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.core import PhaseTimer
from jaxrl_llm.train.rl import trainer as rl_trainer
from jaxrl_llm.train.rl.config import TrainConfig

SETTINGS = {
    "param f32 / compute bf16": ("float32", "bfloat16"),
    "param bf16 / compute bf16": ("bfloat16", "bfloat16"),
    "param f32 / compute f32": ("float32", "float32"),
}


def moved_fraction(config, overrides, param_dtype, compute_dtype, steps) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(
            TrainConfig,
            config,
            [
                *overrides,
                f"run_dir={run_dir}",
                f"model.param_dtype={param_dtype}",
                f"model.compute_dtype={compute_dtype}",
                "trainer.learning_rate=1e-6",
                "logging.progress=false",
            ],
        )
        trainer = rl_trainer.RLTrainer(cfg)
        with jax.set_mesh(trainer.mesh):
            trainer.setup()
            start = jax.tree.map(np.asarray, trainer.policy_params)
            for step in range(steps):
                trainer.train_step(step, PhaseTimer())
            end = jax.tree.map(np.asarray, trainer.policy_params)
    changed = sum(int(np.sum(a != b)) for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(end)))
    return changed / sum(a.size for a in jax.tree.leaves(start))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("config", nargs="?", default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    overrides = args.overrides or ["sft_warmup.steps=0", "rollout.prompts_per_step=8"]
    out = {}
    for name, (param_dtype, compute_dtype) in SETTINGS.items():
        out[name] = moved_fraction(args.config, overrides, param_dtype, compute_dtype, args.steps)
        print(f"{name}: {100 * out[name]:.1f}% of the policy's weights moved in {args.steps} steps")
    print(json.dumps({"jax": jax.__version__, "backend": jax.default_backend(), **out}))


if __name__ == "__main__":
    main()
