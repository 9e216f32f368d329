"""Tests for jaxrl_llm.preference against the float64 references in tests/reference/."""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxrl_llm import preference as P
from tests.reference import preference as ref

N = 16
LOG2 = math.log(2.0)
# Per-type label smoothing exercised (exo_pair needs ε > 0, robust ε < 0.5).
SMOOTHING = {"sigmoid": (0.0, 0.2), "robust": (0.0, 0.2), "exo_pair": (1e-3, 0.2)}


def _pairs(rng, n=N, scale=10.0):
    """Summed log-probs of random pairs: margins of both signs, zero lengths included."""
    chosen = rng.normal(-30.0, scale, n)
    rejected = rng.normal(-30.0, scale, n)
    ref_chosen = chosen + rng.normal(0.0, scale / 3, n)
    ref_rejected = rejected + rng.normal(0.0, scale / 3, n)
    n_w = rng.integers(0, 20, n).astype(np.float64)
    n_l = rng.integers(0, 20, n).astype(np.float64)
    n_w[0] = n_l[1] = 0.0
    return chosen, rejected, ref_chosen, ref_rejected, n_w, n_l


def _smoothing(loss_type):
    return SMOOTHING.get(loss_type, (0.0,))


def _cases():
    return [(t, eps) for t in P.LOSS_TYPES for eps in _smoothing(t)]


# Most tests run eagerly on purpose: with the shapes they share ([N] f32, one token batch shape),
# every primitive compiles once for the whole file, where a jit per loss configuration would
# compile again for each. The jit tests below cover the compiled path.


def _tile(values, n=N):
    """A short hand-made pattern repeated to the shared length ``N``."""
    return np.resize(np.asarray(values), n)


def _grad_of_sum(fn, argnums, **static):
    return jax.grad(lambda *a, **k: jnp.sum(fn(*a, **static, **k)), argnums=argnums)


def _dpo_static(loss_type, eps, beta, kw):
    return dict(beta=beta, loss_type=loss_type, label_smoothing=eps, **kw)


def _dpo_f32(arrays, loss_type, eps, beta=0.1, dtype=jnp.float32, **kw):
    chosen, rejected, ref_chosen, ref_rejected, n_w, n_l = (jnp.asarray(a, dtype) for a in arrays)
    return P.dpo(
        chosen,
        rejected,
        ref_chosen,
        ref_rejected,
        **_dpo_static(loss_type, eps, beta, kw),
        chosen_len=n_w,
        rejected_len=n_l,
    )


def _dpo_grad_f32(arrays, loss_type, eps, beta=0.1):
    """Gradient of the summed loss with respect to the chosen and rejected log-probs."""
    chosen, rejected, *rest = (jnp.asarray(a, jnp.float32) for a in arrays)

    def total(c, r):
        return _dpo_f32((c, r, *rest), loss_type, eps, beta=beta).sum()

    return jax.grad(total, (0, 1))(chosen, rejected)


def _dpo_ref(arrays, loss_type, eps, beta=0.1, **kw):
    chosen, rejected, ref_chosen, ref_rejected, n_w, n_l = arrays
    return ref.dpo(
        chosen,
        rejected,
        ref_chosen,
        ref_rejected,
        loss_type,
        beta=beta,
        eps=eps,
        n_w=n_w,
        n_l=n_l,
        **kw,
    )


# ------------------------------------------------------------------------------------------
# Sequence helpers.


def test_sequence_helpers_match_reference(rng):
    token_logps = rng.normal(-2.0, 1.0, (5, 7)).astype(np.float32)
    mask = rng.random((5, 7)) < 0.6
    mask[2] = False
    np.testing.assert_allclose(
        P.sequence_logps(token_logps, mask), ref.seq_sum(token_logps, mask), rtol=1e-6
    )
    np.testing.assert_allclose(
        P.average_logps(token_logps, mask), ref.seq_avg(token_logps, mask), rtol=1e-6
    )
    np.testing.assert_array_equal(P.sequence_lengths(mask), ref.seq_len(mask))
    assert float(P.average_logps(token_logps, mask)[2]) == 0.0  # empty completion guarded
    chex.assert_type(P.sequence_logps(token_logps.astype(jnp.bfloat16), mask), jnp.float32)


