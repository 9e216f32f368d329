"""Tests for jaxrl_llm.losses.value against the float64 references of tests/reference/losses.py."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxrl_llm.losses import value
from jaxrl_llm.losses.aggregation import aggregate
from tests.reference import losses as ref

B, T = 4, 6


def _batch(rng):
    old = rng.normal(size=(B, T)).astype(np.float32)
    values = (old + rng.normal(size=(B, T))).astype(np.float32)  # often outside the ±0.5 band
    returns = rng.normal(size=(B, T)).astype(np.float32)
    return values, old, returns


@pytest.mark.parametrize("clip", [0.0, 0.2, 0.5, 10.0])
def test_matches_reference(rng, clip):
    values, old, returns = _batch(rng)
    out = value.clipped_value_loss(values, old, returns, clip=clip)
    chex.assert_shape(out, (B, T))
    chex.assert_type(out, jnp.float32)
    want = ref.clipped_value_loss(values, old, returns, clip)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    grad = jax.grad(lambda v: value.clipped_value_loss(v, old, returns, clip=clip).sum())(values)
    np.testing.assert_allclose(
        grad, ref.clipped_value_loss_grad(values, old, returns, clip), rtol=1e-5, atol=1e-6
    )
    frac = value.value_clip_fraction(values, old, returns, clip=clip)
    chex.assert_shape(frac, (B, T))
    np.testing.assert_array_equal(frac, ref.value_clip_fraction(values, old, returns, clip))


def test_hand_checked():
    old = jnp.zeros((1, 4))
    returns = jnp.array([[2.0, -2.0, 2.0, 0.0]])
    values = jnp.array([[1.0, 1.0, 0.2, 0.0]])
    # v̂ = (0.5, 0.5, 0.2, 0): token 0 clipped branch larger (½·1.5² > ½·1²), no gradient;
    # token 1 unclipped larger (½·9 > ½·6.25); token 2 inside the band; token 3 exact.
    out = value.clipped_value_loss(values, old, returns, clip=0.5)
    np.testing.assert_allclose(out, [[1.125, 4.5, 1.62, 0.0]], rtol=1e-6)
    grad = jax.grad(lambda v: value.clipped_value_loss(v, old, returns).sum())(values)
    np.testing.assert_allclose(grad, [[0.0, 3.0, -1.8, 0.0]], rtol=1e-6)
    np.testing.assert_array_equal(value.value_clip_fraction(values, old, returns), [[1, 0, 0, 0]])


def test_masked_positions_get_zero_gradient(rng):
    values, old, returns = _batch(rng)
    mask = ref.ragged_mask(rng, B, T, empty_rows=(2,))
    bad_returns = np.where(mask > 0, returns, 1e18).astype(np.float32)
    loss, grad = jax.value_and_grad(
        lambda v: aggregate(value.clipped_value_loss(v, old, bad_returns), mask, "token-mean")
    )(values)
    want = ref.aggregate(ref.clipped_value_loss(values, old, returns), mask, "token-mean")
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    assert np.all(np.asarray(grad)[mask == 0] == 0.0)


def test_check_grads(rng):
    values, old, returns = _batch(rng)
    band = np.abs(values - old)
    assert np.all(np.abs(band - 0.5) > 1e-2)  # away from the clip kinks

    def f(v):
        return value.clipped_value_loss(v, old, returns)

    check_grads(f, (values,), order=1, modes=["rev"], eps=1e-3, atol=1e-2, rtol=1e-2)


# Not dyadic, so no difference of two bf16 values lies exactly on a clip kink.
@pytest.mark.parametrize("clip", [0.2, 0.45])
def test_bf16_inputs_are_upcast_before_any_math(rng, clip):
    """bf16 critic outputs give f32 losses equal to f64 math on the bf16-rounded inputs (math
    in bf16 is off by up to 2^-9 relative per operation), and the same clip indicators."""
    data = ref.bf16_batch(rng)
    bf = [jnp.asarray(data[k]) for k in ("values", "old_values", "returns")]
    exact = [np.float64(data[k]) for k in ("values", "old_values", "returns")]
    assert all(x.dtype == jnp.bfloat16 for x in bf)
    out = value.clipped_value_loss(*bf, clip=clip)
    chex.assert_type(out, jnp.float32)
    want = ref.clipped_value_loss(*exact, clip)
    np.testing.assert_allclose(np.float64(out), want, rtol=1e-6, atol=1e-6)
    frac = value.value_clip_fraction(*bf, clip=clip)
    chex.assert_type(frac, jnp.float32)
    want_frac = ref.value_clip_fraction(*exact, clip)
    assert 0 < want_frac.mean() < 1
    np.testing.assert_array_equal(frac, want_frac)
    grad = jax.grad(lambda v: value.clipped_value_loss(v, *bf[1:], clip=clip).sum())(bf[0])
    assert grad.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.float64(grad), ref.clipped_value_loss_grad(*exact, clip), rtol=2**-8
    )


def test_jit_vmap_and_no_recompile(rng):
    values, old, returns = _batch(rng)
    full = value.clipped_value_loss(values, old, returns)
    traces = []

    @jax.jit
    def f(v, o, r):
        traces.append(None)
        return value.clipped_value_loss(v, o, r, clip=0.2), value.value_clip_fraction(v, o, r)

    f(values, old, returns)
    f(values + 1.0, old, returns)
    assert len(traces) == 1
    batched = jax.vmap(value.clipped_value_loss)(
        np.stack([values, old]), np.stack([old, old]), np.stack([returns, returns])
    )
    np.testing.assert_allclose(batched[0], full, rtol=1e-6)
    np.testing.assert_allclose(batched[1], 0.5 * (old - returns) ** 2, rtol=1e-5, atol=1e-6)


def test_errors(rng):
    values, old, returns = _batch(rng)
    with pytest.raises(ValueError, match="clip must be >= 0"):
        value.clipped_value_loss(values, old, returns, clip=-0.1)
    with pytest.raises(ValueError, match="clip"):
        value.value_clip_fraction(values, old, returns, clip=None)
    with pytest.raises(ValueError, match=r"returns\(4, 5\)"):
        value.clipped_value_loss(values, old, returns[:, :5])
    with pytest.raises(ValueError, match="rank 2"):
        value.clipped_value_loss(values[0], old[0], returns[0])
