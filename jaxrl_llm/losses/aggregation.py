"""Reduce a masked ``[B, T]`` per-token loss to the scalar that is differentiated.

How tokens and sequences are weighted is part of each algorithm, not a detail: GRPO averages
per sequence then over sequences, DAPO averages over all tokens of the batch, Dr.GRPO sums per
sequence and divides by a constant. With the *global* normalisers of :func:`normalisers`
passed to every micro-batch, the micro-batch losses sum to the full-batch loss in every mode,
so gradient accumulation is exact.

Mask convention: bool or 0/1 float; a position counts as valid where ``mask > 0``. Masked
positions contribute exactly 0 to the value and to the gradient, whatever (finite or not) the
per-token value there is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm._checks import (
    as_mask,
    check_batch_time,
    check_choice,
    check_non_negative,
    check_positive,
    check_rank,
    check_shape,
    f32,
)

Array = jax.Array
Scalar = Array | float | int

MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)

# verl's per-sequence epsilon; only matters for empty rows, whose token sum is 0 anyway.
_SEQ_EPS = 1e-8


def _valid(mask: Array) -> Array:
    return as_mask(mask) > 0


def _count(valid: Array, axis: int | None = None) -> Array:
    # Integer count: an f32 running sum of ones stops growing at 2**24 tokens.
    return jnp.sum(valid, axis=axis, dtype=jnp.int32).astype(jnp.float32)


def _check_scalar(name: str, value: Scalar | None, *, positive: bool = False) -> None:
    if value is None:
        return
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number or a scalar array, got {value!r}")
    if isinstance(value, int | float):
        (check_positive if positive else check_non_negative)(name, value)
        return
    check_shape(name, value, ())


def normalisers(mask: Array) -> tuple[Array, Array]:
    """Full-batch ``(num_tokens, num_seqs) = (Σ m, #rows with Σ_t m > 0)``.

    Compute these once on the whole batch and pass them to :func:`aggregate` for each of the
    K row micro-batches: the K aggregated losses then sum to the full-batch loss (and their
    gradients to the full-batch gradient) in every mode. The counts are raw (0 for an empty
    batch); :func:`aggregate` guards them with ``max(·, 1)``.

    Args:
      mask: ``[B, T]`` bool or 0/1 completion mask of the whole batch.

    Returns:
      ``(num_tokens, num_seqs)``, two float32 scalars.

    Raises:
      ValueError: if ``mask`` is not rank 2.
    """
    check_rank("mask", mask, 2)
    valid = _valid(mask)
    return _count(valid), _count(jnp.any(valid, axis=-1))


def aggregate(
    values: Array,
    mask: Array,
    mode: str,
    *,
    num_tokens: Scalar | None = None,
    num_seqs: Scalar | None = None,
    norm_constant: Scalar | None = None,
) -> Array:
    """Masked reduction of a per-token loss ``v`` to a scalar.

    - ``token-mean``: ``Σ v·m / N_tok`` (DAPO, Yu et al. 2025);
    - ``token-sum``: ``Σ v·m``;
    - ``seq-mean-token-mean``: ``Σ_i [Σ_t v·m / (Σ_t m + 1e-8)] / N_seq`` (GRPO, Shao et al.
      2024);
    - ``seq-mean-token-sum``: ``Σ_i Σ_t v·m / N_seq``;
    - ``seq-mean-token-sum-norm``: ``Σ_i Σ_t v·m / N_seq / C`` (Dr.GRPO, Liu et al. 2025,
      "Understanding R1-Zero-Like Training", with ``C`` the maximum completion length).

    ``N_tok = max(num_tokens, 1)``, ``num_tokens`` defaulting to ``Σ m`` of ``values``'s own
    batch; ``N_seq = max(num_seqs, 1)``, ``num_seqs`` defaulting to the number of non-empty
    rows (rows with at least one valid token) in all ``seq-*`` modes, so all-masked padding
    rows never dilute the mean. ``C = norm_constant``, default ``T = values.shape[1]``.
    Normalisers a mode does not use are ignored.

    Args:
      values: ``[B, T]`` per-token loss.
      mask: ``[B, T]`` bool or 0/1 completion mask.
      mode: one of :data:`MODES`.
      num_tokens: global valid-token count (Python number or traced scalar), see
        :func:`normalisers`.
      num_seqs: global non-empty-row count (Python number or traced scalar).
      norm_constant: Dr.GRPO constant ``C`` (Python number > 0 or traced scalar; a traced
        value ``<= 0`` is replaced by 1).

    Returns:
      float32 scalar.

    Raises:
      ValueError: on an unknown mode, shapes other than two equal ``[B, T]``, a normaliser that
        is not a scalar, negative counts or ``norm_constant <= 0``.
    """
    check_choice("mode", mode, MODES)
    check_batch_time("values", values, mask)
    _check_scalar("num_tokens", num_tokens)
    _check_scalar("num_seqs", num_seqs)
    _check_scalar("norm_constant", norm_constant, positive=True)

    valid = _valid(mask)
    masked = jnp.where(valid, f32(values), 0.0)
    if mode == "token-sum":
        return jnp.sum(masked)
    if mode == "token-mean":
        n_tok = _count(valid) if num_tokens is None else f32(num_tokens)
        return jnp.sum(masked) / jnp.maximum(n_tok, 1.0)

    row_tokens = _count(valid, axis=-1)
    row_sums = jnp.sum(masked, axis=-1)
    if mode == "seq-mean-token-mean":
        row_sums = row_sums / (row_tokens + _SEQ_EPS)
    n_seq = _count(row_tokens > 0) if num_seqs is None else f32(num_seqs)
    loss = jnp.sum(row_sums) / jnp.maximum(n_seq, 1.0)
    if mode == "seq-mean-token-sum-norm":
        c = f32(values.shape[1] if norm_constant is None else norm_constant)
        loss = loss / jnp.where(c > 0, c, 1.0)
    return loss


def sequence_mean(seq_values: Array, mask: Array, *, num_seqs: Scalar | None = None) -> Array:
    """Mean of a per-sequence loss over non-empty rows: ``Σ_i v_i·[Σ_t m_i,t > 0] / N_seq``.

    For losses that are already per sequence, such as GMPO (Zhao et al. 2025, "Geometric-Mean
    Policy Optimization"). ``N_seq = max(num_seqs, 1)`` with ``num_seqs`` defaulting to the
    number of non-empty rows; pass the full-batch value from :func:`normalisers` to make
    micro-batch losses sum to the full-batch loss. Empty rows contribute exactly 0 to the
    value and the gradient.

    Args:
      seq_values: ``[B]`` per-sequence loss.
      mask: ``[B, T]`` bool or 0/1 completion mask.
      num_seqs: global non-empty-row count (Python number or traced scalar).

    Returns:
      float32 scalar.

    Raises:
      ValueError: if ``seq_values`` is not ``[B]`` for a ``[B, T]`` mask, or ``num_seqs`` is
        not a non-negative scalar.
    """
    check_rank("mask", mask, 2)
    check_shape("seq_values", seq_values, jnp.shape(mask)[:1])
    _check_scalar("num_seqs", num_seqs)
    non_empty = jnp.any(_valid(mask), axis=-1)
    n_seq = _count(non_empty) if num_seqs is None else f32(num_seqs)
    return jnp.sum(jnp.where(non_empty, f32(seq_values), 0.0)) / jnp.maximum(n_seq, 1.0)