def test_padding_contributes_nothing_even_if_non_finite():
    token_logps = jnp.array([[-1.0, -2.0, -jnp.inf, jnp.nan]], jnp.float32)
    mask = jnp.array([[1, 1, 0, 0]], jnp.float32)
    assert float(P.sequence_logps(token_logps, mask)[0]) == -3.0
    grad = jax.grad(lambda x: P.average_logps(x, mask).sum())(token_logps)
    np.testing.assert_array_equal(grad, [[0.5, 0.5, 0.0, 0.0]])


def test_sequence_helpers_reject_bad_shapes():
    with pytest.raises(ValueError, match="mask"):
        P.sequence_logps(jnp.zeros((2, 3)), jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="rank 2"):
        P.sequence_lengths(jnp.ones(3))


# ------------------------------------------------------------------------------------------
# DPO loss types: values.


@pytest.mark.parametrize("loss_type,eps", _cases())
def test_dpo_matches_reference(rng, loss_type, eps):
    arrays = _pairs(rng)
    got = _dpo_f32(arrays, loss_type, eps)
    chex.assert_shape(got, (N,))
    chex.assert_type(got, jnp.float32)
    np.testing.assert_allclose(got, _dpo_ref(arrays, loss_type, eps), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("beta", [0.05, 2.0])
def test_dpo_matches_reference_across_beta(rng, beta):
    arrays = _pairs(rng, scale=3.0)
    for loss_type, eps in _cases():
        got = _dpo_f32(arrays, loss_type, eps, beta=beta)
        want = _dpo_ref(arrays, loss_type, eps, beta=beta)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=loss_type)


def test_discopop_tau(rng):
    arrays = _pairs(rng, scale=3.0)
    got = _dpo_f32(arrays, "discopop", 0.0, discopop_tau=0.3)
    np.testing.assert_allclose(got, _dpo_ref(arrays, "discopop", 0.0, tau=0.3), rtol=2e-5)
    assert not np.allclose(got, _dpo_f32(arrays, "discopop", 0.0))


def _equal_pair_value(loss_type, eps, beta):
    """Hand-derived loss at c = ρ = 0 (so Δ = 0) with equal lengths."""
    return {
        "sigmoid": LOG2,
        "hinge": 1.0,
        "ipo": (1.0 / (2.0 * beta)) ** 2,
        "robust": LOG2,  # (1 − 2ε)·log 2 / (1 − 2ε)
        "exo_pair": -LOG2 - 0.5 * math.log(max(eps * (1.0 - eps), 1e-300)),
        "nca_pair": 2.0 * LOG2,
        "bco_pair": 2.0 * LOG2,
        "sppo_hard": 2.0 * (1.0 / (2.0 * beta)) ** 2,
        "apo_zero": 1.0,
        "apo_down": 1.0,
        "discopop": 0.5 * LOG2 + 0.5,
        "sigmoid_norm": LOG2,
    }[loss_type]


@pytest.mark.parametrize("loss_type,eps", _cases())
def test_dpo_equal_chosen_and_rejected(loss_type, eps):
    beta = 0.25
    lp = _tile([-12.0, -3.5, 0.0])
    lengths = _tile([4.0, 7.0, 0.0])
    got = _dpo_f32((lp, lp, lp, lp, lengths, lengths), loss_type, eps, beta=beta)
    np.testing.assert_allclose(got, _equal_pair_value(loss_type, eps, beta) * np.ones(N), rtol=1e-6)


def test_sigmoid_dpo_tails_by_hand():
    # Δ = +1e4 → loss ≈ 0; Δ = −1e4 → loss ≈ −logσ(−1000) = 1000.
    zeros = np.zeros(N)
    margin = _tile([1e4, -1e4])
    got = _dpo_f32((margin, zeros, zeros, zeros, zeros, zeros), "sigmoid", 0.0)
    np.testing.assert_allclose(got, _tile([0.0, 1000.0]), atol=1e-6)
    smoothed = _dpo_f32((margin, zeros, zeros, zeros, zeros, zeros), "sigmoid", 0.1)
    np.testing.assert_allclose(smoothed, _tile([100.0, 900.0]), rtol=1e-6)


