"""Token-level estimators: ``[B, T]`` advantages, whitened over the valid tokens of the batch.

Masked whitening, REINFORCE++ (discounted reward-to-go, or a group baseline broadcast over
the tokens) and GAE; masked positions are exactly 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm._checks import as_mask, check_batch_time, check_non_negative, check_same_shape, f32
from jaxrl_llm.losses.advantages._groups import center, check_row_mask, rewards_groups

Array = jax.Array

_WHITEN_EPS = 1e-8


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
    check_row_mask(rewards, mask)
    groups = rewards_groups(rewards, group_size)
    base = groups if group_size == 1 else center(groups)
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
