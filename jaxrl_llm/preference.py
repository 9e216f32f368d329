"""Offline preference losses: DPO and its variants, KTO, ORPO, SimPO and CPO.

Notation (shared/SPEC_LOSSES.md): for a pair (chosen ``y_w``, rejected ``y_l``) with summed
completion log-probs, ``c = lp_θ(y_w) − lp_ref(y_w)``, ``ρ = lp_θ(y_l) − lp_ref(y_l)`` and
``Δ = c − ρ``. Every loss is per pair (``[N]``) and meant to be minimised; the math runs in
float32 whatever the input dtype, and ``jax.nn.log_sigmoid`` keeps values and gradients finite
for margins of any size. Hyper-parameters are static Python values (resolve configs before
``jax.jit``).

:func:`preference_loss` goes from what a model produces (per-token log-probs and masks) to a
scalar loss plus TRL-style metrics; the per-pair functions compose with anything else.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.nn import log_sigmoid, sigmoid

from jaxrl_llm._checks import (
    as_mask,
    check_batch_time,
    check_choice,
    check_non_negative,
    check_positive,
    check_rank,
    check_same_shape,
    f32,
)
from jaxrl_llm.types import LossOutput

Array = jax.Array

#: The ``loss_type`` values :func:`dpo` accepts (one, or a weighted mixture of several).
LOSS_TYPES: tuple[str, ...] = (
    "sigmoid",
    "hinge",
    "ipo",
    "robust",
    "exo_pair",
    "nca_pair",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "discopop",
    "sigmoid_norm",
)
#: Every ``loss_name`` :func:`preference_loss` accepts.
PREFERENCE_LOSSES: tuple[str, ...] = LOSS_TYPES + ("kto", "orpo", "simpo", "cpo")

_SMOOTHED = ("sigmoid", "robust", "exo_pair")
_LENGTH_NORMALISED = ("ipo", "sigmoid_norm")
_REFERENCE_FREE = ("orpo", "simpo", "cpo")
_DPO_LOSS_KWARGS = ("loss_weights", "discopop_tau")
_DEFAULT_DISCOPOP_TAU = 0.05
# log1mexp(0) = −inf: a token-averaged log-prob of exactly 0 (a certain model) is moved
# this far below 0 so ORPO's odds stay finite and differentiable.
_LOG1MEXP_MAX_INPUT = -1e-7

# --------------------------------------------------------------------------------------------
# Sequence log-probs from per-token log-probs.


def sequence_lengths(mask: Array) -> Array:
    """``n_i = Σ_t m_i,t``: valid tokens per completion.

    Args:
      mask: ``[N, T]`` bool or 0/1 completion mask.

    Returns:
      ``[N]`` float32 token counts (0 for an empty completion).
    """
    check_rank("mask", mask, 2)
    return jnp.sum(as_mask(mask), axis=-1)


def sequence_logps(token_logps: Array, mask: Array) -> Array:
    """``lp(y_i) = Σ_t m_i,t · lp_i,t``: summed completion log-probs.

    Padding contributes exactly 0 to the value and the gradient, even where the padded
    log-probs are ``-inf`` or NaN.

    Args:
      token_logps: ``[N, T]`` per-token log-probs (any float dtype).
      mask: ``[N, T]`` bool or 0/1 completion mask.

    Returns:
      ``[N]`` float32 sums.
    """
    check_batch_time("token_logps", token_logps, mask)
    valid = as_mask(mask) > 0
    return jnp.sum(jnp.where(valid, f32(token_logps), 0.0), axis=-1)


def average_logps(token_logps: Array, mask: Array) -> Array:
    """``lp̄(y_i) = Σ_t m·lp / max(n_i, 1)``: token-averaged completion log-probs.

    SimPO (Meng et al. 2024) and ORPO (Hong et al. 2024) score sequences this way. An empty
    completion averages to 0.

    Args:
      token_logps: ``[N, T]`` per-token log-probs.
      mask: ``[N, T]`` bool or 0/1 completion mask.

    Returns:
      ``[N]`` float32 averages.
    """
    return sequence_logps(token_logps, mask) / jnp.maximum(sequence_lengths(mask), 1.0)


# --------------------------------------------------------------------------------------------
# DPO loss types: one small function per row of the SPEC_LOSSES.md table.


class _Hyper(NamedTuple):
    beta: float
    label_smoothing: float
    discopop_tau: float
    chosen_len: Array | None  # [N] f32, already guarded with max(n, 1)
    rejected_len: Array | None


def _sigmoid(c: Array, rho: Array, hp: _Hyper) -> Array:
    z = hp.beta * (c - rho)
    eps = hp.label_smoothing
    return -(1.0 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z)


def _hinge(c: Array, rho: Array, hp: _Hyper) -> Array:
    return jax.nn.relu(1.0 - hp.beta * (c - rho))


def _ipo(c: Array, rho: Array, hp: _Hyper) -> Array:
    return jnp.square(c / hp.chosen_len - rho / hp.rejected_len - 1.0 / (2.0 * hp.beta))


def _robust(c: Array, rho: Array, hp: _Hyper) -> Array:
    z = hp.beta * (c - rho)
    eps = hp.label_smoothing
    return (-(1.0 - eps) * log_sigmoid(z) + eps * log_sigmoid(-z)) / (1.0 - 2.0 * eps)


def _exo_pair(c: Array, rho: Array, hp: _Hyper) -> Array:
    z = hp.beta * (c - rho)
    eps = hp.label_smoothing
    return sigmoid(z) * (log_sigmoid(z) - math.log1p(-eps)) + sigmoid(-z) * (
        log_sigmoid(-z) - math.log(eps)
    )


def _nca_pair(c: Array, rho: Array, hp: _Hyper) -> Array:
    bc, brho = hp.beta * c, hp.beta * rho
    return -log_sigmoid(bc) - 0.5 * log_sigmoid(-bc) - 0.5 * log_sigmoid(-brho)


def _bco_pair(c: Array, rho: Array, hp: _Hyper) -> Array:
    return -log_sigmoid(hp.beta * c) - log_sigmoid(-hp.beta * rho)


def _sppo_hard(c: Array, rho: Array, hp: _Hyper) -> Array:
    half_inv_beta = 1.0 / (2.0 * hp.beta)
    return jnp.square(c - half_inv_beta) + jnp.square(rho + half_inv_beta)


def _apo_zero(c: Array, rho: Array, hp: _Hyper) -> Array:
    # 1 − σ(x) written as σ(−x): exact in the tail where σ(x) rounds to 1.
    return sigmoid(-hp.beta * c) + sigmoid(hp.beta * rho)


def _apo_down(c: Array, rho: Array, hp: _Hyper) -> Array:
    return sigmoid(hp.beta * c) + sigmoid(-hp.beta * (c - rho))


def _discopop(c: Array, rho: Array, hp: _Hyper) -> Array:
    z = hp.beta * (c - rho)
    tau = hp.discopop_tau
    # μ·exp(−z) as exp(logσ(z/τ) − z): the naive product is 0·inf = NaN once z ≪ 0.
    return sigmoid(-z / tau) * -log_sigmoid(z) + jnp.exp(log_sigmoid(z / tau) - z)


def _sigmoid_norm(c: Array, rho: Array, hp: _Hyper) -> Array:
    return -log_sigmoid(hp.beta * (c / hp.chosen_len - rho / hp.rejected_len))


_DPO_LOSSES = {
    "sigmoid": _sigmoid,
    "hinge": _hinge,
    "ipo": _ipo,
    "robust": _robust,
    "exo_pair": _exo_pair,
    "nca_pair": _nca_pair,
    "bco_pair": _bco_pair,
    "sppo_hard": _sppo_hard,
    "apo_zero": _apo_zero,
    "apo_down": _apo_down,
    "discopop": _discopop,
    "sigmoid_norm": _sigmoid_norm,
}


def _loss_types_and_weights(
    loss_type: str | Sequence[str], loss_weights: Sequence[float] | None
) -> tuple[tuple[str, ...], tuple[float, ...]]:
    if not isinstance(loss_type, str | Sequence):
        raise ValueError(f"loss_type must be a str or a sequence of str, got {loss_type!r}")
    types = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)
    if not types:
        raise ValueError("loss_type must be a loss type or a non-empty sequence of them")
    for name in types:
        check_choice("loss_type", name, LOSS_TYPES)
    if loss_weights is None:
        return types, (1.0,) * len(types)
    weights = tuple(float(w) for w in loss_weights)
    if len(weights) != len(types):
        raise ValueError(
            f"loss_weights {weights} must have one weight per loss type {types} "
            f"(got {len(weights)} for {len(types)})"
        )
    for w in weights:
        if not (math.isfinite(w) and w >= 0):
            raise ValueError(f"loss_weights must be finite and >= 0, got {weights}")
    return types, weights


def _check_label_smoothing(label_smoothing: float, types: Sequence[str]) -> None:
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing!r}")
    if label_smoothing > 0 and not any(t in _SMOOTHED for t in types):
        raise ValueError(
            f"label_smoothing={label_smoothing} has no effect on loss_type {types}; "
            f"it applies to {_SMOOTHED}"
        )
    if "robust" in types and label_smoothing >= 0.5:
        raise ValueError(
            f"loss_type 'robust' divides by 1 − 2ε: label_smoothing must be < 0.5, "
            f"got {label_smoothing}"
        )
    if "exo_pair" in types and label_smoothing <= 0:
        raise ValueError(
            "loss_type 'exo_pair' takes log(ε): label_smoothing must be > 0 "
            "(TRL uses 1e-3 when unset)"
        )


def _guarded_length(name: str, length: Array | None, like: Array) -> Array | None:
    if length is None:
        return None
    check_same_shape(**{"chosen": like, name: length})
    return jnp.maximum(f32(length), 1.0)


def dpo(
    chosen: Array,
    rejected: Array,
    ref_chosen: Array,
    ref_rejected: Array,
    *,
    beta: float = 0.1,
    loss_type: str | Sequence[str] = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_len: Array | None = None,
    rejected_len: Array | None = None,
    **loss_kwargs: Any,
) -> Array:
    """Per-pair DPO-family loss with ``c = chosen − ref_chosen``, ``ρ = rejected − ref_rejected``.

    With ``Δ = c − ρ``, ``z = βΔ``, ``ε = label_smoothing``, ``n`` = completion token counts
    (guarded with ``max(n, 1)``):

    - ``sigmoid``: ``−(1−ε)·logσ(z) − ε·logσ(−z)``. DPO (Rafailov 2023); ε > 0 is cDPO
      (Mitchell 2023).
    - ``hinge``: ``relu(1 − z)``. SLiC (Zhao 2023).
    - ``ipo``: ``(c/n_w − ρ/n_l − 1/(2β))²``. IPO (Azar 2023).
    - ``robust``: ``[−(1−ε)·logσ(z) + ε·logσ(−z)] / (1 − 2ε)``. rDPO (Chowdhury 2024).
    - ``exo_pair``: ``σ(z)·(logσ(z) − log(1−ε)) + σ(−z)·(logσ(−z) − log ε)``. EXO (Ji 2024).
    - ``nca_pair``: ``−logσ(βc) − ½·logσ(−βc) − ½·logσ(−βρ)``. NCA (Chen 2024).
    - ``bco_pair``: ``−logσ(βc) − logσ(−βρ)``. BCO (Jung 2024).
    - ``sppo_hard``: ``(c − 1/(2β))² + (ρ + 1/(2β))²``. SPPO (Wu 2024).
    - ``apo_zero``: ``(1 − σ(βc)) + σ(βρ)``. APO (D'Oosterlinck 2024).
    - ``apo_down``: ``σ(βc) + (1 − σ(z))``. APO (D'Oosterlinck 2024).
    - ``discopop``: ``(1 − μ)·(−logσ(z)) + μ·exp(−z)``, ``μ = σ(z/τ)``. DiscoPOP (Lu 2024).
    - ``sigmoid_norm``: ``−logσ(β·(c/n_w − ρ/n_l))``, DPO on length-normalised log ratios.

    ``bco_pair`` is the spec's form without BCO's running reward shift δ (TRL keeps a
    running mean of the rewards for it). ``discopop`` is unbounded above when ``τ ≥ 1``
    and ``z → −∞`` (its ``μ·exp(−z)`` term then grows without limit).

    A weighted mixture (MPO, Wang et al. 2024) is a sequence of loss types with
    ``loss_weights`` in ``loss_kwargs``:
    ``dpo(..., loss_type=("sigmoid", "bco_pair"), loss_weights=(0.8, 0.2))`` returns
    ``0.8·L_sigmoid + 0.2·L_bco_pair`` (weights default to 1 each).

    Args:
      chosen: ``[N]`` summed policy log-probs of the chosen completions (carry the gradient).
        Scalars (rank 0) are accepted too, so the function can be vmapped over pairs.
      rejected: ``[N]`` summed policy log-probs of the rejected completions.
      ref_chosen: ``[N]`` summed reference log-probs of the chosen completions.
      ref_rejected: ``[N]`` summed reference log-probs of the rejected completions.
      beta: ``β > 0``, the inverse temperature of the implicit reward.
      loss_type: one of :data:`LOSS_TYPES`, or a sequence of them (a mixture).
      label_smoothing: ``ε ∈ [0, 0.5]``, used by ``sigmoid``, ``robust`` (``ε < 0.5``) and
        ``exo_pair`` (``ε > 0``); a non-zero value with none of these is an error.
      chosen_len: ``[N]`` token counts of the chosen completions (``ipo``, ``sigmoid_norm``).
      rejected_len: ``[N]`` token counts of the rejected completions.
      **loss_kwargs: ``loss_weights`` (one non-negative float per loss type) and
        ``discopop_tau`` (``τ > 0``, default 0.05).

    Returns:
      ``[N]`` float32 per-pair losses.

    Raises:
      ValueError: on an unknown loss type or keyword, a bad hyper-parameter, mismatched shapes,
        or ``ipo`` / ``sigmoid_norm`` without ``chosen_len`` and ``rejected_len``.
    """
    unknown = sorted(set(loss_kwargs) - set(_DPO_LOSS_KWARGS))
    if unknown:
        raise ValueError(f"unknown loss_kwargs {unknown}; dpo accepts {_DPO_LOSS_KWARGS}")
    types, weights = _loss_types_and_weights(loss_type, loss_kwargs.get("loss_weights"))
    check_positive("beta", beta)
    _check_label_smoothing(label_smoothing, types)
    tau = loss_kwargs.get("discopop_tau")
    if tau is not None and "discopop" not in types:
        raise ValueError(f"discopop_tau has no effect on loss_type {types}")
    tau = _DEFAULT_DISCOPOP_TAU if tau is None else tau
    check_positive("discopop_tau", tau)

    check_rank("chosen", chosen, (0, 1))
    check_same_shape(
        chosen=chosen, rejected=rejected, ref_chosen=ref_chosen, ref_rejected=ref_rejected
    )
    needs_lengths = [t for t in types if t in _LENGTH_NORMALISED]
    if needs_lengths and (chosen_len is None or rejected_len is None):
        raise ValueError(
            f"loss_type {needs_lengths} normalises by completion length: pass chosen_len and "
            "rejected_len (token counts, e.g. sequence_lengths(mask))"
        )
    hp = _Hyper(
        beta=beta,
        label_smoothing=label_smoothing,
        discopop_tau=tau,
        chosen_len=_guarded_length("chosen_len", chosen_len, chosen),
        rejected_len=_guarded_length("rejected_len", rejected_len, chosen),
    )
    c = f32(chosen) - f32(ref_chosen)
    rho = f32(rejected) - f32(ref_rejected)
    return sum(w * _DPO_LOSSES[t](c, rho, hp) for t, w in zip(types, weights))


# --------------------------------------------------------------------------------------------
# KTO.


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


# --------------------------------------------------------------------------------------------
# Reference-free losses on token-averaged log-probs: ORPO, SimPO, CPO.


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
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing!r}")
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


# --------------------------------------------------------------------------------------------
# From per-token log-probs to a scalar loss with metrics.


def _reference_sums(name: str, ref: Array | None, mask: Array, n: int) -> Array:
    if ref is None:
        raise ValueError(f"{name} is required by this loss (a reference model's log-probs)")
    if jnp.ndim(ref) == 2:
        return sequence_logps(ref, mask)
    check_rank(name, ref, (1, 2))
    if jnp.shape(ref)[0] != n:
        raise ValueError(f"{name} must have shape [N]=({n},) or [N, T], got {jnp.shape(ref)}")
    return f32(ref)


def _batch_token_mean_nll(chosen_sum: Array, chosen_len: Array) -> Array:
    # Spread TRL's batch NLL, −Σ lp / Σ n over all chosen tokens, evenly over pairs so the
    # mean of the per-pair losses carries it exactly.
    num_pairs = chosen_sum.shape[0]
    return -chosen_sum * num_pairs / jnp.maximum(jnp.sum(chosen_len), 1.0)


def _metrics(
    loss: Array, reward_chosen: Array, reward_rejected: Array, lw: Array, ll: Array
) -> dict[str, Array]:
    sg = jax.lax.stop_gradient
    reward_chosen, reward_rejected = sg(reward_chosen), sg(reward_rejected)
    return {
        "loss": sg(loss),
        "rewards/chosen": jnp.mean(reward_chosen),
        "rewards/rejected": jnp.mean(reward_rejected),
        "rewards/accuracies": jnp.mean((reward_chosen > reward_rejected).astype(jnp.float32)),
        "rewards/margins": jnp.mean(reward_chosen - reward_rejected),
        "logps/chosen": jnp.mean(sg(lw)),
        "logps/rejected": jnp.mean(sg(ll)),
    }


_KTO_KWARGS = (
    "desirable_weight",
    "undesirable_weight",
    "kl_policy_logps",
    "kl_ref_logps",
    "kl_mask",
)
_PREFERENCE_KWARGS = {
    "kto": _KTO_KWARGS,
    "orpo": (),
    "simpo": ("gamma", "label_smoothing", "cpo_alpha"),
    "cpo": ("gamma", "label_smoothing", "cpo_alpha"),
}


def _check_kwargs(loss_name: str, kwargs: dict[str, Any], allowed: Sequence[str]) -> None:
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise ValueError(
            f"unknown keyword(s) {unknown} for loss {loss_name!r}; it accepts {tuple(allowed)}"
        )


def _kto_loss(chosen, rejected, ref_chosen, ref_rejected, beta, kwargs) -> LossOutput:
    kl_policy, kl_ref = kwargs.pop("kl_policy_logps", None), kwargs.pop("kl_ref_logps", None)
    kl_mask = kwargs.pop("kl_mask", None)
    if kl_mask is not None:
        if kl_policy is None or kl_ref is None:
            raise ValueError("kl_mask needs per-token kl_policy_logps and kl_ref_logps")
        kl_policy, kl_ref = sequence_logps(kl_policy, kl_mask), sequence_logps(kl_ref, kl_mask)
    labels = jnp.concatenate([jnp.ones_like(chosen, bool), jnp.zeros_like(rejected, bool)])
    per_example = kto(
        jnp.concatenate([chosen, rejected]),
        jnp.concatenate([ref_chosen, ref_rejected]),
        labels,
        kl_policy,
        kl_ref,
        beta=beta,
        **kwargs,
    )
    loss = jnp.mean(per_example)
    metrics = _metrics(
        loss, beta * (chosen - ref_chosen), beta * (rejected - ref_rejected), chosen, rejected
    )
    metrics["kl"] = (
        jnp.zeros((), jnp.float32) if kl_policy is None else kto_reference_point(kl_policy, kl_ref)
    )
    return LossOutput(loss, metrics)


def _reference_free_loss(
    loss_name, chosen_tok, chosen_mask, rejected_tok, rejected_mask, beta, kwargs
) -> LossOutput:
    lw = average_logps(chosen_tok, chosen_mask)
    ll = average_logps(rejected_tok, rejected_mask)
    chosen_nll = _batch_token_mean_nll(
        sequence_logps(chosen_tok, chosen_mask), sequence_lengths(chosen_mask)
    )
    extra = {"nll_loss": jnp.mean(jax.lax.stop_gradient(chosen_nll))}
    if loss_name == "orpo":
        per_pair = orpo(lw, ll, beta=beta, chosen_nll=chosen_nll)
        log_odds = jax.lax.stop_gradient(orpo_log_odds(lw, ll))
        extra["log_odds_chosen"] = jnp.mean(log_odds)
        extra["log_odds_ratio"] = jnp.mean(log_sigmoid(log_odds))
    else:
        fn = simpo if loss_name == "simpo" else cpo
        per_pair = fn(lw, ll, beta=beta, chosen_nll=chosen_nll, **kwargs)
    loss = jnp.mean(per_pair)
    return LossOutput(loss, {**_metrics(loss, beta * lw, beta * ll, lw, ll), **extra})


def preference_loss(
    loss_name: str | Sequence[str],
    policy_chosen_logps: Array,
    chosen_mask: Array,
    policy_rejected_logps: Array,
    rejected_mask: Array,
    ref_chosen_logps: Array | None = None,
    ref_rejected_logps: Array | None = None,
    *,
    beta: float = 0.1,
    **kwargs: Any,
) -> LossOutput:
    """Mean preference loss over N pairs, from per-token log-probs, with TRL-style metrics.

    ``L = mean_i ℓ_i`` where ``ℓ`` is the per-pair loss ``loss_name`` names:

    - a DPO loss type (or a sequence of them, a mixture): :func:`dpo` on summed log-probs
      (:func:`sequence_logps`), completion lengths from the masks;
    - ``"kto"``: :func:`kto` on the chosen completions (desirable) and the rejected ones
      (undesirable) as 2N examples, mean over the 2N;
    - ``"orpo"``, ``"simpo"``, ``"cpo"``: :func:`orpo` / :func:`simpo` / :func:`cpo` on
      token-averaged log-probs (:func:`average_logps`), no reference model. Their NLL term is
      TRL's: the token mean over every chosen token of the batch.

    Metrics (float32 scalars, means over pairs, no gradient): ``loss``, ``rewards/chosen``
    (``β·c``; ``β·lw`` for the reference-free losses, as TRL reports), ``rewards/rejected``,
    ``rewards/accuracies`` (fraction with chosen reward > rejected), ``rewards/margins``,
    ``logps/chosen`` and ``logps/rejected`` (the sequence log-probs the loss used: summed, or
    token-averaged for the reference-free losses); plus ``kl`` (``z0``) for KTO,
    ``nll_loss`` for ORPO/SimPO/CPO, ``log_odds_chosen`` and ``log_odds_ratio`` for ORPO.

    Args:
      loss_name: one of :data:`PREFERENCE_LOSSES`, or a sequence of :data:`LOSS_TYPES`.
      policy_chosen_logps: ``[N, T]`` per-token policy log-probs of the chosen completions.
      chosen_mask: ``[N, T]`` bool or 0/1 mask of the chosen completions.
      policy_rejected_logps: ``[N, T']`` per-token policy log-probs of the rejected ones.
      rejected_mask: ``[N, T']`` mask of the rejected completions.
      ref_chosen_logps: reference log-probs of the chosen completions, summed ``[N]`` (as
        :class:`~jaxrl_llm.types.PreferenceBatch` stores them) or per-token ``[N, T]``.
        Required by the DPO losses and KTO; must be ``None`` for ORPO, SimPO and CPO.
      ref_rejected_logps: the same for the rejected completions.
      beta: ``β > 0``.
      **kwargs: per loss: DPO ``label_smoothing``, ``loss_weights``, ``discopop_tau``; KTO
        ``desirable_weight``, ``undesirable_weight``, ``kl_policy_logps``, ``kl_ref_logps``
        (summed ``[M]``, or per-token ``[M, T]`` with ``kl_mask``); SimPO/CPO ``gamma``,
        ``label_smoothing``, ``cpo_alpha``; ORPO none.

    Returns:
      ``LossOutput(loss, metrics)``, loss a float32 scalar.

    Raises:
      ValueError: on an unknown loss name or keyword, shape mismatches, a missing reference
        for a loss that needs one or a reference given to a reference-free loss.
    """
    check_batch_time("policy_chosen_logps", policy_chosen_logps, chosen_mask)
    check_batch_time("policy_rejected_logps", policy_rejected_logps, rejected_mask)
    num_pairs = jnp.shape(chosen_mask)[0]
    if jnp.shape(rejected_mask)[0] != num_pairs:
        raise ValueError(
            f"chosen_mask {jnp.shape(chosen_mask)} and rejected_mask "
            f"{jnp.shape(rejected_mask)} must have the same number of pairs N"
        )
    is_dpo = not isinstance(loss_name, str) or loss_name in LOSS_TYPES
    if not is_dpo:
        check_choice("loss_name", loss_name, PREFERENCE_LOSSES)
    kwargs = dict(kwargs)

    if loss_name in _REFERENCE_FREE:
        _check_kwargs(loss_name, kwargs, _PREFERENCE_KWARGS[loss_name])
        if ref_chosen_logps is not None or ref_rejected_logps is not None:
            raise ValueError(f"loss {loss_name!r} is reference-free: pass no reference log-probs")
        return _reference_free_loss(
            loss_name,
            policy_chosen_logps,
            chosen_mask,
            policy_rejected_logps,
            rejected_mask,
            beta,
            kwargs,
        )

    chosen = sequence_logps(policy_chosen_logps, chosen_mask)
    rejected = sequence_logps(policy_rejected_logps, rejected_mask)
    ref_chosen = _reference_sums("ref_chosen_logps", ref_chosen_logps, chosen_mask, num_pairs)
    ref_rejected = _reference_sums(
        "ref_rejected_logps", ref_rejected_logps, rejected_mask, num_pairs
    )
    if loss_name == "kto":
        _check_kwargs(loss_name, kwargs, _KTO_KWARGS)
        return _kto_loss(chosen, rejected, ref_chosen, ref_rejected, beta, kwargs)

    _check_kwargs(str(loss_name), kwargs, ("label_smoothing",) + _DPO_LOSS_KWARGS)
    per_pair = dpo(
        chosen,
        rejected,
        ref_chosen,
        ref_rejected,
        beta=beta,
        loss_type=loss_name,
        chosen_len=sequence_lengths(chosen_mask),
        rejected_len=sequence_lengths(rejected_mask),
        **kwargs,
    )
    loss = jnp.mean(per_pair)
    metrics = _metrics(
        loss, beta * (chosen - ref_chosen), beta * (rejected - ref_rejected), chosen, rejected
    )
    return LossOutput(loss, metrics)