@pytest.mark.parametrize("loss_type,eps", _cases())
def test_dpo_huge_margins_are_finite(loss_type, eps):
    big = 1e4
    values = _tile([big, -big, big, -big, 0.0])
    arrays = (values, -values, np.zeros(N), np.zeros(N), np.full(N, 3.0), np.full(N, 0.0))
    got = _dpo_f32(arrays, loss_type, eps)
    assert np.all(np.isfinite(got)), got
    np.testing.assert_allclose(got, _dpo_ref(arrays, loss_type, eps), rtol=1e-5, atol=1e-5)
    grads = _dpo_grad_f32(arrays, loss_type, eps)
    assert all(np.all(np.isfinite(g)) for g in grads), grads


@pytest.mark.parametrize("loss_type", ["ipo", "sigmoid_norm"])
def test_zero_length_completions_are_guarded(loss_type):
    lp = _tile([-3.0, -1.0])
    arrays = (lp, lp - 2.0, np.zeros(N), np.zeros(N), np.zeros(N), _tile([0, 2]))
    got = _dpo_f32(arrays, loss_type, 0.0)
    assert np.all(np.isfinite(got))
    # max(n, 1): a zero-length completion is divided by 1.
    want = ref.dpo(
        _tile([-3.0, -1.0]),
        _tile([-5.0, -3.0]),
        np.zeros(N),
        np.zeros(N),
        loss_type,
        beta=0.1,
        n_w=np.ones(N),
        n_l=_tile([1.0, 2.0]),
    )
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_mixture_is_weighted_sum(rng):
    arrays = _pairs(rng)
    got = _dpo_f32(arrays, ("sigmoid", "bco_pair"), 0.1, loss_weights=(0.8, 0.2))
    want = 0.8 * _dpo_ref(arrays, "sigmoid", 0.1) + 0.2 * _dpo_ref(arrays, "bco_pair", 0.1)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # A list works as well as a tuple (eager: a list is not hashable for the jit cache).
    unweighted = P.dpo(
        *arrays[:4], loss_type=["ipo", "hinge"], chosen_len=arrays[4], rejected_len=arrays[5]
    )
    want = _dpo_ref(arrays, "ipo", 0.0) + _dpo_ref(arrays, "hinge", 0.0)
    np.testing.assert_allclose(unweighted, want, rtol=2e-5, atol=2e-5)


# ------------------------------------------------------------------------------------------
# DPO loss types: gradients.


def _moderate(rng, n=N):
    return tuple(jnp.asarray(rng.normal(0.0, 2.0, n), jnp.float32) for _ in range(4))


@pytest.mark.parametrize("loss_type,eps", _cases())
def test_dpo_check_grads(rng, loss_type, eps):
    lengths = jnp.asarray(rng.integers(0, 9, N), jnp.float32)
    fn = functools.partial(
        P.dpo,
        beta=0.5,
        loss_type=loss_type,
        label_smoothing=eps,
        chosen_len=lengths,
        rejected_len=lengths[::-1],
    )
    chosen, rejected, ref_chosen, ref_rejected = _moderate(rng)
    if loss_type == "hinge":
        # Keep βΔ away from the kink at 1, where finite differences are meaningless.
        z = 0.5 * (chosen - ref_chosen - rejected + ref_rejected)
        chosen = jnp.where(jnp.abs(z - 1.0) < 0.3, chosen + 1.5, chosen)
    args = (chosen, rejected, ref_chosen, ref_rejected)
    check_grads(fn, args, order=1, modes=("rev",), atol=1e-2, rtol=1e-2, eps=1e-2)


@pytest.mark.parametrize("loss_type,eps", _cases())
def test_dpo_gradient_matches_reference_finite_differences(rng, loss_type, eps):
    arrays = _pairs(rng, scale=3.0)
    beta = 0.5
    got = _dpo_grad_f32(arrays, loss_type, eps, beta=beta)
    h = 1e-6
    for arg, g in enumerate(got):
        want = np.zeros(N)
        for i in range(N):
            plus = [np.array(a, np.float64) for a in arrays]
            minus = [np.array(a, np.float64) for a in arrays]
            plus[arg][i] += h
            minus[arg][i] -= h
            want[i] = (
                _dpo_ref(plus, loss_type, eps, beta=beta).sum()
                - _dpo_ref(minus, loss_type, eps, beta=beta).sum()
            ) / (2 * h)
        np.testing.assert_allclose(g, want, rtol=1e-3, atol=1e-4, err_msg=f"{loss_type} arg {arg}")


