"""Shared pieces of the group estimators: rows as ``[B / G, G]`` groups, centring, checks.

Rows are prompts x group size with **contiguous groups**: rows ``g*G ... g*G+G-1`` answer
prompt ``g``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm._checks import check_group_size, check_rank, f32

Array = jax.Array


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


def is_constant(groups: Array) -> Array:
    """``[N, G] -> [N, 1]`` bool: all rewards of the group are equal (``max == min``)."""
    return jnp.max(groups, axis=1, keepdims=True) == jnp.min(groups, axis=1, keepdims=True)


def center(groups: Array) -> Array:
    """``[N, G] -> [N, G]``: ``r - mean_g``, exactly 0 for a constant group.

    ``sum / G`` of equal non-representable values can round away from them, so constant
    groups are detected with ``max == min`` and zeroed rather than trusted to cancel.
    """
    centered = groups - jnp.mean(groups, axis=1, keepdims=True)
    return jnp.where(is_constant(groups), 0.0, centered)


def rewards_groups(rewards: Array, group_size: int) -> Array:
    """Validates ``[B]`` rewards and a group size dividing ``B``; returns f32 groups."""
    check_rank("rewards", rewards, 1)
    if jnp.shape(rewards)[0] == 0:
        raise ValueError("rewards must hold at least one row, got shape (0,)")
    return group_view(f32(rewards), group_size)


def check_row_mask(rewards: Array, mask: Array) -> None:
    """Raises unless ``mask`` is ``[B, T]`` with ``B`` the length of ``rewards``."""
    check_rank("rewards", rewards, 1)
    check_rank("mask", mask, 2)
    if jnp.shape(mask)[0] != jnp.shape(rewards)[0]:
        raise ValueError(
            f"mask shape {tuple(jnp.shape(mask))} must be [B, T] with B = "
            f"{jnp.shape(rewards)[0]} from rewards shape {tuple(jnp.shape(rewards))}"
        )
