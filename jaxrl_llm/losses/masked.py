"""Masked reductions over ``[B, T]`` / ``[B]`` arrays, the one home of the loss layer's.

- weighted, with verl_F's semantics: :func:`masked_sum` ``Σ v·m`` and :func:`masked_mean`
  ``Σ v·m / (Σ m + 1e-8)``;
- selected, for metrics: :func:`selected_sum` ``Σ v·[m > 0]`` and :func:`token_mean`
  ``Σ v·[m > 0] / max(N_tok, 1)`` with the loss's global token count, so that summing the
  metrics of K micro-batches gives the full-batch metric;
- the guarded statistics (extremes, std, inverse) ``losses.correction`` and the loss metrics
  are built from.

Masked entries never contribute, even when they hold inf or NaN, and every reduction is finite on
all-masked input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

EPS = 1e-8


def masked_sum(values: Array, mask: Array, axis=None) -> Array:
    """``Σ v·m`` over ``axis`` (a weighted mask weighs), masked garbage zeroed first."""
    return jnp.sum(jnp.where(mask > 0, values, 0.0) * mask, axis=axis)


def masked_mean(values: Array, mask: Array, axis=None) -> Array:
    """verl_F's ``Σ v·m / (Σ m + 1e-8)`` over ``axis``."""
    return masked_sum(values, mask, axis) / (jnp.sum(mask, axis=axis) + EPS)


def selected_sum(values: Array, mask: Array) -> Array:
    """``Σ v·[m > 0]``: the entries the mask selects, unweighted; masked garbage (even inf)
    contributes exactly 0."""
    return jnp.sum(jnp.where(mask > 0, values, 0.0))


def token_mean(values: Array, mask: Array, num_tokens: Array) -> Array:
    """``Σ v·[m > 0] / max(N_tok, 1)``, the normaliser of every additive metric."""
    return selected_sum(values, mask) / jnp.maximum(num_tokens, 1)


def extreme(values: Array, mask: Array, reduce, fill: float) -> Array:
    """``reduce`` over the entries where ``mask``; 0 when there are none."""
    out = reduce(jnp.where(mask > 0, values, fill))
    return jnp.where(jnp.any(mask > 0), out, 0.0)


def row_mean(values: Array, rows: Array, empty: float = 0.0) -> Array:
    """Mean of the per-row ``values`` over ``rows`` (those with a valid token); ``empty``
    when there are none. verl averages over every row: it never meets one without a valid
    token, but a dynamic-sampling filler row here has none, and counting it would pull every
    per-row statistic towards "no mismatch"."""
    mean = jnp.sum(jnp.where(rows, values, 0.0)) / jnp.maximum(jnp.sum(rows), 1)
    return jnp.where(jnp.any(rows), mean, empty)


def inverse(x: Array) -> Array:
    """``1 / x``, 0 where ``x`` is 0 (an ESS over no valid token)."""
    return jnp.where(x > 0, 1.0 / jnp.where(x > 0, x, 1.0), 0.0)


def std(values: Array, valid: Array) -> Array:
    """Sample std (ddof 1) over the ``valid`` entries of a vector; 0 with fewer than two."""
    n = jnp.sum(valid)
    mean = jnp.sum(jnp.where(valid, values, 0.0)) / jnp.maximum(n, 1.0)
    var = jnp.sum(jnp.where(valid, (values - mean) ** 2, 0.0)) / jnp.maximum(n - 1.0, 1.0)
    return jnp.where(n > 1, jnp.sqrt(var), 0.0)


def clamped_std(values: Array, mask: Array, low: float, high: float) -> Array:
    """verl's token std: of ``values`` clamped to ``[low, high]``; 0 with one valid token."""
    clamped = jnp.clip(values, low, high)
    mean = masked_mean(clamped, mask)
    var = masked_mean(clamped**2, mask) - mean**2
    return jnp.where(jnp.sum(mask) > 1, jnp.sqrt(jnp.maximum(var, 0.0)), 0.0)
