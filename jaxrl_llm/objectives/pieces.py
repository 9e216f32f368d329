"""The pieces an :class:`~jaxrl_llm.objectives.Objective` is composed of, each owning its
hyper-parameters and their checks.

A piece is a frozen, hashable dataclass (objectives are jit-static). The registered functions
receive their own piece: an advantage estimator its :class:`Advantage`, a ratio its
:class:`Ratio`, a surrogate its :class:`Surrogate`. A user's estimator or surrogate declares its
own typed hyper-parameters (``register_surrogate("mine", fn, params=MyParams)``, ``MyParams`` a
frozen dataclass) and reads them from ``piece.params``.

Error messages name a field by its flat config name (``kl_coef``, ``clip_high``): the name a
user writes in ``objective.overrides`` or :func:`~jaxrl_llm.objectives.make`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl_llm import _checks
from jaxrl_llm.losses import aggregation, kl

ADVANTAGE_SCALES = ("group", "batch", "none")
KL_PLACEMENTS = ("loss", "reward")
# Divergences to a teacher's next-token distribution an objective may add to its loss.
DISTILL_LOSSES = ("jsd",)


def _pair(value: Any) -> Any:
    """YAML lists -> tuples of floats (hashable)."""
    return tuple(float(v) for v in value) if isinstance(value, list | tuple) else value


@dataclasses.dataclass(frozen=True)
class Advantage:
    """The advantage estimator and its hyper-parameters.

    Attributes:
      name: a registered estimator (``objectives.estimators_available()``; flat name
        ``advantage``).
      scale: ``"group" | "batch" | "none"`` for ``grpo`` / ``pass_at_k`` (``advantage_scale``).
      std_ddof: ddof of the group std (1 as verl/TRL, 0 as the GRPO paper).
      gamma: discount for ``reinforce_pp`` / ``gae``.
      lam: GAE lambda.
      reward_weights: weights of the reward columns of ``gdpo`` (``None``: 1).
      distill_coef: weight of the teacher term ``log π_T − log π_old`` of the ``distill`` and
        ``grpo_distill`` estimators (on-policy distillation).
      prime_beta: beta of PRIME's implicit process reward ``beta*(lp_prm - lp_ref)``.
      dynamic_sampling: drop groups whose rewards are all equal and refill the batch (DAPO).
      params: a user estimator's own hyper-parameters (an instance of the ``params`` type it
        was registered with; a mapping is converted), ``None`` for the built-ins.
    """

    name: str = "grpo"
    scale: str = "group"
    std_ddof: int = 1
    gamma: float = 1.0
    lam: float = 1.0
    reward_weights: tuple[float, ...] | None = None
    distill_coef: float = 1.0
    prime_beta: float = 0.05
    dynamic_sampling: bool = False
    params: Any = None

    def __post_init__(self):
        object.__setattr__(self, "reward_weights", _pair(self.reward_weights))
        _checks.check_choice("advantage_scale", self.scale, ADVANTAGE_SCALES)
        for field, value in (("distill_coef", self.distill_coef), ("prime_beta", self.prime_beta)):
            _checks.check_non_negative(field, value)
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"gamma and lam must be in [0, 1], got {self.gamma}, {self.lam}")
        if self.reward_weights is not None and not self.reward_weights:
            raise ValueError("reward_weights must hold one weight per reward column")


@dataclasses.dataclass(frozen=True)
class Ratio:
    """The importance ratio: a registered kind and its clamps.

    Attributes:
      kind: ``"token"`` (PPO) or ``"gspo_token"`` (GSPO's length-normalised sequence ratio),
        or a user's (flat name ``ratio``).
      clamp: clamp of the token log-ratio before ``exp`` (``ratio_clamp``).
      max_log_ratio: upper clamp of the GSPO log-ratio.
    """

    kind: str = "token"
    clamp: float = 20.0
    max_log_ratio: float = 10.0

    def __post_init__(self):
        _checks.check_positive("ratio_clamp", self.clamp)
        _checks.check_positive("max_log_ratio", self.max_log_ratio)


@dataclasses.dataclass(frozen=True)
class Surrogate:
    """The policy surrogate and its bounds.

    Attributes:
      name: a registered surrogate (``objectives.surrogates_available()``; flat name
        ``surrogate``).
      clip_low: lower clip epsilon (``None``: no lower bound, for surrogates registered with
        ``clip_low_optional``, i.e. CISPO). DPPO's lower divergence bound.
      clip_high: upper clip epsilon (CISPO: the ratio is capped at ``1 + clip_high``). DPPO's
        upper divergence bound.
      dual_clip: dual-clip constant ``c > 1`` for ``A < 0`` (``None``: off).
      tau_pos: SAPO temperature for positive advantages.
      tau_neg: SAPO temperature for negative advantages.
      ratio_cap: truncation ``C`` of the detached IS weight ``min(r, C)`` of ``dppo_tv`` /
        ``dppo_kl`` (verl's ``clip_ratio_c`` there; ``None``: no cap).
      cov_fraction: fraction of the valid tokens ``kl_cov`` penalises / ``clip_cov`` leaves out
        (verl's ``kl_cov_ratio`` / ``clip_cov_ratio``).
      cov_bounds: ``(low, high)`` covariance window of ``clip_cov`` (verl's ``clip_cov_lb``,
        ``clip_cov_ub``).
      kl_cov_coef: coefficient of ``kl_cov``'s ``|log r|`` penalty (verl's ``ppo_kl_coef``).
      params: a user surrogate's own hyper-parameters (an instance of the ``params`` type it
        was registered with; a mapping is converted), ``None`` for the built-ins.
    """

    name: str = "ppo_clip"
    clip_low: float | None = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    ratio_cap: float | None = None
    cov_fraction: float = 2e-4
    cov_bounds: tuple[float, float] = (1.0, 5.0)
    kl_cov_coef: float = 0.1
    params: Any = None

    def __post_init__(self):
        object.__setattr__(self, "cov_bounds", _pair(self.cov_bounds))
        _checks.check_clip_bounds(self.clip_low, self.clip_high)
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip!r}")
        for field in ("tau_pos", "tau_neg", "ratio_cap"):
            _checks.check_positive(field, getattr(self, field))
        if not 0.0 < self.cov_fraction <= 1.0:
            raise ValueError(f"cov_fraction must be in (0, 1], got {self.cov_fraction!r}")
        bounds = self.cov_bounds
        if not (isinstance(bounds, tuple) and len(bounds) == 2 and bounds[0] < bounds[1]):
            raise ValueError(f"cov_bounds must be (low, high) with low < high, got {bounds!r}")
        _checks.check_non_negative("kl_cov_coef", self.kl_cov_coef)


@dataclasses.dataclass(frozen=True)
class KLPenalty:
    """The KL term to the reference policy.

    Attributes:
      kind: ``"k1" | "k2" | "k3" | "abs"`` or ``None`` (no KL, no reference model needed;
        flat name ``kl_kind``).
      coef: KL coefficient beta (``kl_coef``).
      placement: ``"loss"`` (aggregated like the policy loss) or ``"reward"``
        (``r_t -= beta*kl_t``; ``kl_placement``).
      straight_through: value of ``kind``, gradient of k2 (``kl_straight_through``).
      bias_correction: multiply the per-token KL in the loss by the importance ratio
        (DeepSeek-V3.2's unbiased KL estimate; TRL's ``use_bias_correction_kl``;
        ``kl_bias_correction``).
    """

    kind: str | None = None
    coef: float = 0.0
    placement: str = "loss"
    straight_through: bool = False
    bias_correction: bool = False

    def __post_init__(self):
        _checks.check_choice("kl_kind", self.kind, (None, *kl.KINDS))
        _checks.check_choice("kl_placement", self.placement, KL_PLACEMENTS)
        _checks.check_non_negative("kl_coef", self.coef)

    @property
    def active(self) -> bool:
        """Whether the objective has a KL term at all (a kind and a positive coefficient)."""
        return self.kind is not None and self.coef > 0

    @property
    def in_reward(self) -> bool:
        """Whether the KL is subtracted from the rewards (``placement="reward"``)."""
        return self.kind is not None and self.placement == "reward"


@dataclasses.dataclass(frozen=True)
class Entropy:
    """The entropy bonus, fixed or adaptive.

    Attributes:
      coef: coefficient of the bonus (loss ``-= coef * entropy``; ``entropy_coef``).
      target: adaptive coefficient (Skywork-OR1; TRL's ``use_adaptive_entropy`` /
        ``entropy_target``): target mean per-token entropy in nats. The coefficient, ``coef``
        at the start, moves by ``coef_delta`` each optimizer step (up while the measured entropy
        is at or below the target, else down) within ``coef_bounds``, and the bonus applies
        only while the last measured entropy is at or below the target
        (:mod:`~jaxrl_llm.objectives.entropy_control`; the coefficient is train state).
        ``None``: the fixed ``coef``.
      coef_delta: the adaptive coefficient's step (``entropy_coef_delta``).
      coef_bounds: ``(min, max)`` of the adaptive coefficient (``entropy_coef_bounds``).
    """

    coef: float = 0.0
    target: float | None = None
    coef_delta: float = 0.005
    coef_bounds: tuple[float, float] = (0.0, 1.0)

    def __post_init__(self):
        object.__setattr__(self, "coef_bounds", _pair(self.coef_bounds))
        _checks.check_non_negative("entropy_coef", self.coef)
        _checks.check_non_negative("entropy_target", self.target)
        _checks.check_positive("entropy_coef_delta", self.coef_delta)
        bounds = self.coef_bounds
        if not (isinstance(bounds, tuple) and len(bounds) == 2 and 0 <= bounds[0] <= bounds[1]):
            raise ValueError(
                f"entropy_coef_bounds must be (min, max) with 0 <= min <= max, got {bounds!r}"
            )
        if self.target is not None and not bounds[0] <= self.coef <= bounds[1]:
            raise ValueError(
                f"entropy_coef={self.coef!r} (the adaptive coefficient's start) must lie "
                f"in entropy_coef_bounds={bounds!r}"
            )

    @property
    def adaptive(self) -> bool:
        """Whether the coefficient is adaptive (``target`` set): train state."""
        return self.target is not None


@dataclasses.dataclass(frozen=True)
class Aggregation:
    """How the per-token losses become the scalar (:mod:`jaxrl_llm.losses.aggregation`).

    Attributes:
      mode: the aggregation mode (flat name ``aggregation``). GMPO's policy term is per
        sequence and always averages over non-empty sequences; the mode then applies to its KL
        and entropy terms.
      norm_constant: constant of ``seq-mean-token-sum-norm`` (``None``: the completion width).
    """

    mode: str = "token-mean"
    norm_constant: float | None = None

    def __post_init__(self):
        _checks.check_choice("aggregation mode", self.mode, aggregation.MODES)
        _checks.check_positive("norm_constant", self.norm_constant)


@dataclasses.dataclass(frozen=True)
class TokenSelection:
    """Which tokens the policy loss trains on (:mod:`jaxrl_llm.losses.token_selection`).

    Attributes:
      top_entropy_quantile: ``ρ``: only the top-``ρ`` fraction of tokens by entropy (Wang et
        al. 2025; TRL's name); 1 keeps every token. Needs the per-token entropy.
      off_policy_mask_threshold: ``δ`` of DeepSeek-V3.2's off-policy sequence mask (TRL's
        name): negative-advantage rows whose mean ``log π_sampler − log π_θ`` exceeds it leave
        the policy loss; ``None``: off. ``π_sampler`` is ``batch.rollout_logprobs`` when given,
        else the old log-probs.
      m2_threshold: ``τ`` of M2PO's second-moment mask (AReaL's name): the tokens of largest
        ``(log π_θ − log π_sampler)²`` leave the policy loss until the batch's mean squared
        log-ratio is under it (AReaL's default 0.04); ``None``: off.
    """

    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    m2_threshold: float | None = None

    def __post_init__(self):
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError(
                f"top_entropy_quantile must be in [0, 1], got {self.top_entropy_quantile!r}"
            )
        _checks.check_non_negative("off_policy_mask_threshold", self.off_policy_mask_threshold)
        if self.m2_threshold is not None and not self.m2_threshold > 0:
            raise ValueError(f"m2_threshold must be > 0, got {self.m2_threshold!r}")


@dataclasses.dataclass(frozen=True)
class ValueLoss:
    """PPO's critic loss.

    Attributes:
      clip: critic clip range (``value_clip``).
      coef: weight of the value loss when trained jointly (``value_coef``).
    """

    clip: float = 0.5
    coef: float = 0.5

    def __post_init__(self):
        _checks.check_non_negative("value_clip", self.clip)
        _checks.check_non_negative("value_coef", self.coef)


@dataclasses.dataclass(frozen=True)
class Distill:
    """A divergence to a teacher's next-token distribution added to the loss.

    Attributes:
      loss: ``"jsd"``: GKD's generalised JSD (Agarwal et al. 2024, arXiv:2306.13649; TRL's
        ``GKDTrainer``), ``loss += coef · agg(JSD_β)`` over the trained tokens, aggregated
        like the policy loss (``losses.distillation.top_k_generalized_jsd`` of the student's
        and the teacher's log-probs of the teacher's top-``k`` tokens, renormalised there);
        needs a teacher (``teacher.path``). ``None``: no such term (flat name
        ``distill_loss``).
      jsd_beta: ``β`` in ``[0, 1]`` (0: forward ``KL(teacher ‖ student)``, 1: reverse
        ``KL(student ‖ teacher)``; TRL's ``beta``, default 0.5).
      top_k: ``k``, the teacher's most likely tokens the JSD is restricted to (both
        distributions renormalised over them); ``None``: the whole vocabulary (the teacher's
        ``[B, T, V]`` log-probs ride in the batch; ``distill_top_k``).
      coef: the weight of the term (config ``teacher.coef``; ``distill_loss_coef``).
    """

    loss: str | None = None
    jsd_beta: float = 0.5
    top_k: int | None = None
    coef: float = 1.0

    def __post_init__(self):
        _checks.check_choice("distill_loss", self.loss, (None, *DISTILL_LOSSES))
        beta = self.jsd_beta
        if isinstance(beta, bool) or not isinstance(beta, int | float) or not 0 <= beta <= 1:
            raise ValueError(f"jsd_beta must be in [0, 1], got {beta!r}")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(
                f"distill_top_k must be an int >= 1 (the teacher's most likely tokens) or None "
                f"(the whole vocabulary), got {k!r}"
            )
        _checks.check_non_negative("distill_loss_coef", self.coef)


def typed_params(kind: str, name: str, declared: type | None, value: Any) -> Any:
    """A registered function's hyper-parameters as its declared type.

    Args:
      kind: ``"surrogate"`` or ``"estimator"`` (for messages).
      name: the registered name.
      declared: the frozen dataclass it was registered with (``params=``), or None.
      value: ``None``, an instance of ``declared``, or a mapping of its fields.

    Returns:
      ``None`` when nothing is declared and nothing given; else an instance of ``declared``
      (its defaults when ``value`` is None).

    Raises:
      ValueError: parameters for a function that declares none, unknown field names, or a
        value of another type.
    """
    if declared is None:
        if value is None or value == {}:
            return None
        raise ValueError(
            f"{kind} {name!r} declares no parameters (register it with params=...), got {value!r}"
        )
    if value is None:
        value = {}
    if isinstance(value, declared):
        return value
    if not isinstance(value, dict):
        raise ValueError(
            f"{kind} {name!r} takes {declared.__name__} parameters (or a mapping of its "
            f"fields), got {value!r}"
        )
    fields = {f.name for f in dataclasses.fields(declared)}
    unknown = sorted(set(value) - fields)
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {unknown} of {kind} {name!r}; its {declared.__name__} "
            f"has {sorted(fields)}"
        )
    frozen = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
    return declared(**frozen)


def check_params_type(kind: str, declared: Any) -> None:
    """A registration's ``params`` must be a frozen dataclass type (hashable: jit-static)."""
    if declared is None:
        return
    params = getattr(declared, "__dataclass_params__", None)
    if not isinstance(declared, type) or params is None or not params.frozen:
        raise ValueError(
            f"a {kind}'s params must be a frozen dataclass type "
            f"(@dataclasses.dataclass(frozen=True)), got {declared!r}"
        )
