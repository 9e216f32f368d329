"""Advantages from several reward columns (one per reward function): GDPO."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm._checks import as_mask, check_choice, check_rank, check_shape, f32
from jaxrl_llm.losses.advantages._outcome import grpo
from jaxrl_llm.losses.advantages._token import whiten

Array = jax.Array

BATCH_NORMS = ("sequence", "token")


def gdpo(
    reward_columns: Array,
    mask: Array | None = None,
    *,
    group_size: int,
    weights: tuple[float, ...] | None = None,
    batch_norm: str = "sequence",
    std_ddof: int = 1,
    eps: float = 1e-6,
) -> Array:
    """Normalise each reward, then sum: ``A = norm_B(Σ_k w_k·(r_k − μ_gk) / (σ_gk + eps))``.

    GDPO (2026, "GDPO: Group reward-Decoupled Normalization Policy Optimization
    for Multi-reward RL Optimization", arXiv:2601.05242; TRL's
    ``multi_objective_aggregation="normalize_then_sum"``, verl's ``gdpo``): summing the
    rewards before GRPO's group normalisation lets the reward with the widest spread decide
    every advantage and maps distinct reward combinations to the same advantage; normalising
    each column within its group first (:func:`grpo`, ``scale="group"``) keeps them apart.
    The weighted sum ``s`` is then normalised over the batch:

    - ``batch_norm="sequence"`` (the paper, TRL): ``(s − mean(s)) / (std(s) + eps)`` over
      the ``B`` completions (std with ``std_ddof``), ``[B]``;
    - ``batch_norm="token"`` (verl): ``whiten(s·m, m)·m`` over every valid token of the
      batch (:func:`whiten`, so long completions weigh more), ``[B, T]``.

    A column whose group is constant contributes exactly 0 there; a batch whose sums are
    all equal gets exactly 0 (``"sequence"``).

    Args:
      reward_columns: ``[B, K]`` one column per reward function.
      mask: ``[B, T]`` completion mask (``batch_norm="token"`` only).
      group_size: ``G``, must divide ``B``.
      weights: ``K`` weights ``w_k`` (None: all 1).
      batch_norm: ``"sequence"`` or ``"token"``.
      std_ddof: ddof of the group and batch std (1 as verl / TRL).
      eps: added to both stds (verl 1e-6, TRL 1e-4).

    Returns:
      ``[B]`` (``"sequence"``) or ``[B, T]`` (``"token"``) f32 advantages.

    Raises:
      ValueError: on bad shapes, weights, group size or ``batch_norm``.
    """
    check_choice("GDPO batch_norm", batch_norm, BATCH_NORMS)
    check_rank("reward_columns", reward_columns, 2)
    columns = f32(reward_columns)
    rows, num = columns.shape
    if num == 0:
        raise ValueError("reward_columns must hold at least one column, got shape (B, 0)")
    w = jnp.ones((num,), jnp.float32) if weights is None else f32(jnp.asarray(weights))
    check_shape("weights", w, (num,))
    per_column = jax.vmap(
        lambda r: grpo(r, group_size=group_size, scale="group", std_ddof=std_ddof, eps=eps),
        in_axes=1,
        out_axes=1,
    )(columns)
    total = jnp.sum(per_column * w[None, :], axis=1)
    if batch_norm == "sequence":
        return grpo(total, group_size=rows, scale="group", std_ddof=std_ddof, eps=eps)
    if mask is None:
        raise ValueError('batch_norm="token" needs the completion mask')
    check_rank("mask", mask, 2)
    check_shape("mask", mask, (rows, jnp.shape(mask)[1]))
    m = as_mask(mask)
    return whiten(total[:, None] * m, m) * m
