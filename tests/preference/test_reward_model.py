"""Tests for jaxrl_llm.preference.bradley_terry against float64 NumPy references.

TRL's RewardTrainer loss is ``−mean(logσ(r_w − r_l − m)) + c·mean((r_w + r_l)²)``; the mean of
the per-pair losses must equal it.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import preference as P
from tests.preference.common import LOG2, N, _grad_of_sum, _tile
from tests.reference import preference as ref


def _scores(rng):
    rw, rl = rng.normal(0.5, 2.0, N), rng.normal(-0.5, 2.0, N)
    margins = rng.uniform(0.0, 2.0, N)
    return rw, rl, margins


@pytest.mark.parametrize("use_margin", [False, True])
@pytest.mark.parametrize("center", [0.0, 0.01])
def test_bradley_terry_matches_reference(rng, use_margin, center):
    rw, rl, margins = _scores(rng)
    m = margins if use_margin else None
    got = P.bradley_terry(
        jnp.asarray(rw, jnp.float32),
        jnp.asarray(rl, jnp.float32),
        margins=None if m is None else jnp.asarray(m, jnp.float32),
        center_rewards_coefficient=center,
    )
    chex.assert_shape(got, (N,))
    chex.assert_type(got, jnp.float32)
    want = ref.bradley_terry(rw, rl, margins=m, center=center)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # TRL's batch formula, written out on the float64 inputs.
    diff = rw - rl - (0.0 if m is None else m)
    trl = -np.mean(ref.log_sigmoid(diff)) + center * np.mean((rw + rl) ** 2)
    np.testing.assert_allclose(float(jnp.mean(got)), trl, rtol=1e-5)


@pytest.mark.parametrize("center", [0.0, 0.05])
def test_bradley_terry_gradient_matches_finite_differences(rng, center):
    rw, rl, margins = _scores(rng)
    g_w, g_l = _grad_of_sum(P.bradley_terry, (0, 1), center_rewards_coefficient=center)(
        jnp.asarray(rw, jnp.float32), jnp.asarray(rl, jnp.float32), margins=margins
    )
    h = 1e-6
    for g, which in ((g_w, 0), (g_l, 1)):
        want = np.zeros(N)
        for i in range(N):
            plus, minus = [rw.copy(), rl.copy()], [rw.copy(), rl.copy()]
            plus[which][i] += h
            minus[which][i] -= h
            want[i] = (
                ref.bradley_terry(*plus, margins=margins, center=center).sum()
                - ref.bradley_terry(*minus, margins=margins, center=center).sum()
            ) / (2 * h)
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-6)


def test_bradley_terry_by_hand_and_tails():
    equal = P.bradley_terry(jnp.zeros(N), jnp.zeros(N))
    np.testing.assert_allclose(equal, LOG2, rtol=1e-6)
    # A margin m asks for r_w − r_l > m: at r_w − r_l = m the loss is log 2.
    at_margin = P.bradley_terry(jnp.full(N, 2.0), jnp.zeros(N), margins=jnp.full(N, 2.0))
    np.testing.assert_allclose(at_margin, LOG2, rtol=1e-6)
    # Centring: c·(r_w + r_l)² on top.
    centred = P.bradley_terry(jnp.full(N, 1.0), jnp.full(N, 1.0), center_rewards_coefficient=0.25)
    np.testing.assert_allclose(centred, LOG2 + 1.0, rtol=1e-6)
    big = jnp.asarray(_tile([1e4, -1e4]), jnp.float32)
    vals = P.bradley_terry(big, -big)
    grads = _grad_of_sum(P.bradley_terry, (0, 1))(big, -big)
    np.testing.assert_allclose(vals, _tile([0.0, 2e4]), rtol=1e-6)
    assert all(np.all(np.isfinite(g)) for g in grads)
    np.testing.assert_allclose(jax.jit(P.bradley_terry)(big, -big), vals, rtol=1e-6)


def test_bradley_terry_errors():
    z = jnp.zeros(3)
    with pytest.raises(ValueError, match="shape mismatch"):
        P.bradley_terry(z, jnp.zeros(4))
    with pytest.raises(ValueError, match="shape mismatch"):
        P.bradley_terry(z, z, margins=jnp.zeros(2))
    with pytest.raises(ValueError, match="center_rewards_coefficient"):
        P.bradley_terry(z, z, center_rewards_coefficient=-0.1)
    with pytest.raises(ValueError, match="rank"):
        P.bradley_terry(jnp.zeros((2, 3)), jnp.zeros((2, 3)))
