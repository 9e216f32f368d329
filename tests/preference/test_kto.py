"""Tests for jaxrl_llm.preference.kto against tests/reference/preference.py."""

from __future__ import annotations

import functools

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxrl_llm import preference as P
from tests.preference.common import N, _grad_of_sum, _tile
from tests.reference import preference as ref

# ------------------------------------------------------------------------------------------
# KTO.


def _kto_inputs(rng, n=N, m=6):
    policy = rng.normal(-20.0, 5.0, n)
    reference = policy + rng.normal(0.0, 4.0, n)
    labels = rng.random(n) < 0.5
    labels[:2] = [True, False]
    kl_policy = rng.normal(-25.0, 5.0, m)
    kl_ref = kl_policy + rng.normal(-1.0, 1.0, m)  # mean log ratio > 0: z0 > 0
    return policy, reference, labels, kl_policy, kl_ref


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.33, 0.7)])
def test_kto_matches_reference(rng, weights):
    policy, reference, labels, kl_policy, kl_ref = _kto_inputs(rng)
    to32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    got = P.kto(
        to32(policy),
        to32(reference),
        labels,
        to32(kl_policy),
        to32(kl_ref),
        beta=0.3,
        desirable_weight=weights[0],
        undesirable_weight=weights[1],
    )
    want = ref.kto(
        policy, reference, labels, kl_policy, kl_ref, beta=0.3, w_d=weights[0], w_u=weights[1]
    )
    chex.assert_shape(got, (N,))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert float(P.kto_reference_point(to32(kl_policy), to32(kl_ref))) > 0


def test_kto_reference_point_clamped_and_detached(rng):
    policy, reference, labels, kl_policy, kl_ref = (jnp.asarray(a) for a in _kto_inputs(rng))
    # Mean log ratio < 0 → z0 = 0, the same as passing no KL pairs.
    below = P.kto(policy, reference, labels, kl_policy, kl_policy + 3.0)
    np.testing.assert_allclose(below, P.kto(policy, reference, labels, None, None), rtol=1e-6)
    np.testing.assert_allclose(
        below,
        ref.kto(
            np.asarray(policy), np.asarray(reference), np.asarray(labels), None, None, beta=0.1
        ),
        rtol=1e-5,
    )
    grad = _grad_of_sum(P.kto, 3)(policy, reference, labels, kl_policy, kl_ref)
    np.testing.assert_array_equal(grad, 0.0)


def test_kto_gradients_and_tails(rng):
    policy, reference, labels, kl_policy, kl_ref = _kto_inputs(rng)
    policy, reference, kl_policy, kl_ref = (
        jnp.asarray(a, jnp.float32) for a in (policy, reference, kl_policy, kl_ref)
    )
    g = _grad_of_sum(P.kto, 0)(policy, reference, labels, kl_policy, kl_ref)
    # Desirable examples are pushed up, undesirable ones down.
    assert np.all(np.asarray(g)[np.asarray(labels)] < 0)
    assert np.all(np.asarray(g)[~np.asarray(labels)] > 0)
    check_grads(
        lambda p: P.kto(p, reference, labels, kl_policy, kl_ref, beta=0.5),
        (policy / 10,),
        order=1,
        modes=("rev",),
        atol=1e-2,
        rtol=1e-2,
        eps=1e-2,
    )
    huge = jnp.asarray(_tile([1e4, -1e4, 1e4, -1e4]), jnp.float32)
    lab = jnp.asarray(_tile([True, True, False, False]))
    vals = P.kto(huge, jnp.zeros(N), lab, None, None)
    grads = _grad_of_sum(P.kto, 0)(huge, jnp.zeros(N), lab, None, None)
    assert np.all(np.isfinite(grads))
    np.testing.assert_allclose(vals, _tile([0, 1, 1, 0]), atol=1e-6)


def test_kto_errors():
    z = jnp.zeros(3)
    with pytest.raises(ValueError, match="shape mismatch"):
        P.kto(z, z, jnp.ones(4, bool), None, None)
    with pytest.raises(ValueError, match="neither"):
        P.kto(z, z, z, z, None)
    with pytest.raises(ValueError, match="empty"):
        P.kto(z, z, z, jnp.zeros(0), jnp.zeros(0))
    with pytest.raises(ValueError, match="desirable_weight"):
        P.kto(z, z, z, None, None, desirable_weight=-1.0)
