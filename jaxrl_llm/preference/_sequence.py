"""Sequence log-probs from per-token log-probs, and checks shared by the preference losses."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm._checks import as_mask, check_batch_time, check_rank, check_same_shape, f32

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


def token_mean_nll(
    chosen_logps: Array,
    chosen_len: Array,
    *,
    prompt_logps: Array | None = None,
    prompt_len: Array | None = None,
) -> Array:
    """``NLL = −(Σ_i lp(y_w^i) + Σ_i lp(x^i)) / max(Σ_i n_w^i + Σ_i n_x^i, 1)`` on every pair.

    The token-mean negative log-likelihood over every chosen token of the batch, as TRL
    computes its SFT terms (``nn.CrossEntropyLoss`` over the batch): the value is the same
    for all ``N`` pairs, so the mean of per-pair losses carries it exactly and its gradient
    with respect to each token is ``−1/Σn``. Without prompt terms it covers completion tokens
    only (TRL's CPOTrainer NLL and DPOTrainer's ``sft`` loss type); with them it also covers
    the prompt tokens the model predicts (TRL's ORPOTrainer NLL). It couples the pairs of a
    batch, so a micro-batch (or a ``vmap`` over pairs) normalises by its own token count.

    Args:
      chosen_logps: ``[N]`` summed log-probs of the chosen completions (:func:`sequence_logps`).
      chosen_len: ``[N]`` token counts of the chosen completions (:func:`sequence_lengths`).
      prompt_logps: ``[N]`` summed log-probs of the prompt tokens the model predicts (every
        real prompt token but the first, which has no context), or ``None``.
      prompt_len: ``[N]`` counts of those prompt tokens; required with ``prompt_logps``.

    Returns:
      ``[N]`` float32, every entry the batch NLL (rank 0 in, rank 0 out).

    Raises:
      ValueError: on mismatched shapes, or only one of ``prompt_logps`` and ``prompt_len``.
    """
    check_rank("chosen_logps", chosen_logps, (0, 1))
    if (prompt_logps is None) != (prompt_len is None):
        raise ValueError("pass both prompt_logps and prompt_len, or neither (completion only)")
    check_same_shape(
        chosen_logps=chosen_logps,
        chosen_len=chosen_len,
        prompt_logps=prompt_logps,
        prompt_len=prompt_len,
    )
    total = jnp.sum(f32(chosen_logps))
    count = jnp.sum(f32(chosen_len))
    if prompt_logps is not None:
        total = total + jnp.sum(f32(prompt_logps))
        count = count + jnp.sum(f32(prompt_len))
    return jnp.broadcast_to(-total / jnp.maximum(count, 1.0), jnp.shape(chosen_logps))
