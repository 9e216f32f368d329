"""The policy update of every RL objective: log-probs → ``objectives.policy_loss`` → step.

Everything here is pure and jit-able; the objective and the model settings are bound before
``jax.jit``. The step's batch is a :class:`~jaxrl_llm.types.RolloutBatch` whose token fields are
set; the whole batch's token and row counts reach every micro-batch (``train.step``), so the
accumulated gradient equals the full-batch gradient for every aggregation mode.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxrl_llm import masked_stats, objectives
from jaxrl_llm.train.adapters import has_dropout
from jaxrl_llm.train.forward import sequence_logprobs
from jaxrl_llm.train.step import LossFn, Step, Totals, make_step
from jaxrl_llm.types import RolloutBatch, sequences_of

PyTree = Any


def with_totals(batch: RolloutBatch, totals: Totals | None) -> RolloutBatch:
    """The batch carrying the whole batch's normalisers (``num_tokens`` / ``num_seqs``)."""
    if totals is None:
        return batch
    return batch._replace(num_tokens=totals.num_tokens, num_seqs=totals.num_seqs)


# Bound on |log pi_train - log pi_rollout| inside exp (k3): finite however far apart they are.
_MAX_LOG_RATIO = 20.0


def sampler_mismatch(
    train_logprobs: jax.Array, rollout_logprobs: jax.Array, mask: jax.Array, num_tokens
) -> dict[str, jax.Array]:
    """How far the sampler's log-probs are from the trainer's, on the valid tokens.

    With ``d = log pi_train(y) - log pi_rollout(y)`` (``y`` sampled by the rollout policy):
    ``rollout/logprob_diff_mean = Σ|d|·m / N``, ``rollout/logprob_diff_max = max |d|`` and
    ``rollout/k3 = Σ (e^d - 1 - d)·m / N``, the k3 estimate (Schulman, 2020) of
    ``KL(pi_rollout || pi_train)`` (``d`` clipped to ±20 inside the exponential). ``N`` is the
    whole batch's token count (micro-batch sums then add up). Zero in exact arithmetic when
    both sides run the same policy: what is left is the numerics (bf16 matmuls, kernels,
    batch shapes).
    """
    mask = mask.astype(jnp.float32)
    diff = jax.lax.stop_gradient(train_logprobs).astype(jnp.float32) - rollout_logprobs
    clipped = jnp.clip(diff, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    denom = jnp.maximum(jnp.asarray(num_tokens, jnp.float32), 1.0)
    return {
        "rollout/logprob_diff_mean": jnp.sum(jnp.abs(diff) * mask) / denom,
        "rollout/logprob_diff_max": masked_stats.extreme(jnp.abs(diff), mask, jnp.max, 0.0),
        "rollout/k3": jnp.sum((jnp.expm1(clipped) - clipped) * mask) / denom,
    }


def make_policy_loss_fn(
    model_config,
    objective: objectives.Objective,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    remat: str = "none",
    compute_entropy: bool = True,
) -> LossFn:
    """``(params, batch, totals) -> (loss, metrics)``: log-probs → ``objectives.policy_loss``.

    See :func:`make_policy_step` for the arguments.
    """
    need_entropy = compute_entropy or objective.needs_entropy

    def loss_fn(params, batch: RolloutBatch, totals: Totals | None, key=None):
        out = sequence_logprobs(
            params,
            model_config,
            sequences_of(batch),
            packing=batch.packing,  # this micro-batch's plan, or None (padded)
            temperature=temperature,
            chunk_size=chunk_size,
            remat=remat,
            return_entropy=need_entropy,
            dropout_key=key,
        )
        token_logprobs, entropy = out if need_entropy else (out, None)
        if batch.old_logprobs is None:  # on-policy: this forward's own log-probs, held fixed
            batch = batch._replace(old_logprobs=jax.lax.stop_gradient(token_logprobs))
        result = objectives.policy_loss(
            objective,
            token_logprobs,
            with_totals(batch, totals),
            entropy=entropy,
            entropy_coef=None if totals is None else totals.entropy_coef,
        )
        metrics = result.metrics
        if batch.rollout_logprobs is not None:
            # Against this step's own forward: exact while the parameters are the rollout's
            # (every step on-policy; a batch's first optimizer step otherwise).
            count = jnp.sum(batch.completion_mask) if totals is None else totals.num_tokens
            metrics = {
                **metrics,
                **sampler_mismatch(
                    token_logprobs, batch.rollout_logprobs, batch.completion_mask, count
                ),
            }
        return result.loss, metrics

    return loss_fn


def make_policy_step(
    model_config,
    objective: objectives.Objective,
    optimizer: optax.GradientTransformation,
    *,
    micro_batches: int = 1,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    remat: str = "none",
    compute_entropy: bool = True,
    param_shardings: PyTree | None = None,
) -> Step:
    """A pure policy-update step: log-probs → ``objectives.policy_loss`` → gradient → optax.

    Args:
      model_config: the policy's ``ModelConfig`` (static).
      objective: the ``Objective`` (static).
      optimizer: the optax transformation whose state is in ``TrainState.opt_state``.
      micro_batches: gradient-accumulation micro-batches (``train.step.make_step``).
      temperature: sampling temperature, applied to the recomputed log-probs (so the ratio
        starts at 1 when the policy has not moved).
      chunk_size: sequence chunk of the log-prob computation (memory ``O(B·chunk·V)``).
      remat: ``"none"`` or ``"layer"`` (recompute each layer in the backward pass).
      compute_entropy: also compute the per-token entropy (metric; needed for a bonus).
      param_shardings: the parameters' shardings (``train.step.make_step``).

    Returns:
      ``step(state, batch) -> (state, metrics)``; ``batch`` is a ``RolloutBatch`` with prompt and
      completion tokens, masks, ``old_logprobs``, ``advantages`` and, when the objective needs
      them, ``ref_logprobs``. ``old_logprobs=None`` means on-policy: the behaviour log-probs
      are this step's own, ``stop_gradient(logprobs)`` (ratio exactly 1, as in TRL's
      ``GRPOTrainer`` with one update per generation batch), which saves the separate
      forward pass; valid only while the parameters have not moved since the rollout (one
      epoch, one minibatch; ``train.rl.trainer.on_policy_update``).
    """
    loss_fn = make_policy_loss_fn(
        model_config,
        objective,
        temperature=temperature,
        chunk_size=chunk_size,
        remat=remat,
        compute_entropy=compute_entropy,
    )
    return make_step(
        loss_fn,
        optimizer,
        micro_batches=micro_batches,
        param_shardings=param_shardings,
        loss_takes_key=has_dropout(model_config),  # LoRA dropout in the update
        adaptive_entropy=objective if objective.adaptive_entropy else None,
    )
