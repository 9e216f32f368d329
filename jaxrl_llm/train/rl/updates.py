"""How the RL update consumes a rollout batch: on- or off-policy log-probs, the rollout
correction of the whole batch, minibatch rows taken on device, the EMA reference, and the
metrics averaged over the minibatch updates."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from jaxrl_llm import objectives
from jaxrl_llm.losses import correction
from jaxrl_llm.train.rl.spec import RunSpec
from jaxrl_llm.types import RolloutBatch


def on_policy_update(run: RunSpec) -> bool:
    """Whether the update of the resolved job ``run`` (``spec.resolve``) can take its own
    forward's log-probs as the behaviour log-probs.

    True with one epoch and one minibatch per rollout batch (the parameters have not moved
    since the rollout when the single update runs) unless the advantages need the behaviour
    log-probs first (an estimator requiring them, or KL in the reward). Then the separate
    old-log-prob forward is skipped and the update uses ``stop_gradient(logprobs)`` (ratio 1),
    as TRL's ``GRPOTrainer`` does with one update per generation batch.
    """
    objective = run.objective
    kl_in_reward = (
        objective.kl.placement == "reward" and objective.kl.kind is not None and objective.kl.coef
    )
    return (
        run.shape.updates_per_step == 1
        and not run.sampler.max_staleness  # else sampled by older parameters
        and "old_logprobs" not in objective.estimator_requires
        and not kl_in_reward
        and not batch_corrected(objective)
    )


def batch_corrected(objective: objectives.Objective) -> bool:
    """Whether the trainer corrects the whole batch before the update (``decoupled`` mode:
    the IS weights and rejection of the old log-probs against the sampler's, verl's
    normalisers: rejected tokens leave the batch's token count). ``bypass`` mode corrects
    inside the loss, against the current policy."""
    spec = objective.correction
    return spec is not None and spec.mode == "decoupled"


def update_objective(objective: objectives.Objective) -> objectives.Objective:
    """The objective the update's loss runs: without a correction the batch already carries."""
    if batch_corrected(objective):
        return objective.replace(correction=None)
    return objective


@functools.partial(jax.jit, static_argnums=0)
def _correct(spec, old, rollout, mask):
    return correction.apply(spec, old, rollout, mask)


def correct_batch(
    objective: objectives.Objective, batch: RolloutBatch
) -> tuple[RolloutBatch, dict[str, float]]:
    """The batch with the objective's decoupled rollout correction applied (IS weights in
    ``is_weights``, rejected tokens out of ``completion_mask`` but still attended), and the
    correction's metrics (``rollout_corr/*``); unchanged without one."""
    if not batch_corrected(objective):
        return batch, {}
    weights, kept, metrics = _correct(
        objective.correction,
        batch.old_logprobs,
        batch.rollout_logprobs,
        batch.completion_mask,
    )
    attention = batch.completion_mask if batch.attention_mask is None else batch.attention_mask
    batch = batch._replace(
        completion_mask=(kept > 0).astype(batch.completion_mask.dtype),
        attention_mask=attention,
        is_weights=weights,
    )
    return batch, {k: float(v) for k, v in jax.device_get(metrics).items()}


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
