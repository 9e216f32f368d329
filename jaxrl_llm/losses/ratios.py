"""Importance ratios between the current and the behaviour policy, in log space.

Three views of the same quantity ``Δ = lp − old``:

- per token (PPO / GRPO / DAPO): ``clip(Δ, −clamp, clamp)``;
- per sequence (GSPO): the length-normalised mean of ``Δ`` over valid tokens;
- GSPO-token: the sequence value on every token, with a per-token gradient.

All functions return float32 whatever the input dtype. ``old_logprobs`` is treated as data:
wrap it in ``jax.lax.stop_gradient`` if it was computed from the parameters being trained.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm._checks import as_mask, check_batch_time, check_positive, check_rank, f32

Array = jax.Array


def _masked(x: Array, mask: Array) -> Array:
    # `where`, not `x * mask`: garbage (inf) at padded positions must give 0, not inf·0 = NaN,
    # and the cotangent reaching `x` there is exactly 0.
    return jnp.where(mask > 0, x, 0.0)


def token_log_ratio(logprobs: Array, old_logprobs: Array, *, clamp: float = 20.0) -> Array:
    """Per-token log importance ratio ``log r_t = clip(lp_t − old_t, −clamp, clamp)``.

    The PPO ratio (Schulman et al. 2017, "Proximal Policy Optimization Algorithms") in log
    space. The clamp keeps ``exp`` finite downstream (``exp(20) ≈ 4.9e8``); outside
    ``[−clamp, clamp]`` the gradient is 0, as with verl's clamp.

    Args:
      logprobs: ``[B, T]`` log-probs of the sampled tokens under the current policy.
      old_logprobs: ``[B, T]`` log-probs under the behaviour (rollout) policy.
      clamp: bound on ``|log r|``, > 0.

    Returns:
      ``[B, T]`` float32 log-ratios (padding positions hold whatever the inputs give; mask them
      in the aggregation).

    Raises:
      ValueError: on ranks other than 2, mismatched shapes or ``clamp <= 0``.
    """
    check_rank("logprobs", logprobs, 2)
    check_batch_time("old_logprobs", old_logprobs, logprobs)
    check_positive("clamp", clamp)
    return jnp.clip(f32(logprobs) - f32(old_logprobs), -clamp, clamp)


def sequence_log_ratio(logprobs: Array, old_logprobs: Array, mask: Array) -> Array:
    """Length-normalised sequence log ratio ``log s_i = Σ_t m·(lp − old) / max(Σ_t m, 1)``.

    GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization") uses
    ``s_i = (π(y_i) / π_old(y_i))^(1/|y_i|)``. No clamp is applied here. An all-masked row
    gives exactly 0 (ratio 1).

    Args:
      logprobs: ``[B, T]`` current log-probs.
      old_logprobs: ``[B, T]`` behaviour log-probs.
      mask: ``[B, T]`` bool or 0/1 completion mask.

    Returns:
      ``[B]`` float32.

    Raises:
      ValueError: if the three inputs are not ``[B, T]`` of one shape.
    """
    check_batch_time("logprobs", logprobs, mask)
    check_batch_time("old_logprobs", old_logprobs, mask)
    m = as_mask(mask)
    delta = _masked(f32(logprobs) - f32(old_logprobs), m)
    lengths = jnp.sum(m > 0, axis=-1, dtype=jnp.int32).astype(jnp.float32)
    return jnp.sum(delta, axis=-1) / jnp.maximum(lengths, 1.0)


def gspo_token_log_ratio(
    logprobs: Array, old_logprobs: Array, mask: Array, *, max_log_ratio: float = 10.0
) -> Array:
    """GSPO-token log ratio ``min(lp_t − sg(lp_t) + sg(log s_i), max_log_ratio)``.

    GSPO-token (Zheng et al. 2025, "Group Sequence Policy Optimization", eq. 13): every token
    of row ``i`` carries the sequence value ``log s_i`` (see :func:`sequence_log_ratio`), while
    the gradient is per token: ``∂ exp(out_t) / ∂ lp_t = s_i`` (``∂/∂lp_u = 0`` for ``u ≠ t``).
    With a ``[B]`` advantage this equals GSPO's sequence-level gradient. The cap bounds
    ``exp`` (verl caps at 10); where it binds the gradient is 0.

    Padding tokens get the value ``min(log s_i, max_log_ratio)`` too, and exactly zero
    gradient, so garbage there never reaches the result.

    Args:
      logprobs: ``[B, T]`` current log-probs.
      old_logprobs: ``[B, T]`` behaviour log-probs.
      mask: ``[B, T]`` bool or 0/1 completion mask.
      max_log_ratio: upper cap on the log ratio, > 0.

    Returns:
      ``[B, T]`` float32.

    Raises:
      ValueError: on mismatched shapes or ``max_log_ratio <= 0``.
    """
    check_positive("max_log_ratio", max_log_ratio)
    seq = jax.lax.stop_gradient(sequence_log_ratio(logprobs, old_logprobs, mask))
    lp = jnp.where(as_mask(mask) > 0, f32(logprobs), 0.0)
    # lp − sg(lp) is exactly 0 in value but carries d/dlp = 1.
    return jnp.minimum(lp - jax.lax.stop_gradient(lp) + seq[:, None], max_log_ratio)
