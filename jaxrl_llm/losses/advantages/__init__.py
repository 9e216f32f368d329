"""Advantage estimators for RL post-training of language models.

Every function is pure and jit-able, upcasts its inputs to f32 (int, bool and bf16 rewards
included), validates shapes at trace time, and follows ``shared/SPEC_LOSSES.md``.

Rows are prompts x group size with **contiguous groups**: rows ``g*G ... g*G+G-1`` answer
prompt ``g``. A group whose rewards are all equal gets advantage exactly 0 (never a rounding
residue, never NaN; ``reinforce_pp_baseline`` excepted, whose batch whitening shifts every
row), and masked positions of ``[B, T]`` outputs are exactly 0.

Hyper-parameters (``group_size``, ``scale``, ``gamma``, ...) are static Python values: pass
them through ``functools.partial`` or ``static_argnames`` when jitting.

Outcome estimators (one advantage per completion, ``[B]``) live in ``_outcome``, token-level
ones (``[B, T]``, whitened over the batch) in ``_token``, GDPO's several reward columns in
``_multi_reward``, on-policy distillation's teacher term in ``_teacher``, the group helpers in
``_groups``; every public name is exported here.
"""

from jaxrl_llm.losses.advantages._groups import group_view
from jaxrl_llm.losses.advantages._multi_reward import gdpo
from jaxrl_llm.losses.advantages._outcome import gpg, grpo, opo, pass_at_k, remax, rloo
from jaxrl_llm.losses.advantages._teacher import distillation
from jaxrl_llm.losses.advantages._token import gae, reinforce_pp, reinforce_pp_baseline, whiten

__all__ = [
    "distillation",
    "gae",
    "gdpo",
    "gpg",
    "group_view",
    "grpo",
    "opo",
    "pass_at_k",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "rloo",
    "whiten",
]
