"""The :class:`Objective` dataclass and the presets of shared/SPEC_LOSSES.md.

An :class:`Objective` is a frozen description of which pieces to use (advantage estimator,
ratio kind, surrogate and its bounds, KL kind / coefficient / placement, entropy coefficient,
aggregation mode and constant), the way optax's aliases are presets over transforms. The
estimator, ratio and surrogate are names in registries that users extend
(:func:`~jaxrl_llm.objectives.register_surrogate`, ...); construction validates them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxrl_llm import _checks, aggregation, correction, kl
from jaxrl_llm.objectives import estimator_registry, surrogate_registry

ADVANTAGE_SCALES = ("group", "batch", "none")
KL_PLACEMENTS = ("loss", "reward")
# Divergences to a teacher's next-token distribution an objective may add to its loss.
DISTILL_LOSSES = ("jsd",)


def _freeze(value: Any, where: str) -> Any:
    """A hashable version of a user hyper-parameter (lists become tuples)."""
    if isinstance(value, list | tuple):
        return tuple(_freeze(item, where) for item in value)
    try:
        hash(value)
    except TypeError:
        raise ValueError(
            f"{where}={value!r} is not hashable; Objective.extra values must be hashable "
            "(numbers, strings, tuples) so that objectives stay jit-static"
        ) from None
    return value


def freeze_extra(extra: Mapping[str, Any] | Any) -> tuple[tuple[str, Any], ...]:
    """``{name: value}`` (or ``(name, value)`` pairs) -> sorted hashable pairs."""
    pairs = list(extra.items() if isinstance(extra, Mapping) else extra)
    if not all(isinstance(pair, tuple | list) and len(pair) == 2 for pair in pairs):
        raise ValueError(f"extra must be a mapping or (name, value) pairs, got {extra!r}")
    names = [name for name, _ in pairs]
    if not all(isinstance(name, str) and name for name in names):
        raise ValueError(f"extra names must be non-empty strings, got {names}")
    if len(set(names)) != len(names):
        raise ValueError(f"extra names must be unique, got {names}")
    return tuple(sorted((name, _freeze(value, f"extra[{name!r}]")) for name, value in pairs))


@dataclasses.dataclass(frozen=True)
class Objective:
    """Which loss pieces make up a policy objective, and their hyper-parameters.

    Attributes:
      name: preset name (informational).
      advantage: a registered advantage estimator (:func:`estimators_available`).
      advantage_scale: ``"group" | "batch" | "none"`` for ``grpo`` / ``pass_at_k``.
      std_ddof: ddof of the group std (1 as verl/TRL, 0 as the GRPO paper).
      dynamic_sampling: drop groups whose rewards are all equal and refill the batch (DAPO).
      gamma: discount for ``reinforce_pp`` / ``gae``.
      lam: GAE lambda.
      ratio: a registered ratio kind: ``"token"`` (PPO) or ``"gspo_token"`` (GSPO's
        length-normalised sequence ratio).
      ratio_clamp: clamp of the token log-ratio before ``exp``.
      max_log_ratio: upper clamp of the GSPO log-ratio.
      surrogate: a registered surrogate (:func:`surrogates_available`).
      clip_low: lower clip epsilon (``None``: no lower bound, for surrogates registered with
        ``clip_low_optional``, i.e. CISPO).
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
      extra: hyper-parameters of user surrogates / estimators as sorted ``(name, value)``
        pairs; a dict is accepted and converted (read them with :attr:`extra_dict`).
      rollout_correction: ``jaxrl_llm.correction.Correction`` (a mapping of its fields is
        accepted and converted) or None: IS weights / rejection of the sampler-trainer
        mismatch, from ``batch.rollout_logprobs``.
      ratio_cap: truncation ``C`` of the detached IS weight ``min(r, C)`` of the ``dppo_tv``
        / ``dppo_kl`` surrogates (verl's ``clip_ratio_c`` there; ``None``: no cap). Their
        trust-region bounds are ``clip_low`` / ``clip_high`` (divergences, as in verl).
      cov_fraction: fraction of the valid tokens ``kl_cov`` penalises / ``clip_cov`` leaves
        out (verl's ``kl_cov_ratio`` / ``clip_cov_ratio``).
      cov_bounds: ``(low, high)`` covariance window of ``clip_cov`` (verl's ``clip_cov_lb``,
        ``clip_cov_ub``).
      kl_cov_coef: coefficient of ``kl_cov``'s ``|log r|`` penalty (verl's ``ppo_kl_coef``).
      top_entropy_quantile: ``ρ``: the policy loss trains only on the top-``ρ`` fraction of
        tokens by entropy (Wang et al. 2025; TRL's name); 1 keeps every token. Needs the
        per-token entropy.
      off_policy_mask_threshold: ``δ`` of DeepSeek-V3.2's off-policy sequence mask (TRL's
        name): negative-advantage rows whose mean ``log π_sampler − log π_θ`` exceeds it
        leave the policy loss; ``None``: off. ``π_sampler`` is ``batch.rollout_logprobs``
        when given, else the old log-probs.
      kl_bias_correction: multiply the per-token KL in the loss by the importance ratio
        (DeepSeek-V3.2's unbiased KL estimate; TRL's ``use_bias_correction_kl``).
      reward_weights: weights of the reward columns of the ``gdpo`` estimator (``None``: 1).
      distill_coef: weight of the teacher term ``log π_T − log π_old`` of the ``distill`` and
        ``grpo_distill`` estimators (on-policy distillation).
      m2_threshold: ``τ`` of M2PO's second-moment mask (AReaL's name): the tokens of largest
        ``(log π_θ − log π_sampler)²`` leave the policy loss until the batch's mean squared
        log-ratio is under it (:func:`~jaxrl_llm.token_selection.m2po_mask`; AReaL's default
        0.04); ``None``: off. ``π_sampler`` as for ``off_policy_mask_threshold``.
      entropy_target: adaptive entropy coefficient (Skywork-OR1; TRL's
        ``use_adaptive_entropy`` / ``entropy_target``): target mean per-token entropy in nats.
        The coefficient, ``entropy_coef`` at the start, moves by ``entropy_coef_delta`` each
        optimizer step (up while the measured entropy is at or below the target, else down)
        within ``entropy_coef_bounds``, and the bonus applies only while the last measured
        entropy is at or below the target (:mod:`~jaxrl_llm.objectives.entropy_control`; the
        coefficient is train state, handed to ``policy_loss(entropy_coef=...)``). ``None``:
        the fixed ``entropy_coef``.
      entropy_coef_delta: the adaptive coefficient's step (TRL's ``entropy_coef_delta``).
      entropy_coef_bounds: ``(min, max)`` of the adaptive coefficient (TRL's
        ``entropy_coef_min`` / ``entropy_coef_max``).
      distill_loss: ``"jsd"``: GKD's generalised JSD to a teacher's next-token distribution
        (Agarwal et al. 2024, arXiv:2306.13649; TRL's ``GKDTrainer``) is added to the loss,
        ``loss += distill_loss_coef · agg(JSD_β)`` over the trained tokens, aggregated like
        the policy loss (``distillation.top_k_generalized_jsd`` of the student's and the
        teacher's log-probs of the teacher's top-``k`` tokens, renormalised there); needs a
        teacher (``teacher.path``). ``None``: no such term.
      jsd_beta: ``β`` of that JSD in ``[0, 1]`` (0: forward ``KL(teacher ‖ student)``, 1:
        reverse ``KL(student ‖ teacher)``; TRL's ``beta``, default 0.5).
      distill_top_k: ``k``, the teacher's most likely tokens the JSD is restricted to (both
        distributions renormalised over them); ``None``: the whole vocabulary (``k = V``,
        for small vocabularies: the teacher's ``[B, T, V]`` log-probs ride in the batch).
      distill_loss_coef: the weight of the JSD term (config ``teacher.coef``).
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
    extra: tuple[tuple[str, Any], ...] = ()
    rollout_correction: correction.Correction | None = None
    ratio_cap: float | None = None
    cov_fraction: float = 2e-4
    cov_bounds: tuple[float, float] = (1.0, 5.0)
    kl_cov_coef: float = 0.1
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    kl_bias_correction: bool = False
    reward_weights: tuple[float, ...] | None = None
    distill_coef: float = 1.0
    m2_threshold: float | None = None
    entropy_target: float | None = None
    entropy_coef_delta: float = 0.005
    entropy_coef_bounds: tuple[float, float] = (0.0, 1.0)
    distill_loss: str | None = None
    jsd_beta: float = 0.5
    distill_top_k: int | None = None
    distill_loss_coef: float = 1.0

    def __post_init__(self):
        # Frozen: the normalisations go through object.__setattr__.
        object.__setattr__(self, "extra", freeze_extra(self.extra))
        for field in ("cov_bounds", "reward_weights", "entropy_coef_bounds"):  # YAML: lists
            value = getattr(self, field)
            if isinstance(value, list | tuple):
                object.__setattr__(self, field, tuple(float(v) for v in value))
        self._check_stabilisers()
        object.__setattr__(
            self, "rollout_correction", correction.Correction.of(self.rollout_correction)
        )
        _checks.check_choice("advantage estimator", self.advantage, estimator_registry.ESTIMATORS)
        _checks.check_choice("advantage_scale", self.advantage_scale, ADVANTAGE_SCALES)
        _checks.check_choice("ratio", self.ratio, surrogate_registry.RATIOS)
        _checks.check_choice("surrogate", self.surrogate, surrogate_registry.SURROGATES)
        _checks.check_choice("kl_kind", self.kl_kind, (None, *kl.KINDS))
        _checks.check_choice("kl_placement", self.kl_placement, KL_PLACEMENTS)
        _checks.check_choice("aggregation mode", self.aggregation, aggregation.MODES)
        surrogate = surrogate_registry.surrogate_spec(self.surrogate)
        if self.clip_low is None and not surrogate.clip_low_optional:
            takes_none = [
                name
                for name, spec in surrogate_registry.SURROGATES.items()
                if spec.clip_low_optional
            ]
            raise ValueError(
                f"clip_low=None (no lower bound) is not valid for surrogate {self.surrogate!r}; "
                f"surrogates that take it: {takes_none}"
            )
        _checks.check_clip_bounds(self.clip_low, self.clip_high)
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip!r}")
        for field in (
            "kl_coef",
            "entropy_coef",
            "value_clip",
            "value_coef",
            "prime_beta",
            "distill_coef",
        ):
            _checks.check_non_negative(field, getattr(self, field))
        for field in ("ratio_clamp", "max_log_ratio", "tau_pos", "tau_neg"):
            _checks.check_positive(field, getattr(self, field))
        _checks.check_positive("norm_constant", self.norm_constant)
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"gamma and lam must be in [0, 1], got {self.gamma}, {self.lam}")
        if surrogate.ratios is not None and self.ratio not in surrogate.ratios:
            raise ValueError(
                f"surrogate {self.surrogate!r} takes no {self.ratio!r} ratio; "
                f"it takes {surrogate.ratios}"
            )

    def _check_stabilisers(self) -> None:
        _checks.check_positive("ratio_cap", self.ratio_cap)
        if not 0.0 < self.cov_fraction <= 1.0:
            raise ValueError(f"cov_fraction must be in (0, 1], got {self.cov_fraction!r}")
        bounds = self.cov_bounds
        if not (isinstance(bounds, tuple) and len(bounds) == 2 and bounds[0] < bounds[1]):
            raise ValueError(f"cov_bounds must be (low, high) with low < high, got {bounds!r}")
        _checks.check_non_negative("kl_cov_coef", self.kl_cov_coef)
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError(
                f"top_entropy_quantile must be in [0, 1], got {self.top_entropy_quantile!r}"
            )
        _checks.check_non_negative("off_policy_mask_threshold", self.off_policy_mask_threshold)
        if self.m2_threshold is not None and not self.m2_threshold > 0:
            raise ValueError(f"m2_threshold must be > 0, got {self.m2_threshold!r}")
        self._check_entropy_control()
        self._check_distill_loss()
        if self.reward_weights is not None and not self.reward_weights:
            raise ValueError("reward_weights must hold one weight per reward column")
        estimator = estimator_registry.ESTIMATORS.get(self.advantage)
        kl_in_reward = self.kl_placement == "reward" and self.kl_kind is not None
        columns = estimator is not None and "reward_columns" in estimator.requires
        if columns and kl_in_reward and self.kl_coef > 0:
            raise ValueError(
                f"the {self.advantage} estimator normalises each reward column: a KL penalty "
                "in the reward has no column; use kl_placement='loss'"
            )

    def _check_entropy_control(self) -> None:
        _checks.check_non_negative("entropy_target", self.entropy_target)
        _checks.check_positive("entropy_coef_delta", self.entropy_coef_delta)
        bounds = self.entropy_coef_bounds
        if not (isinstance(bounds, tuple) and len(bounds) == 2 and 0 <= bounds[0] <= bounds[1]):
            raise ValueError(
                f"entropy_coef_bounds must be (min, max) with 0 <= min <= max, got {bounds!r}"
            )
        if self.entropy_target is not None and not bounds[0] <= self.entropy_coef <= bounds[1]:
            raise ValueError(
                f"entropy_coef={self.entropy_coef!r} (the adaptive coefficient's start) must lie "
                f"in entropy_coef_bounds={bounds!r}"
            )

    def _check_distill_loss(self) -> None:
        _checks.check_choice("distill_loss", self.distill_loss, (None, *DISTILL_LOSSES))
        beta = self.jsd_beta
        if isinstance(beta, bool) or not isinstance(beta, int | float) or not 0 <= beta <= 1:
            raise ValueError(f"jsd_beta must be in [0, 1], got {beta!r}")
        k = self.distill_top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(
                f"distill_top_k must be an int >= 1 (the teacher's most likely tokens) or None "
                f"(the whole vocabulary), got {k!r}"
            )
        _checks.check_non_negative("distill_loss_coef", self.distill_loss_coef)

    @property
    def needs_teacher(self) -> bool:
        """Whether a distillation teacher must score the rollout batch: an estimator that
        takes its log-probs (``distill``, ``grpo_distill``) or a ``distill_loss``."""
        return "teacher_logprobs" in self.estimator_requires or self.distill_loss is not None

    @property
    def adaptive_entropy(self) -> bool:
        """Whether the entropy coefficient is adaptive (``entropy_target`` set): train state."""
        return self.entropy_target is not None

    @property
    def extra_dict(self) -> dict[str, Any]:
        """The user hyper-parameters of :attr:`extra` as a (fresh) dict."""
        return dict(self.extra)

    @property
    def needs_reference(self) -> bool:
        """Whether a reference policy's log-probs are needed (no KL term: no reference model)."""
        estimator = estimator_registry.estimator_spec(self.advantage)
        return self.kl_kind is not None and self.kl_coef > 0 or estimator.needs_reference

    @property
    def needs_entropy(self) -> bool:
        """Whether ``policy_loss`` needs the per-token entropy (bonus, adaptive coefficient or
        top-entropy mask)."""
        return self.entropy_coef > 0 or self.adaptive_entropy or self.top_entropy_quantile < 1.0

    @property
    def needs_reward_columns(self) -> bool:
        """Whether the estimator needs one reward column per reward function (GDPO)."""
        return "reward_columns" in self.estimator_requires

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether the behaviour policy's log-probs enter the loss (all but REINFORCE/GPG)."""
        return surrogate_registry.surrogate_spec(self.surrogate).needs_old_logprobs

    @property
    def estimator_requires(self) -> tuple[str, ...]:
        """The optional estimator inputs the advantage estimator cannot do without."""
        return estimator_registry.estimator_spec(self.advantage).requires

    @property
    def min_group_size(self) -> int:
        """The smallest rollout group size the advantage estimator accepts."""
        return estimator_registry.estimator_spec(self.advantage).min_group_size

    @property
    def needs_critic(self) -> bool:
        """Whether the estimator needs critic values (GAE)."""
        return "values" in self.estimator_requires

    @property
    def needs_process_rewards(self) -> bool:
        """Whether the estimator needs dense process rewards (PRIME's implicit PRM)."""
        return "process_rewards" in self.estimator_requires


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
        # On-policy distillation: the student's own samples, the teacher's per-token reverse
        # KL as the advantage (needs a teacher: ``teacher.path``).
        Objective(name="distill", advantage="distill", aggregation="token-mean"),
        # GKD (Agarwal et al. 2024) on the student's own samples: no advantage, the loss is
        # the generalised JSD (β = 0.5, TRL's default) to the teacher at every completion token.
        Objective(
            name="distill_gkd",
            advantage="none",
            aggregation="token-mean",
            distill_loss="jsd",
            jsd_beta=0.5,
        ),
    )
}


def available() -> tuple[str, ...]:
    """Names of every preset, in the order of shared/SPEC_LOSSES.md."""
    return tuple(PRESETS)


def make(name: str, **overrides: Any) -> Objective:
    """A preset with any hyper-parameter overridden.

    Args:
      name: one of :func:`available`.
      **overrides: fields of :class:`Objective` (``extra`` may be a dict).

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
