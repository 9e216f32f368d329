"""Reference-free preference losses: ORPO, CPO, SimPO and AlphaPO."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.nn import log_sigmoid

from jaxrl_llm._checks import (
    check_choice,
    check_non_negative,
    check_positive,
    check_rank,
    check_same_shape,
    f32,
)
from jaxrl_llm.preference._sequence import check_label_smoothing

Array = jax.Array

#: The ``loss_type`` values :func:`cpo` accepts (TRL's CPOTrainer: ``simpo`` is ``sigmoid``
#: with a margin, ``alphapo`` is :func:`alphapo`).
CPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "hinge", "ipo")

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

    Two conventions for the SFT term ``NLL(y_w)``:

    - **completion** (the paper's, the default): the NLL of the chosen completion given the
      prompt, ``−lw`` per pair; :func:`preference_loss` uses its batch form,
      :func:`token_mean_nll` over the chosen completion tokens.
    - **prompt and completion** (TRL's ORPOTrainer): the causal-LM cross-entropy over every
      token of the chosen sequence the model predicts, prompt included (all real tokens but
      the first), averaged over the batch's tokens: pass
      ``chosen_nll=token_mean_nll(chosen_sums, chosen_len, prompt_logps=..., prompt_len=...)``,
      or ``nll="prompt_and_completion"`` to :func:`preference_loss`.

    Args:
      chosen_avg: ``[N]`` token-averaged policy log-probs of the chosen completions
        (:func:`average_logps`; carry the gradient).
      rejected_avg: ``[N]`` token-averaged policy log-probs of the rejected completions.
      beta: ``β > 0``, weight of the odds-ratio term (the paper's λ).
      chosen_nll: ``[N]`` SFT term per pair; default ``−lw`` (the completion's token-mean NLL,
        per sequence).

    Returns:
      ``[N]`` float32 per-pair losses.
    """
    check_positive("beta", beta)
    _check_pair("chosen_avg", chosen_avg, rejected_avg, chosen_nll)
    nll = -f32(chosen_avg) if chosen_nll is None else f32(chosen_nll)
    return nll - beta * log_sigmoid(orpo_log_odds(chosen_avg, rejected_avg))


def alphapo_reward(logps: Array, alpha: float) -> Array:
    """AlphaPO's reward ``r_α = (1 − p^(−α))/α = −expm1(−α·lp)/α``, ``p = exp(lp)``.

    Gupta et al. 2025, "AlphaPO: Reward Shape Matters for LLM Alignment": ``α = 0`` is the
    log reward ``lp`` (its limit); ``α > 0`` flattens the reward of unlikely sequences.

    Args:
      logps: policy log-probs, any shape (token-averaged for AlphaPO).
      alpha: ``α``, any finite float.

    Returns:
      float32 array of the same shape.
    """
    if not math.isfinite(alpha):
        raise ValueError(f"alpha must be finite, got {alpha!r}")
    lp = f32(logps)
    return lp if alpha == 0 else -jnp.expm1(-alpha * lp) / alpha


