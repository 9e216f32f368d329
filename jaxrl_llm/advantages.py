"""Advantage estimators for RL post-training of language models.

Every function is pure and jit-able, upcasts its inputs to f32 (int, bool and bf16 rewards
included), validates shapes at trace time, and follows ``shared/SPEC_LOSSES.md``.

Rows are prompts x group size with **contiguous groups**: rows ``g*G ... g*G+G-1`` answer
prompt ``g``. A group whose rewards are all equal gets advantage exactly 0 (never a rounding
residue, never NaN; ``reinforce_pp_baseline`` excepted, whose batch whitening shifts every
row), and masked positions of ``[B, T]`` outputs are exactly 0.

Hyper-parameters (``group_size``, ``scale``, ``gamma``, ...) are static Python values: pass
them through ``functools.partial`` or ``static_argnames`` when jitting.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm._checks import (
    as_mask,
    check_batch_time,
    check_choice,
    check_group_size,
    check_non_negative,
    check_rank,
    check_same_shape,
    f32,
)

Array = jax.Array

_GRPO_SCALES = ("group", "batch", "none")
_WHITEN_EPS = 1e-8


# --------------------------------------------------------------------------------------
# Group helpers
# --------------------------------------------------------------------------------------


def group_view(x: Array, group_size: int) -> Array:
    """Reshapes per-row values ``[B, ...]`` into groups ``[B / G, G, ...]``.

    Groups are contiguous rows (``g*G ... g*G+G-1``), so this is a plain reshape.

    Args:
      x: ``[B, ...]`` array, rows = prompts x group size.
      group_size: ``G``, a positive int dividing ``B``.

    Returns:
      ``[B / G, G, ...]`` view of ``x`` (dtype unchanged).

    Raises:
      ValueError: if ``x`` is a scalar or ``group_size`` does not divide ``B``.
    """
    if jnp.ndim(x) < 1:
        raise ValueError(f"expected per-row values [B, ...], got shape {jnp.shape(x)}")
    batch = jnp.shape(x)[0]
    check_group_size(batch, group_size)
    return jnp.reshape(x, (batch // group_size, group_size) + tuple(jnp.shape(x)[1:]))


def _is_constant(groups: Array) -> Array:
    """``[N, G] -> [N, 1]`` bool: all rewards of the group are equal (``max == min``)."""
    return jnp.max(groups, axis=1, keepdims=True) == jnp.min(groups, axis=1, keepdims=True)


def _center(groups: Array) -> Array:
    """``[N, G] -> [N, G]``: ``r - mean_g``, exactly 0 for a constant group.

    ``sum / G`` of equal non-representable values can round away from them, so constant
    groups are detected with ``max == min`` and zeroed rather than trusted to cancel.
    """
    centered = groups - jnp.mean(groups, axis=1, keepdims=True)
    return jnp.where(_is_constant(groups), 0.0, centered)


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
        sigma = _safe_std(_center(groups), axis=1, ddof=ddof)
    else:
        flat = groups.reshape(-1)
        centered = jnp.where(jnp.max(flat) == jnp.min(flat), 0.0, flat - jnp.mean(flat))
        sigma = _safe_std(centered, axis=None, ddof=ddof)
    return _safe_divide(x, sigma + eps)


def _rewards_1d(rewards: Array, group_size: int) -> Array:
    """Validates ``[B]`` rewards and a group size dividing ``B``; returns f32 groups."""
    check_rank("rewards", rewards, 1)
    if jnp.shape(rewards)[0] == 0:
        raise ValueError("rewards must hold at least one row, got shape (0,)")
    return group_view(f32(rewards), group_size)


def _check_row_mask(rewards: Array, mask: Array) -> None:
    """Raises unless ``mask`` is ``[B, T]`` with ``B`` the length of ``rewards``."""
    check_rank("rewards", rewards, 1)
    check_rank("mask", mask, 2)
    if jnp.shape(mask)[0] != jnp.shape(rewards)[0]:
        raise ValueError(
            f"mask shape {tuple(jnp.shape(mask))} must be [B, T] with B = "
            f"{jnp.shape(rewards)[0]} from rewards shape {tuple(jnp.shape(rewards))}"
        )


# --------------------------------------------------------------------------------------
# Outcome (per-sequence) estimators
# --------------------------------------------------------------------------------------


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
    groups = _rewards_1d(rewards, group_size)
    centered = _center(groups)
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
    groups = _rewards_1d(rewards, group_size)
    if group_size == 1:
        return jnp.zeros_like(groups).reshape(-1)
    return (_center(groups) * (group_size / (group_size - 1))).reshape(-1)


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
    _check_row_mask(rewards, mask)
    groups = _rewards_1d(rewards, group_size)
    lengths = group_view(jnp.sum(as_mask(mask), axis=1), group_size)
    total = jnp.sum(lengths, axis=1, keepdims=True)
    weights = jnp.where(total > 0, lengths, 1.0)
    baseline = jnp.sum(weights * groups, axis=1, keepdims=True) / jnp.sum(
        weights, axis=1, keepdims=True
    )
    advantages = jnp.where(_is_constant(groups), 0.0, groups - baseline)
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
    groups = _rewards_1d(rewards, group_size)
    informative_rows = jnp.sum(~_is_constant(groups)) * group_size
    alpha = groups.size / jnp.maximum(informative_rows, 1).astype(jnp.float32)
    return (alpha * _center(groups)).reshape(-1)


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
    groups = _rewards_1d(rewards, group_size)
    if group_size < 2:
        raise ValueError(f"pass_at_k needs group_size >= 2 (a best and a second), got {group_size}")
    top2 = jax.lax.top_k(groups, 2)[0]
    # Zeroed rather than trusted to be 0 so that constant groups also get no gradient
    # (the gap over sigma + eps would otherwise pass 1 / eps to the two top rows).
    gap = jnp.where(_is_constant(groups), 0.0, top2[:, :1] - top2[:, 1:])
    gap = _scale_by_std(gap, groups, scale=scale, ddof=1, eps=eps)
    best = jax.nn.one_hot(jnp.argmax(groups, axis=1), group_size, dtype=jnp.bool_)
    return jnp.where(best, gap, 0.0).reshape(-1)


# --------------------------------------------------------------------------------------
# Token-level estimators
# --------------------------------------------------------------------------------------


def whiten(x: Array, mask: Array, *, shift_mean: bool = True) -> Array:
    """Masked whitening: ``(x - mu) * rsqrt(var + 1e-8)`` (``+ mu`` when ``shift_mean=False``).

    ``mu = sum x m / max(sum m, 1)`` and ``var = sum (x - mu)^2 m / (sum m - 1)`` (unbiased)
    over **all** valid entries, as verl's ``masked_whiten`` (used by PPO, Schulman et al.
    2017, arXiv:1707.06347, and REINFORCE++, Hu 2025, arXiv:2501.03262). With fewer than two
    valid entries there is no variance estimate and the scale is 1: the result is ``x - mu``
    (``x`` when ``shift_mean=False``).

    Masked positions return exactly 0, whatever ``x`` holds there (NaN padding included), and
    get no gradient; callers that need the raw value there can ``where`` it back.

    Args:
      x: values of any shape (typically ``[B, T]``).
      mask: bool or f32 0/1 mask of the shape of ``x``.
      shift_mean: ``False`` adds ``mu`` back after scaling.

    Returns:
      f32 array of the shape of ``x``.

    Raises:
      ValueError: if ``x`` and ``mask`` shapes differ.
    """
    check_same_shape(x=x, mask=mask)
    valid = as_mask(mask) != 0
    values = jnp.where(valid, f32(x), 0.0)
    count = jnp.sum(valid.astype(jnp.float32))
    mean = jnp.sum(values) / jnp.maximum(count, 1.0)
    centered = jnp.where(valid, values - mean, 0.0)
    var = jnp.sum(jnp.square(centered)) / jnp.maximum(count - 1.0, 1.0)
    inv_std = jnp.where(count >= 2, jax.lax.rsqrt(var + _WHITEN_EPS), 1.0)
    out = centered * inv_std
    if not shift_mean:
        out = out + mean
    return jnp.where(valid, out, 0.0)


def _reverse_masked_scan(step, carry, *xs: Array) -> Array:
    """Runs ``step(carry, x_t) -> (carry, out_t)`` for ``t = T-1 ... 0`` over ``[B, T]`` inputs.

    Time goes first for ``lax.scan``; outputs come back as ``[B, T]``.
    """
    _, outs = jax.lax.scan(step, carry, tuple(jnp.swapaxes(x, 0, 1) for x in xs), reverse=True)
    return jnp.swapaxes(outs, 0, 1)


def reinforce_pp(token_rewards: Array, mask: Array, *, gamma: float = 1.0) -> Array:
    """REINFORCE++: whitened discounted reward-to-go over the valid tokens of the batch.

    Scanning ``t = T-1 ... 0``: ``run = R_t + gamma * run`` where ``m_t = 1``, carried
    unchanged across masked positions (so mask holes are skipped, not reset);
    ``A_t = run * m_t``; result ``whiten(A, m) * m`` over all valid tokens of the batch.
    Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
    Models", arXiv:2501.03262.

    Args:
      token_rewards: ``[B, T]`` per-token rewards (outcome reward on the last valid token,
        minus any in-reward KL); masked positions are ignored.
      mask: ``[B, T]`` bool or f32 completion mask.
      gamma: discount ``>= 0``.

    Returns:
      ``[B, T]`` f32 advantages, exactly 0 at masked positions.

    Raises:
      ValueError: unless both are ``[B, T]`` of one shape, or on a negative ``gamma``.
    """
    check_batch_time("token_rewards", token_rewards, mask)
    check_non_negative("gamma", gamma)
    valid = as_mask(mask) != 0

    def step(run, inputs):
        reward_t, valid_t = inputs
        run = jnp.where(valid_t, reward_t + gamma * run, run)
        return run, jnp.where(valid_t, run, 0.0)

    init = jnp.zeros(jnp.shape(mask)[:1], jnp.float32)
    returns = _reverse_masked_scan(step, init, f32(token_rewards), valid)
    return whiten(returns, valid)


def reinforce_pp_baseline(rewards: Array, mask: Array, *, group_size: int) -> Array:
    """REINFORCE++ with group baseline: ``A0_i = r_i - mu_g`` broadcast over T, whitened.

    ``A = whiten(A0, m) * m`` over all valid tokens of the batch; with ``G = 1`` there is
    no group baseline and ``A0 = r``. Hu 2025, "REINFORCE++", arXiv:2501.03262 (the
    ``reinforce_plus_plus_baseline`` estimator of verl).

    ``A0`` is exactly 0 on a constant group, but the whitening then subtracts the
    length-weighted batch mean of ``A0`` (not 0 with ragged lengths), so such a group's
    final advantage is ``-mu / sigma_batch``, as the spec and verl define it.

    Args:
      rewards: ``[B]`` one scalar per completion.
      mask: ``[B, T]`` bool or f32 completion mask.
      group_size: ``G``, must divide ``B``.

    Returns:
      ``[B, T]`` f32 advantages, exactly 0 at masked positions.

    Raises:
      ValueError: on wrong ranks, a mask whose ``B`` differs, or a bad group size.
    """
    _check_row_mask(rewards, mask)
    groups = _rewards_1d(rewards, group_size)
    base = groups if group_size == 1 else _center(groups)
    per_token = jnp.broadcast_to(base.reshape(-1, 1), jnp.shape(mask))
    return whiten(per_token, mask)


def gae(
    token_rewards: Array,
    values: Array,
    mask: Array,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Array, Array]:
    """Generalised advantage estimation over valid tokens, whitened.

    Scanning ``t = T-1 ... 0`` over valid tokens only (the next value and running GAE carry
    across masked positions, both starting at 0 after the last valid token):
    ``delta_t = R_t + gamma * V_next - V_t``, ``gae_t = delta_t + gamma * lam * gae_next``;
    ``returns = gae + V``; ``advantages = whiten(gae, m) * m``. Schulman et al. 2016,
    "High-Dimensional Continuous Control Using Generalized Advantage Estimation",
    arXiv:1506.02438.

    Args:
      token_rewards: ``[B, T]`` per-token rewards; masked positions are ignored.
      values: ``[B, T]`` critic values; masked positions are ignored.
      mask: ``[B, T]`` bool or f32 completion mask.
      gamma: discount ``>= 0``.
      lam: GAE ``lambda >= 0``.

    Returns:
      ``(advantages, returns)``, both ``[B, T]`` f32 and exactly 0 at masked positions;
      ``returns`` (the value targets) are not whitened.

    Raises:
      ValueError: unless all three are ``[B, T]`` of one shape, or on negative
        ``gamma`` / ``lam``.
    """
    check_batch_time("token_rewards", token_rewards, mask)
    check_batch_time("values", values, mask)
    check_non_negative("gamma", gamma)
    check_non_negative("lam", lam)
    valid = as_mask(mask) != 0
    values = f32(values)

    def step(carry, inputs):
        next_value, next_gae = carry
        reward_t, value_t, valid_t = inputs
        delta = reward_t + gamma * next_value - value_t
        gae_t = delta + gamma * lam * next_gae
        carry = (
            jnp.where(valid_t, value_t, next_value),
            jnp.where(valid_t, gae_t, next_gae),
        )
        return carry, jnp.where(valid_t, gae_t, 0.0)

    zeros = jnp.zeros(jnp.shape(mask)[:1], jnp.float32)
    raw = _reverse_masked_scan(step, (zeros, zeros), f32(token_rewards), values, valid)
    returns = jnp.where(valid, raw + values, 0.0)
    return whiten(raw, valid), returns


__all__ = [
    "gae",
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
