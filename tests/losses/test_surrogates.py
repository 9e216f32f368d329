"""Tests for jaxrl_llm.losses.surrogates against the float64 references of
tests/reference/losses.py."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxrl_llm.losses import surrogates
from jaxrl_llm.losses.aggregation import MODES, aggregate, sequence_mean
from jaxrl_llm.losses.ratios import token_log_ratio
from tests.reference import losses as ref
from tests.reference import stabilisers as stab

B, T = 6, 5
PPO_CONFIGS = [(0.2, 0.2, None), (0.2, 0.28, None), (0.2, 0.2, 3.0)]


def _batch(rng, adv_rank=1):
    log_ratio = (rng.normal(size=(B, T)) * 0.4).astype(np.float32)
    log_ratio[0, :3] = [3.0, -3.0, 1.5]  # far beyond both bounds and the dual clip
    lp = (rng.normal(size=(B, T)) - 2.0).astype(np.float32)
    shape = (B,) if adv_rank == 1 else (B, T)
    adv = rng.normal(size=shape).astype(np.float32)
    adv[1] = 0.0
    mask = ref.ragged_mask(rng, B, T, empty_rows=(4,), full_rows=(0,))
    return log_ratio, lp, adv, mask


def _smooth_log_ratio(rng):
    """Log-ratios at least 0.05 away from every kink (log 0.8, log 1.2, log 1.28, log 3)."""
    centres = np.array([-0.8, -0.45, 0.0, 0.5, 0.8])
    return (rng.choice(centres, size=(B, T)) + rng.uniform(-0.1, 0.1, (B, T))).astype(np.float32)


# ----------------------------------------------------------------------------- ppo_clip


@pytest.mark.parametrize("adv_rank", [1, 2])
@pytest.mark.parametrize("clip_low,clip_high,dual_clip", PPO_CONFIGS)
def test_ppo_clip_matches_reference(rng, adv_rank, clip_low, clip_high, dual_clip):
    log_ratio, _, adv, _ = _batch(rng, adv_rank)
    kw = {"clip_low": clip_low, "clip_high": clip_high, "dual_clip": dual_clip}
    out = surrogates.ppo_clip(log_ratio, adv, **kw)
    chex.assert_shape(out, (B, T))
    chex.assert_type(out, jnp.float32)
    np.testing.assert_allclose(out, ref.ppo_clip(log_ratio, adv, **kw), rtol=1e-5, atol=1e-6)
    grad = jax.grad(lambda x: surrogates.ppo_clip(x, adv, **kw).sum())(log_ratio)
    np.testing.assert_allclose(grad, ref.ppo_clip_grad(log_ratio, adv, **kw), rtol=1e-5, atol=1e-6)
    metrics = surrogates.ppo_clip_metrics(log_ratio, adv, **kw)
    want = ref.ppo_clip_metrics(log_ratio, adv, **kw)
    assert set(metrics) == {"clipped", "clipped_lower"}
    for key in want:
        chex.assert_shape(metrics[key], (B, T))
        np.testing.assert_array_equal(metrics[key], want[key])


E3 = float(np.exp(np.float32(3.0)))
# (log_ratio, advantage, dual_clip, loss, d loss / d log_ratio, clipped, clipped_lower);
# clip 0.2 / 0.2. Hand-derived from L = max(−A·r, −A·clip(r, 0.8, 1.2)).
PPO_CASES = [
    (3.0, 1.0, None, -1.2, 0.0, 1, 0),  # far above, A > 0: clipped
    (3.0, -1.0, None, E3, E3, 0, 0),  # far above, A < 0: unbounded without dual clip
    (3.0, -1.0, 3.0, 3.0, 0.0, 0, 1),  # ... bounded by the dual clip
    (3.0, 1.0, 3.0, -1.2, 0.0, 1, 0),  # dual clip never touches A > 0
    (-3.0, 1.0, None, -np.exp(-3.0), -np.exp(-3.0), 0, 0),  # far below, A > 0: unclipped
    (-3.0, -1.0, None, 0.8, 0.0, 1, 0),  # far below, A < 0: clipped
    (-3.0, -1.0, 3.0, 0.8, 0.0, 1, 0),
    (0.0, 2.0, None, -2.0, -2.0, 0, 0),  # on-policy: gradient −A
    (0.0, -2.0, 3.0, 2.0, 2.0, 0, 0),
    (0.1, 0.0, 3.0, 0.0, 0.0, 0, 0),  # zero advantage: no loss, no gradient
]


@pytest.mark.parametrize("case", PPO_CASES)
def test_ppo_clip_hand_checked(case):
    log_ratio, adv, dual, loss, grad, clipped, lower = case
    x = jnp.full((1, 1), log_ratio)
    a = jnp.array([adv])

    def f(z):
        return surrogates.ppo_clip(z, a, dual_clip=dual)[0, 0]

    np.testing.assert_allclose(f(x), loss, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(f)(x)[0, 0], grad, rtol=1e-6)
    metrics = surrogates.ppo_clip_metrics(x, a, dual_clip=dual)
    assert (metrics["clipped"][0, 0], metrics["clipped_lower"][0, 0]) == (clipped, lower)


def test_ppo_clip_exactly_at_the_bounds():
    log_ratio = jnp.log(jnp.array([[0.8, 1.2, 1.28]]))
    for adv, want in [(1.0, [-0.8, -1.2, -1.2]), (-1.0, [0.8, 1.2, 1.28])]:
        np.testing.assert_allclose(
            surrogates.ppo_clip(log_ratio, jnp.array([adv])), [want], rtol=1e-6
        )
    # Clip-higher (DAPO): with ε_high = 0.28 a ratio of 1.25 is inside the band for A > 0.
    x = jnp.log(jnp.array([[1.25]]))
    np.testing.assert_allclose(surrogates.ppo_clip(x, jnp.ones(1)), [[-1.2]], rtol=1e-6)
    np.testing.assert_allclose(
        surrogates.ppo_clip(x, jnp.ones(1), clip_high=0.28), [[-1.25]], rtol=1e-6
    )


def test_dual_clip_only_changes_negative_advantages(rng):
    log_ratio, _, adv, _ = _batch(rng, adv_rank=2)
    plain = np.asarray(surrogates.ppo_clip(log_ratio, adv))
    dual = np.asarray(surrogates.ppo_clip(log_ratio, adv, dual_clip=1.5))
    np.testing.assert_array_equal(dual[adv >= 0], plain[adv >= 0])
    assert np.any(dual[adv < 0] < plain[adv < 0])


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_ppo_clip_check_grads(rng, dual_clip):
    log_ratio = _smooth_log_ratio(rng)
    adv = rng.normal(size=(B,)).astype(np.float32)

    def f(x):
        return surrogates.ppo_clip(x, adv, dual_clip=dual_clip)

    check_grads(f, (log_ratio,), order=1, modes=["rev"], eps=1e-3, atol=1e-2, rtol=1e-2)


# ----------------------------------------------------------------------------- on-policy gradients


@pytest.mark.parametrize("mode", MODES)
def test_on_policy_gradients_equal_reinforce(rng, mode):
    """At old = sg(lp) (r = 1), PPO-clip, CISPO and SAPO have the vanilla PG gradient."""
    _, lp, adv, mask = _batch(rng)

    def loss(fn):
        def f(x):
            return aggregate(fn(x), mask, mode)

        return jax.grad(f)(lp)

    want = loss(lambda x: surrogates.reinforce(x, adv))

    def ratio(x):
        return token_log_ratio(x, jax.lax.stop_gradient(x))

    got = {
        "ppo_clip": loss(lambda x: surrogates.ppo_clip(ratio(x), adv, dual_clip=3.0)),
        "cispo": loss(lambda x: surrogates.cispo(ratio(x), x, adv, clip_low=None, clip_high=4.0)),
        "sapo": loss(lambda x: surrogates.sapo(ratio(x), adv)),
    }
    for name, grad in got.items():
        np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7, err_msg=name)
    assert np.any(np.asarray(want) != 0.0)


def test_on_policy_gmpo_gradient_equals_sequence_mean_reinforce(rng):
    _, lp, adv, mask = _batch(rng)

    def gmpo_loss(x):
        ratio = token_log_ratio(x, jax.lax.stop_gradient(x))
        return sequence_mean(surrogates.gmpo(ratio, adv, mask), mask)

    def pg_loss(x):
        return aggregate(surrogates.reinforce(x, adv), mask, "seq-mean-token-mean")

    np.testing.assert_allclose(jax.grad(gmpo_loss)(lp), jax.grad(pg_loss)(lp), rtol=1e-5)


def test_cispo_keeps_the_gradient_of_clipped_tokens_ppo_does_not():
    lp = jnp.array([[-1.0, -1.0]])
    old = jnp.array([[-4.0, -1.05]])  # ratio e^3 (clipped) and e^0.05 (inside)
    adv = jnp.array([1.0])

    def ppo(x):
        return surrogates.ppo_clip(token_log_ratio(x, old), adv, clip_high=0.28).sum()

    def cispo(x):
        ratio = token_log_ratio(x, old)
        return surrogates.cispo(ratio, x, adv, clip_low=0.2, clip_high=0.28).sum()

    np.testing.assert_allclose(jax.grad(ppo)(lp), [[0.0, -np.exp(0.05)]], rtol=1e-5)
    np.testing.assert_allclose(jax.grad(cispo)(lp), [[-1.28, -np.exp(0.05)]], rtol=1e-5)


# ----------------------------------------------------------------------------- cispo


@pytest.mark.parametrize("adv_rank", [1, 2])
@pytest.mark.parametrize("clip_low", [None, 0.2])
def test_cispo_matches_reference(rng, adv_rank, clip_low):
    log_ratio, lp, adv, _ = _batch(rng, adv_rank)
    kw = {"clip_low": clip_low, "clip_high": 0.28}
    out = surrogates.cispo(log_ratio, lp, adv, **kw)
    chex.assert_shape(out, (B, T))
    np.testing.assert_allclose(out, ref.cispo(log_ratio, lp, adv, **kw), rtol=1e-5, atol=1e-6)
    g_ratio, g_lp = jax.grad(lambda x, y: surrogates.cispo(x, y, adv, **kw).sum(), (0, 1))(
        log_ratio, lp
    )
    np.testing.assert_array_equal(g_ratio, np.zeros((B, T)))  # the weight is detached
    np.testing.assert_allclose(
        g_lp, ref.cispo_grad_wrt_lp(log_ratio, adv, **kw), rtol=1e-5, atol=1e-6
    )
    clipped = surrogates.cispo_metrics(log_ratio, **kw)["clipped"]
    want = ref.cispo_weight(log_ratio, **kw) != np.exp(log_ratio.astype(np.float64))
    np.testing.assert_array_equal(clipped, want.astype(np.float32))


def test_cispo_bounds_hand_checked():
    log_ratio = jnp.log(jnp.array([[0.1, 1.0, 10.0]]))
    lp, adv = jnp.ones((1, 3)), jnp.array([-1.0])
    # No lower bound: weight 0.1 stays; upper bound is 1 + clip_high = 5, not 4.
    np.testing.assert_allclose(
        surrogates.cispo(log_ratio, lp, adv, clip_low=None, clip_high=4.0),
        [[0.1, 1.0, 5.0]],
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        surrogates.cispo(log_ratio, lp, adv, clip_low=0.2, clip_high=4.0),
        [[0.8, 1.0, 5.0]],
        rtol=1e-6,
    )


def test_cispo_check_grads(rng):
    log_ratio, lp, adv, _ = _batch(rng)

    def f(y):
        return surrogates.cispo(log_ratio, y, adv, clip_low=0.2, clip_high=0.28)

    check_grads(f, (lp,), order=1, modes=["rev"], eps=1e-3, atol=1e-2, rtol=1e-2)


# ----------------------------------------------------------------------------- sapo


@pytest.mark.parametrize("adv_rank", [1, 2])
def test_sapo_matches_reference(rng, adv_rank):
    log_ratio, _, adv, _ = _batch(rng, adv_rank)
    for taus in [(1.0, 1.05), (0.5, 2.0)]:
        kw = {"tau_pos": taus[0], "tau_neg": taus[1]}
        out = surrogates.sapo(log_ratio, adv, **kw)
        chex.assert_shape(out, (B, T))
        np.testing.assert_allclose(out, ref.sapo(log_ratio, adv, **kw), rtol=1e-5, atol=1e-6)


def test_sapo_hand_checked_temperatures():
    x = jnp.log(jnp.array([[2.0]]))
    sig = lambda z: 1.0 / (1.0 + np.exp(-z))  # noqa: E731
    np.testing.assert_allclose(surrogates.sapo(x, jnp.ones(1)), [[-4.0 * sig(1.0)]], rtol=1e-6)
    np.testing.assert_allclose(
        surrogates.sapo(x, -jnp.ones(1)), [[4.0 / 1.05 * sig(1.05)]], rtol=1e-6
    )
    assert surrogates.sapo(x, jnp.zeros(1))[0, 0] == 0.0


def test_sapo_check_grads(rng):
    log_ratio, _, adv, _ = _batch(rng)

    def f(x):
        return surrogates.sapo(x, adv)

    check_grads(f, (log_ratio * 0.5,), order=1, modes=["rev"], eps=1e-3, atol=1e-2, rtol=1e-2)


# ----------------------------------------------------------------------------- gmpo


@pytest.mark.parametrize("adv_rank", [1, 2])
def test_gmpo_matches_reference(rng, adv_rank):
    log_ratio, _, adv, mask = _batch(rng, adv_rank)
    out = surrogates.gmpo(log_ratio, adv, mask)
    chex.assert_shape(out, (B,))
    chex.assert_type(out, jnp.float32)
    np.testing.assert_allclose(out, ref.gmpo(log_ratio, adv, mask), rtol=1e-5, atol=1e-6)
    assert out[4] == 0.0  # empty row
    clipped = surrogates.gmpo_metrics(log_ratio, adv, mask)["clipped"]
    np.testing.assert_array_equal(clipped, ref.gmpo_clipped(log_ratio, adv, mask))
    assert np.asarray(clipped).sum() > 0
    kw = {"clip_low": 0.1, "clip_high": 0.3}
    np.testing.assert_allclose(
        surrogates.gmpo(log_ratio, adv, mask, **kw),
        ref.gmpo(log_ratio, adv, mask, **kw),
        rtol=1e-5,
        atol=1e-6,
    )


def test_gmpo_hand_checked():
    # A > 0: Δ = (0.8, 0.0) → Δ* = (0.4, 0.0), ρ = exp(0.2); A < 0: Δ = (−0.8, 0.8)
    # → Δ* = (−0.4, 0.8), ρ = exp(0.2); the third token is padding.
    log_ratio = jnp.array([[0.8, 0.0, 50.0], [-0.8, 0.8, -50.0]])
    mask = jnp.array([[1, 1, 0], [1, 1, 0]], bool)
    adv = jnp.array([2.0, -1.0])
    np.testing.assert_allclose(
        surrogates.gmpo(log_ratio, adv, mask), [-2.0 * np.exp(0.2), np.exp(0.2)], rtol=1e-6
    )
    grad = jax.grad(lambda x: surrogates.gmpo(x, adv, mask).sum())(log_ratio)
    # Only unclipped valid tokens move ρ: d/dΔ_t = −Ā·ρ/n.
    e = np.exp(0.2)
    np.testing.assert_allclose(grad, [[0.0, -e, 0.0], [0.0, 0.5 * e, 0.0]], rtol=1e-6)


def test_gmpo_check_grads(rng):
    log_ratio = rng.uniform(-0.3, 0.3, (B, T)).astype(np.float32)  # inside the ±0.4 kinks
    _, _, adv, mask = _batch(rng)

    def f(x):
        return surrogates.gmpo(x, adv, mask)

    check_grads(f, (log_ratio,), order=1, modes=["rev"], eps=1e-3, atol=1e-2, rtol=1e-2)


# ----------------------------------------------------------------------------- reinforce


@pytest.mark.parametrize("adv_rank", [1, 2])
def test_reinforce_matches_reference(rng, adv_rank):
    _, lp, adv, _ = _batch(rng, adv_rank)
    out = surrogates.reinforce(lp, adv)
    chex.assert_shape(out, (B, T))
    np.testing.assert_allclose(out, ref.reinforce(lp, adv), rtol=1e-6)
    check_grads(lambda y: surrogates.reinforce(y, adv), (lp,), order=2, modes=["rev"], eps=1e-3)


# ----------------------------------------------------------------------------- masking, dtypes, jit


def test_garbage_padding_gets_exactly_zero_gradient(rng):
    log_ratio, lp, adv, mask = _batch(rng)
    bad_ratio = np.where(mask > 0, log_ratio, 1e4).astype(np.float32)
    bad_ratio[4, 0] = np.inf  # row 4 is empty
    bad_lp = np.where(mask > 0, lp, -1e30).astype(np.float32)
    losses = {
        "ppo_clip": lambda x, y: surrogates.ppo_clip(x, adv, dual_clip=3.0),
        "sapo": lambda x, y: surrogates.sapo(x, adv),
        "cispo": lambda x, y: surrogates.cispo(x, y, adv, clip_low=None, clip_high=4.0),
    }
    for name, fn in losses.items():
        value, (g_ratio, g_lp) = jax.value_and_grad(
            lambda x, y, fn=fn: aggregate(fn(x, y), mask, "token-mean"), (0, 1)
        )(bad_ratio, bad_lp)
        np.testing.assert_allclose(
            value, aggregate(fn(log_ratio, lp), mask, "token-mean"), rtol=1e-6, err_msg=name
        )
        for g in (g_ratio, g_lp):
            g = np.asarray(g)
            assert np.all(np.isfinite(g)), name
            assert np.all(g[mask == 0] == 0.0), name
    value, grad = jax.value_and_grad(lambda x: sequence_mean(surrogates.gmpo(x, adv, mask), mask))(
        bad_ratio
    )
    np.testing.assert_allclose(
        value, sequence_mean(surrogates.gmpo(log_ratio, adv, mask), mask), rtol=1e-6
    )
    assert np.all(np.asarray(grad)[mask == 0] == 0.0)


def _bf16_case(rng, adv_rank):
    """bf16 ``(log_ratio, logprobs, advantages, mask)`` and their exact values in f64."""
    data = ref.bf16_batch(rng)
    delta = np.float64(data["logprobs"]) - np.float64(data["old_logprobs"])
    log_ratio = ref.bf16(delta)  # as if Δ were formed in bf16 upstream: |Δ| up to 8
    adv = data["advantages" if adv_rank == 1 else "token_advantages"]
    bf = [jnp.asarray(x) for x in (log_ratio, data["logprobs"], adv)]
    exact = [np.float64(x) for x in (log_ratio, data["logprobs"], adv)]
    return bf, exact, data["mask"]


@pytest.mark.parametrize("adv_rank", [1, 2])
def test_bf16_inputs_are_upcast_before_any_math(rng, adv_rank):
    """bf16 inputs give f32 losses equal to f64 math on the bf16-rounded inputs (math in bf16
    is off by up to 2^-9 relative per operation), and the same clipping indicators."""
    (x, lp, a), (x64, lp64, a64), mask = _bf16_case(rng, adv_rank)
    assert x.dtype == lp.dtype == a.dtype == jnp.bfloat16
    ppo = {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0}
    cases = {
        "ppo_clip": (surrogates.ppo_clip(x, a, **ppo), ref.ppo_clip(x64, a64, **ppo)),
        "ppo_clip/no dual": (surrogates.ppo_clip(x, a), ref.ppo_clip(x64, a64)),
        "cispo": (
            surrogates.cispo(x, lp, a, clip_low=None, clip_high=4.0),
            ref.cispo(x64, lp64, a64, None, 4.0),
        ),
        "cispo/both bounds": (
            surrogates.cispo(x, lp, a, clip_low=0.2, clip_high=0.28),
            ref.cispo(x64, lp64, a64, 0.2, 0.28),
        ),
        "sapo": (surrogates.sapo(x, a), ref.sapo(x64, a64)),
        "gmpo": (surrogates.gmpo(x, a, mask), ref.gmpo(x64, a64, mask)),
        "reinforce": (surrogates.reinforce(lp, a), ref.reinforce(lp64, a64)),
    }
    for name, (got, want) in cases.items():
        chex.assert_type(got, jnp.float32)
        np.testing.assert_allclose(np.float64(got), want, rtol=1e-6, atol=1e-6, err_msg=name)

    indicators = {
        "ppo_clip_metrics": (
            surrogates.ppo_clip_metrics(x, a, **ppo),
            ref.ppo_clip_metrics(x64, a64, **ppo),
        ),
        "cispo_metrics": (
            surrogates.cispo_metrics(x, clip_low=0.2, clip_high=0.28),
            # Truncated where r leaves [0.8, 1.28] (not ``weight != exp``: the reference's
            # math.exp and np.exp may differ by an ulp).
            {"clipped": (np.exp(x64) > 1.28) | (np.exp(x64) < 0.8)},
        ),
        "gmpo_metrics": (
            surrogates.gmpo_metrics(x, a, mask),
            {"clipped": ref.gmpo_clipped(x64, a64, mask)},
        ),
    }
    for name, (got, want) in indicators.items():
        assert got.keys() == want.keys(), name
        for key in want:
            chex.assert_type(got[key], jnp.float32)
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{name}/{key}")
            assert 0 < np.mean(want[key]) < 1 or key == "clipped_lower", (name, key)


def test_bf16_gradient_is_the_rounded_f32_gradient(rng):
    """The cotangent reaching a bf16 input is bf16, within bf16 rounding of the exact one."""
    (x, lp, a), (x64, lp64, a64), _ = _bf16_case(rng, 2)
    kw = {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0}
    grad = jax.grad(lambda v: surrogates.ppo_clip(v, a, **kw).sum())(x)
    assert grad.dtype == jnp.bfloat16
    want = ref.ppo_clip_grad(x64, a64, **kw)
    assert np.count_nonzero(want) > want.size // 4
    np.testing.assert_allclose(np.float64(grad), want, rtol=2**-8)
    grad = jax.grad(lambda v: surrogates.cispo(x, v, a, clip_low=None, clip_high=4.0).sum())(lp)
    assert grad.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.float64(grad), ref.cispo_grad_wrt_lp(x64, a64, None, 4.0), rtol=2**-8
    )


def test_jit_vmap_and_no_recompile(rng):
    log_ratio, lp, adv, mask = _batch(rng)
    traces = []

    @jax.jit
    def f(x, y, a, m):
        traces.append(None)
        return (
            surrogates.ppo_clip(x, a, clip_high=0.28, dual_clip=3.0),
            surrogates.cispo(x, y, a, clip_low=None, clip_high=4.0),
            surrogates.sapo(x, a),
            surrogates.gmpo(x, a, m),
            surrogates.reinforce(y, a),
            surrogates.ppo_clip_metrics(x, a, dual_clip=3.0),
        )

    out = f(log_ratio, lp, adv, mask)
    f(log_ratio * 0.5, lp, -adv, mask)
    assert len(traces) == 1
    np.testing.assert_allclose(out[3], ref.gmpo(log_ratio, adv, mask), rtol=1e-5, atol=1e-6)
    batched = jax.vmap(lambda x, a: surrogates.ppo_clip(x, a))(
        np.stack([log_ratio, -log_ratio]), np.stack([adv, 2 * adv])
    )
    chex.assert_shape(batched, (2, B, T))
    np.testing.assert_allclose(batched[1], ref.ppo_clip(-log_ratio, 2 * adv), rtol=1e-5, atol=1e-6)


def test_errors(rng):
    log_ratio, lp, adv, mask = _batch(rng)
    with pytest.raises(ValueError, match="clip_low"):
        surrogates.ppo_clip(log_ratio, adv, clip_low=1.0)
    with pytest.raises(ValueError, match="clip_low"):
        surrogates.ppo_clip(log_ratio, adv, clip_low=-0.1)
    with pytest.raises(ValueError, match="clip_high"):
        surrogates.ppo_clip(log_ratio, adv, clip_high=-0.2)
    with pytest.raises(ValueError, match="clip_low"):
        surrogates.ppo_clip(log_ratio, adv, clip_low=None)
    for bad in (1.0, 0.5):
        with pytest.raises(ValueError, match="dual_clip must be > 1"):
            surrogates.ppo_clip(log_ratio, adv, dual_clip=bad)
        with pytest.raises(ValueError, match="dual_clip must be > 1"):
            surrogates.ppo_clip_metrics(log_ratio, adv, dual_clip=bad)
    with pytest.raises(ValueError, match=r"advantages must have shape.*\(7,\)"):
        surrogates.ppo_clip(log_ratio, np.zeros(7))
    with pytest.raises(ValueError, match="rank 2"):
        surrogates.sapo(log_ratio[0], adv[:1])
    with pytest.raises(ValueError, match="tau_neg"):
        surrogates.sapo(log_ratio, adv, tau_neg=0.0)
    with pytest.raises(ValueError, match="tau_pos"):
        surrogates.sapo(log_ratio, adv, tau_pos=-1.0)
    with pytest.raises(ValueError, match="clip_high"):
        surrogates.cispo(log_ratio, lp, adv, clip_low=None, clip_high=None)
    with pytest.raises(ValueError, match=r"log_ratio.*logprobs"):
        surrogates.cispo(log_ratio, lp[:, :3], adv, clip_low=None, clip_high=4.0)
    with pytest.raises(ValueError, match="clip_low"):
        surrogates.gmpo(log_ratio, adv, mask, clip_low=1.5)
    with pytest.raises(ValueError, match="mask"):
        surrogates.gmpo(log_ratio, adv, mask[:, :2])
    with pytest.raises(ValueError, match="advantages"):
        surrogates.reinforce(lp, adv[:, None])


# ------------------------------------------------------------------ DPPO, KL-Cov, Clip-Cov
# Float64 references of the peers' formulas in tests/reference/stabilisers.py.


def _policy(rng, adv_rank=1):
    """Log-probs spread over (0, 1] in probability, moves that cross both trust regions."""
    old = np.log(rng.uniform(0.02, 0.98, (B, T))).astype(np.float32)
    lp = np.log(np.clip(np.exp(old) + rng.normal(0.0, 0.25, (B, T)), 1e-3, 0.999))
    lp = lp.astype(np.float32)
    shape = (B,) if adv_rank == 1 else (B, T)
    adv = rng.normal(size=shape).astype(np.float32)
    adv[1] = 0.0
    mask = ref.ragged_mask(rng, B, T, empty_rows=(4,), full_rows=(0,))
    return lp, old, adv, mask


def _dppo_loss(lp, old, adv, **kw):
    return surrogates.dppo(token_log_ratio(lp, old), lp, old, adv, **kw)


@pytest.mark.parametrize("adv_rank", [1, 2])
@pytest.mark.parametrize(
    "divergence,delta_low,delta_high,cap",
    [("tv", 0.15, 0.15, None), ("tv", 0.1, 0.2, 1.5)]
    + [("kl", 0.05, 0.05, None), ("kl", 0.02, 0.08, 1.5)],
)
def test_dppo_matches_reference(rng, adv_rank, divergence, delta_low, delta_high, cap):
    lp, old, adv, _ = _policy(rng, adv_rank)
    kw = {"divergence": divergence, "delta_low": delta_low, "delta_high": delta_high}
    want_inside = stab.dppo_inside(lp, old, adv, divergence, delta_low, delta_high)
    assert 0 < want_inside.mean() < 1  # both sides of the trust region are exercised
    np.testing.assert_array_equal(surrogates.dppo_trust_region(lp, old, adv, **kw), want_inside)
    want, want_grad = stab.dppo(lp, old, adv, divergence, delta_low, delta_high, cap)
    out = _dppo_loss(lp, old, adv, ratio_cap=cap, **kw)
    chex.assert_shape(out, (B, T))
    chex.assert_type(out, jnp.float32)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    grad = jax.grad(lambda x: _dppo_loss(x, old, adv, ratio_cap=cap, **kw).sum())(lp)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)
    metrics = surrogates.dppo_metrics(token_log_ratio(lp, old), lp, old, adv, ratio_cap=cap, **kw)
    np.testing.assert_array_equal(metrics["clipped"], 1.0 - want_inside)
    if cap is not None:
        capped = (np.exp(np.float64(lp) - old) > cap) * want_inside
        np.testing.assert_array_equal(metrics["clipped_lower"], capped)
        assert capped.any()


# (p_old, p, A, divergence, inside): hand-checked against the definitions, δ = 0.15 (TV) and
# 0.05 (KL). A rare token may grow by a large ratio; a likely one may not lose much mass.
DPPO_CASES = [
    (0.01, 0.10, 1.0, "tv", 1),  # ratio 10, TV 0.09 <= 0.15: PPO would clip, DPPO does not
    (0.50, 0.70, 1.0, "tv", 0),  # +0.2 > 0.15
    (0.99, 0.80, 1.0, "tv", 1),  # probability fell while A > 0: always inside
    (0.99, 0.80, -1.0, "tv", 0),  # ratio 0.81 is inside PPO's 0.8, but −0.19 < −0.15
    (0.01, 0.10, 1.0, "kl", 0),  # KL(Ber(.01)‖Ber(.1)) = 0.0697 > 0.05
    (0.01, 0.05, 1.0, "kl", 1),  # 0.0202 <= 0.05
    (0.50, 0.30, -1.0, "kl", 0),  # 0.0872 > 0.05
    (0.50, 0.60, -1.0, "kl", 1),  # moved up with A < 0: always inside
]


@pytest.mark.parametrize("case", DPPO_CASES)
def test_dppo_trust_region_hand_checked(case):
    old_p, p, adv, divergence, inside = case
    delta = 0.15 if divergence == "tv" else 0.05
    lp, old = jnp.log(jnp.array([[p]])), jnp.log(jnp.array([[old_p]]))
    kw = {"divergence": divergence, "delta_low": delta, "delta_high": delta}
    region = surrogates.dppo_trust_region(lp, old, jnp.array([adv]), **kw)
    assert float(region[0, 0]) == inside
    grad = jax.grad(lambda x: _dppo_loss(x, old, jnp.array([adv]), **kw)[0, 0])(lp)
    np.testing.assert_allclose(grad[0, 0], -adv * p / old_p * inside, rtol=1e-5)


def test_dppo_binary_kl_value_hand_checked():
    d = surrogates.binary_divergence(
        jnp.log(jnp.array([[0.1]])), jnp.log(jnp.array([[0.01]])), kind="kl"
    )
    want = 0.01 * np.log(0.01 / 0.1) + 0.99 * np.log(0.99 / 0.9)
    np.testing.assert_allclose(d[0, 0], want, rtol=1e-5)


@pytest.mark.parametrize("adv_rank", [1, 2])
@pytest.mark.parametrize("fraction,coef", [(0.1, 0.1), (0.3, 1.0), (1e-4, 1.0)])
def test_kl_cov_matches_reference(rng, adv_rank, fraction, coef):
    lp, old, adv, mask = _policy(rng, adv_rank)
    x = lp - old
    selected = np.asarray(surrogates.kl_cov_selection(lp, adv, mask, fraction=fraction))
    want_selected = stab.kl_cov_selection(lp, adv, mask, fraction)
    np.testing.assert_array_equal(selected, want_selected)
    assert selected.sum() == max(1, int(mask.sum() * fraction))
    np.testing.assert_allclose(
        surrogates.token_covariance(lp, adv, mask),
        stab.covariance(lp, adv, mask),
        rtol=1e-5,
        atol=1e-6,
    )

    def f(z):
        return surrogates.kl_cov(z - old, z, adv, mask, fraction=fraction, coef=coef)

    want, want_grad = stab.kl_cov(x, lp, adv, mask, fraction, coef)
    valid = mask > 0
    np.testing.assert_allclose(np.asarray(f(lp))[valid], want[valid], rtol=1e-5, atol=1e-6)
    grad = jax.grad(lambda z: aggregate(f(z), mask, "token-sum"))(lp)
    np.testing.assert_allclose(grad, want_grad * valid, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fraction", [0.05, 0.5, 1.0])
def test_clip_cov_zeroes_a_random_subset_of_the_candidates(rng, fraction):
    lp, old, adv, mask = _policy(rng, adv_rank=2)
    x = lp - old
    cov = stab.covariance(lp, adv, mask)
    low, high = np.quantile(cov[mask > 0], [0.2, 0.9])
    kw = {"cov_low": low, "cov_high": high, "clip_low": 0.2, "clip_high": 0.28}
    candidates = stab.clip_cov_candidates(x, lp, adv, mask, low, high, 0.2, 0.28)
    want_count = min(stab.clip_count(mask, fraction), int(candidates.sum()))
    assert candidates.sum() > 1
    draws = []
    for seed in range(3):
        key = jax.random.key(seed)
        selected = np.asarray(
            surrogates.clip_cov_selection(x, lp, adv, mask, key=key, fraction=fraction, **kw)
        )
        assert selected.sum() == want_count
        assert np.all(candidates[selected > 0])
        draws.append(selected)

        def f(z, key=key):
            return surrogates.clip_cov(z - old, z, adv, mask, key=key, fraction=fraction, **kw)

        plain = ref.ppo_clip(x, adv, clip_low=0.2, clip_high=0.28)
        np.testing.assert_allclose(f(lp), plain * (1 - selected), rtol=1e-5, atol=1e-6)
        grad = jax.grad(lambda z, f=f: f(z).sum())(lp)
        plain_grad = ref.ppo_clip_grad(x, adv, clip_low=0.2, clip_high=0.28)
        np.testing.assert_allclose(grad, plain_grad * (1 - selected), rtol=1e-5, atol=1e-6)
    if want_count < candidates.sum():
        assert any(np.any(d != draws[0]) for d in draws[1:])  # the draw depends on the key


def test_stabilisers_edge_cases_give_no_nan(rng):
    """Empty mask, every token clipped, zero covariance (constant advantages), probabilities
    of exactly 1 and garbage padding: finite values and gradients, and the documented 0s."""
    lp, old, adv, mask = _policy(rng, adv_rank=1)
    empty = np.zeros_like(mask)
    key = jax.random.key(0)
    garbage_lp = np.where(mask > 0, lp, 5.0).astype(np.float32)  # log-prob > 0 on padding

    def losses(z, m, a, o):
        x = z - o
        return {
            "dppo_tv": surrogates.dppo(x, z, o, a, divergence="tv"),
            "dppo_kl": surrogates.dppo(x, z, o, a, divergence="kl", ratio_cap=2.0),
            "kl_cov": surrogates.kl_cov(x, z, a, m, fraction=0.5),
            "clip_cov": surrogates.clip_cov(x, z, a, m, key=key, fraction=0.5, cov_low=-1.0),
        }

    cases = {
        "empty": (lp, empty, adv, old),
        "all_clipped": (old + 3.0 * np.sign(adv)[:, None], mask, adv, old),
        "zero_covariance": (lp, mask, np.ones_like(adv), old),
        "certain": (np.zeros_like(lp), mask, adv, np.zeros_like(old)),
        "garbage": (garbage_lp, mask, adv, old),
    }
    for name, (z, m, a, o) in cases.items():
        z = jnp.asarray(z, jnp.float32)
        for piece in losses(z, m, a, o):

            def total(y, m=m, a=a, o=o, piece=piece):
                return aggregate(losses(y, m, a, o)[piece], m, "token-mean")

            value, grad = jax.value_and_grad(total)(z)
            assert np.isfinite(float(value)), (name, piece)
            assert np.all(np.isfinite(grad)), (name, piece)
            if name == "empty":
                assert float(value) == 0.0 and not np.any(grad)
            if name == "garbage":
                assert not np.any(np.asarray(grad)[mask == 0]), piece
    # Every token held by PPO's clip: Clip-Cov has no candidate left and equals PPO-clip.
    z = jnp.asarray(old + 3.0 * np.sign(adv)[:, None], jnp.float32)
    x = z - old
    np.testing.assert_array_equal(
        surrogates.clip_cov(x, z, adv, mask, key=key, fraction=1.0, cov_low=-1e9, cov_high=1e9),
        surrogates.ppo_clip(x, adv),
    )
    # Zero covariance: KL-Cov still picks its count (by index), no NaN.
    selected = surrogates.kl_cov_selection(lp, np.ones_like(adv), mask, fraction=0.2)
    assert float(selected.sum()) == max(1, int(0.2 * mask.sum()))


def test_stabiliser_errors(rng):
    lp, old, adv, mask = _policy(rng)
    x = lp - old
    with pytest.raises(ValueError, match="divergence"):
        surrogates.dppo(x, lp, old, adv, divergence="js")
    with pytest.raises(ValueError, match="ratio_cap"):
        surrogates.dppo(x, lp, old, adv, ratio_cap=0.0)
    with pytest.raises(ValueError, match="delta_low"):
        surrogates.dppo_trust_region(lp, old, adv, delta_low=-0.1)
    with pytest.raises(ValueError, match="fraction"):
        surrogates.kl_cov(x, lp, adv, mask, fraction=0.0)
    with pytest.raises(ValueError, match="cov_low < cov_high"):
        surrogates.clip_cov(x, lp, adv, mask, key=jax.random.key(0), cov_low=2.0, cov_high=1.0)
    with pytest.raises(ValueError, match="shape"):
        surrogates.kl_cov(x, lp[:, :-1], adv, mask)
