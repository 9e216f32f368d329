"""The Bradley-Terry reward-model loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.nn import log_sigmoid

from jaxrl_llm._checks import check_non_negative, check_rank, check_same_shape, f32

Array = jax.Array


def bradley_terry(
    chosen_scores: Array,
    rejected_scores: Array,
    *,
    margins: Array | None = None,
    center_rewards_coefficient: float = 0.0,
) -> Array:
    """Per-pair reward-model loss ``ℓ = −logσ(r_w − r_l − m) + c·(r_w + r_l)²``.

    The Bradley-Terry model of preferences (Bradley & Terry 1952) as a reward-model loss
    (Ouyang et al. 2022, InstructGPT); ``m`` is a per-pair margin (Llama 2, Touvron et al.
    2023) and ``c`` the reward-centring coefficient (Eisenstein et al. 2023). The mean over
    pairs equals TRL RewardTrainer's loss,
    ``−mean(logσ(r_w − r_l − m)) + c·mean((r_w + r_l)²)``.

    Args:
      chosen_scores: ``[N]`` rewards ``r_w`` of the chosen completions.
      rejected_scores: ``[N]`` rewards ``r_l`` of the rejected completions.
      margins: ``[N]`` margins ``m`` (default 0).
      center_rewards_coefficient: ``c ≥ 0``.

    Returns:
      ``[N]`` float32 per-pair losses.

    Raises:
      ValueError: on mismatched shapes or ``c < 0``.
    """
    check_non_negative("center_rewards_coefficient", center_rewards_coefficient)
    check_rank("chosen_scores", chosen_scores, 1)
    check_same_shape(chosen_scores=chosen_scores, rejected_scores=rejected_scores, margins=margins)
    rw, rl = f32(chosen_scores), f32(rejected_scores)
    m = 0.0 if margins is None else f32(margins)
    loss = -log_sigmoid(rw - rl - m)
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * jnp.square(rw + rl)
    return loss
