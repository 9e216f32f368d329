"""The :class:`Objective`: a policy objective composed of pieces, and the presets of
shared/SPEC_LOSSES.md written as compositions.

An :class:`Objective` names which pieces make up the loss — the advantage estimator, the
importance ratio, the surrogate, the KL term, the entropy bonus, the aggregation, the token
selection, the rollout correction, the critic's loss and a distillation term
(:mod:`~jaxrl_llm.objectives.pieces`) — the way optax's aliases are compositions of
transforms. Each piece owns its hyper-parameters and their checks; the objective checks what
spans pieces (a surrogate's accepted ratios and lower bound, a registered function's declared
parameters). Presets are compositions::

    Objective(name="grpo", kl=KLPenalty("k3", 0.04), aggregation=Aggregation("seq-mean-token-mean"))

:func:`make` and :meth:`Objective.replace` also take the flat names configs use
(``make("grpo", surrogate="cispo", clip_low=None, clip_high=4.0)``; :data:`FLAT_NAMES` maps
each to its piece and field).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl_llm.losses import correction
from jaxrl_llm.objectives import estimator_registry, surrogate_registry
from jaxrl_llm.objectives.pieces import (
    ADVANTAGE_SCALES,
    DISTILL_LOSSES,
    KL_PLACEMENTS,
    Advantage,
    Aggregation,
    Distill,
    Entropy,
    KLPenalty,
    Ratio,
    Surrogate,
    TokenSelection,
    ValueLoss,
    typed_params,
)

__all__ = ["ADVANTAGE_SCALES", "DISTILL_LOSSES", "KL_PLACEMENTS", "Objective", "available", "make"]

# The pieces of an objective: field name -> piece type.
PIECES: dict[str, type] = {
    "advantage": Advantage,
    "ratio": Ratio,
    "surrogate": Surrogate,
    "kl": KLPenalty,
    "entropy": Entropy,
    "aggregation": Aggregation,
    "selection": TokenSelection,
    "value": ValueLoss,
    "distill": Distill,
}

# The flat names configs and ``make`` use -> (piece, field of the piece).
FLAT_NAMES: dict[str, tuple[str, str]] = {
    "advantage": ("advantage", "name"),
    "advantage_scale": ("advantage", "scale"),
    "std_ddof": ("advantage", "std_ddof"),
    "gamma": ("advantage", "gamma"),
    "lam": ("advantage", "lam"),
    "reward_weights": ("advantage", "reward_weights"),
    "distill_coef": ("advantage", "distill_coef"),
    "prime_beta": ("advantage", "prime_beta"),
    "dynamic_sampling": ("advantage", "dynamic_sampling"),
    "advantage_params": ("advantage", "params"),
    "ratio": ("ratio", "kind"),
    "ratio_clamp": ("ratio", "clamp"),
    "max_log_ratio": ("ratio", "max_log_ratio"),
    "surrogate": ("surrogate", "name"),
    "clip_low": ("surrogate", "clip_low"),
    "clip_high": ("surrogate", "clip_high"),
    "dual_clip": ("surrogate", "dual_clip"),
    "tau_pos": ("surrogate", "tau_pos"),
    "tau_neg": ("surrogate", "tau_neg"),
    "ratio_cap": ("surrogate", "ratio_cap"),
    "cov_fraction": ("surrogate", "cov_fraction"),
    "cov_bounds": ("surrogate", "cov_bounds"),
    "kl_cov_coef": ("surrogate", "kl_cov_coef"),
    "surrogate_params": ("surrogate", "params"),
    "kl_kind": ("kl", "kind"),
    "kl_coef": ("kl", "coef"),
    "kl_placement": ("kl", "placement"),
    "kl_straight_through": ("kl", "straight_through"),
    "kl_bias_correction": ("kl", "bias_correction"),
    "entropy_coef": ("entropy", "coef"),
    "entropy_target": ("entropy", "target"),
    "entropy_coef_delta": ("entropy", "coef_delta"),
    "entropy_coef_bounds": ("entropy", "coef_bounds"),
    "aggregation": ("aggregation", "mode"),
    "norm_constant": ("aggregation", "norm_constant"),
    "top_entropy_quantile": ("selection", "top_entropy_quantile"),
    "off_policy_mask_threshold": ("selection", "off_policy_mask_threshold"),
    "m2_threshold": ("selection", "m2_threshold"),
    "value_clip": ("value", "clip"),
    "value_coef": ("value", "coef"),
    "distill_loss": ("distill", "loss"),
    "jsd_beta": ("distill", "jsd_beta"),
    "distill_top_k": ("distill", "top_k"),
    "distill_loss_coef": ("distill", "coef"),
}


@dataclasses.dataclass(frozen=True)
class Objective:
    """Which loss pieces make up a policy objective; each piece owns its hyper-parameters.

    Attributes:
      name: preset name (informational).
      advantage: the advantage estimator (:class:`~.pieces.Advantage`).
      ratio: the importance ratio (:class:`~.pieces.Ratio`).
      surrogate: the policy surrogate and its bounds (:class:`~.pieces.Surrogate`).
      kl: the KL term to the reference (:class:`~.pieces.KLPenalty`).
      entropy: the entropy bonus, fixed or adaptive (:class:`~.pieces.Entropy`).
      aggregation: how per-token losses become the scalar (:class:`~.pieces.Aggregation`).
      selection: which tokens the policy loss trains on (:class:`~.pieces.TokenSelection`).
      correction: ``losses.correction.Correction`` (a mapping of its fields is accepted) or
        None: IS weights / rejection of the sampler-trainer mismatch, from
        ``batch.rollout_logprobs`` (flat name ``rollout_correction``).
      value: PPO's critic loss (:class:`~.pieces.ValueLoss`).
      distill: a divergence to a teacher added to the loss (:class:`~.pieces.Distill`).

    A piece may be given as a mapping of its fields (YAML). User estimators and surrogates
    registered with ``params=`` get their parameters converted to that type here.
    """

    name: str = "custom"
    advantage: Advantage = Advantage()
    ratio: Ratio = Ratio()
    surrogate: Surrogate = Surrogate()
    kl: KLPenalty = KLPenalty()
    entropy: Entropy = Entropy()
    aggregation: Aggregation = Aggregation()
    selection: TokenSelection = TokenSelection()
    correction: correction.Correction | None = None
    value: ValueLoss = ValueLoss()
    distill: Distill = Distill()

    def __post_init__(self):
        # Frozen: the normalisations go through object.__setattr__.
        for field, piece_type in PIECES.items():
            piece = getattr(self, field)
            if isinstance(piece, dict):
                object.__setattr__(self, field, piece_type(**piece))
            elif not isinstance(piece, piece_type):
                raise ValueError(
                    f"Objective.{field} must be a {piece_type.__name__} (or a mapping of its "
                    f"fields), got {piece!r}"
                )
        object.__setattr__(self, "correction", correction.Correction.of(self.correction))
        self._check_registered()

    def _check_registered(self) -> None:
        """The checks that span pieces or read the registries."""
        estimator = estimator_registry.estimator_spec(self.advantage.name)
        surrogate = surrogate_registry.surrogate_spec(self.surrogate.name)
        surrogate_registry.ratio_fn(self.ratio.kind)
        object.__setattr__(
            self,
            "advantage",
            dataclasses.replace(
                self.advantage,
                params=typed_params(
                    "estimator", self.advantage.name, estimator.params, self.advantage.params
                ),
            ),
        )
        object.__setattr__(
            self,
            "surrogate",
            dataclasses.replace(
                self.surrogate,
                params=typed_params(
                    "surrogate", self.surrogate.name, surrogate.params, self.surrogate.params
                ),
            ),
        )
        if self.surrogate.clip_low is None and not surrogate.clip_low_optional:
            takes_none = [
                name
                for name, spec in surrogate_registry.SURROGATES.items()
                if spec.clip_low_optional
            ]
            raise ValueError(
                f"clip_low=None (no lower bound) is not valid for surrogate "
                f"{self.surrogate.name!r}; surrogates that take it: {takes_none}"
            )
        if surrogate.ratios is not None and self.ratio.kind not in surrogate.ratios:
            raise ValueError(
                f"surrogate {self.surrogate.name!r} takes no {self.ratio.kind!r} ratio; "
                f"it takes {surrogate.ratios}"
            )
        if "reward_columns" in estimator.requires and self.kl.in_reward and self.kl.coef > 0:
            raise ValueError(
                f"the {self.advantage.name} estimator normalises each reward column: a KL "
                "penalty in the reward has no column; use kl_placement='loss'"
            )

    def replace(self, **changes: Any) -> Objective:
        """A copy with pieces or flat names (:data:`FLAT_NAMES`) changed, validated again.

        ``replace(clip_high=0.28, kl=KLPenalty("k3", 0.01))``: a piece replaces the whole piece
        (or, as a mapping, updates the named fields of it); a flat name sets one field. A
        field named both ways is refused.

        Raises:
          ValueError: an unknown name (listing the valid ones) or an invalid value.
        """
        pieces: dict[str, Any] = {}
        fields: dict[str, dict[str, Any]] = {}
        top: dict[str, Any] = {}
        for key, value in changes.items():
            if key in PIECES and not isinstance(value, str | bool | type(None)):
                if isinstance(value, dict):
                    fields.setdefault(key, {}).update(value)
                else:
                    pieces[key] = value
            elif key in FLAT_NAMES:
                piece, field = FLAT_NAMES[key]
                if field in fields.get(piece, {}):
                    raise ValueError(f"{key} is set twice (flat and in {piece})")
                fields.setdefault(piece, {})[field] = value
            elif key in ("name", "correction", "rollout_correction"):
                top["correction" if key == "rollout_correction" else key] = value
            elif key == "extra":
                raise ValueError(
                    "extra is gone: a user estimator or surrogate declares its parameters "
                    "(register_surrogate(..., params=MyParams)) and takes them as "
                    "surrogate_params / advantage_params"
                )
            else:
                valid = sorted({*FLAT_NAMES, *PIECES, "name", "rollout_correction"})
                raise ValueError(f"unknown Objective field(s) {[key]}; valid fields: {valid}")
        for piece, updates in fields.items():
            base = pieces.pop(piece, getattr(self, piece))
            unknown = sorted(set(updates) - {f.name for f in dataclasses.fields(base)})
            if unknown:
                raise ValueError(f"unknown {piece} field(s) {unknown}")
            pieces[piece] = dataclasses.replace(base, **updates)
        return dataclasses.replace(self, **pieces, **top)

    def value_of(self, flat_name: str) -> Any:
        """The value a flat config name reads (``value_of("kl_coef")`` is ``self.kl.coef``).

        Raises:
          ValueError: ``flat_name`` is none of :data:`FLAT_NAMES` (``rollout_correction``
            reads :attr:`correction`).
        """
        if flat_name == "rollout_correction":
            return self.correction
        if flat_name not in FLAT_NAMES:
            raise ValueError(f"unknown Objective field {flat_name!r}; valid: {sorted(FLAT_NAMES)}")
        piece, field = FLAT_NAMES[flat_name]
        return getattr(getattr(self, piece), field)

    @property
    def needs_teacher(self) -> bool:
        """Whether a distillation teacher must score the rollout batch: an estimator that
        takes its log-probs (``distill``, ``grpo_distill``) or a distillation loss."""
        return "teacher_logprobs" in self.estimator_requires or self.distill.loss is not None

    @property
    def needs_reference(self) -> bool:
        """Whether a reference policy's log-probs are needed (no KL term: no reference model)."""
        estimator = estimator_registry.estimator_spec(self.advantage.name)
        return self.kl.active or estimator.needs_reference

    @property
    def needs_entropy(self) -> bool:
        """Whether ``policy_loss`` needs the per-token entropy (bonus, adaptive coefficient or
        top-entropy mask)."""
        return (
            self.entropy.coef > 0
            or self.entropy.adaptive
            or self.selection.top_entropy_quantile < 1.0
        )

    @property
    def needs_reward_columns(self) -> bool:
        """Whether the estimator needs one reward column per reward function (GDPO)."""
        return "reward_columns" in self.estimator_requires

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether the behaviour policy's log-probs enter the loss (all but REINFORCE/GPG)."""
        return surrogate_registry.surrogate_spec(self.surrogate.name).needs_old_logprobs

    @property
    def estimator_requires(self) -> tuple[str, ...]:
        """The optional estimator inputs the advantage estimator cannot do without."""
        return estimator_registry.estimator_spec(self.advantage.name).requires

    @property
    def min_group_size(self) -> int:
        """The smallest rollout group size the advantage estimator accepts."""
        return estimator_registry.estimator_spec(self.advantage.name).min_group_size

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
            kl=KLPenalty(kind="k3", coef=0.04),
            aggregation=Aggregation("seq-mean-token-mean"),
        ),
        Objective(
            name="dapo",
            advantage=Advantage(dynamic_sampling=True),
            surrogate=Surrogate(clip_high=0.28),
        ),
        Objective(
            name="dr_grpo",
            advantage=Advantage(scale="none"),
            aggregation=Aggregation("seq-mean-token-sum-norm"),
        ),
        Objective(
            name="gspo",
            ratio=Ratio("gspo_token"),
            surrogate=Surrogate(clip_low=3e-4, clip_high=4e-4),
            aggregation=Aggregation("seq-mean-token-mean"),
        ),
        Objective(
            name="gspo_token",
            ratio=Ratio("gspo_token"),
            surrogate=Surrogate(clip_low=3e-4, clip_high=4e-4),
            aggregation=Aggregation("seq-mean-token-mean"),
        ),
        Objective(name="cispo", surrogate=Surrogate("cispo", clip_low=None, clip_high=4.0)),
        Objective(
            name="gmpo",
            surrogate=Surrogate("gmpo", clip_low=0.4, clip_high=0.4),
            aggregation=Aggregation("seq-mean-token-mean"),
        ),
        Objective(
            name="sapo",
            surrogate=Surrogate("sapo"),
            aggregation=Aggregation("seq-mean-token-mean"),
        ),
        Objective(name="rloo", advantage=Advantage("rloo")),
        Objective(
            name="reinforce_pp",
            advantage=Advantage("reinforce_pp"),
            kl=KLPenalty(kind="k1", coef=0.01, placement="reward"),
        ),
        Objective(name="gpg", advantage=Advantage("gpg"), surrogate=Surrogate("reinforce")),
        Objective(
            name="ppo",
            advantage=Advantage("gae"),
            surrogate=Surrogate(dual_clip=3.0),
            kl=KLPenalty(kind="k1", coef=0.05, placement="reward"),
        ),
        Objective(name="prime", advantage=Advantage("prime")),
        # On-policy distillation: the student's own samples, the teacher's per-token reverse
        # KL as the advantage (needs a teacher: ``teacher.path``).
        Objective(name="distill", advantage=Advantage("distill")),
        # GKD (Agarwal et al. 2024) on the student's own samples: no advantage, the loss is
        # the generalised JSD (β = 0.5, TRL's default) to the teacher at every completion token.
        Objective(
            name="distill_gkd",
            advantage=Advantage("none"),
            distill=Distill(loss="jsd", jsd_beta=0.5),
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
      **overrides: pieces (``kl=KLPenalty(...)``, or a mapping of some of its fields) or flat
        names (:data:`FLAT_NAMES`: ``clip_high=0.28``, ``surrogate="cispo"``,
        ``surrogate_params={"alpha": 0.5}`` for a user surrogate's declared parameters).

    Returns:
      The validated objective.

    Raises:
      ValueError: unknown preset or field, or an invalid combination.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown objective {name!r}; available: {available()}")
    return PRESETS[name].replace(**overrides)
