"""The policy loss of an objective: registered ratio and surrogate, plus KL and entropy terms."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from jaxrl_llm import _checks
from jaxrl_llm.losses import aggregation, correction, distillation, kl, masked, token_selection
from jaxrl_llm.objectives import surrogate_registry
from jaxrl_llm.objectives.objective import Objective
from jaxrl_llm.types import LossOutput, RolloutBatch

Array = jax.Array

# Metrics policy_loss reports itself; a surrogate's metrics may not shadow them.
RESERVED_METRICS = frozenset(
    {
        "pg_loss",
        "approx_kl",
        "ratio_mean",
        "ratio_min",
        "ratio_max",
        "kl",
        "kl_loss",
        "entropy",
        "entropy_loss",
        "entropy_coef",
        "entropy_top",
        "distill/jsd",
        "distill/jsd_loss",
        "loss",
    }
)


def _call_surrogate(
    objective: Objective, inputs: surrogate_registry.SurrogateInputs
) -> tuple[Array, dict[str, Array]]:
    """The registered surrogate's ``(loss, metrics)``, its output checked."""
    spec = surrogate_registry.surrogate_spec(objective.surrogate.name)
    out = spec.fn(objective.surrogate, inputs)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError(
            f"surrogate {objective.surrogate.name!r} must return (loss, metrics), got {type(out)}"
        )
    loss, metrics = out
    if not isinstance(metrics, Mapping):
        raise ValueError(
            f"surrogate {objective.surrogate.name!r} must return metrics as a mapping, "
            f"got {metrics!r}"
        )
    shadowed = sorted(RESERVED_METRICS & set(metrics))
    if shadowed:
        raise ValueError(
            f"surrogate {objective.surrogate.name!r} returned metrics {shadowed}, which "
            "policy_loss reports itself; rename them"
        )
    shape = jnp.shape(loss)
    if shape not in ((), jnp.shape(inputs.mask)):
        raise ValueError(
            f"surrogate {objective.surrogate.name!r} returned a loss of shape {shape}; expected a "
            f"per-token [B, T]={jnp.shape(inputs.mask)} loss or a scalar"
        )
    return loss, dict(metrics)


def _surrogate_term(
    objective: Objective,
    inputs: surrogate_registry.SurrogateInputs,
    weights: Array | None,
    selection: Array | None,
) -> tuple[Array, dict[str, Array]]:
    """``(pg_loss, metrics)`` of the registered surrogate, weighted by the rollout-correction
    ``weights`` and multiplied by the token ``selection`` (when given), and reduced.

    A surrogate that reduces its own loss (GMPO's per-sequence mean) cannot be multiplied per
    token: it is called again on the selected tokens only (``mask·selection``; the global
    normalisers unchanged, so a dropped row counts in the mean with 0).
    """
    loss, metrics = _call_surrogate(objective, inputs)
    if jnp.shape(loss) == jnp.shape(inputs.mask):
        for factor in (weights, selection):
            loss = loss if factor is None else loss * factor
        return inputs.aggregate(loss), metrics
    if weights is not None:
        raise ValueError(
            f"surrogate {objective.surrogate.name!r} returns one loss for the batch, so per-token "
            "rollout-correction IS weights cannot multiply it; use rejection only "
            "(rollout_correction.is_level=None)"
        )
    if selection is not None:
        loss, metrics = _call_surrogate(objective, inputs._replace(mask=inputs.mask * selection))
        if jnp.shape(loss) != ():
            raise ValueError(f"surrogate {objective.surrogate.name!r} changed its loss's shape")
    return _checks.f32(loss), metrics


def _token_selection(
    objective: Objective,
    logprobs: Array,
    inputs: surrogate_registry.SurrogateInputs,
    batch: RolloutBatch,
    entropy: Array | None,
) -> tuple[Array | None, Array | None, dict[str, Array]]:
    """``(selection or None, entropy selection or None, metrics)`` of the objective's token
    masks (:mod:`jaxrl_llm.losses.token_selection`)."""
    selection = entropy_selection = None
    metrics: dict[str, Array] = {}
    if objective.selection.top_entropy_quantile < 1.0:
        entropy_selection = token_selection.top_entropy_mask(
            entropy, inputs.mask, quantile=objective.selection.top_entropy_quantile
        )
        selection = entropy_selection
        metrics["top_entropy_frac"] = inputs.token_mean(entropy_selection)
    sampling = inputs.old_logprobs
    if batch.rollout_logprobs is not None:
        _checks.check_batch_time("rollout_logprobs", batch.rollout_logprobs, inputs.mask)
        sampling = jax.lax.stop_gradient(_checks.f32(batch.rollout_logprobs))
    if objective.selection.off_policy_mask_threshold is not None:
        kept = token_selection.off_policy_sequence_mask(
            logprobs,
            sampling,
            inputs.advantages,
            inputs.mask,
            threshold=objective.selection.off_policy_mask_threshold,
        )
        metrics["off_policy_masked_frac"] = inputs.token_mean(1.0 - kept)
        selection = kept if selection is None else selection * kept
    if objective.selection.m2_threshold is not None:
        # M2PO: log π_θ − log π_sampler, as AReaL's proximal − behaviour log-probs on a
        # batch's first optimizer step (the parameters the old log-probs were taken with).
        log_ratio = jax.lax.stop_gradient(logprobs) - sampling
        kept = token_selection.m2po_mask(
            log_ratio, inputs.mask, threshold=objective.selection.m2_threshold
        )
        metrics["m2po_m2"] = inputs.token_mean(jnp.square(log_ratio))
        metrics["m2po_masked_frac"] = inputs.token_mean(1.0 - kept)
        selection = kept if selection is None else selection * kept
    return selection, entropy_selection, metrics


