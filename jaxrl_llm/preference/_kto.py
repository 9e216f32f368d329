"""KTO (Ethayarajh et al. 2024): per-example prospect-theoretic loss on unpaired data."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.nn import sigmoid

from jaxrl_llm._checks import (
    as_mask,
    check_non_negative,
    check_positive,
    check_rank,
    check_same_shape,
    f32,
)

Array = jax.Array


def kto_reference_point(kl_policy_logps: Array, kl_ref_logps: Array) -> Array:
    """``z0 = sg(max(mean_j(lp_θ(y'_j) − lp_ref(y'_j)), 0))``: KTO's reference point.

    Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization": a
    biased, non-negative estimate of ``KL(π_θ ‖ π_ref)`` from mismatched (prompt, completion)
    pairs ``y'``, detached from the gradient.

    Args:
      kl_policy_logps: ``[M]`` summed policy log-probs of the mismatched completions, M ≥ 1.
      kl_ref_logps: ``[M]`` summed reference log-probs of the same completions.

    Returns:
      float32 scalar.
    """
    check_rank("kl_policy_logps", kl_policy_logps, 1)
    check_same_shape(kl_policy_logps=kl_policy_logps, kl_ref_logps=kl_ref_logps)
    if jnp.shape(kl_policy_logps)[0] == 0:
        raise ValueError("kl_policy_logps is empty: KTO's reference point needs M >= 1 pairs")
    kl = jnp.mean(f32(kl_policy_logps) - f32(kl_ref_logps))
    return jax.lax.stop_gradient(jnp.maximum(kl, 0.0))


def kto(
    policy_logps: Array,
    ref_logps: Array,
    labels: Array,
    kl_policy_logps: Array | None,
    kl_ref_logps: Array | None,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> Array:
    """Per-example KTO loss with ``r = lp_θ(y) − lp_ref(y)`` and ``z0`` the reference point.

    ``L = λ_D·(1 − σ(β·(r − z0)))`` for desirable examples and
    ``L = λ_U·(1 − σ(β·(z0 − r)))`` for undesirable ones, ``λ_D = desirable_weight``,
    ``λ_U = undesirable_weight``, ``z0 =`` :func:`kto_reference_point` (detached).

    Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization".
    Data may be unpaired (any mix of labels). Paired data is the chosen completions labelled
    desirable and the rejected ones undesirable, concatenated (what :func:`preference_loss`
    does). The paper sets ``λ_D·n_D / (λ_U·n_U)`` in ``[1, 4/3]`` for imbalanced data.

    Args:
      policy_logps: ``[N]`` summed policy log-probs of the completions (carry the gradient).
      ref_logps: ``[N]`` summed reference log-probs of the completions.
      labels: ``[N]`` bool or 0/1, true for a desirable completion.
      kl_policy_logps: ``[M]`` summed policy log-probs of mismatched pairs (prompt ``x_i``
        with the completion of another example), or ``None`` with ``kl_ref_logps=None`` for
        ``z0 = 0`` (as TRL does when it skips the KL estimate).
      kl_ref_logps: ``[M]`` summed reference log-probs of the same mismatched pairs.
      beta: ``β > 0``.
      desirable_weight: ``λ_D ≥ 0``.
      undesirable_weight: ``λ_U ≥ 0``.

    Returns:
      ``[N]`` float32 per-example losses.

    Raises:
      ValueError: on mismatched shapes, only one of the KL inputs, or a bad hyper-parameter.
    """
    check_positive("beta", beta)
    check_non_negative("desirable_weight", desirable_weight)
    check_non_negative("undesirable_weight", undesirable_weight)
    check_rank("policy_logps", policy_logps, 1)
    check_same_shape(policy_logps=policy_logps, ref_logps=ref_logps, labels=labels)
    if (kl_policy_logps is None) != (kl_ref_logps is None):
        raise ValueError("pass both kl_policy_logps and kl_ref_logps, or neither (z0 = 0)")
    z0 = (
        jnp.zeros((), jnp.float32)
        if kl_policy_logps is None
        else kto_reference_point(kl_policy_logps, kl_ref_logps)
    )
    r = f32(policy_logps) - f32(ref_logps)
    desirable = desirable_weight * sigmoid(-beta * (r - z0))
    undesirable = undesirable_weight * sigmoid(-beta * (z0 - r))
    return jnp.where(as_mask(labels) > 0, desirable, undesirable)
