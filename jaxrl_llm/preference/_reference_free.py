"""Reference-free preference losses on token-averaged log-probs: ORPO, SimPO and CPO."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.nn import log_sigmoid

from jaxrl_llm._checks import check_non_negative, check_positive, check_rank, check_same_shape, f32
from jaxrl_llm.preference._sequence import check_label_smoothing

Array = jax.Array

# log1mexp(0) = −inf: a token-averaged log-prob of exactly 0 (a certain model) is moved
# this far below 0 so ORPO's odds stay finite and differentiable.
_LOG1MEXP_MAX_INPUT = -1e-7


def log1mexp(x: Array) -> Array:
    """``log(1 − exp(x))`` for ``x ≤ 0``, stable everywhere (Mächler 2012).

    ``log(−expm1(x))`` for ``x > −ln 2``, ``log1p(−exp(x))`` otherwise; each branch only sees
    inputs from its own side, so the gradient of the unused one cannot leak NaN. ``x`` is
    clamped to at most ``-1e-7`` so ``x = 0`` (a certain model) stays finite.

    Args:
      x: float array of log-probabilities (``≤ 0``), any shape.

    Returns:
      float32 array of the same shape.
    """
    x = jnp.minimum(f32(x), _LOG1MEXP_MAX_INPUT)
    near_zero = x > -math.log(2.0)
    x_near = jnp.where(near_zero, x, -1.0)
    x_far = jnp.where(near_zero, -1.0, x)
    return jnp.where(near_zero, jnp.log(-jnp.expm1(x_near)), jnp.log1p(-jnp.exp(x_far)))


def _check_pair(chosen_name: str, chosen: Array, rejected: Array, nll: Array | None) -> None:
    check_rank(chosen_name, chosen, (0, 1))
    check_same_shape(**{chosen_name: chosen, "rejected": rejected, "chosen_nll": nll})


def orpo_log_odds(chosen_avg: Array, rejected_avg: Array) -> Array:
    """``log(odds(y_w)/odds(y_l)) = (lw − ll) − (log1mexp(lw) − log1mexp(ll))``.

    ``odds(y) = P(y)/(1 − P(y))`` with ``P = exp(lp̄)`` on token-averaged log-probs
    (Hong et al. 2024, ORPO).

    Args:
      chosen_avg: ``[N]`` token-averaged policy log-probs of the chosen completions.
      rejected_avg: ``[N]`` token-averaged policy log-probs of the rejected completions.

    Returns:
      ``[N]`` float32 log odds ratios.
    """
    _check_pair("chosen_avg", chosen_avg, rejected_avg, None)
    lw, ll = f32(chosen_avg), f32(rejected_avg)
    return (lw - ll) - (log1mexp(lw) - log1mexp(ll))


def orpo(
    chosen_avg: Array,
    rejected_avg: Array,
    *,
    beta: float = 0.1,
    chosen_nll: Array | None = None,
) -> Array:
    """Per-pair ORPO loss ``NLL(y_w) − β·logσ(log_odds)`` (no reference model).

    Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model";
    ``log_odds`` is :func:`orpo_log_odds` on token-averaged log-probs ``lw``, ``ll``.

    Args:
      chosen_avg: ``[N]`` token-averaged policy log-probs of the chosen completions
        (:func:`average_logps`; carry the gradient).
      rejected_avg: ``[N]`` token-averaged policy log-probs of the rejected completions.
      beta: ``β > 0``, weight of the odds-ratio term (the paper's λ).
      chosen_nll: ``[N]`` SFT term per pair; default ``−lw`` (the per-sequence token-mean NLL).
        :func:`preference_loss` passes TRL's batch token-mean instead.

    Returns:
      ``[N]`` float32 per-pair losses.
    """
    check_positive("beta", beta)
    _check_pair("chosen_avg", chosen_avg, rejected_avg, chosen_nll)
    nll = -f32(chosen_avg) if chosen_nll is None else f32(chosen_nll)
    return nll - beta * log_sigmoid(orpo_log_odds(chosen_avg, rejected_avg))


def cpo(
    chosen_logps: Array,
    rejected_logps: Array,
    *,
    beta: float = 0.1,
    gamma: float = 0.0,
    label_smoothing: float = 0.0,
    cpo_alpha: float = 1.0,
    chosen_nll: Array | None = None,
) -> Array:
    """Per-pair reference-free sigmoid loss with a margin and an SFT term.

    With ``h = β·(lw − ll) − γ`` (that is ``β·(lw − ll − γ/β)``):
    ``L = −(1−ε)·logσ(h) − ε·logσ(−h) + α·NLL(y_w)``.

    CPO (Xu et al. 2024, "Contrastive Preference Optimization"): ``γ = 0``, ``α = 1``.
    :func:`simpo` is the same loss with SimPO's defaults. The spec scores sequences by
    token-averaged log-probs; TRL's CPOTrainer with ``loss_type="sigmoid"`` uses summed ones
    (pass :func:`sequence_logps` here to reproduce it).

    Args:
      chosen_logps: ``[N]`` policy log-probs of the chosen completions (token-averaged per
        the spec; carry the gradient).
      rejected_logps: ``[N]`` policy log-probs of the rejected completions.
      beta: ``β > 0``.
      gamma: target reward margin ``γ ≥ 0``.
      label_smoothing: ``ε ∈ [0, 0.5]``.
      cpo_alpha: ``α ≥ 0``, weight of the NLL term.
      chosen_nll: ``[N]`` SFT term per pair; default ``−lw``.

    Returns:
      ``[N]`` float32 per-pair losses.
    """
    check_positive("beta", beta)
    check_non_negative("gamma", gamma)
    check_non_negative("cpo_alpha", cpo_alpha)
    check_label_smoothing(label_smoothing)
    _check_pair("chosen_logps", chosen_logps, rejected_logps, chosen_nll)
    lw, ll = f32(chosen_logps), f32(rejected_logps)
    h = beta * (lw - ll) - gamma
    loss = -(1.0 - label_smoothing) * log_sigmoid(h) - label_smoothing * log_sigmoid(-h)
    if cpo_alpha == 0:
        return loss
    nll = -lw if chosen_nll is None else f32(chosen_nll)
    return loss + cpo_alpha * nll


def simpo(
    chosen_avg: Array,
    rejected_avg: Array,
    *,
    beta: float = 0.1,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
    cpo_alpha: float = 0.0,
    chosen_nll: Array | None = None,
) -> Array:
    """Per-pair SimPO loss ``−(1−ε)·logσ(β·(lw − ll) − γ) − ε·logσ(−β·(lw − ll) + γ)``.

    Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward":
    token-averaged log-probs ``lw``, ``ll`` and a target margin ``γ``; ``cpo_alpha > 0`` adds
    ``α·NLL(y_w)`` (CPO-SimPO). Defaults follow the spec and TRL's CPOTrainer (``β = 0.1``,
    ``γ = 0.5``); the SimPO paper tunes ``β`` in ``[2, 2.5]`` and ``γ/β`` in ``[0.3, 1.6]``.

    Args:
      chosen_avg: ``[N]`` token-averaged policy log-probs of the chosen completions.
      rejected_avg: ``[N]`` token-averaged policy log-probs of the rejected completions.
      beta: ``β > 0``.
      gamma: target reward margin ``γ ≥ 0``.
      label_smoothing: ``ε ∈ [0, 0.5]``.
      cpo_alpha: ``α ≥ 0``, weight of the NLL term.
      chosen_nll: ``[N]`` SFT term per pair; default ``−lw``.

    Returns:
      ``[N]`` float32 per-pair losses.
    """
    return cpo(
        chosen_avg,
        rejected_avg,
        beta=beta,
        gamma=gamma,
        label_smoothing=label_smoothing,
        cpo_alpha=cpo_alpha,
        chosen_nll=chosen_nll,
    )
