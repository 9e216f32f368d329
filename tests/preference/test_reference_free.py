"""Tests for ORPO, CPO, SimPO and AlphaPO against tests/reference/preference.py."""

from __future__ import annotations

import functools
import math

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxrl_llm import preference as P
from tests.preference.common import LOG2, N, _grad_of_sum, _tile
from tests.reference import preference as ref

# ------------------------------------------------------------------------------------------
# ORPO, SimPO, CPO.


def test_log1mexp_matches_reference_both_branches():
    x = _tile([-1e4, -50.0, -5.0, -1.0, -math.log(2.0), -0.6, -1e-3, -1e-6]).astype(np.float32)
    np.testing.assert_allclose(P.log1mexp(x), ref.log1mexp(x), rtol=2e-6, atol=1e-20)
    x[-1] = 0.0  # log(1 − 1) = −inf, clamped to stay finite
    assert np.all(np.isfinite(P.log1mexp(x)))
    assert np.all(np.isfinite(_grad_of_sum(P.log1mexp, 0)(x)))


def _avg_pairs(rng, n=N):
    lw = -rng.gamma(2.0, 0.6, n)
    ll = -rng.gamma(2.0, 0.6, n)
    lw[0], ll[1] = -1e-5, -8.0
    return lw, ll


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_orpo_matches_reference(rng, beta):
    lw, ll = _avg_pairs(rng)
    got = P.orpo(jnp.asarray(lw, jnp.float32), jnp.asarray(ll, jnp.float32), beta=beta)
    want, log_odds = ref.orpo(lw, ll, beta=beta)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        P.orpo_log_odds(lw.astype(np.float32), ll.astype(np.float32)),
        log_odds,
        rtol=1e-4,
        atol=1e-4,
    )
    nll = rng.random(N)
    got = P.orpo(
        jnp.asarray(lw, jnp.float32), jnp.asarray(ll, jnp.float32), beta=beta, chosen_nll=nll
    )
    np.testing.assert_allclose(got, ref.orpo(lw, ll, beta=beta, nll=nll)[0], rtol=1e-5, atol=1e-5)


def test_orpo_equal_pair_and_extremes():
    lp = jnp.asarray(_tile([-0.1, -2.0]), jnp.float32)
    # Equal log-probs: log odds 0, loss = −lw + β·log 2.
    np.testing.assert_allclose(P.orpo(lp, lp), -lp + 0.1 * LOG2, rtol=1e-6)
    extreme_w = jnp.asarray(_tile([0.0, -1e4, -1e-7, -1e4]), jnp.float32)
    extreme_l = jnp.asarray(_tile([-1e4, 0.0, -1e4, -1e-7]), jnp.float32)
    vals = P.orpo(extreme_w, extreme_l)
    grads = _grad_of_sum(P.orpo, (0, 1))(extreme_w, extreme_l)
    assert np.all(np.isfinite(vals)) and all(np.all(np.isfinite(g)) for g in grads)
    check_grads(
        P.orpo,
        (jnp.asarray(_tile([-0.3, -1.5, -0.05])), jnp.asarray(_tile([-0.7, -0.2, -3.0]))),
        order=1,
        modes=("rev",),
        atol=1e-2,
        rtol=1e-2,
        eps=1e-3,
    )