def test_sigmoid_gradient_raises_chosen_lowers_rejected(rng):
    chosen, rejected, ref_chosen, ref_rejected = _moderate(rng)
    g_chosen, g_rejected = _grad_of_sum(P.dpo, (0, 1))(chosen, rejected, ref_chosen, ref_rejected)
    # Gradient descent moves along −grad: chosen up, rejected down.
    assert np.all(g_chosen < 0) and np.all(g_rejected > 0)
    np.testing.assert_allclose(g_chosen, -g_rejected, rtol=1e-6)


def test_ipo_minimum_at_half_inverse_beta():
    beta = 0.2
    n_w, n_l = jnp.array([4.0, 1.0]), jnp.array([2.0, 3.0])
    # c/n_w − ρ/n_l = 1/(2β) with ρ = 0.
    chosen = n_w / (2 * beta)
    zeros = jnp.zeros(2)

    @jax.jit
    def loss(c):
        return P.dpo(
            c, zeros, zeros, zeros, beta=beta, loss_type="ipo", chosen_len=n_w, rejected_len=n_l
        ).sum()

    assert float(loss(chosen)) == pytest.approx(0.0, abs=1e-10)
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(chosen), 0.0, atol=1e-7)
    assert float(loss(chosen + 0.1)) > 0 and float(loss(chosen - 0.1)) > 0


# ------------------------------------------------------------------------------------------
# jit, vmap, dtypes, recompilation.


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "discopop"])
def test_dpo_jit_and_vmap(rng, loss_type):
    arrays = tuple(jnp.asarray(a, jnp.float32) for a in _pairs(rng))
    fn = functools.partial(P.dpo, loss_type=loss_type)
    eager = fn(*arrays[:4], chosen_len=arrays[4], rejected_len=arrays[5])
    jitted = jax.jit(fn)(*arrays[:4], chosen_len=arrays[4], rejected_len=arrays[5])
    np.testing.assert_allclose(jitted, eager, rtol=1e-6)
    # vmap over a leading axis of 2 stacked batches, and over individual pairs.
    stacked = tuple(jnp.stack([a, a[::-1]]) for a in arrays)
    batched = jax.jit(jax.vmap(lambda *a: fn(*a[:4], chosen_len=a[4], rejected_len=a[5])))(*stacked)
    chex.assert_shape(batched, (2, N))
    np.testing.assert_allclose(batched[0], eager, rtol=1e-6)
    np.testing.assert_allclose(batched[1], eager[::-1], rtol=1e-6)
    per_pair = jax.jit(jax.vmap(lambda *a: fn(*a[:4], chosen_len=a[4], rejected_len=a[5])))(*arrays)
    np.testing.assert_allclose(per_pair, eager, rtol=1e-6)


@pytest.mark.parametrize("loss_type,eps", _cases())
def test_dpo_bf16_inputs_give_f32(rng, loss_type, eps):
    arrays = _pairs(rng, scale=3.0)
    bf16 = tuple(jnp.asarray(a, jnp.bfloat16) for a in arrays)
    got = _dpo_f32(bf16, loss_type, eps, dtype=jnp.bfloat16)
    chex.assert_type(got, jnp.float32)
    # Same math as f32 on the bf16-rounded inputs: upcast happens before any subtraction.
    want = _dpo_f32(tuple(np.asarray(a.astype(jnp.float32)) for a in bf16), loss_type, eps)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_no_recompile_on_second_call(rng):
    traces = []

    def fn(*args):
        traces.append(1)
        return P.dpo(*args, loss_type=("sigmoid", "apo_zero"), loss_weights=(1.0, 0.5)).mean()

    jitted = jax.jit(jax.value_and_grad(fn))
    first = _moderate(rng)
    jitted(*first)
    jitted(*_moderate(rng))
    assert len(traces) == 1


# ------------------------------------------------------------------------------------------
# DPO: errors.


