"""PRIME's implicit process reward model: dense rewards and the PRM's outcome loss.

Cui et al. 2025, "Process Reinforcement through Implicit Rewards". The implicit PRM is a
language model ``π_prm`` (a trainable copy of the policy) read against a reference ``π_ref``:
its per-token reward is ``r_t = β·(log π_prm(y_t) − log π_ref(y_t))`` and its outcome logit the
sum ``Σ_t r_t``. It is trained online on outcome labels with the cross-entropy "implicit PRM"
loss ``ℓ = BCE(σ(Σ_t r_t), correct)``. Pure functions over masked ``[B, T]`` arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxrl_llm import _checks
from jaxrl_llm.types import LossOutput

Array = jax.Array


def implicit_sequence_reward(prm_logprobs, ref_logprobs, mask, *, beta: float) -> Array:
    """``β·Σ_t m_t·(lp_prm − lp_ref)``: the implicit PRM's outcome logit, ``[B]`` f32."""
    _checks.check_batch_time("prm_logprobs", prm_logprobs, mask)
    _checks.check_batch_time("ref_logprobs", ref_logprobs, mask)
    mask = _checks.as_mask(mask)
    diff = _checks.f32(prm_logprobs) - _checks.f32(ref_logprobs)
    return beta * jnp.sum(jnp.where(mask > 0, diff, 0.0), axis=1)


def process_rewards(prm_logprobs, ref_logprobs, mask, *, beta: float) -> Array:
    """Dense implicit rewards ``r_t = β·(lp_prm − lp_ref)``, 0 on masked tokens: ``[B, T]``."""
    _checks.check_batch_time("prm_logprobs", prm_logprobs, mask)
    _checks.check_batch_time("ref_logprobs", ref_logprobs, mask)
    mask = _checks.as_mask(mask)
    diff = _checks.f32(prm_logprobs) - _checks.f32(ref_logprobs)
    return beta * jnp.where(mask > 0, diff, 0.0)


def prm_loss(prm_logprobs, ref_logprobs, mask, labels, *, beta: float, num_seqs=None) -> LossOutput:
    """The implicit PRM's outcome loss ``Σ_i BCE(σ(β·Σ_t(lp_prm − lp_ref)), y_i) / N_seq``.

    Args:
      prm_logprobs: ``[B, T]`` PRM log-probs (carry the gradient).
      ref_logprobs: ``[B, T]`` reference log-probs (no gradient).
      mask: ``[B, T]`` completion mask; empty rows contribute nothing.
      labels: ``[B]`` outcome labels in ``{0, 1}`` (1 = correct).
      beta: the implicit reward's ``β``.
      num_seqs: global count of non-empty rows (micro-batching); default this batch's.

    Returns:
      ``LossOutput`` with metrics ``prm/loss`` and ``prm/accuracy`` (logit sign vs label).
    """
    _checks.check_shape("labels", labels, mask.shape[:1])
    mask = _checks.as_mask(mask)
    ref_logprobs = jax.lax.stop_gradient(ref_logprobs)
    logit = implicit_sequence_reward(prm_logprobs, ref_logprobs, mask, beta=beta)
    labels = _checks.f32(labels)
    rows = (jnp.sum(mask, axis=1) > 0).astype(jnp.float32)
    count = jnp.sum(rows) if num_seqs is None else num_seqs
    denom = jnp.maximum(count, 1.0)
    loss = jnp.sum(optax.sigmoid_binary_cross_entropy(logit, labels) * rows) / denom
    hit = ((logit > 0) == (labels > 0.5)).astype(jnp.float32) * rows
    return LossOutput(loss, {"prm/loss": loss, "prm/accuracy": jnp.sum(hit) / denom})
