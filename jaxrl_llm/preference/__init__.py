"""Offline preference losses: DPO and its variants, KTO, ORPO, CPO, SimPO, AlphaPO, and the
Bradley-Terry reward-model loss.

Notation (shared/SPEC_LOSSES.md): for a pair (chosen ``y_w``, rejected ``y_l``) with summed
completion log-probs, ``c = lp_θ(y_w) − lp_ref(y_w)``, ``ρ = lp_θ(y_l) − lp_ref(y_l)`` and
``Δ = c − ρ``. Every loss is per pair (``[N]``) and meant to be minimised; the math runs in
float32 whatever the input dtype, and ``jax.nn.log_sigmoid`` keeps values and gradients finite
for margins of any size. Hyper-parameters are static Python values (resolve configs before
``jax.jit``). The formulas follow TRL 1.16's trainers; each docstring states where they differ
(tests/preference/test_trl_conformance.py runs TRL's own loss code against them).

:func:`preference_loss` goes from what a model produces (per-token log-probs and masks) to a
scalar loss plus TRL-style metrics; the per-pair functions compose with anything else.
"""

from jaxrl_llm.preference._dpo import BATCH_COUPLED, LOSS_TYPES, check_dpo_settings, dpo
from jaxrl_llm.preference._kto import kto, kto_reference_point
from jaxrl_llm.preference._loss import ORPO_NLL_MODES, PREFERENCE_LOSSES, preference_loss
from jaxrl_llm.preference._reference_free import (
    CPO_LOSS_TYPES,
    alphapo,
    alphapo_reward,
    cpo,
    log1mexp,
    orpo,
    orpo_log_odds,
    simpo,
)
from jaxrl_llm.preference._reward_model import bradley_terry
from jaxrl_llm.preference._sequence import (
    average_logps,
    check_label_smoothing,
    sequence_lengths,
    sequence_logps,
    token_mean_nll,
)

__all__ = [
    "BATCH_COUPLED",
    "CPO_LOSS_TYPES",
    "LOSS_TYPES",
    "ORPO_NLL_MODES",
    "PREFERENCE_LOSSES",
    "alphapo",
    "alphapo_reward",
    "average_logps",
    "bradley_terry",
    "check_dpo_settings",
    "check_label_smoothing",
    "cpo",
    "dpo",
    "kto",
    "kto_reference_point",
    "log1mexp",
    "orpo",
    "orpo_log_odds",
    "preference_loss",
    "sequence_lengths",
    "sequence_logps",
    "simpo",
    "token_mean_nll",
]