@pytest.mark.parametrize(
    "fn,kwargs,ref_kwargs",
    [
        (P.simpo, {}, {"gamma": 0.5, "alpha": 0.0}),
        (P.simpo, {"beta": 2.0, "gamma": 1.0, "label_smoothing": 0.1}, {"gamma": 1.0, "eps": 0.1}),
        (P.simpo, {"cpo_alpha": 0.5}, {"gamma": 0.5, "alpha": 0.5}),
        (P.cpo, {}, {"gamma": 0.0, "alpha": 1.0}),
        (P.cpo, {"cpo_alpha": 0.0, "label_smoothing": 0.3}, {"gamma": 0.0, "eps": 0.3}),
    ],
)
def test_simpo_cpo_match_reference(rng, fn, kwargs, ref_kwargs):
    lw, ll = _avg_pairs(rng)
    got = fn(jnp.asarray(lw, jnp.float32), jnp.asarray(ll, jnp.float32), **kwargs)
    want = ref.simpo_cpo(lw, ll, beta=kwargs.get("beta", 0.1), **ref_kwargs)
    chex.assert_type(got, jnp.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_simpo_margin_by_hand_and_huge_margins():
    # lw = ll: loss = −logσ(−γ) = log(1 + e^γ).
    lp = jnp.asarray(_tile([-1.0, -3.0]), jnp.float32)
    np.testing.assert_allclose(P.simpo(lp, lp), math.log1p(math.exp(0.5)), rtol=1e-6)
    big = jnp.asarray(_tile([1e4, -1e4]), jnp.float32)
    vals = P.cpo(big, -big, label_smoothing=0.1)
    grads = _grad_of_sum(P.cpo, (0, 1), label_smoothing=0.1)(big, -big)
    assert (
        np.all(np.isfinite(vals)) and np.all(np.isfinite(grads[1])) and np.all(np.isfinite(grads))
    )
    check_grads(
        P.simpo,
        (jnp.asarray(_tile([-0.3, -1.5])), jnp.asarray(_tile([-0.7, -0.2]))),
        order=1,
        modes=("rev",),
        atol=1e-2,
        rtol=1e-2,
        eps=1e-3,
    )


def test_reference_free_errors():
    z = jnp.zeros(3)
    with pytest.raises(ValueError, match="shape mismatch"):
        P.simpo(z, jnp.zeros(4))
    with pytest.raises(ValueError, match="chosen_nll"):
        P.orpo(z, z, chosen_nll=jnp.zeros(2))
    with pytest.raises(ValueError, match="label_smoothing"):
        P.cpo(z, z, label_smoothing=0.6)
    with pytest.raises(ValueError, match="gamma"):
        P.simpo(z, z, gamma=-1.0)
    with pytest.raises(ValueError, match="beta"):
        P.orpo(z, z, beta=0.0)


# ------------------------------------------------------------------------------------------
# CPO loss types and AlphaPO.


@pytest.mark.parametrize("loss_type", P.CPO_LOSS_TYPES)
@pytest.mark.parametrize("alpha", [0.0, 0.25])
def test_cpo_loss_types_match_reference(rng, loss_type, alpha):
    lw, ll = _avg_pairs(rng)
    got = P.cpo(
        jnp.asarray(lw, jnp.float32),
        jnp.asarray(ll, jnp.float32),
        beta=0.5,
        loss_type=loss_type,
        alpha=alpha,
        cpo_alpha=0.3,
    )
    want = ref.simpo_cpo(lw, ll, beta=0.5, gamma=0.0, alpha=0.3, loss_type=loss_type, shape=alpha)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_alphapo_reward_by_hand_and_limit():
    lp = jnp.asarray(_tile([-0.5, -2.0, 0.0]), jnp.float32)
    np.testing.assert_array_equal(P.alphapo_reward(lp, 0.0), lp)
    # α = 1: r = 1 − 1/p = 1 − e^{−lp}.
    np.testing.assert_allclose(P.alphapo_reward(lp, 1.0), 1.0 - np.exp(-np.asarray(lp)), rtol=1e-6)
    # α → 0 recovers the log reward, and the gradient e^{−α·lp} → 1.
    np.testing.assert_allclose(P.alphapo_reward(lp, 1e-4), lp, atol=1e-3)
    grad = _grad_of_sum(P.alphapo_reward, 0, alpha=0.5)(lp)
    np.testing.assert_allclose(grad, np.exp(-0.5 * np.asarray(lp)), rtol=1e-6)
    with pytest.raises(ValueError, match="alpha must be finite"):
        P.alphapo_reward(lp, math.inf)


@pytest.mark.parametrize("alpha", [0.0, 0.1, -0.3])
def test_alphapo_matches_reference(rng, alpha):
    lw, ll = _avg_pairs(rng)
    got = P.alphapo(
        jnp.asarray(lw, jnp.float32), jnp.asarray(ll, jnp.float32), alpha=alpha, beta=2.5
    )
    want = ref.simpo_cpo(lw, ll, beta=2.5, gamma=0.5, shape=alpha)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    check_grads(
        functools.partial(P.alphapo, alpha=alpha, beta=2.5),
        (jnp.asarray(_tile([-0.3, -1.5])), jnp.asarray(_tile([-0.7, -0.2]))),
        order=1,
        modes=("rev",),
        atol=1e-2,
        rtol=1e-2,
        eps=1e-3,
    )


def test_cpo_loss_type_errors():
    z = jnp.zeros(3)
    with pytest.raises(ValueError, match="unknown loss_type"):
        P.cpo(z, z, loss_type="simpo")
    with pytest.raises(ValueError, match="'sigmoid' only"):
        P.cpo(z, z, loss_type="hinge", gamma=0.5)
    with pytest.raises(ValueError, match="'sigmoid' only"):
        P.cpo(z, z, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(TypeError, match="alpha"):
        P.alphapo(z, z)  # alpha has no default: alpha = 0 would be plain SimPO
