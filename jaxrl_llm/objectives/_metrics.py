"""Masked metric reductions shared by the loss terms.

Metrics use the loss's global token count, so summing the metrics of K micro-batches gives
the full-batch metric (``*_min`` / ``*_max`` keys reduce by min / max instead).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def masked_sum(values: Array, mask: Array) -> Array:
    """``Σ v·[m > 0]``; masked garbage (even inf) contributes exactly 0."""
    return jnp.sum(jnp.where(mask > 0, values, 0.0))


def token_mean(values: Array, mask: Array, num_tokens: Array) -> Array:
    """``Σ v·m / max(N_tok, 1)``, the normaliser of every additive metric."""
    return masked_sum(values, mask) / jnp.maximum(num_tokens, 1)
