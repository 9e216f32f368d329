"""``models.dense``: values and gradients against float64 NumPy, on both backward paths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import matmul
from jaxrl_llm.models.matmul import dense


def _reference(x, w, contract, g):
    """float64 ``y = tensordot(x, w)``, and ``dx, dw`` of ``sum(y * g)``."""
    x, w, g = (np.asarray(a, np.float64) for a in (x, w, g))
    y = np.tensordot(x, w, contract)
    # d/dx sum(g * (x . w)) = g . w^T over the output axes; d/dw = x^T . g over the batch axes.
    out_axes = list(range(contract, w.ndim))
    dx = np.tensordot(g, w, axes=(list(range(x.ndim - contract, g.ndim)), out_axes))
    batch_axes = list(range(x.ndim - contract))
    dw = np.tensordot(x, g, axes=(batch_axes, batch_axes))
    return y, dx, dw


@pytest.mark.parametrize(
    "x_shape, w_shape, contract",
    [((3, 5, 4), (4, 6), 1), ((2, 3, 4), (4, 2, 5), 1), ((2, 3, 2, 4), (2, 4, 6), 2)],
)
def test_values_and_gradients_match_float64(x_shape, w_shape, contract):
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    out_shape = x_shape[: len(x_shape) - contract] + w_shape[contract:]
    g = rng.standard_normal(out_shape)
    want_y, want_dx, want_dw = _reference(x, w, contract, g)

    def loss(x, w):
        return jnp.sum(dense(x, w, contract) * jnp.asarray(g, jnp.float32))

    xf, wf = jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)
    np.testing.assert_allclose(dense(xf, wf, contract), want_y, rtol=1e-5, atol=1e-5)
    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(xf, wf)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5)
    # The autodiff path (TPU/GPU) gives the same numbers.
    dx_ad, dw_ad = jax.grad(
        lambda x, w: jnp.sum(matmul._product(x, w, contract, None) * jnp.asarray(g, jnp.float32)),
        argnums=(0, 1),
    )(xf, wf)
    np.testing.assert_allclose(dx_ad, want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw_ad, want_dw, rtol=1e-5, atol=1e-5)


@pytest.mark.cpu_only
def test_cpu_uses_the_two_gemm_backward():
    x, w = jnp.ones((2, 3, 4)), jnp.ones((4, 5))
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda x, w: dense(x, w).sum(), argnums=1))(x, w))
    # The rows flattened to one axis: X [6, 4] meets g [6, 5] (autodiff keeps [2, 3, 4]).
    assert "f32[6,4]" in jaxpr and "f32[6,5]" in jaxpr


def test_bf16_inputs_with_f32_output():
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((4, 8, 16)), rng.standard_normal((16, 32))
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    y = dense(xb, wb, preferred_element_type=jnp.float32)
    assert y.dtype == jnp.float32
    # f32 accumulation of the bf16-rounded inputs: exact to f32 rounding.
    want = np.tensordot(np.asarray(xb, np.float64), np.asarray(wb, np.float64), 1)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-4)
    dx, dw = jax.grad(lambda x, w: dense(x, w, preferred_element_type=jnp.float32).sum(), (0, 1))(
        xb, wb
    )
    assert (dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16)
    _, want_dx, want_dw = _reference(xb, wb, 1, np.ones((4, 8, 32)))
    np.testing.assert_allclose(np.asarray(dx, np.float64), want_dx, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(dw, np.float64), want_dw, rtol=2e-2, atol=5e-2)


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match="last 1 axes of x"):
        dense(jnp.ones((2, 3)), jnp.ones((4, 5)))
