"""Tests for jaxrl_llm.preference.dpo against the float64 references in tests/reference/."""

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
from tests.preference.common import LOG2, N, _grad_of_sum, _tile
from tests.reference import preference as ref

# Per-type label smoothing exercised (exo_pair needs ε > 0, robust ε < 0.5).
SMOOTHING = {
    "sigmoid": (0.0, 0.2),
    "robust": (0.0, 0.2),
    "exo_pair": (1e-3, 0.2),
    "aot": (0.0, 0.2),
    "aot_unpaired": (0.0, 0.2),
}


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


def _equal_pair_value(loss_type, eps, beta, lp, lengths):
    """Hand-derived loss at c = ρ = 0 (so Δ = 0) with equal lengths."""
    if loss_type == "sft":  # the batch's chosen token-mean NLL, on every pair
        return -np.sum(lp) / np.sum(lengths)
    return {
        "sigmoid": LOG2,
        "hinge": 1.0,
        "ipo": (1.0 / (2.0 * beta)) ** 2,
        "robust": LOG2,  # (1 − 2ε)·log 2 / (1 − 2ε)
        "exo_pair": -LOG2 - 0.5 * math.log(max(eps * (1.0 - eps), 1e-300)),
        "nca_pair": 2.0 * LOG2,
        "bco_pair": 2.0 * LOG2,
        "sppo_hard": 2.0 * (1.0 / (2.0 * beta)) ** 2,
        "aot": LOG2,  # sorted differences all 0: S_ε(0) = log 2 for any ε
        "aot_unpaired": LOG2,
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
    want = _equal_pair_value(loss_type, eps, beta, lp, lengths) * np.ones(N)
    np.testing.assert_allclose(got, want, rtol=1e-6)


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


def _sort_separated(rng, n=N):
    """Inputs whose sorted quantities (AOT's chosen − rejected, c, ρ, and the reference's
    chosen − rejected) are all at least 0.2 apart, so finite differences never reorder them
    (a sort is only piecewise linear)."""
    pa, pb, pc, pd = (rng.permutation(n).astype(np.float32) for _ in range(4))
    return (
        jnp.asarray(0.5 * pa),
        jnp.asarray(0.02 * pb),
        jnp.asarray(0.02 * pc),
        jnp.asarray(0.5 * pd),
    )


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
    if loss_type in ("aot", "aot_unpaired"):
        chosen, rejected, ref_chosen, ref_rejected = _sort_separated(rng)
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
# Batch-coupled loss types: AOT sorts over the batch, SFT averages over its chosen tokens.


def test_aot_by_hand():
    beta, eps = 0.5, 0.1
    # Policy chosen − rejected: [3, −1] → sorted [−1, 3]; reference: [0, 2] → sorted [0, 2].
    chosen, rejected = jnp.array([3.0, -1.0]), jnp.zeros(2)
    ref_chosen, ref_rejected = jnp.array([0.0, 2.0]), jnp.zeros(2)
    got = P.dpo(
        chosen, rejected, ref_chosen, ref_rejected, beta=beta, loss_type="aot", label_smoothing=eps
    )
    delta = np.array([-1.0, 1.0])
    want = -(1 - eps) * ref.log_sigmoid(beta * delta) - eps * ref.log_sigmoid(-beta * delta)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # Unpaired: c = [3, −3] → [−3, 3]; ρ = [0, 0].
    got = P.dpo(chosen, rejected, ref_chosen, ref_rejected, beta=beta, loss_type="aot_unpaired")
    np.testing.assert_allclose(got, -ref.log_sigmoid(beta * np.array([-3.0, 3.0])), rtol=1e-6)


@pytest.mark.parametrize("loss_type", ["aot", "aot_unpaired"])
def test_aot_is_a_function_of_sorted_values(rng, loss_type):
    # Reordering the pairs leaves the sorted slots, hence the per-slot losses, unchanged; the
    # gradient follows each pair to its slot.
    args = _sort_separated(rng)
    perm = rng.permutation(N)
    fn = functools.partial(P.dpo, loss_type=loss_type, beta=0.5)
    np.testing.assert_allclose(fn(*args), fn(*(a[perm] for a in args)), rtol=1e-6)
    grads = _grad_of_sum(P.dpo, (0, 1), loss_type=loss_type, beta=0.5)
    g, g_perm = grads(*args), grads(*(a[perm] for a in args))
    for a, b in zip(g, g_perm):
        np.testing.assert_allclose(np.asarray(a)[perm], b, rtol=1e-6)
    # Under jit too, and the sum is what any reordering-blind mean sees.
    np.testing.assert_allclose(jax.jit(fn)(*args), fn(*args), rtol=1e-6)


def test_sft_is_the_batch_chosen_token_mean_nll():
    chosen = jnp.array([-4.0, -6.0, -1.0])
    lengths = jnp.array([2.0, 3.0, 0.0])
    zeros = jnp.zeros(3)

    def loss(c):
        return P.dpo(c, zeros, zeros, zeros, loss_type="sft", chosen_len=lengths)

    np.testing.assert_allclose(loss(chosen), [11.0 / 5.0] * 3, rtol=1e-6)
    # d mean / d chosen_i = −1/Σn for every pair; rejected and reference get nothing.
    np.testing.assert_allclose(jax.grad(lambda c: loss(c).mean())(chosen), [-0.2] * 3, rtol=1e-6)
    g = _grad_of_sum(P.dpo, (1, 2, 3), loss_type="sft", chosen_len=lengths)(
        chosen, zeros, zeros, zeros
    )
    for x in g:
        np.testing.assert_array_equal(x, 0.0)
    # No rejected_len needed; vmapped over pairs it is each sequence's own token mean.
    per_pair = jax.vmap(lambda c, n: P.dpo(c, 0.0, 0.0, 0.0, loss_type="sft", chosen_len=n))
    np.testing.assert_allclose(per_pair(chosen, lengths), [2.0, 2.0, 1.0], rtol=1e-6)


def test_sft_needs_chosen_len_and_ignores_smoothing_rules():
    z = jnp.zeros(3)
    with pytest.raises(ValueError, match=r"\['sft'\].*\['chosen_len'\]"):
        P.dpo(z, z, z, z, loss_type="sft")
    with pytest.raises(ValueError, match="no effect"):
        P.dpo(z, z, z, z, loss_type="sft", chosen_len=z, label_smoothing=0.1)
    # In a mixture with a smoothed type, ε applies to that type only.
    mix = P.dpo(z, z, z, z, loss_type=("aot", "sft"), chosen_len=jnp.ones(3), label_smoothing=0.1)
    np.testing.assert_allclose(mix, LOG2, rtol=1e-6)