def cpo(
    chosen_logps: Array,
    rejected_logps: Array,
    *,
    beta: float = 0.1,
    gamma: float = 0.0,
    label_smoothing: float = 0.0,
    cpo_alpha: float = 1.0,
    chosen_nll: Array | None = None,
    loss_type: str = "sigmoid",
    alpha: float = 0.0,
) -> Array:
    """Per-pair reference-free preference loss plus an SFT term (TRL's CPOTrainer losses).

    With rewards ``r = alphapo_reward(lp, α)`` (``r = lp`` for ``α = 0``) and
    ``u = r_w − r_l``:

    - ``sigmoid``: ``−(1−ε)·logσ(βu − γ) − ε·logσ(−βu + γ)``, that is ``β·(u − γ/β)``;
    - ``hinge``: ``relu(1 − βu)`` (SLiC);
    - ``ipo``: ``(u − 1/(2β))²`` (IPO);

    plus ``α_cpo·NLL(y_w)`` in each case.

    CPO (Xu et al. 2024, "Contrastive Preference Optimization") is ``sigmoid`` with
    ``γ = 0``, ``α_cpo = 1`` on summed log-probs (:func:`sequence_logps`), as in the paper and
    TRL's CPOTrainer; TRL scores ``ipo`` (and ``simpo``) on token-averaged log-probs
    (:func:`average_logps`). :func:`simpo` is ``sigmoid`` with SimPO's ``γ``, :func:`alphapo`
    adds AlphaPO's reward shape. TRL's ``loss_type="simpo"`` is ``sigmoid`` with
    ``gamma=simpo_gamma`` here, and its ``alpha`` is ``alpha``. The spec and
    :func:`preference_loss` score CPO on token-averaged log-probs.

    Args:
      chosen_logps: ``[N]`` policy log-probs of the chosen completions (carry the gradient).
      rejected_logps: ``[N]`` policy log-probs of the rejected completions.
      beta: ``β > 0``.
      gamma: target reward margin ``γ ≥ 0`` (``sigmoid`` only).
      label_smoothing: ``ε ∈ [0, 0.5]`` (``sigmoid`` only; TRL warns and ignores it for
        ``hinge`` / ``ipo``, here it is an error).
      cpo_alpha: ``α_cpo ≥ 0``, weight of the NLL term.
      chosen_nll: ``[N]`` SFT term per pair; default ``−lw``. TRL's is the token mean over
        the batch's chosen completion tokens (:func:`token_mean_nll`).
      loss_type: one of :data:`CPO_LOSS_TYPES`.
      alpha: AlphaPO's reward shape ``α`` (:func:`alphapo_reward`); 0 is the log reward.

    Returns:
      ``[N]`` float32 per-pair losses.
    """
    check_choice("loss_type", loss_type, CPO_LOSS_TYPES)
    check_positive("beta", beta)
    check_non_negative("gamma", gamma)
    check_non_negative("cpo_alpha", cpo_alpha)
    check_label_smoothing(label_smoothing)
    if loss_type != "sigmoid" and (gamma or label_smoothing):
        raise ValueError(
            f"gamma and label_smoothing apply to loss_type 'sigmoid' only, got gamma={gamma}, "
            f"label_smoothing={label_smoothing} with loss_type {loss_type!r}"
        )
    _check_pair("chosen_logps", chosen_logps, rejected_logps, chosen_nll)
    lw = f32(chosen_logps)
    u = alphapo_reward(lw, alpha) - alphapo_reward(rejected_logps, alpha)
    if loss_type == "sigmoid":
        h = beta * u - gamma
        loss = -(1.0 - label_smoothing) * log_sigmoid(h) - label_smoothing * log_sigmoid(-h)
    elif loss_type == "hinge":
        loss = jax.nn.relu(1.0 - beta * u)
    else:
        loss = jnp.square(u - 1.0 / (2.0 * beta))
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
    alpha: float = 0.0,
) -> Array:
    """Per-pair SimPO loss ``−(1−ε)·logσ(β·(lw − ll) − γ) − ε·logσ(−β·(lw − ll) + γ)``.

    Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward":
    token-averaged log-probs ``lw``, ``ll`` and a target margin ``γ``; ``cpo_alpha > 0`` adds
    ``α_cpo·NLL(y_w)`` (CPO-SimPO); ``alpha ≠ 0`` replaces ``lw``, ``ll`` by AlphaPO rewards
    (:func:`alphapo_reward`). Defaults follow the spec and TRL's CPOTrainer (``β = 0.1``,
    ``γ = 0.5``); the SimPO paper tunes ``β`` in ``[2, 2.5]`` and ``γ/β`` in ``[0.3, 1.6]``.

    Args:
      chosen_avg: ``[N]`` token-averaged policy log-probs of the chosen completions.
      rejected_avg: ``[N]`` token-averaged policy log-probs of the rejected completions.
      beta: ``β > 0``.
      gamma: target reward margin ``γ ≥ 0``.
      label_smoothing: ``ε ∈ [0, 0.5]``.
      cpo_alpha: ``α_cpo ≥ 0``, weight of the NLL term.
      chosen_nll: ``[N]`` SFT term per pair; default ``−lw``.
      alpha: AlphaPO's reward shape ``α`` (0: SimPO's log reward).

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
        alpha=alpha,
    )


def alphapo(
    chosen_avg: Array,
    rejected_avg: Array,
    *,
    alpha: float,
    beta: float = 0.1,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> Array:
    """Per-pair AlphaPO loss: SimPO on AlphaPO rewards, no NLL term.

    With ``r_α(y) = (1 − exp(lp̄(y))^(−α))/α`` on token-averaged log-probs
    (:func:`alphapo_reward`) and ``u = r_α(y_w) − r_α(y_l)``:
    ``L = −(1−ε)·logσ(βu − γ) − ε·logσ(−βu + γ)``.

    Gupta et al. 2025, "AlphaPO: Reward Shape Matters for LLM Alignment". TRL's
    ``CPOConfig(loss_type="alphapo")`` is this loss: ``loss_type="simpo"`` with
    ``cpo_alpha=0`` and the given ``alpha``. ``alpha`` has no default here because
    ``alpha = 0`` is plain SimPO (TRL's default ``alpha=0.0`` silently gives SimPO).

    Args:
      chosen_avg: ``[N]`` token-averaged policy log-probs of the chosen completions.
      rejected_avg: ``[N]`` token-averaged policy log-probs of the rejected completions.
      alpha: the reward shape ``α`` (finite; 0 reduces to SimPO).
      beta: ``β > 0``.
      gamma: target reward margin ``γ ≥ 0``.
      label_smoothing: ``ε ∈ [0, 0.5]``.

    Returns:
      ``[N]`` float32 per-pair losses.
    """
    return simpo(
        chosen_avg,
        rejected_avg,
        beta=beta,
        gamma=gamma,
        label_smoothing=label_smoothing,
        cpo_alpha=0.0,
        alpha=alpha,
    )
