"""``models.moe.load_balancing_loss`` / ``router_z_loss``: values and gradients with respect to
the router logits against float64 NumPy (``tests.reference.router_losses``), padding masked out.
tests/models/test_moe.py compares the load-balancing loss with transformers' own function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import moe
from tests.reference.router_losses import router_losses as _reference


@pytest.mark.parametrize("top_k", [1, 2])
def test_values_and_gradients_match_float64(top_k, rng):
    logits = 2.0 * rng.standard_normal((3, 2, 7, 5))  # [L, B, S, E]
    mask = rng.random((2, 7)) < 0.7
    mask[0, 0] = True
    lb, zl, d_lb, d_z = _reference(logits, mask, top_k)
    x = jnp.asarray(logits, jnp.float32)
    got_lb, grad_lb = jax.value_and_grad(lambda v: moe.load_balancing_loss(v, mask, top_k=top_k))(x)
    got_z, grad_z = jax.value_and_grad(lambda v: moe.router_z_loss(v, mask))(x)
    np.testing.assert_allclose(float(got_lb), lb, rtol=1e-5)
    np.testing.assert_allclose(float(got_z), zl, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad_lb), d_lb, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad_z), d_z, rtol=1e-4, atol=1e-7)


def test_padding_changes_neither_value_nor_gradient(rng):
    """Junk logits on padding: the same losses as the real tokens alone, exactly zero gradient."""
    logits = rng.standard_normal((2, 3, 6, 4)).astype(np.float32)
    mask = np.ones((3, 6), bool)
    mask[1, 4:] = mask[2, :2] = False
    junk = logits.copy()
    junk[:, ~mask] = 1e4 * rng.standard_normal((2, int((~mask).sum()), 4))
    real = logits[:, mask][:, None]  # [L, 1, N, E]: the real tokens alone, unmasked
    for fn in (
        lambda v, m: moe.load_balancing_loss(v, m, top_k=2),
        lambda v, m: moe.router_z_loss(v, m),
    ):
        value, grad = jax.value_and_grad(fn)(jnp.asarray(junk), mask)
        assert np.isfinite(float(value))
        np.testing.assert_allclose(float(value), float(fn(real, None)), rtol=1e-6)
        assert np.all(np.asarray(grad)[:, ~mask] == 0.0)


def test_no_real_token_gives_zero_not_nan():
    logits = jnp.ones((2, 2, 3, 4))
    mask = np.zeros((2, 3), bool)
    assert float(moe.load_balancing_loss(logits, mask, top_k=2)) == 0.0
    assert float(moe.router_z_loss(logits, mask)) == 0.0
