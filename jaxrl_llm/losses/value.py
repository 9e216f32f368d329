"""Critic loss for PPO-style training with a learned value function."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm._checks import check_non_negative, check_rank, check_same_shape, f32

Array = jax.Array


def _squared_errors(
    values: Array, old_values: Array, returns: Array, clip: float
) -> tuple[Array, Array]:
    if clip is None:
        raise ValueError("clip must be a number >= 0, got None")
    check_non_negative("clip", clip)
    check_rank("values", values, 2)
    check_same_shape(values=values, old_values=old_values, returns=returns)
    v, v_old, target = f32(values), f32(old_values), f32(returns)
    v_clipped = jnp.clip(v, v_old - clip, v_old + clip)
    return jnp.square(v - target), jnp.square(v_clipped - target)


def clipped_value_loss(
    values: Array, old_values: Array, returns: Array, *, clip: float = 0.5
) -> Array:
    """Clipped value loss ``½·max((v − R)², (v̂ − R)²)``, ``v̂ = clip(v, v_old − c, v_old + c)``.

    The value-clipping variant of PPO (Schulman et al. 2017, "Proximal Policy Optimization
    Algorithms"; as in OpenAI baselines and verl): the pessimistic of the clipped and
    unclipped errors, so the critic cannot move by more than ``c`` per update to lower its
    loss. Where the clipped branch is larger the gradient is 0.

    Args:
      values: ``[B, T]`` current critic values (carry the gradient).
      old_values: ``[B, T]`` critic values at rollout time.
      returns: ``[B, T]`` value targets.
      clip: ``c >= 0``.

    Returns:
      ``[B, T]`` float32 per-token loss (aggregate it with the mask).

    Raises:
      ValueError: on ranks other than 2, mismatched shapes or ``clip < 0``.
    """
    unclipped, clipped = _squared_errors(values, old_values, returns, clip)
    return 0.5 * jnp.maximum(unclipped, clipped)


def value_clip_fraction(
    values: Array, old_values: Array, returns: Array, *, clip: float = 0.5
) -> Array:
    """Per-token indicator ``(v̂ − R)² > (v − R)²``: the clipped branch is the larger one
    (verl's ``vf_clipfrac`` before the masked mean).

    Args:
      values, old_values, returns, clip: as in :func:`clipped_value_loss`.

    Returns:
      ``[B, T]`` float32 0/1 array without gradient.

    Raises:
      ValueError: as :func:`clipped_value_loss`.
    """
    unclipped, clipped = jax.lax.stop_gradient(_squared_errors(values, old_values, returns, clip))
    return (clipped > unclipped).astype(jnp.float32)
