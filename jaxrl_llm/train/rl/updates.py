"""How the RL update consumes a rollout batch: on- or off-policy log-probs, minibatch rows
taken on device, the EMA reference, and the metrics averaged over the minibatch updates."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from jaxrl_llm import objectives
from jaxrl_llm.train.rl.config import TrainConfig


def on_policy_update(cfg: TrainConfig, objective: objectives.Objective) -> bool:
    """Whether the update can take its own forward's log-probs as the behaviour log-probs.

    True with one epoch and one minibatch per rollout batch (the parameters have not moved
    since the rollout when the single update runs) unless the advantages need the behaviour
    log-probs first (an estimator requiring them, or KL in the reward). Then the separate
    old-log-prob forward is skipped and the update uses ``stop_gradient(logprobs)`` (ratio 1),
    as TRL's ``GRPOTrainer`` does with one update per generation batch.
    """
    kl_in_reward = (
        objective.kl_placement == "reward" and objective.kl_kind is not None and objective.kl_coef
    )
    return (
        cfg.trainer.epochs == 1
        and cfg.trainer.minibatches == 1
        and "old_logprobs" not in objective.estimator_requires
        and not kl_in_reward
    )


def mean_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Means over minibatch updates (``*_max`` / ``*_min`` keys: max / min)."""
    out = {}
    for key in rows[0]:
        values = np.array([float(r[key]) for r in rows])
        if key.endswith("_max"):
            out[key] = float(values.max())
        elif key.endswith("_min"):
            out[key] = float(values.min())
        else:
            out[key] = float(values.mean())
    return out


@functools.partial(jax.jit, static_argnums=2)
def ema(reference, params, decay: float):
    return jax.tree.map(
        lambda r, p: decay * r + (1.0 - decay) * p.astype(r.dtype), reference, params
    )


@functools.partial(jax.jit, static_argnums=2)
def take_rows(tree, rows, row_sharding):
    """The rows of every leaf, kept sharded over the batch axes (a minibatch on device)."""
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x[rows], row_sharding), tree)
