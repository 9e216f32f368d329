"""The adaptive entropy coefficient: a step-to-step controller of the entropy bonus.

Skywork-OR1's adaptive entropy control (He et al. 2025, "Skywork Open Reasoner 1 Technical
Report", arXiv:2505.22312; TRL's ``use_adaptive_entropy``): after each optimizer step
``k`` with measured mean per-token entropy ``H_k``,

    ``α_{k+1} = min(α_k + δ, α_max)``  if ``H_k ≤ H_target``,
    ``α_{k+1} = max(α_k − δ, α_min)``  otherwise,

and step ``k + 1`` applies ``α_{k+1}·[H_k ≤ H_target]``: the bonus acts only while the entropy
is at or below the target (TRL's gating), and nothing before the first measurement
(``H_{−1} = +∞``). ``α_0 = objective.entropy.coef``, ``δ = entropy_coef_delta``,
``(α_min, α_max) = entropy_coef_bounds``, ``H_target = entropy_target``.

The controller is step-to-step state (:class:`EntropyControl`, two f32 scalars) that lives in
the train state, so a checkpoint resumes it bit-exactly; everything here is pure and jit-able.
``H_k`` is measured by ``policy_loss`` over the tokens the bonus acts on (every completion
token, or the top-entropy ones with ``top_entropy_quantile < 1``, as TRL), token-weighted over
the whole optimizer-step batch (:func:`measured_entropy` of the step's summed metrics).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm import _checks
from jaxrl_llm.objectives.objective import Objective

Array = jax.Array


class EntropyControl(NamedTuple):
    """The adaptive entropy coefficient's state (train state; replicated scalars).

    Attributes:
      coef: f32 scalar ``α_k``, the coefficient after the last update.
      entropy: f32 scalar ``H_{k−1}``, the mean entropy measured at the last optimizer step
        (``+inf`` before the first).
    """

    coef: Array
    entropy: Array


def adaptive_entropy_coef(
    coef: Array, entropy: Array, *, target: float, delta: float, bounds: tuple[float, float]
) -> Array:
    """``α' = min(α + δ, α_max)`` if ``H ≤ H_target`` else ``max(α − δ, α_min)``.

    Args:
      coef: scalar ``α``.
      entropy: scalar measured mean entropy ``H`` (nats).
      target: ``H_target``.
      delta: ``δ > 0``.
      bounds: ``(α_min, α_max)``.

    Returns:
      f32 scalar ``α'``, no gradient.
    """
    coef = jax.lax.stop_gradient(_checks.f32(coef))
    raised = jnp.minimum(coef + delta, bounds[1])
    lowered = jnp.maximum(coef - delta, bounds[0])
    return jnp.where(_checks.f32(entropy) <= target, raised, lowered)


def gated_coef(coef: Array, last_entropy: Array, *, target: float) -> Array:
    """``α·[H_last ≤ H_target]``: the coefficient the next step applies (TRL's gating).

    Args:
      coef: scalar ``α``.
      last_entropy: scalar ``H`` of the last step (``+inf``: none yet, so 0).
      target: ``H_target``.

    Returns:
      f32 scalar, no gradient.
    """
    coef = jax.lax.stop_gradient(_checks.f32(coef))
    return jnp.where(_checks.f32(last_entropy) <= target, coef, 0.0)


def _check_adaptive(objective: Objective) -> None:
    if not objective.entropy.adaptive:
        raise ValueError(
            f"objective {objective.name!r} has no adaptive entropy coefficient; "
            "set objective.overrides.entropy_target"
        )


def init_control(objective: Objective) -> EntropyControl:
    """``EntropyControl(α_0 = objective.entropy.coef, H = +inf)``.

    Raises:
      ValueError: the objective has no ``entropy_target``.
    """
    _check_adaptive(objective)
    return EntropyControl(
        coef=jnp.asarray(objective.entropy.coef, jnp.float32),
        entropy=jnp.asarray(jnp.inf, jnp.float32),
    )


def applied_coef(objective: Objective, control: EntropyControl) -> Array:
    """The coefficient this step's ``policy_loss(entropy_coef=...)`` applies:
    :func:`gated_coef` of the state."""
    _check_adaptive(objective)
    return gated_coef(control.coef, control.entropy, target=objective.entropy.target)


def measured_entropy(objective: Objective, metrics: Mapping[str, Array]) -> Array:
    """``H_k``: the mean entropy of the tokens the bonus acts on, from one optimizer step's
    ``policy_loss`` metrics summed over its micro-batches (``train.step``).

    ``metrics["entropy"]`` (``Σ H·m / N``) without a top-entropy mask; with one,
    ``metrics["entropy_top"] / metrics["top_entropy_frac"]`` (both over ``N``: the mean over
    the selected tokens, TRL's ``effective_mask``). No token: 0 (TRL's ``clamp(min=1)``).

    Raises:
      ValueError: a metric ``policy_loss`` reports for this objective is missing.
    """
    keys = (
        ("entropy_top", "top_entropy_frac")
        if objective.selection.top_entropy_quantile < 1.0
        else ()
    )
    missing = sorted({"entropy", *keys} - set(metrics))
    if missing:
        raise ValueError(
            f"measured_entropy needs policy_loss's metrics {missing} (computed with the "
            "per-token entropy)"
        )
    if not keys:
        return jax.lax.stop_gradient(_checks.f32(metrics["entropy"]))
    total = jax.lax.stop_gradient(_checks.f32(metrics["entropy_top"]))
    share = jax.lax.stop_gradient(_checks.f32(metrics["top_entropy_frac"]))
    return jnp.where(share > 0, total / jnp.where(share > 0, share, 1.0), 0.0)


def update_control(
    objective: Objective, control: EntropyControl, metrics: Mapping[str, Array]
) -> EntropyControl:
    """The state after an optimizer step whose summed ``policy_loss`` metrics are ``metrics``:
    ``(adaptive_entropy_coef(α_k, H_k), H_k)``."""
    _check_adaptive(objective)
    entropy = measured_entropy(objective, metrics)
    coef = adaptive_entropy_coef(
        control.coef,
        entropy,
        target=objective.entropy.target,
        delta=objective.entropy.coef_delta,
        bounds=objective.entropy.coef_bounds,
    )
    return EntropyControl(coef=coef, entropy=entropy)
