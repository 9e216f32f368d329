"""Objective presets: GRPO, DAPO, Dr.GRPO, GSPO, CISPO, ... as data over the loss pieces.

An :class:`Objective` is a frozen description of which pieces to use (advantage estimator,
ratio kind, surrogate and its bounds, KL kind / coefficient / placement, entropy coefficient,
aggregation mode and constant), the way optax's aliases are presets over transforms. The
presets in :data:`PRESETS` are rows of shared/SPEC_LOSSES.md's table; any combination of the
pieces is equally valid (``make("grpo", surrogate="cispo", clip_low=None, clip_high=4.0)``).

Configs stop at the jit boundary: an ``Objective`` is hashable and is closed over (or passed
as a static argument); only arrays flow through the traced math.

Metrics are normalised with the same global counts as the loss (``batch.num_tokens`` /
``batch.num_seqs``), so summing the metrics of K micro-batches gives the full-batch metric,
except keys ending in ``_min`` / ``_max``, which reduce by min / max.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm import _checks, advantages, aggregation, kl, ratios, surrogates, value
from jaxrl_llm.types import LossOutput, RolloutBatch

Array = jax.Array

ADVANTAGES = (
    "grpo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "opo",
    "gpg",
    "pass_at_k",
    "gae",
    "prime",
)
RATIOS = ("token", "gspo_token")
SURROGATES = ("ppo_clip", "cispo", "sapo", "gmpo", "reinforce")
KL_PLACEMENTS = ("loss", "reward")


@dataclasses.dataclass(frozen=True)
class Objective:
    """Which loss pieces make up a policy objective, and their hyper-parameters.

    Attributes:
      name: preset name (informational).
      advantage: advantage estimator, one of :data:`ADVANTAGES`.
      advantage_scale: ``"group" | "batch" | "none"`` for ``grpo`` / ``pass_at_k``.
      std_ddof: ddof of the group std (1 as verl/TRL, 0 as the GRPO paper).
      dynamic_sampling: drop groups whose rewards are all equal and refill the batch (DAPO).
      gamma: discount for ``reinforce_pp`` / ``gae``.
      lam: GAE lambda.
      ratio: ``"token"`` (PPO) or ``"gspo_token"`` (GSPO's length-normalised sequence ratio).
      ratio_clamp: clamp of the token log-ratio before ``exp``.
      max_log_ratio: upper clamp of the GSPO log-ratio.
      surrogate: one of :data:`SURROGATES`.
      clip_low: lower clip epsilon (``None``: no lower bound, CISPO only).
      clip_high: upper clip epsilon (CISPO: the ratio is capped at ``1 + clip_high``).
      dual_clip: dual-clip constant ``c > 1`` for ``A < 0`` (``None``: off).
      tau_pos: SAPO temperature for positive advantages.
      tau_neg: SAPO temperature for negative advantages.
      kl_kind: ``"k1" | "k2" | "k3" | "abs"`` or ``None`` (no KL, no reference model needed).
      kl_coef: KL coefficient (beta).
      kl_placement: ``"loss"`` (aggregated like the policy loss) or ``"reward"``
        (``r_t -= beta*kl_t``).
      kl_straight_through: value of ``kl_kind``, gradient of k2.
      entropy_coef: coefficient of the entropy bonus (loss ``-= coef * entropy``).
      aggregation: aggregation mode (see :mod:`jaxrl_llm.aggregation`). GMPO's policy term is
        per sequence and always averages over non-empty sequences; the mode then applies to
        its KL and entropy terms.
      norm_constant: constant of ``seq-mean-token-sum-norm`` (``None``: the completion width T).
      value_clip: critic clip range (PPO).
      value_coef: weight of the value loss when trained jointly (PPO).
      prime_beta: beta of PRIME's implicit process reward ``beta*(lp_prm - lp_ref)``.
    """

    name: str = "custom"
    advantage: str = "grpo"
    advantage_scale: str = "group"
    std_ddof: int = 1
    dynamic_sampling: bool = False
    gamma: float = 1.0
    lam: float = 1.0
    ratio: str = "token"
    ratio_clamp: float = 20.0
    max_log_ratio: float = 10.0
    surrogate: str = "ppo_clip"
    clip_low: float | None = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    kl_kind: str | None = None
    kl_coef: float = 0.0
    kl_placement: str = "loss"
    kl_straight_through: bool = False
    entropy_coef: float = 0.0
    aggregation: str = "token-mean"
    norm_constant: float | None = None
    value_clip: float = 0.5
    value_coef: float = 0.5
    prime_beta: float = 0.05

    def __post_init__(self):
        _checks.check_choice("advantage estimator", self.advantage, ADVANTAGES)
        _checks.check_choice("advantage_scale", self.advantage_scale, ("group", "batch", "none"))
        _checks.check_choice("ratio", self.ratio, RATIOS)
        _checks.check_choice("surrogate", self.surrogate, SURROGATES)
        _checks.check_choice("kl_kind", self.kl_kind, (None, *kl.KINDS))
        _checks.check_choice("kl_placement", self.kl_placement, KL_PLACEMENTS)
        _checks.check_choice("aggregation mode", self.aggregation, aggregation.MODES)
        if self.clip_low is None and self.surrogate != "cispo":
            raise ValueError(f"clip_low=None (no lower bound) is only valid for cispo, not {self}")
        _checks.check_clip_bounds(self.clip_low, self.clip_high)
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip!r}")
        for field in ("kl_coef", "entropy_coef", "value_clip", "value_coef", "prime_beta"):
            _checks.check_non_negative(field, getattr(self, field))
        for field in ("ratio_clamp", "max_log_ratio", "tau_pos", "tau_neg"):
            _checks.check_positive(field, getattr(self, field))
        _checks.check_positive("norm_constant", self.norm_constant)
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"gamma and lam must be in [0, 1], got {self.gamma}, {self.lam}")
        if self.ratio == "gspo_token" and self.surrogate in ("gmpo", "reinforce"):
            raise ValueError(f"surrogate {self.surrogate!r} takes no GSPO ratio")

    @property
    def needs_reference(self) -> bool:
        """Whether a reference policy's log-probs are needed (no KL term: no reference model)."""
        return self.kl_kind is not None and self.kl_coef > 0 or self.advantage == "prime"

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether the behaviour policy's log-probs enter the loss (all but REINFORCE/GPG)."""
        return self.surrogate != "reinforce"

    @property
    def needs_critic(self) -> bool:
        return self.advantage == "gae"


PRESETS: dict[str, Objective] = {
    preset.name: preset
    for preset in (
        Objective(
            name="grpo",
            kl_kind="k3",
            kl_coef=0.04,
            aggregation="seq-mean-token-mean",
        ),
        Objective(
            name="dapo",
            dynamic_sampling=True,
            clip_high=0.28,
            aggregation="token-mean",
        ),
        Objective(
            name="dr_grpo",
            advantage_scale="none",
            aggregation="seq-mean-token-sum-norm",
        ),
        Objective(
            name="gspo",
            ratio="gspo_token",
            clip_low=3e-4,
            clip_high=4e-4,
            aggregation="seq-mean-token-mean",
        ),
        Objective(
            name="gspo_token",
            ratio="gspo_token",
            clip_low=3e-4,
            clip_high=4e-4,
            aggregation="seq-mean-token-mean",
        ),
        Objective(
            name="cispo",
            surrogate="cispo",
            clip_low=None,
            clip_high=4.0,
            aggregation="token-mean",
        ),
        Objective(
            name="gmpo",
            surrogate="gmpo",
            clip_low=0.4,
            clip_high=0.4,
            aggregation="seq-mean-token-mean",
        ),
        Objective(
            name="sapo",
            surrogate="sapo",
            aggregation="seq-mean-token-mean",
        ),
        Objective(name="rloo", advantage="rloo", aggregation="token-mean"),
        Objective(
            name="reinforce_pp",
            advantage="reinforce_pp",
            kl_kind="k1",
            kl_coef=0.01,
            kl_placement="reward",
            aggregation="token-mean",
        ),
        Objective(name="gpg", advantage="gpg", surrogate="reinforce", aggregation="token-mean"),
        Objective(
            name="ppo",
            advantage="gae",
            dual_clip=3.0,
            kl_kind="k1",
            kl_coef=0.05,
            kl_placement="reward",
            aggregation="token-mean",
        ),
        Objective(name="prime", advantage="prime", aggregation="token-mean"),
    )
}


def available() -> tuple[str, ...]:
    """Names of every preset, in the order of shared/SPEC_LOSSES.md."""
    return tuple(PRESETS)


def make(name: str, **overrides: Any) -> Objective:
    """A preset with any hyper-parameter overridden.

    Args:
      name: one of :func:`available`.
      **overrides: fields of :class:`Objective`.

    Returns:
      The validated objective.

    Raises:
      ValueError: unknown preset or field, or an invalid combination.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown objective {name!r}; available: {available()}")
    fields = {f.name for f in dataclasses.fields(Objective)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown Objective field(s) {unknown}; valid fields: {sorted(fields)}")
    return dataclasses.replace(PRESETS[name], **overrides)


def _masked_sum(x: Array, mask: Array) -> Array:
    return jnp.sum(jnp.where(mask > 0, x, 0.0))


def _masked_extreme(x: Array, mask: Array, fn, fill: float) -> Array:
    # An all-masked batch reports 0 rather than +-inf.
    value = fn(jnp.where(mask > 0, x, fill))
    return jnp.where(jnp.any(mask > 0), value, 0.0)


def policy_loss(
    objective: Objective,
    logprobs: Array,
    batch: RolloutBatch,
    *,
    entropy: Array | None = None,
) -> LossOutput:
    """The policy loss of an objective on one (micro-)batch.

    ``loss = agg(surr(ratio(lp, old), A)) + kl_coef·agg(kl(lp, ref)) − entropy_coef·agg(H)``
    where the KL term is present only for ``kl_placement="loss"``, and ``agg`` is
    ``objective.aggregation`` with ``batch.num_tokens`` / ``batch.num_seqs`` as global
    normalisers (so K micro-batches sum to the full-batch loss and gradient).

    Args:
      objective: which pieces to use.
      logprobs: ``[B, T]`` current policy log-probs (carry the gradient).
      batch: ``RolloutBatch`` with ``completion_mask``, ``old_logprobs`` and ``advantages``
        (``[B]`` or ``[B, T]``); ``ref_logprobs`` when the objective puts KL in the loss.
      entropy: optional ``[B, T]`` per-token entropy (needed when ``entropy_coef > 0``).

    Returns:
      ``LossOutput(loss, metrics)``; metrics as listed in shared/SPEC_LOSSES.md.
    """
    mask = _checks.as_mask(batch.completion_mask)
    _checks.check_batch_time("logprobs", logprobs, mask)
    _checks.check_batch_time("old_logprobs", batch.old_logprobs, mask)
    _checks.check_advantages(batch.advantages, mask)
    logprobs = _checks.f32(logprobs)
    old_logprobs = jax.lax.stop_gradient(_checks.f32(batch.old_logprobs))
    adv = jax.lax.stop_gradient(_checks.f32(batch.advantages))
    kl_in_loss = objective.kl_kind is not None and objective.kl_placement == "loss"
    if kl_in_loss and objective.kl_coef > 0 and batch.ref_logprobs is None:
        raise ValueError(
            f"objective {objective.name!r} puts KL in the loss: batch.ref_logprobs is None"
        )
    if objective.entropy_coef > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs the per-token entropy")

    default_tokens, default_seqs = aggregation.normalisers(mask)
    num_tokens = default_tokens if batch.num_tokens is None else batch.num_tokens
    num_seqs = default_seqs if batch.num_seqs is None else batch.num_seqs

    def agg(values: Array) -> Array:
        return aggregation.aggregate(
            values,
            mask,
            objective.aggregation,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            norm_constant=objective.norm_constant,
        )

    def token_mean(values: Array) -> Array:
        return _masked_sum(values, mask) / jnp.maximum(num_tokens, 1)

    if objective.ratio == "gspo_token":
        log_ratio = ratios.gspo_token_log_ratio(
            logprobs, old_logprobs, mask, max_log_ratio=objective.max_log_ratio
        )
    else:
        log_ratio = ratios.token_log_ratio(logprobs, old_logprobs, clamp=objective.ratio_clamp)

    metrics: dict[str, Array] = {}
    surrogate = objective.surrogate
    if surrogate == "ppo_clip":
        per_token = surrogates.ppo_clip(
            log_ratio,
            adv,
            clip_low=objective.clip_low,
            clip_high=objective.clip_high,
            dual_clip=objective.dual_clip,
        )
        indicators = surrogates.ppo_clip_metrics(
            log_ratio,
            adv,
            clip_low=objective.clip_low,
            clip_high=objective.clip_high,
            dual_clip=objective.dual_clip,
        )
        metrics["clip_frac"] = token_mean(indicators["clipped"])
        metrics["clip_frac_lower"] = token_mean(indicators["clipped_lower"])
    elif surrogate == "cispo":
        per_token = surrogates.cispo(
            log_ratio, logprobs, adv, clip_low=objective.clip_low, clip_high=objective.clip_high
        )
        indicators = surrogates.cispo_metrics(
            log_ratio, clip_low=objective.clip_low, clip_high=objective.clip_high
        )
        metrics["clip_frac"] = token_mean(indicators["clipped"])
    elif surrogate == "sapo":
        per_token = surrogates.sapo(
            log_ratio, adv, tau_pos=objective.tau_pos, tau_neg=objective.tau_neg
        )
    elif surrogate == "gmpo":
        per_seq = surrogates.gmpo(
            log_ratio, adv, mask, clip_low=objective.clip_low, clip_high=objective.clip_high
        )
        indicators = surrogates.gmpo_metrics(
            log_ratio, adv, mask, clip_low=objective.clip_low, clip_high=objective.clip_high
        )
        metrics["clip_frac"] = token_mean(indicators["clipped"])
        per_token = None
        # GMPO's loss is already per sequence: its mean over non-empty rows, whatever the mode.
        pg_loss = aggregation.sequence_mean(per_seq, mask, num_seqs=num_seqs)
    else:
        per_token = surrogates.reinforce(logprobs, adv)

    if per_token is not None:
        pg_loss = agg(per_token)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss

    ratio = jnp.exp(jnp.clip(log_ratio, -objective.ratio_clamp, objective.ratio_clamp))
    metrics["approx_kl"] = token_mean(-(logprobs - old_logprobs))
    metrics["ratio_mean"] = token_mean(ratio)
    metrics["ratio_min"] = _masked_extreme(ratio, mask, jnp.min, jnp.inf)
    metrics["ratio_max"] = _masked_extreme(ratio, mask, jnp.max, -jnp.inf)

    if batch.ref_logprobs is not None and objective.kl_kind is not None:
        _checks.check_batch_time("ref_logprobs", batch.ref_logprobs, mask)
        ref = jax.lax.stop_gradient(_checks.f32(batch.ref_logprobs))
        per_token_kl = kl.estimate(
            logprobs,
            ref,
            kind=objective.kl_kind,
            straight_through=objective.kl_straight_through,
        )
        metrics["kl"] = token_mean(per_token_kl)
        if kl_in_loss:
            kl_loss = agg(per_token_kl)
            metrics["kl_loss"] = kl_loss
            loss = loss + objective.kl_coef * kl_loss

    if entropy is not None:
        _checks.check_batch_time("entropy", entropy, mask)
        entropy = _checks.f32(entropy)
        metrics["entropy"] = token_mean(jax.lax.stop_gradient(entropy))
        if objective.entropy_coef > 0:
            entropy_loss = agg(entropy)
            metrics["entropy_loss"] = entropy_loss
            loss = loss - objective.entropy_coef * entropy_loss

    metrics["loss"] = loss
    return LossOutput(loss=loss, metrics=metrics)


def value_loss(objective: Objective, values: Array, batch: RolloutBatch) -> LossOutput:
    """PPO's clipped critic loss, aggregated like the policy loss.

    ``vf_loss = agg(½·max((v − R)², (clip(v, v_old ± c) − R)²))`` with ``c = objective.value_clip``.

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
        values, batch.old_values, batch.returns, clip=objective.value_clip
    )
    default_tokens, default_seqs = aggregation.normalisers(mask)
    num_tokens = default_tokens if batch.num_tokens is None else batch.num_tokens
    num_seqs = default_seqs if batch.num_seqs is None else batch.num_seqs
    vf_loss = aggregation.aggregate(
        per_token,
        mask,
        objective.aggregation,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_constant=objective.norm_constant,
    )
    clip_fraction = value.value_clip_fraction(
        values, batch.old_values, batch.returns, clip=objective.value_clip
    )
    metrics = {
        "vf_loss": vf_loss,
        "vf_clipfrac": _masked_sum(clip_fraction, mask) / jnp.maximum(num_tokens, 1),
        "value_mean": _masked_sum(jax.lax.stop_gradient(_checks.f32(values)), mask)
        / jnp.maximum(num_tokens, 1),
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


def outcome_token_rewards(rewards: Array, mask: Array) -> Array:
    """Places each row's scalar reward on its last valid token: ``[B]`` -> ``[B, T]`` (f32)."""
    _checks.check_rank("mask", mask, 2)
    _checks.check_shape("rewards", rewards, mask.shape[:1])
    mask = _checks.as_mask(mask)
    positions = jnp.arange(mask.shape[1])
    last = jnp.max(jnp.where(mask > 0, positions, -1), axis=1)
    return jnp.where(positions[None, :] == last[:, None], _checks.f32(rewards)[:, None], 0.0)


def _group_loo_token_rewards(token_rewards: Array, mask: Array, group_size: int) -> Array:
    # PRIME's RLOO on dense rewards: r_t - mean_{j != i} (per-sequence mean of r over row j).
    seq_mean = jnp.sum(token_rewards * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
    group_sum = jnp.repeat(
        seq_mean.reshape(-1, group_size).sum(axis=1), group_size, total_repeat_length=mask.shape[0]
    )
    scale = group_size / (group_size - 1)
    return (token_rewards * scale - group_sum[:, None] / (group_size - 1)) * mask


def compute_advantages(
    objective: Objective,
    rewards: Array,
    mask: Array,
    *,
    group_size: int,
    old_logprobs: Array | None = None,
    ref_logprobs: Array | None = None,
    values: Array | None = None,
    baseline_rewards: Array | None = None,
    process_rewards: Array | None = None,
) -> tuple[Array, Array | None]:
    """Advantages (and value targets) for an objective, from one rollout batch.

    With ``kl_placement="reward"`` the per-token KL ``beta*kl(old, ref)`` is subtracted from the
    token rewards (token-level estimators) or its row sum from the scalar reward (sequence-level
    estimators).

    Args:
      objective: selects the estimator and its hyper-parameters.
      rewards: ``[B]`` outcome reward per completion.
      mask: ``[B, T]`` completion mask.
      group_size: completions per prompt (groups contiguous).
      old_logprobs: ``[B, T]`` behaviour log-probs (KL in the reward).
      ref_logprobs: ``[B, T]`` reference log-probs (KL in the reward).
      values: ``[B, T]`` critic values (``gae``).
      baseline_rewards: ``[B]`` greedy-completion rewards (``remax``).
      process_rewards: ``[B, T]`` dense implicit rewards ``beta*(lp_prm - lp_ref)`` (``prime``).

    Returns:
      ``(advantages, returns)``: advantages ``[B]`` or ``[B, T]``; returns ``[B, T]`` for
      ``gae`` / ``prime`` and ``None`` otherwise.
    """
    mask = _checks.as_mask(mask)
    rewards = _checks.f32(rewards)
    _checks.check_shape("rewards", rewards, mask.shape[:1])
    _checks.check_group_size(mask.shape[0], group_size)
    kl_penalty = jnp.zeros_like(mask)
    if objective.kl_placement == "reward" and objective.kl_kind is not None and objective.kl_coef:
        if old_logprobs is None or ref_logprobs is None:
            raise ValueError(
                f"objective {objective.name!r} puts KL in the reward: "
                "old_logprobs and ref_logprobs are required"
            )
        kl_penalty = (
            objective.kl_coef
            * kl.estimate(old_logprobs, ref_logprobs, kind=objective.kl_kind)
            * mask
        )

    name = objective.advantage
    if name in ("reinforce_pp", "gae", "prime"):
        token_rewards = outcome_token_rewards(rewards, mask) - kl_penalty
        if name == "reinforce_pp":
            return advantages.reinforce_pp(token_rewards, mask, gamma=objective.gamma), None
        if name == "gae":
            if values is None:
                raise ValueError("the gae estimator needs critic values")
            return advantages.gae(
                token_rewards, values, mask, gamma=objective.gamma, lam=objective.lam
            )
        if process_rewards is None:
            raise ValueError("the prime estimator needs process_rewards")
        if group_size < 2:
            raise ValueError("the prime estimator needs group_size >= 2 for its RLOO baselines")
        _checks.check_batch_time("process_rewards", process_rewards, mask)
        dense = _group_loo_token_rewards(_checks.f32(process_rewards), mask, group_size)
        outcome = outcome_token_rewards(advantages.rloo(rewards, group_size=group_size), mask)
        returns = jnp.flip(jnp.cumsum(jnp.flip((dense + outcome - kl_penalty) * mask, 1), 1), 1)
        return advantages.whiten(returns, mask) * mask, returns * mask

    rewards = rewards - jnp.sum(kl_penalty, axis=1)
    if name == "grpo":
        adv = advantages.grpo(
            rewards,
            group_size=group_size,
            scale=objective.advantage_scale,
            std_ddof=objective.std_ddof,
        )
    elif name == "pass_at_k":
        adv = advantages.pass_at_k(rewards, group_size=group_size, scale=objective.advantage_scale)
    elif name in ("rloo", "gpg"):
        adv = getattr(advantages, name)(rewards, group_size=group_size)
    elif name in ("opo", "reinforce_pp_baseline"):
        adv = getattr(advantages, name)(rewards, mask, group_size=group_size)
    else:  # remax
        if baseline_rewards is None:
            raise ValueError(
                "the remax estimator needs baseline_rewards (greedy-completion rewards)"
            )
        adv = advantages.remax(rewards, baseline_rewards)
    return adv, None
