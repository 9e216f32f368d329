"""From per-token log-probs to a scalar preference loss with TRL-style metrics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.nn import log_sigmoid

from jaxrl_llm._checks import check_batch_time, check_choice, check_rank, f32
from jaxrl_llm.preference._dpo import DPO_LOSS_KWARGS, LOSS_TYPES, dpo
from jaxrl_llm.preference._kto import kto, kto_reference_point
from jaxrl_llm.preference._reference_free import (
    alphapo,
    alphapo_reward,
    cpo,
    orpo,
    orpo_log_odds,
    simpo,
)
from jaxrl_llm.preference._sequence import (
    average_logps,
    sequence_lengths,
    sequence_logps,
    token_mean_nll,
)
from jaxrl_llm.types import LossOutput

Array = jax.Array

#: Every ``loss_name`` :func:`preference_loss` accepts.
PREFERENCE_LOSSES: tuple[str, ...] = LOSS_TYPES + ("kto", "orpo", "simpo", "cpo", "alphapo")
#: ORPO's SFT-term conventions (``nll`` of :func:`preference_loss`): the paper's NLL of the
#: chosen completion, or TRL ORPOTrainer's NLL of the whole chosen sequence.
ORPO_NLL_MODES: tuple[str, ...] = ("completion", "prompt_and_completion")
_REFERENCE_FREE = ("orpo", "simpo", "cpo", "alphapo")


def _reference_sums(name: str, ref: Array | None, mask: Array, n: int) -> Array:
    if ref is None:
        raise ValueError(f"{name} is required by this loss (a reference model's log-probs)")
    if jnp.ndim(ref) == 2:
        return sequence_logps(ref, mask)
    check_rank(name, ref, (1, 2))
    if jnp.shape(ref)[0] != n:
        raise ValueError(f"{name} must have shape [N]=({n},) or [N, T], got {jnp.shape(ref)}")
    return f32(ref)


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
    "orpo": ("nll", "prompt_logps", "prompt_mask"),
    "simpo": ("gamma", "label_smoothing", "cpo_alpha", "alpha"),
    "cpo": ("gamma", "label_smoothing", "cpo_alpha", "alpha"),
    "alphapo": ("alpha", "gamma", "label_smoothing"),
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


def _orpo_prompt_terms(kwargs: dict[str, Any], num_pairs: int) -> tuple[Array, Array] | None:
    mode = kwargs.pop("nll", "completion")
    check_choice("nll", mode, ORPO_NLL_MODES)
    prompt_logps, prompt_mask = kwargs.pop("prompt_logps", None), kwargs.pop("prompt_mask", None)
    if mode == "completion":
        if prompt_logps is not None or prompt_mask is not None:
            raise ValueError(
                "prompt_logps / prompt_mask are used by nll='prompt_and_completion' only"
            )
        return None
    if prompt_logps is None or prompt_mask is None:
        raise ValueError(
            "nll='prompt_and_completion' needs prompt_logps and prompt_mask ([N, P]: the "
            "per-token log-probs of the chosen rows' prompt tokens the model predicts)"
        )
    check_batch_time("prompt_logps", prompt_logps, prompt_mask)
    if jnp.shape(prompt_mask)[0] != num_pairs:
        raise ValueError(
            f"prompt_mask {jnp.shape(prompt_mask)} must have N={num_pairs} rows, one per pair"
        )
    return sequence_logps(prompt_logps, prompt_mask), sequence_lengths(prompt_mask)


def _reference_free_loss(
    loss_name, chosen_tok, chosen_mask, rejected_tok, rejected_mask, beta, kwargs
) -> LossOutput:
    lw = average_logps(chosen_tok, chosen_mask)
    ll = average_logps(rejected_tok, rejected_mask)
    prompt = _orpo_prompt_terms(kwargs, lw.shape[0]) if loss_name == "orpo" else None
    chosen_nll = token_mean_nll(
        sequence_logps(chosen_tok, chosen_mask),
        sequence_lengths(chosen_mask),
        prompt_logps=None if prompt is None else prompt[0],
        prompt_len=None if prompt is None else prompt[1],
    )
    extra = {"nll_loss": jnp.mean(jax.lax.stop_gradient(chosen_nll))}
    alpha = kwargs.get("alpha", 0.0)
    if loss_name == "orpo":
        per_pair = orpo(lw, ll, beta=beta, chosen_nll=chosen_nll)
        log_odds = jax.lax.stop_gradient(orpo_log_odds(lw, ll))
        extra["log_odds_chosen"] = jnp.mean(log_odds)
        extra["log_odds_ratio"] = jnp.mean(log_sigmoid(log_odds))
    elif loss_name == "alphapo":
        if "alpha" not in kwargs:
            raise ValueError("loss 'alphapo' needs alpha (the reward shape; alpha=0 is SimPO)")
        per_pair = alphapo(lw, ll, beta=beta, **kwargs)
    else:
        fn = simpo if loss_name == "simpo" else cpo
        per_pair = fn(lw, ll, beta=beta, chosen_nll=chosen_nll, **kwargs)
    loss = jnp.mean(per_pair)
    reward_w, reward_l = alphapo_reward(lw, alpha), alphapo_reward(ll, alpha)
    metrics = _metrics(loss, beta * reward_w, beta * reward_l, lw, ll)
    return LossOutput(loss, {**metrics, **extra})


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
    - ``"orpo"``, ``"simpo"``, ``"cpo"``, ``"alphapo"``: :func:`orpo` / :func:`simpo` /
      :func:`cpo` / :func:`alphapo` on token-averaged log-probs (:func:`average_logps`), no
      reference model. Their NLL term is normalised as TRL's: :func:`token_mean_nll`, the
      token mean over every chosen completion token of the batch. ORPO's ``nll`` chooses its
      tokens: ``"completion"`` (default, the paper's) or ``"prompt_and_completion"`` (TRL's
      ORPOTrainer: the prompt tokens the model predicts count too; pass their per-token
      log-probs ``prompt_logps`` and ``prompt_mask``, ``[N, P]``, of the chosen rows, every
      real prompt token but the first). CPO here scores token-averaged log-probs as the spec
      says; the CPO paper and TRL's CPOTrainer sum them (call :func:`cpo` directly for that).

    Metrics (float32 scalars, means over pairs, no gradient): ``loss``, ``rewards/chosen``
    (``β·c``; ``β·lw`` for the reference-free losses, ``β·r_α(lw)`` with AlphaPO's ``α``, as
    TRL reports), ``rewards/rejected``,
    ``rewards/accuracies`` (fraction with chosen reward > rejected), ``rewards/margins``,
    ``logps/chosen`` and ``logps/rejected`` (the sequence log-probs the loss used: summed, or
    token-averaged for the reference-free losses); plus ``kl`` (``z0``) for KTO,
    ``nll_loss`` (the NLL term before its weight) for ORPO/SimPO/CPO/AlphaPO,
    ``log_odds_chosen`` and ``log_odds_ratio`` for ORPO.

    Args:
      loss_name: one of :data:`PREFERENCE_LOSSES`, or a sequence of :data:`LOSS_TYPES`.
      policy_chosen_logps: ``[N, T]`` per-token policy log-probs of the chosen completions.
      chosen_mask: ``[N, T]`` bool or 0/1 mask of the chosen completions.
      policy_rejected_logps: ``[N, T']`` per-token policy log-probs of the rejected ones.
      rejected_mask: ``[N, T']`` mask of the rejected completions.
      ref_chosen_logps: reference log-probs of the chosen completions, summed ``[N]`` (as
        :class:`~jaxrl_llm.types.PreferenceBatch` stores them) or per-token ``[N, T]``.
        Required by the DPO losses and KTO; must be ``None`` for the reference-free ones.
      ref_rejected_logps: the same for the rejected completions.
      beta: ``β > 0``.
      **kwargs: per loss: DPO ``label_smoothing``, ``loss_weights``, ``discopop_tau``; KTO
        ``desirable_weight``, ``undesirable_weight``, ``kl_policy_logps``, ``kl_ref_logps``
        (summed ``[M]``, or per-token ``[M, T]`` with ``kl_mask``); SimPO/CPO ``gamma``,
        ``label_smoothing``, ``cpo_alpha``, ``alpha``; AlphaPO ``alpha`` (required),
        ``gamma``, ``label_smoothing``; ORPO ``nll`` (one of :data:`ORPO_NLL_MODES`),
        ``prompt_logps``, ``prompt_mask``.

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

    _check_kwargs(str(loss_name), kwargs, ("label_smoothing",) + DPO_LOSS_KWARGS)
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