def _ones(n=3):
    return (jnp.zeros(n),) * 4


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"loss_type": "exo_pair"}, "exo_pair"),
        ({"loss_type": "robust", "label_smoothing": 0.5}, "robust"),
        ({"loss_type": ("sigmoid", "robust"), "label_smoothing": 0.5}, "robust"),
        ({"loss_type": "dpo"}, "unknown loss_type"),
        ({"loss_type": ()}, "non-empty"),
        ({"loss_type": None}, "loss_type"),
        ({"loss_type": "ipo"}, "chosen_len"),
        ({"loss_type": "sigmoid_norm", "chosen_len": jnp.ones(3)}, "rejected_len"),
        ({"beta": 0.0}, "beta"),
        ({"label_smoothing": 0.7}, r"\[0, 0.5\]"),
        ({"label_smoothing": -0.1}, r"\[0, 0.5\]"),
        ({"loss_type": "hinge", "label_smoothing": 0.1}, "no effect"),
        ({"discopop_tau": 0.1}, "discopop_tau"),
        ({"loss_type": "discopop", "discopop_tau": 0.0}, "discopop_tau"),
        ({"loss_weights": (1.0, 2.0)}, "one weight per loss type"),
        ({"loss_weights": (-1.0,)}, ">= 0"),
        ({"loss_wieghts": (1.0,)}, "unknown loss_kwargs"),
    ],
)
def test_dpo_rejects_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        P.dpo(*_ones(), **kwargs)


def test_dpo_rejects_bad_shapes():
    z = jnp.zeros(3)
    with pytest.raises(ValueError, match=r"shape mismatch.*ref_rejected\(4,\)"):
        P.dpo(z, z, z, jnp.zeros(4))
    with pytest.raises(ValueError, match="rank"):
        P.dpo(*(jnp.zeros((2, 3)),) * 4)
    with pytest.raises(ValueError, match="chosen_len"):
        P.dpo(z, z, z, z, loss_type="ipo", chosen_len=jnp.ones(4), rejected_len=jnp.ones(3))


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
# preference_loss.


def _token_batch(rng, n=6, t=9, t_rej=7, empty_rejected=True):
    chosen_tok = rng.normal(-1.5, 0.8, (n, t)).astype(np.float32)
    rejected_tok = rng.normal(-1.8, 0.8, (n, t_rej)).astype(np.float32)
    chosen_mask = np.arange(t)[None] < rng.integers(1, t + 1, n)[:, None]
    rejected_mask = np.arange(t_rej)[None] < rng.integers(0, t_rej + 1, n)[:, None]
    rejected_mask[:, 0] = True
    if empty_rejected:
        rejected_mask[0] = False
    ref_chosen_tok = (chosen_tok + rng.normal(0, 0.3, (n, t))).astype(np.float32)
    ref_rejected_tok = (rejected_tok + rng.normal(0, 0.3, (n, t_rej))).astype(np.float32)
    return chosen_tok, chosen_mask, rejected_tok, rejected_mask, ref_chosen_tok, ref_rejected_tok


def _expected_metrics(rw, rl, lw, ll):
    return {
        "rewards/chosen": rw.mean(),
        "rewards/rejected": rl.mean(),
        "rewards/accuracies": (rw > rl).mean(),
        "rewards/margins": (rw - rl).mean(),
        "logps/chosen": lw.mean(),
        "logps/rejected": ll.mean(),
    }


def _assert_metrics(out, expected):
    for key, value in expected.items():
        np.testing.assert_allclose(out.metrics[key], value, rtol=1e-5, atol=1e-5, err_msg=key)
        chex.assert_shape(out.metrics[key], ())
    np.testing.assert_allclose(out.metrics["loss"], out.loss, rtol=1e-7)


