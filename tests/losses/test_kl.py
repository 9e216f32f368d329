"""Tests for jaxrl_llm.losses.kl against the float64 references of tests/reference/losses.py."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxrl_llm.losses import kl
from tests.reference import losses as ref
from tests.reference import stabilisers as stab

B, T = 4, 6


def _batch(rng, scale=1.0):
    lp = (rng.normal(size=(B, T)) - 2.0).astype(np.float32)
    ref_lp = (lp + rng.normal(size=(B, T)) * scale).astype(np.float32)
    return lp, ref_lp


def test_kinds_exported():
    assert kl.KINDS == ("k1", "k2", "k3", "abs")


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs"])
def test_matches_reference(rng, kind):
    lp, ref_lp = _batch(rng, scale=8.0)  # large |x|: k3's clamps are exercised
    out = kl.estimate(lp, ref_lp, kind=kind)
    chex.assert_shape(out, (B, T))
    chex.assert_type(out, jnp.float32)
    np.testing.assert_allclose(out, ref.kl(lp, ref_lp, kind), rtol=1e-5, atol=1e-5)


def test_k3_clamps_hand_checked():
    lp = jnp.zeros((1, 4))
    ref_lp = jnp.array([[0.0, 1.0, 30.0, -30.0]])
    out = kl.estimate(lp, ref_lp, kind="k3")
    # exp(1) − 2; exp(20) − 21 clipped to 10; exp(−20) + 20 − 1 clipped to 10.
    np.testing.assert_allclose(out, [[0.0, np.e - 2.0, 10.0, 10.0]], rtol=1e-6)
    assert np.all(np.isfinite(jax.grad(lambda x: kl.estimate(x, ref_lp).sum())(lp)))


def test_equal_policies_give_zero_for_every_kind(rng):
    lp, _ = _batch(rng)
    for kind in kl.KINDS:
        np.testing.assert_array_equal(kl.estimate(lp, lp, kind=kind), np.zeros((B, T)))


# Expectations over tokens sampled from π are taken exactly, Σ_a sg(π(a))·f(a), so the
# unbiasedness checks are deterministic.
LOG_REF = jax.nn.log_softmax(jnp.zeros(5))
THETA = jnp.array([1.0, 0.0, -0.5, 0.5, -1.0])  # inside k3's clamps


def _expected(theta, kind, straight_through=False):
    log_pi = jax.nn.log_softmax(theta)
    est = kl.estimate(log_pi[None], LOG_REF[None], kind=kind, straight_through=straight_through)
    return jnp.sum(jax.lax.stop_gradient(jnp.exp(log_pi)) * est[0])


def _exact_kl(theta):
    log_pi = jax.nn.log_softmax(theta)
    return jnp.sum(jnp.exp(log_pi) * (log_pi - LOG_REF))


def test_k1_k3_unbiased_k2_abs_biased():
    true_kl = float(_exact_kl(THETA))
    np.testing.assert_allclose(_expected(THETA, "k1"), true_kl, rtol=1e-5)
    np.testing.assert_allclose(_expected(THETA, "k3"), true_kl, rtol=1e-5)
    # k2 is biased at second order only; |x| is far off.
    assert abs(float(_expected(THETA, "k2")) - true_kl) > 0.01 * true_kl
    assert abs(float(_expected(THETA, "abs")) - true_kl) > 0.5 * true_kl


def test_straight_through_gradient_is_the_kl_gradient():
    """E_π[∇ straight-through k3] = ∇ KL(π_θ ‖ ref); plain k3's pathwise gradient is not."""
    want = jax.grad(_exact_kl)(THETA)
    got = jax.grad(_expected)(THETA, "k3", True)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    plain = jax.grad(_expected)(THETA, "k3", False)
    assert float(jnp.abs(plain - want).max()) > 0.1 * float(jnp.abs(want).max())


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs"])
def test_check_grads(rng, kind):
    lp, ref_lp = _batch(rng)  # |x| well inside k3's clamps and away from abs's kink at 0
    assert np.abs(lp - ref_lp).min() > 1e-2

    def f(x, y):
        return kl.estimate(x, y, kind=kind)

    check_grads(f, (lp, ref_lp), order=1, modes=["rev"], eps=1e-3, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("straight_through", [False, True])
def test_bf16_inputs_are_upcast_before_any_math(rng, straight_through):
    """bf16 log-probs give f32 estimates equal to f64 math on the bf16-rounded inputs (math in
    bf16 is off by up to 2^-9 relative per operation, ~3% on k3 near lp = -5)."""
    data = ref.bf16_batch(rng)
    lp, ref_lp = (jnp.asarray(data[k]) for k in ("logprobs", "ref_logprobs"))
    lp64, ref64 = np.float64(data["logprobs"]), np.float64(data["ref_logprobs"])
    assert lp.dtype == ref_lp.dtype == jnp.bfloat16
    assert np.abs(ref64 - lp64).max() > 1.0  # k3 well into its exponential range
    for kind in kl.KINDS:
        out = kl.estimate(lp, ref_lp, kind=kind, straight_through=straight_through)
        chex.assert_type(out, jnp.float32)
        want = ref.kl(lp64, ref64, kind)
        np.testing.assert_allclose(np.float64(out), want, rtol=1e-6, atol=1e-6, err_msg=kind)
        grad = jax.grad(
            lambda x, kind=kind: kl.estimate(
                x, ref_lp, kind=kind, straight_through=straight_through
            ).sum()
        )(lp)
        assert grad.dtype == jnp.bfloat16
        if straight_through or kind == "k2":
            # lp − ref is exact in f32, so its bf16 rounding is the rounded exact gradient.
            np.testing.assert_array_equal(grad, ref.bf16(ref.k2_grad_wrt_lp(lp64, ref64)))


def test_jit_vmap_and_no_recompile(rng):
    lp, ref_lp = _batch(rng)
    traces = []

    @jax.jit
    def f(x, y):
        traces.append(None)
        return kl.estimate(x, y, kind="k3", straight_through=True)

    np.testing.assert_allclose(f(lp, ref_lp), kl.estimate(lp, ref_lp), rtol=1e-6)
    f(lp - 1.0, ref_lp)
    assert len(traces) == 1
    stacked = jax.vmap(lambda x, y: kl.estimate(x, y, kind="k2"))(
        np.stack([lp, ref_lp]), np.stack([ref_lp, lp])
    )
    np.testing.assert_allclose(stacked[1], kl.estimate(ref_lp, lp, kind="k2"), rtol=1e-6)


def test_errors(rng):
    lp, ref_lp = _batch(rng)
    with pytest.raises(ValueError, match="unknown kind 'k4'"):
        kl.estimate(lp, ref_lp, kind="k4")
    with pytest.raises(ValueError, match="low_var_kl"):
        kl.estimate(lp, ref_lp, kind="low_var_kl")
    with pytest.raises(ValueError, match=r"\(4, 6\).*\(4, 5\)"):
        kl.estimate(lp, ref_lp[:, :5])
    with pytest.raises(ValueError, match="rank 2"):
        kl.estimate(lp[0], ref_lp[0])


# ----------------------------------------------------------------------------- importance-weighted


def test_importance_weighted_k3_matches_reference(rng):
    """DeepSeek-V3.2's unbiased KL (TRL's ``use_bias_correction_kl``): ``r·k3`` with the
    ratio's gradient kept."""
    lp = -rng.uniform(0.1, 3.0, (4, 6)).astype(np.float32)
    ref_lp = (lp + rng.normal(0.0, 0.5, lp.shape)).astype(np.float32)
    old = (lp + rng.normal(0.0, 0.3, lp.shape)).astype(np.float32)

    def f(x):
        return kl.importance_weighted_estimate(x, ref_lp, x - old, kind="k3")

    want, want_grad = stab.importance_weighted_k3(lp, ref_lp, old)
    np.testing.assert_allclose(f(lp), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda x: f(x).sum())(lp), want_grad, rtol=1e-5, atol=1e-6)
    # On-policy the value is k3's, the gradient is not (the ratio's own gradient, k3·∇lp).
    on = kl.importance_weighted_estimate(lp, ref_lp, jnp.zeros_like(lp))
    np.testing.assert_allclose(on, kl.estimate(lp, ref_lp), rtol=1e-6)


def test_importance_weighted_estimate_is_unbiased_off_policy():
    """Tokens drawn from π_old: ``E_old[r·k3] = KL(π_θ‖π_ref)`` exactly, ``E_old[k3]`` not."""
    old_p, theta, ref_p = np.array([0.6, 0.3, 0.1]), np.array([0.2, 0.5, 0.3]), np.full(3, 1 / 3)
    lp, ref_lp, old = (jnp.log(jnp.asarray(p, jnp.float32))[None] for p in (theta, ref_p, old_p))
    weighted = kl.importance_weighted_estimate(lp, ref_lp, lp - old)[0]
    plain = kl.estimate(lp, ref_lp)[0]
    exact = float(np.sum(theta * np.log(theta / ref_p)))
    np.testing.assert_allclose(float(jnp.sum(old_p * weighted)), exact, rtol=1e-5)
    assert abs(float(jnp.sum(old_p * plain)) - exact) > 1e-2


def test_importance_weighted_estimate_errors(rng):
    lp = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="shape"):
        kl.importance_weighted_estimate(lp, lp, jnp.zeros((2, 2)))
    with pytest.raises(ValueError, match="kind"):
        kl.importance_weighted_estimate(lp, lp, lp, kind="k9")
