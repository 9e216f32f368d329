"""Loss terms beside the policy loss: PPO's critic loss, an SFT term, and their combination."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from jaxrl_llm import _checks
from jaxrl_llm.losses import aggregation, masked, value
from jaxrl_llm.objectives.objective import Objective
from jaxrl_llm.types import LossOutput, RolloutBatch

Array = jax.Array


def value_loss(objective: Objective, values: Array, batch: RolloutBatch) -> LossOutput:
    """PPO's clipped critic loss, aggregated like the policy loss.

    ``vf_loss = agg(½·max((v − R)², (clip(v, v_old ± c) − R)²))`` with ``c = objective.value.clip``.

    Args:
      objective: supplies ``value_clip`` and the aggregation mode.
      values: ``[B, T]`` current critic values.
      batch: needs ``completion_mask``, ``old_values`` and ``returns``.

    Returns:
      ``LossOutput`` with ``vf_loss``, ``vf_clipfrac`` and ``value_mean`` metrics.
    """
    if batch.old_values is None or batch.returns is None:
        raise ValueError("value_loss needs batch.old_values and batch.returns")
    mask = _checks.as_mask(batch.completion_mask)
    per_token = value.clipped_value_loss(
        values, batch.old_values, batch.returns, clip=objective.value.clip
    )
    default_tokens, default_seqs = aggregation.normalisers(mask)
    num_tokens = default_tokens if batch.num_tokens is None else batch.num_tokens
    num_seqs = default_seqs if batch.num_seqs is None else batch.num_seqs
    vf_loss = aggregation.aggregate(
        per_token,
        mask,
        objective.aggregation.mode,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_constant=objective.aggregation.norm_constant,
    )
    clip_fraction = value.value_clip_fraction(
        values, batch.old_values, batch.returns, clip=objective.value.clip
    )
    metrics = {
        "vf_loss": vf_loss,
        "vf_clipfrac": masked.token_mean(clip_fraction, mask, num_tokens),
        "value_mean": masked.token_mean(
            jax.lax.stop_gradient(_checks.f32(values)), mask, num_tokens
        ),
    }
    return LossOutput(loss=vf_loss, metrics=metrics)


def sft_loss(logprobs: Array, mask: Array) -> LossOutput:
    """Token-mean negative log-likelihood ``−Σ m·lp / max(Σ m, 1)`` (an SFT term to combine)."""
    _checks.check_batch_time("logprobs", logprobs, mask)
    nll = aggregation.aggregate(-_checks.f32(logprobs), mask, "token-mean")
    return LossOutput(loss=nll, metrics={"nll": nll})


def combine(
    terms: Mapping[str, LossOutput], weights: Mapping[str, float] | None = None
) -> LossOutput:
    """Weighted sum of loss terms, metrics merged under ``name/`` prefixes.

    ``loss = Σ_k w_k · loss_k`` (``w_k = 1`` when not given). Each term's metrics appear as
    ``f"{name}/{key}"``, and each term's unweighted loss as ``f"{name}/loss"``.

    Args:
      terms: name -> ``LossOutput`` (e.g. ``{"policy": policy_loss(...), "sft": sft_loss(...)}``).
      weights: name -> weight.

    Returns:
      The combined ``LossOutput``; ``metrics["loss"]`` is the total.
    """
    weights = dict(weights or {})
    unknown = sorted(set(weights) - set(terms))
    if unknown:
        raise ValueError(f"weights given for unknown terms {unknown}; terms are {sorted(terms)}")
    if not terms:
        raise ValueError("combine needs at least one term")
    total = jnp.zeros((), jnp.float32)
    metrics: dict[str, Array] = {}
    for name, term in terms.items():
        total = total + weights.get(name, 1.0) * _checks.f32(term.loss)
        metrics.update({f"{name}/{key}": val for key, val in term.metrics.items()})
        metrics[f"{name}/loss"] = term.loss
    metrics["loss"] = total
    return LossOutput(loss=total, metrics=metrics)
