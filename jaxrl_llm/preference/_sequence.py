"""Sequence log-probs from per-token log-probs, and checks shared by the preference losses."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm._checks import as_mask, check_batch_time, check_rank, f32

Array = jax.Array


def check_label_smoothing(label_smoothing: float) -> None:
    """Raises ValueError unless ``ε = label_smoothing ∈ [0, 0.5]``."""
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing!r}")


def sequence_lengths(mask: Array) -> Array:
    """``n_i = Σ_t m_i,t``: valid tokens per completion.

    Args:
      mask: ``[N, T]`` bool or 0/1 completion mask.

    Returns:
      ``[N]`` float32 token counts (0 for an empty completion).
    """
    check_rank("mask", mask, 2)
    return jnp.sum(as_mask(mask), axis=-1)


def sequence_logps(token_logps: Array, mask: Array) -> Array:
    """``lp(y_i) = Σ_t m_i,t · lp_i,t``: summed completion log-probs.

    Padding contributes exactly 0 to the value and the gradient, even where the padded
    log-probs are ``-inf`` or NaN.

    Args:
      token_logps: ``[N, T]`` per-token log-probs (any float dtype).
      mask: ``[N, T]`` bool or 0/1 completion mask.

    Returns:
      ``[N]`` float32 sums.
    """
    check_batch_time("token_logps", token_logps, mask)
    valid = as_mask(mask) > 0
    return jnp.sum(jnp.where(valid, f32(token_logps), 0.0), axis=-1)


def average_logps(token_logps: Array, mask: Array) -> Array:
    """``lp̄(y_i) = Σ_t m·lp / max(n_i, 1)``: token-averaged completion log-probs.

    SimPO (Meng et al. 2024) and ORPO (Hong et al. 2024) score sequences this way. An empty
    completion averages to 0.

    Args:
      token_logps: ``[N, T]`` per-token log-probs.
      mask: ``[N, T]`` bool or 0/1 completion mask.

    Returns:
      ``[N]`` float32 averages.
    """
    return sequence_logps(token_logps, mask) / jnp.maximum(sequence_lengths(mask), 1.0)