@pytest.mark.parametrize("loss_name", ["sigmoid", "ipo", "sigmoid_norm", ("sigmoid", "bco_pair")])
@pytest.mark.parametrize("ref_per_token", [False, True])
def test_preference_loss_dpo(rng, loss_name, ref_per_token):
    ct, cm, rt, rm, rct, rrt = _token_batch(rng)
    lw, ll = ref.seq_sum(ct, cm), ref.seq_sum(rt, rm)
    rw_ref, rl_ref = ref.seq_sum(rct, cm), ref.seq_sum(rrt, rm)
    refs = (rct, rrt) if ref_per_token else (rw_ref.astype(np.float32), rl_ref.astype(np.float32))
    kwargs = {"loss_weights": (0.8, 0.2)} if isinstance(loss_name, tuple) else {}
    out = P.preference_loss(loss_name, ct, cm, rt, rm, *refs, beta=0.2, **kwargs)
    weights = kwargs.get("loss_weights")
    want = ref.dpo(
        lw,
        ll,
        rw_ref,
        rl_ref,
        loss_name,
        weights=weights,
        beta=0.2,
        n_w=ref.seq_len(cm),
        n_l=ref.seq_len(rm),
    ).mean()
    chex.assert_shape(out.loss, ())
    chex.assert_type(out.loss, jnp.float32)
    np.testing.assert_allclose(out.loss, want, rtol=1e-5)
    _assert_metrics(out, _expected_metrics(0.2 * (lw - rw_ref), 0.2 * (ll - rl_ref), lw, ll))


def test_preference_loss_dpo_gradient_only_on_valid_tokens(rng):
    ct, cm, rt, rm, rct, rrt = _token_batch(rng)
    grads = jax.jit(
        jax.grad(lambda c, r: P.preference_loss("sigmoid", c, cm, r, rm, rct, rrt).loss, (0, 1))
    )(ct, rt)
    np.testing.assert_array_equal(np.asarray(grads[0])[~cm], 0.0)
    np.testing.assert_array_equal(np.asarray(grads[1])[~rm], 0.0)
    assert np.all(np.asarray(grads[0])[cm] < 0)


@pytest.mark.parametrize("per_token_kl", [False, True])
def test_preference_loss_kto(rng, per_token_kl):
    ct, cm, rt, rm, rct, rrt = _token_batch(rng)
    kl_pol_tok = rng.normal(-2.0, 0.5, (4, 9)).astype(np.float32)
    kl_ref_tok = (kl_pol_tok - 0.3).astype(np.float32)
    kl_mask = np.ones((4, 9), bool)
    kl_mask[1, 5:] = False
    kl_pol, kl_ref = ref.seq_sum(kl_pol_tok, kl_mask), ref.seq_sum(kl_ref_tok, kl_mask)
    if per_token_kl:
        kl_kwargs = {"kl_policy_logps": kl_pol_tok, "kl_ref_logps": kl_ref_tok, "kl_mask": kl_mask}
    else:
        kl_kwargs = {
            "kl_policy_logps": kl_pol.astype(np.float32),
            "kl_ref_logps": kl_ref.astype(np.float32),
        }
    out = P.preference_loss(
        "kto", ct, cm, rt, rm, rct, rrt, beta=0.3, desirable_weight=1.2, **kl_kwargs
    )
    lw, ll = ref.seq_sum(ct, cm), ref.seq_sum(rt, rm)
    rw_ref, rl_ref = ref.seq_sum(rct, cm), ref.seq_sum(rrt, rm)
    labels = np.array([True] * 6 + [False] * 6)
    want = ref.kto(
        np.concatenate([lw, ll]),
        np.concatenate([rw_ref, rl_ref]),
        labels,
        kl_pol,
        kl_ref,
        beta=0.3,
        w_d=1.2,
    ).mean()
    np.testing.assert_allclose(out.loss, want, rtol=1e-5)
    expected = _expected_metrics(0.3 * (lw - rw_ref), 0.3 * (ll - rl_ref), lw, ll)
    expected["kl"] = max((kl_pol - kl_ref).mean(), 0.0)
    _assert_metrics(out, expected)


@pytest.mark.parametrize("loss_name", ["orpo", "simpo", "cpo"])
def test_preference_loss_reference_free(rng, loss_name):
    # Non-empty completions: an empty one averages to log-prob 0, where ORPO's odds are inf.
    ct, cm, rt, rm, _, _ = _token_batch(rng, empty_rejected=False)
    beta = 0.5
    lw, ll = ref.seq_avg(ct, cm), ref.seq_avg(rt, rm)
    nll = ref.batch_token_mean_nll(ct, cm)
    kwargs = {"gamma": 0.2, "cpo_alpha": 0.3} if loss_name == "simpo" else {}
    out = P.preference_loss(loss_name, ct, cm, rt, rm, beta=beta, **kwargs)
    if loss_name == "orpo":
        per_pair, log_odds = ref.orpo(lw, ll, beta=beta, nll=0.0)
        want = per_pair.mean() + nll
    elif loss_name == "simpo":
        want = ref.simpo_cpo(lw, ll, beta=beta, gamma=0.2, nll=0.0).mean() + 0.3 * nll
    else:
        want = ref.simpo_cpo(lw, ll, beta=beta, gamma=0.0, nll=0.0).mean() + 1.0 * nll
    np.testing.assert_allclose(out.loss, want, rtol=1e-5)
    expected = _expected_metrics(beta * lw, beta * ll, lw, ll)
    expected["nll_loss"] = nll
    if loss_name == "orpo":
        expected["log_odds_chosen"] = log_odds.mean()
        expected["log_odds_ratio"] = ref.log_sigmoid(log_odds).mean()
    _assert_metrics(out, expected)