def policy_loss(
    objective: Objective,
    logprobs: Array,
    batch: RolloutBatch,
    *,
    entropy: Array | None = None,
    entropy_coef: Array | float | None = None,
    student_top_logprobs: Array | None = None,
) -> LossOutput:
    """The policy loss of an objective on one (micro-)batch.

    ``loss = agg(surr(ratio(lp, old), A)) + kl_coef·agg(kl(lp, ref))
    + distill_loss_coef·agg(JSD_β) − entropy_coef·agg(H)``
    where the KL term is present only for ``kl_placement="loss"``, the JSD term only with
    ``objective.distill.loss="jsd"``, and ``agg`` is
    ``objective.aggregation.mode`` with ``batch.num_tokens`` / ``batch.num_seqs`` as global
    normalisers (so K micro-batches sum to the full-batch loss and gradient). ``ratio`` and
    ``surr`` are the registered functions named by ``objective.ratio.kind`` / ``.surrogate``; a
    surrogate that returns a scalar (GMPO) is not aggregated again.

    Rollout correction (``jaxrl_llm.losses.correction``): ``batch.is_weights`` multiply the
    per-token surrogate loss; ``objective.correction`` computes IS weights and a
    rejection mask from ``batch.rollout_logprobs`` — against ``old_logprobs``
    (``mode="decoupled"``) or, with the rollout as the old policy, against
    ``stop_gradient(logprobs)`` (``"bypass"``, weights only for ratio-free surrogates);
    rejected tokens leave every term.

    Token selection (:mod:`jaxrl_llm.losses.token_selection`): with ``top_entropy_quantile < 1``
    only the top-entropy tokens, with ``off_policy_mask_threshold`` only rows the policy has
    not drifted from (or with ``A ≥ 0``) keep their surrogate loss (the others add 0 and
    still count in the normalisers, as in TRL); the entropy bonus acts on the top-entropy
    tokens; the KL term keeps every token, times the ratio with ``kl_bias_correction``. With
    ``m2_threshold`` (M2PO) the tokens of largest ``(log π_θ − log π_sampler)²`` of this
    (micro-)batch leave the surrogate too, until its second moment is under the threshold.

    Adaptive entropy coefficient (``objective.entropy.target``): the coefficient is train
    state (:mod:`~jaxrl_llm.objectives.entropy_control`); the caller hands this step's value
    as ``entropy_coef`` (``entropy_control.applied_coef``), reported as the ``entropy_coef``
    metric, and the ``entropy`` (and, with a top-entropy mask, ``entropy_top``) metrics feed
    the controller's next update.

    Distillation loss (``objective.distill.loss="jsd"``, GKD, arXiv:2306.13649):
    ``JSD_β = distillation.top_k_generalized_jsd(student_top_logprobs,
    batch.teacher_top_logprobs, β=objective.distill.jsd_beta)`` per token, the student's and the
    teacher's distributions restricted to the teacher's top-``k`` tokens and renormalised
    there (``k = V``: the full vocabulary); aggregated over the trained tokens (after
    rollout-correction rejection, before token selection, as the KL term) like the policy
    loss, reported as ``distill/jsd_loss`` (aggregated) and ``distill/jsd`` (the token mean).

    Args:
      objective: which pieces to use.
      logprobs: ``[B, T]`` current policy log-probs (carry the gradient).
      batch: ``RolloutBatch`` with ``completion_mask``, ``old_logprobs`` and ``advantages``
        (``[B]`` or ``[B, T]``); ``ref_logprobs`` when the objective puts KL in the loss.
      entropy: optional ``[B, T]`` per-token entropy (needed when ``objective.needs_entropy``:
        ``entropy_coef > 0``, an ``entropy_target`` or ``top_entropy_quantile < 1``).
      entropy_coef: scalar (may be traced) coefficient of the entropy bonus this step; given
        exactly when the objective's coefficient is adaptive (``entropy_target`` set).
      student_top_logprobs: ``[B, T, k]`` the current policy's log-probs (carry the gradient)
        of the teacher's top-``k`` tokens ``batch.teacher_top_ids`` at each completion
        position (``logprobs.completion_logprobs(gather_ids=...)``); read with
        ``objective.distill.loss``, which needs it and ``batch.teacher_top_logprobs``.

    Returns:
      ``LossOutput(loss, metrics)``; metrics as listed in shared/SPEC_LOSSES.md, the
      surrogate's first.

    Raises:
      ValueError: on mismatched shapes, a missing reference, entropy or teacher top-k, an
        ``entropy_coef`` missing for an adaptive coefficient (or given for a fixed one), or a
        surrogate whose output is malformed.
    """
    mask = _checks.as_mask(batch.completion_mask)
    _checks.check_batch_time("logprobs", logprobs, mask)
    _checks.check_batch_time("old_logprobs", batch.old_logprobs, mask)
    _checks.check_advantages(batch.advantages, mask)
    logprobs = _checks.f32(logprobs)
    old_logprobs = jax.lax.stop_gradient(_checks.f32(batch.old_logprobs))
    adv = jax.lax.stop_gradient(_checks.f32(batch.advantages))
    kl_in_loss = objective.kl.kind is not None and objective.kl.placement == "loss"
    if kl_in_loss and objective.kl.coef > 0 and batch.ref_logprobs is None:
        raise ValueError(
            f"objective {objective.name!r} puts KL in the loss: batch.ref_logprobs is None"
        )
    if objective.needs_entropy and entropy is None:
        raise ValueError(
            "entropy_coef > 0, entropy_target and top_entropy_quantile < 1 need the per-token "
            "entropy"
        )
    if objective.entropy.adaptive != (entropy_coef is not None):
        raise ValueError(
            "policy_loss(entropy_coef=...) is this step's adaptive entropy coefficient: give it "
            "exactly when the objective sets entropy_target "
            f"(entropy_target={objective.entropy.target!r}, entropy_coef={entropy_coef!r}); "
            "see jaxrl_llm.objectives.entropy_control"
        )
    if objective.distill.loss is not None and (
        student_top_logprobs is None or batch.teacher_top_logprobs is None
    ):
        raise ValueError(
            f"objective {objective.name!r} adds the {objective.distill.loss} distillation loss: "
            "it needs batch.teacher_top_logprobs (the teacher's top-k log-probs) and "
            "student_top_logprobs (the policy's log-probs of those tokens)"
        )

    all_tokens = aggregation.normalisers(mask)[0] if batch.num_tokens is None else batch.num_tokens
    weights, mask, old_logprobs, corrected = _rollout_correction(
        objective, logprobs, old_logprobs, batch, mask
    )
    # Without the batch's totals, the kept tokens normalise (verl's decoupled mode); with
    # them, rejected tokens count in the normaliser and add 0 (verl's bypass mode).
    default_tokens, default_seqs = aggregation.normalisers(mask)
    num_tokens = default_tokens if batch.num_tokens is None else batch.num_tokens
    num_seqs = default_seqs if batch.num_seqs is None else batch.num_seqs
    log_ratio = surrogate_registry.ratio_fn(objective.ratio.kind)(
        objective.ratio, logprobs, old_logprobs, mask
    )
    inputs = surrogate_registry.SurrogateInputs(
        log_ratio=log_ratio,
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=adv,
        mask=mask,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        aggregation=objective.aggregation.mode,
        norm_constant=objective.aggregation.norm_constant,
    )

    if entropy is not None:
        _checks.check_batch_time("entropy", entropy, mask)
        entropy = _checks.f32(entropy)
    selection, entropy_selection, selection_metrics = _token_selection(
        objective, logprobs, inputs, batch, entropy
    )
    pg_loss, metrics = _surrogate_term(objective, inputs, weights, selection)
    metrics.update(selection_metrics)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss
    if weights is not None:
        metrics["rollout_corr/is_weight_mean"] = inputs.token_mean(weights)
    if "rollout_corr/rejected" in corrected:
        rejected = masked.selected_sum(corrected["rollout_corr/rejected"], 1.0)
        metrics["rollout_corr/rejected_frac"] = rejected / jnp.maximum(all_tokens, 1)

    ratio = jnp.exp(jnp.clip(log_ratio, -objective.ratio.clamp, objective.ratio.clamp))
    metrics["approx_kl"] = inputs.token_mean(-(logprobs - old_logprobs))
    metrics["ratio_mean"] = inputs.token_mean(ratio)
    metrics["ratio_min"] = masked.extreme(ratio, mask, jnp.min, jnp.inf)
    metrics["ratio_max"] = masked.extreme(ratio, mask, jnp.max, -jnp.inf)

    if batch.ref_logprobs is not None and objective.kl.kind is not None:
        _checks.check_batch_time("ref_logprobs", batch.ref_logprobs, mask)
        ref = jax.lax.stop_gradient(_checks.f32(batch.ref_logprobs))
        kl_kw = {"kind": objective.kl.kind, "straight_through": objective.kl.straight_through}
        if objective.kl.bias_correction:
            per_token_kl = kl.importance_weighted_estimate(logprobs, ref, log_ratio, **kl_kw)
        else:
            per_token_kl = kl.estimate(logprobs, ref, **kl_kw)
        metrics["kl"] = inputs.token_mean(per_token_kl)
        if kl_in_loss:
            kl_loss = inputs.aggregate(per_token_kl)
            metrics["kl_loss"] = kl_loss
            loss = loss + objective.kl.coef * kl_loss

    if objective.distill.loss is not None:
        jsd = distillation.top_k_generalized_jsd(
            student_top_logprobs, batch.teacher_top_logprobs, mask, beta=objective.distill.jsd_beta
        )
        jsd_loss = inputs.aggregate(jsd)
        metrics["distill/jsd"] = inputs.token_mean(jax.lax.stop_gradient(jsd))
        metrics["distill/jsd_loss"] = jsd_loss
        loss = loss + objective.distill.coef * jsd_loss

    if entropy is not None:
        metrics["entropy"] = inputs.token_mean(jax.lax.stop_gradient(entropy))
        if objective.entropy.adaptive or objective.entropy.coef > 0:
            # With a top-entropy mask the bonus acts on the tokens the policy loss trains (TRL).
            bonus = entropy if entropy_selection is None else entropy * entropy_selection
            entropy_loss = inputs.aggregate(bonus)
            metrics["entropy_loss"] = entropy_loss
            coef = objective.entropy.coef
            if objective.entropy.adaptive:
                coef = jax.lax.stop_gradient(_checks.f32(entropy_coef))
                _checks.check_shape("entropy_coef", coef, ())
                # Additive like every metric: each micro-batch's share of the batch's tokens.
                share = masked.selected_sum(1.0, batch.completion_mask) / jnp.maximum(all_tokens, 1)
                metrics["entropy_coef"] = coef * share
                if entropy_selection is not None:  # the controller measures the bonus's tokens
                    metrics["entropy_top"] = inputs.token_mean(jax.lax.stop_gradient(bonus))
            loss = loss - coef * entropy_loss

    metrics["loss"] = loss
    return LossOutput(loss=loss, metrics=metrics)


