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

from jaxrl_llm.preference._dpo import LOSS_TYPES, check_dpo_settings, dpo
from jaxrl_llm.preference._kto import kto, kto_reference_point
from jaxrl_llm.preference._loss import PREFERENCE_LOSSES, preference_loss
from jaxrl_llm.preference._reference_free import cpo, log1mexp, orpo, orpo_log_odds, simpo
from jaxrl_llm.preference._sequence import (
    average_logps,
    check_label_smoothing,
    sequence_lengths,
    sequence_logps,
)

__all__ = [
    "LOSS_TYPES",
    "PREFERENCE_LOSSES",
    "average_logps",
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
]