def test_preference_loss_bf16_and_no_recompile(rng):
    ct, cm, rt, rm, rct, rrt = _token_batch(rng)
    traces = []

    def loss(c, r):
        return P.preference_loss("simpo", c, cm, r, rm).loss

    def fn(c, r):
        traces.append(1)
        return loss(c, r)

    step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
    loss_bf16, grads = step(jnp.asarray(ct, jnp.bfloat16), jnp.asarray(rt, jnp.bfloat16))
    chex.assert_type(loss_bf16, jnp.float32)
    chex.assert_type(grads, jnp.bfloat16)
    rounded = [np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (ct, rt)]
    loss_f32 = jax.jit(loss)
    np.testing.assert_allclose(loss_bf16, loss_f32(*rounded), rtol=1e-6)
    np.testing.assert_allclose(loss_bf16, loss_f32(ct, rt), rtol=1e-2)
    step(jnp.asarray(ct + 0.1, jnp.bfloat16), jnp.asarray(rt - 0.1, jnp.bfloat16))
    assert len(traces) == 1


def test_preference_loss_errors(rng):
    ct, cm, rt, rm, rct, rrt = _token_batch(rng)
    with pytest.raises(ValueError, match="ref_chosen_logps is required"):
        P.preference_loss("sigmoid", ct, cm, rt, rm)
    with pytest.raises(ValueError, match="reference-free"):
        P.preference_loss("simpo", ct, cm, rt, rm, rct, rrt)
    with pytest.raises(ValueError, match="unknown loss_name"):
        P.preference_loss("dpo", ct, cm, rt, rm, rct, rrt)
    with pytest.raises(ValueError, match="number of pairs"):
        P.preference_loss("sigmoid", ct, cm, rt[:3], rm[:3], rct, rrt[:3])
    with pytest.raises(ValueError, match="does not match mask"):
        P.preference_loss("sigmoid", ct[:, :4], cm, rt, rm, rct, rrt)
    with pytest.raises(ValueError, match="ref_rejected_logps must have shape"):
        P.preference_loss("sigmoid", ct, cm, rt, rm, rct, np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="unknown keyword"):
        P.preference_loss("orpo", ct, cm, rt, rm, label_smoothing=0.1)
    with pytest.raises(ValueError, match="unknown keyword"):
        P.preference_loss("sigmoid", ct, cm, rt, rm, rct, rrt, chosen_len=np.ones(6))
    with pytest.raises(ValueError, match="unknown keyword"):
        P.preference_loss("kto", ct, cm, rt, rm, rct, rrt, gamma=1.0)


def test_exported_names():
    assert len(P.LOSS_TYPES) == 12 and len(set(P.LOSS_TYPES)) == 12
    assert set(P.PREFERENCE_LOSSES) == set(P.LOSS_TYPES) | {"kto", "orpo", "simpo", "cpo"}


@pytest.mark.parametrize("loss_name", ["orpo", "simpo", "cpo", "ipo", "kto"])
def test_preference_loss_empty_completion_is_finite(rng, loss_name):
    ct, cm, rt, rm, rct, rrt = _token_batch(rng)
    cm[1] = False
    refs = () if loss_name in ("orpo", "simpo", "cpo") else (rct, rrt)
    value, grads = jax.jit(
        jax.value_and_grad(
            lambda c, r: P.preference_loss(loss_name, c, cm, r, rm, *refs).loss, argnums=(0, 1)
        )
    )(ct, rt)
    assert np.isfinite(value) and all(np.all(np.isfinite(g)) for g in grads)