def _rollout_correction(
    objective: Objective, logprobs: Array, old_logprobs: Array, batch: RolloutBatch, mask: Array
) -> tuple[Array | None, Array, Array, dict[str, Array]]:
    """``(IS weights or None, loss mask, old log-probs, metrics)`` after ``batch.is_weights``
    and the objective's rollout correction (``jaxrl_llm.losses.correction``)."""
    weights = None
    if batch.is_weights is not None:
        _checks.check_batch_time("is_weights", batch.is_weights, mask)
        weights = jax.lax.stop_gradient(_checks.f32(batch.is_weights))
    spec = objective.correction
    if spec is None:
        return weights, mask, old_logprobs, {}
    if batch.rollout_logprobs is None:
        raise ValueError(
            f"objective {objective.name!r} has a rollout_correction: batch.rollout_logprobs "
            "(the sampler's log-probs) is None"
        )
    _checks.check_batch_time("rollout_logprobs", batch.rollout_logprobs, mask)
    rollout = jax.lax.stop_gradient(_checks.f32(batch.rollout_logprobs))
    if spec.mode == "bypass":  # the rollout is the old policy; measure the current one
        old_logprobs, train = rollout, jax.lax.stop_gradient(logprobs)
        # A ratio already carries pi/pi_rollout: weights would count it twice (verl).
        use_weights = not surrogate_registry.surrogate_spec(
            objective.surrogate.name
        ).needs_old_logprobs
    else:
        train, use_weights = old_logprobs, True
    log_ratio = train - rollout
    if spec.is_level is not None and use_weights:
        is_w = spec.weights(log_ratio, mask)[0]
        weights = is_w if weights is None else weights * is_w
    kept = mask
    if spec.rejection:
        kept, _ = correction.rejection_mask(log_ratio, mask, criteria=spec.criteria)
    return weights, kept, old_logprobs, {"rollout_corr/rejected": mask - kept}
