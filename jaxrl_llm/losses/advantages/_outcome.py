"""Outcome estimators: one advantage per completion (``[B]``) from its scalar reward.

GRPO (and Dr.GRPO), RLOO, ReMax, OPO, GPG and pass@k, each a baseline (and a scale) over the
rewards of the completion's group. A group whose rewards are all equal gets exactly 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm._checks import (
    as_mask,
    check_choice,
    check_non_negative,
    check_rank,
    check_same_shape,
    f32,
)
from jaxrl_llm.losses.advantages._groups import (
    center,
    check_row_mask,
    group_view,
    is_constant,
    rewards_groups,
)

Array = jax.Array

_GRPO_SCALES = ("group", "batch", "none")


def _safe_std(centered: Array, *, axis: int | None, ddof: int) -> Array:
    """Standard deviation from centered values with a finite gradient at zero spread.

    ``sqrt`` has an infinite derivative at 0, which turns into NaN even behind a ``where``;
    the variance is replaced by 1 inside the ``sqrt`` where it is 0 and the result set to 0.
    The divisor is ``max(n - ddof, 1)``: with a single value the spread is 0 anyway.
    """
    count = centered.size if axis is None else centered.shape[axis]
    var = jnp.sum(jnp.square(centered), axis=axis, keepdims=axis is not None)
    var = var / max(count - ddof, 1)
    positive = var > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, var, 1.0)), 0.0)


def _safe_divide(numerator: Array, denominator: Array) -> Array:
    """``numerator / denominator`` with 0 where the denominator is 0 (only with ``eps=0``)."""
    nonzero = denominator != 0
    return jnp.where(nonzero, numerator / jnp.where(nonzero, denominator, 1.0), 0.0)


def _scale_by_std(x: Array, groups: Array, *, scale: str, ddof: int, eps: float) -> Array:
    """Divides ``[N, k]`` values by ``sigma + eps``: group std (``[N, 1]``), batch std or 1."""
    if scale == "none":
        return x
    if scale == "group":
        sigma = _safe_std(center(groups), axis=1, ddof=ddof)
    else:
        flat = groups.reshape(-1)
        centered = jnp.where(jnp.max(flat) == jnp.min(flat), 0.0, flat - jnp.mean(flat))
        sigma = _safe_std(centered, axis=None, ddof=ddof)
    return _safe_divide(x, sigma + eps)


def grpo(
    rewards: Array,
    *,
    group_size: int,
    scale: str = "group",
    std_ddof: int = 1,
    eps: float = 1e-6,
) -> Array:
    """Group-relative advantage: ``A_i = (r_i - mu_g) / (sigma + eps)``.

    ``scale="group"``: ``sigma = sigma_g`` (GRPO, Shao et al. 2024, "DeepSeekMath",
    arXiv:2402.03300); ``scale="batch"``: ``sigma = sigma_batch``, the std of all rewards
    of the batch (as TRL's ``scale_rewards="batch"``); ``scale="none"``: ``A_i = r_i - mu_g``
    (Dr.GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783).
    ``sigma`` uses ``std_ddof`` (1 = unbiased as verl/TRL, 0 = population form of the
    GRPO paper). ``G = 1`` and constant groups give exactly 0.

    Args:
      rewards: ``[B]`` one scalar per completion (any real or int dtype).
      group_size: ``G``, completions per prompt; must divide ``B``.
      scale: ``"group"`` | ``"batch"`` | ``"none"``.
      std_ddof: 0 or 1, the delta degrees of freedom of ``sigma``.
      eps: ``>= 0`` added to ``sigma``.

    Returns:
      ``[B]`` f32 advantages.

    Raises:
      ValueError: on a non-``[B]`` input, a group size not dividing ``B``, an unknown
        ``scale`` or ``std_ddof``, or a negative ``eps``.
    """
    check_choice("scale", scale, _GRPO_SCALES)
    check_choice("std_ddof", std_ddof, (0, 1))
    check_non_negative("eps", eps)
    groups = rewards_groups(rewards, group_size)
    centered = center(groups)
    return _scale_by_std(centered, groups, scale=scale, ddof=std_ddof, eps=eps).reshape(-1)


def rloo(rewards: Array, *, group_size: int) -> Array:
    """REINFORCE leave-one-out: ``A_i = r_i - mean_{j != i} r_j = (G r_i - sum_g r) / (G - 1)``.

    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
    Learning from Human Feedback in LLMs", arXiv:2402.14740 (Kool et al. 2019). Computed as
    ``G / (G - 1) * (r_i - mu_g)``, the same quantity with less cancellation. ``G = 1`` and
    constant groups give exactly 0.

    Args:
      rewards: ``[B]`` one scalar per completion.
      group_size: ``G``, must divide ``B``.

    Returns:
      ``[B]`` f32 advantages.

    Raises:
      ValueError: on a non-``[B]`` input or a group size not dividing ``B``.
    """
    groups = rewards_groups(rewards, group_size)
    if group_size == 1:
        return jnp.zeros_like(groups).reshape(-1)
    return (center(groups) * (group_size / (group_size - 1))).reshape(-1)


def remax(rewards: Array, baseline_rewards: Array) -> Array:
    """ReMax: ``A_i = r_i - b_i``, ``b_i`` the reward of the greedy completion of prompt ``i``.

    Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method
    for Aligning Large Language Models", arXiv:2310.10505.

    Args:
      rewards: ``[B]`` rewards of the sampled completions.
      baseline_rewards: ``[B]`` rewards of the greedy completions, one per row (repeat a
        per-prompt baseline over its group).

    Returns:
      ``[B]`` f32 advantages.

    Raises:
      ValueError: unless both are ``[B]`` of the same shape.
    """
    check_rank("rewards", rewards, 1)
    check_rank("baseline_rewards", baseline_rewards, 1)
    check_same_shape(rewards=rewards, baseline_rewards=baseline_rewards)
    return f32(rewards) - f32(baseline_rewards)


def opo(rewards: Array, mask: Array, *, group_size: int) -> Array:
    """OPO length-weighted baseline: ``A_i = r_i - sum_j L_j r_j / sum_j L_j`` within group.

    ``L_j = sum_t m_{j,t}`` is the completion length. Hao et al. 2025, "On-Policy RL with
    Optimal Reward Baseline", arXiv:2505.23585. A group whose rows are all empty
    (``sum_j L_j = 0``) falls back to equal weights, the limit of equal lengths, so its
    baseline is still a reward of the group; constant groups give exactly 0.

    Args:
      rewards: ``[B]`` one scalar per completion.
      mask: ``[B, T]`` bool or f32 completion mask (lengths are its row sums).
      group_size: ``G``, must divide ``B``.

    Returns:
      ``[B]`` f32 advantages.

    Raises:
      ValueError: on wrong ranks, a mask whose ``B`` differs, or a bad group size.
    """
    check_row_mask(rewards, mask)
    groups = rewards_groups(rewards, group_size)
    lengths = group_view(jnp.sum(as_mask(mask), axis=1), group_size)
    total = jnp.sum(lengths, axis=1, keepdims=True)
    weights = jnp.where(total > 0, lengths, 1.0)
    baseline = jnp.sum(weights * groups, axis=1, keepdims=True) / jnp.sum(
        weights, axis=1, keepdims=True
    )
    advantages = jnp.where(is_constant(groups), 0.0, groups - baseline)
    return advantages.reshape(-1)


def gpg(rewards: Array, *, group_size: int) -> Array:
    """GPG: ``A_i = alpha (r_i - mu_g)``, ``alpha = B / max(#rows of non-constant groups, 1)``.

    Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning", arXiv:2504.02546. ``alpha`` undoes the dilution of the batch mean by rows
    whose group has zero advantage. Constant groups (and ``G = 1``) give exactly 0.

    Args:
      rewards: ``[B]`` one scalar per completion.
      group_size: ``G``, must divide ``B``.

    Returns:
      ``[B]`` f32 advantages.

    Raises:
      ValueError: on a non-``[B]`` input or a group size not dividing ``B``.
    """
    groups = rewards_groups(rewards, group_size)
    informative_rows = jnp.sum(~is_constant(groups)) * group_size
    alpha = groups.size / jnp.maximum(informative_rows, 1).astype(jnp.float32)
    return (alpha * center(groups)).reshape(-1)


def pass_at_k(
    rewards: Array,
    *,
    group_size: int,
    scale: str = "group",
    eps: float = 1e-6,
) -> Array:
    """Pass@k advantage: the best row of each group gets ``r_max - r_second``, others 0.

    ``scale="group"`` divides by ``sigma_g + eps`` (unbiased group std, as verl's
    ``grpo_passk``); ``"batch"`` by the unbiased std of all rewards plus ``eps``; ``"none"``
    leaves the gap unscaled. Tang et al. 2025, "Optimizing Language Models for Inference
    Time Objectives using Reinforcement Learning", arXiv:2503.19595.

    Ties: the first row holding the maximum is the best row; when the maximum is shared,
    ``r_second = r_max``, so every row of the group gets exactly 0 whichever row is "best".

    Args:
      rewards: ``[B]`` one scalar per completion.
      group_size: ``G >= 2``, must divide ``B``.
      scale: ``"group"`` | ``"batch"`` | ``"none"``.
      eps: ``>= 0`` added to the std.

    Returns:
      ``[B]`` f32 advantages, at most one non-zero per group.

    Raises:
      ValueError: if ``G < 2``, on a non-``[B]`` input, a group size not dividing ``B``,
        an unknown ``scale`` or a negative ``eps``.
    """
    check_choice("scale", scale, _GRPO_SCALES)
    check_non_negative("eps", eps)
    groups = rewards_groups(rewards, group_size)
    if group_size < 2:
        raise ValueError(f"pass_at_k needs group_size >= 2 (a best and a second), got {group_size}")
    top2 = jax.lax.top_k(groups, 2)[0]
    # Zeroed rather than trusted to be 0 so that constant groups also get no gradient
    # (the gap over sigma + eps would otherwise pass 1 / eps to the two top rows).
    gap = jnp.where(is_constant(groups), 0.0, top2[:, :1] - top2[:, 1:])
    gap = _scale_by_std(gap, groups, scale=scale, ddof=1, eps=eps)
    best = jax.nn.one_hot(jnp.argmax(groups, axis=1), group_size, dtype=jnp.bool_)
    return jnp.where(best, gap, 0.0).reshape(-1)
