"""Objective presets: GRPO, DAPO, Dr.GRPO, GSPO, CISPO, ... as compositions of loss pieces.

An :class:`Objective` is composed of pieces (:mod:`.pieces`: :class:`Advantage`,
:class:`Ratio`, :class:`Surrogate`, :class:`KLPenalty`, :class:`Entropy`,
:class:`Aggregation`, :class:`TokenSelection`, :class:`ValueLoss`, :class:`Distill`, and the
rollout correction), each owning its hyper-parameters, the way optax's aliases are compositions
of transforms. The presets in :data:`PRESETS` are rows of shared/SPEC_LOSSES.md's table; any
composition is equally valid (``make("grpo", surrogate="cispo", clip_low=None,
clip_high=4.0)``, or ``make("grpo", kl=KLPenalty("k1", 0.01))``).

The estimator, ratio and surrogate are registries kept as data, open to user entries without
editing the library; a registered function receives its own piece:
:func:`register_surrogate` (``fn(surrogate, SurrogateInputs) -> (loss, metrics)``),
:func:`register_estimator` (``fn(advantage, AdvantageInputs) -> (advantages, returns)``)
and :func:`register_ratio` (``fn(ratio, lp, old_lp, mask)``); :data:`SURROGATES`,
:data:`ADVANTAGES` (alias :data:`ESTIMATORS`) and :data:`RATIOS` are live read-only views of
them. A user function declares its own typed hyper-parameters (``register_surrogate("mine",
fn, params=MineParams)``, a frozen dataclass) and reads ``surrogate.params``; they are set with
``make("grpo", surrogate="mine", surrogate_params={"alpha": 0.5})``.

Configs stop at the jit boundary: an ``Objective`` is hashable and is closed over (or passed
as a static argument); only arrays flow through the traced math. Register user pieces before
building jitted steps: a compiled step keeps the function it was traced with.

Metrics are normalised with the same global counts as the loss (``batch.num_tokens`` /
``batch.num_seqs``), so summing the metrics of K micro-batches gives the full-batch metric,
except keys ending in ``_min`` / ``_max``, which reduce by min / max.

Modules: :mod:`.pieces` (the pieces), :mod:`.objective` (``Objective``, presets, ``make``),
:mod:`.registry` (the generic registry), :mod:`.surrogate_registry`,
:mod:`.estimator_registry`, :mod:`.policy` (``policy_loss``), :mod:`.estimation`
(``compute_advantages``, ``advantage_fn``), :mod:`.terms` (``value_loss``, ``sft_loss``,
``combine``) and :mod:`.entropy_control` (the adaptive entropy coefficient's state and update).
The pure functions they compose are in :mod:`jaxrl_llm.losses`.
"""

# `objectives.advantages` has always been jaxrl_llm.losses.advantages (tests/train use it).
from jaxrl_llm.losses import advantages
from jaxrl_llm.objectives import entropy_control
from jaxrl_llm.objectives.entropy_control import EntropyControl
from jaxrl_llm.objectives.estimation import advantage_fn, compute_advantages
from jaxrl_llm.objectives.estimator_registry import (
    ESTIMATORS,
    OPTIONAL_INPUTS,
    AdvantageInputs,
    EstimatorSpec,
    estimators_available,
    outcome_token_rewards,
    register_estimator,
    unregister_estimator,
)
from jaxrl_llm.objectives.objective import (
    FLAT_NAMES,
    KL_PLACEMENTS,
    PRESETS,
    Objective,
    available,
    make,
)
from jaxrl_llm.objectives.pieces import (
    Advantage,
    Aggregation,
    Distill,
    Entropy,
    KLPenalty,
    Ratio,
    Surrogate,
    TokenSelection,
    ValueLoss,
)
from jaxrl_llm.objectives.policy import policy_loss
from jaxrl_llm.objectives.surrogate_registry import (
    RATIOS,
    SURROGATES,
    SurrogateInputs,
    SurrogateSpec,
    ratios_available,
    register_ratio,
    register_surrogate,
    surrogates_available,
    unregister_ratio,
    unregister_surrogate,
)
from jaxrl_llm.objectives.terms import combine, sft_loss, value_loss

ADVANTAGES = ESTIMATORS

__all__ = [
    "ADVANTAGES",
    "ESTIMATORS",
    "FLAT_NAMES",
    "KL_PLACEMENTS",
    "OPTIONAL_INPUTS",
    "PRESETS",
    "RATIOS",
    "SURROGATES",
    "Advantage",
    "AdvantageInputs",
    "Aggregation",
    "Distill",
    "Entropy",
    "KLPenalty",
    "Ratio",
    "Surrogate",
    "TokenSelection",
    "ValueLoss",
    "EntropyControl",
    "EstimatorSpec",
    "Objective",
    "SurrogateInputs",
    "SurrogateSpec",
    "advantage_fn",
    "advantages",
    "available",
    "combine",
    "compute_advantages",
    "entropy_control",
    "estimators_available",
    "make",
    "outcome_token_rewards",
    "pieces",
    "policy_loss",
    "ratios_available",
    "register_estimator",
    "register_ratio",
    "register_surrogate",
    "sft_loss",
    "surrogates_available",
    "unregister_estimator",
    "unregister_ratio",
    "unregister_surrogate",
    "value_loss",
]
