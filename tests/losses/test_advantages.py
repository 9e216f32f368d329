"""Tests for jaxrl_llm.losses.advantages against the float64 references in tests/reference."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxrl_llm.losses import advantages as adv
from tests.reference import advantages as ref
from tests.reference import stabilisers as stab

RTOL = 1e-5
ATOL = 1e-4
SCALES = ("group", "batch", "none")
NUM_GROUPS = 6
TIME = 9


def _assert_close(actual, expected, *, rtol=RTOL, atol=ATOL, name=""):
    chex.assert_type(actual, jnp.float32)
    chex.assert_shape(actual, np.shape(expected))
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol, err_msg=name
    )


def _random_mask(rng, batch, time, *, holes=True):
    """Right-padded ragged rows (some empty, some full), optionally with holes inside."""
    lengths = rng.integers(0, time + 1, size=batch)
    lengths[0], lengths[-1] = time, 1
    mask = np.arange(time)[None, :] < lengths[:, None]
    if holes:
        mask &= rng.random((batch, time)) > 0.2
    return mask


def _outcome_batch(rng, group_size):
    """``[6 G]`` rewards (Gaussian, shifted, 0/1 and one constant group) and a ragged mask."""
    rewards = rng.normal(size=(NUM_GROUPS, group_size))
    rewards[1] = 3.0 + 10.0 * rewards[1]
    rewards[2:4] = rng.integers(0, 2, size=(2, group_size))
    rewards[4] = 0.7
    rewards = rewards.astype(np.float32).reshape(-1)
    return rewards, _random_mask(rng, rewards.size, TIME)


@functools.partial(jax.jit, static_argnames=("group_size",))
def _outcome(rewards, mask, *, group_size):
    """Every per-sequence estimator on one batch: one compile per shape, dtype and ``G``."""
    out = {
        f"grpo/{scale}/ddof{ddof}": adv.grpo(
            rewards, group_size=group_size, scale=scale, std_ddof=ddof
        )
        for scale in SCALES
        for ddof in (0, 1)
    }
    out["rloo"] = adv.rloo(rewards, group_size=group_size)
    out["gpg"] = adv.gpg(rewards, group_size=group_size)
    out["opo"] = adv.opo(rewards, mask, group_size=group_size)
    out["rpp_baseline"] = adv.reinforce_pp_baseline(rewards, mask, group_size=group_size)
    if group_size >= 2:
        for scale in SCALES:
            out[f"pass_at_k/{scale}"] = adv.pass_at_k(rewards, group_size=group_size, scale=scale)
    return out


def _outcome_reference(rewards, mask, group_size):
    out = {
        f"grpo/{scale}/ddof{ddof}": ref.grpo(rewards, group_size, scale, ddof)
        for scale in SCALES
        for ddof in (0, 1)
    }
    out["rloo"] = ref.rloo(rewards, group_size)
    out["gpg"] = ref.gpg(rewards, group_size)
    out["opo"] = ref.opo(rewards, mask, group_size)
    out["rpp_baseline"] = ref.reinforce_pp_baseline(rewards, mask, group_size)
    if group_size >= 2:
        for scale in SCALES:
            out[f"pass_at_k/{scale}"] = ref.pass_at_k(rewards, group_size, scale)
    return out


@functools.partial(jax.jit, static_argnames=("gamma", "lam"))
def _token(token_rewards, values, mask, *, gamma, lam):
    """Every per-token estimator on one batch: one compile per shape, dtype and hypers."""
    advantages, returns = adv.gae(token_rewards, values, mask, gamma=gamma, lam=lam)
    return {
        "gae": advantages,
        "gae_returns": returns,
        "reinforce_pp": adv.reinforce_pp(token_rewards, mask, gamma=gamma),
        "whiten": adv.whiten(token_rewards, mask),
        "whiten_unshifted": adv.whiten(token_rewards, mask, shift_mean=False),
    }


def _token_reference(token_rewards, values, mask, gamma, lam):
    advantages, returns = ref.gae(token_rewards, values, mask, gamma, lam)
    return {
        "gae": advantages,
        "gae_returns": returns,
        "reinforce_pp": ref.reinforce_pp(token_rewards, mask, gamma),
        "whiten": ref.whiten(token_rewards, mask),
        "whiten_unshifted": ref.whiten(token_rewards, mask, shift_mean=False),
    }


def _token_batch(rng, *, holes=True, batch=6, time=11):
    mask = _random_mask(rng, batch, time, holes=holes)
    token_rewards, values = (1.0 + rng.normal(size=(2, batch, time))).astype(np.float32)
    return token_rewards, values, mask


TOKEN_HYPERS = [(1.0, 1.0, False), (1.0, 1.0, True), (0.99, 0.95, True), (0.0, 0.5, True)]


# --------------------------------------------------------------------------------------
# Random batches against the references
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [1, 2, 3, 8])
def test_outcome_estimators_match_reference(rng, group_size):
    rewards, mask = _outcome_batch(rng, group_size)
    got = _outcome(rewards, mask, group_size=group_size)
    want = _outcome_reference(rewards, mask, group_size)
    assert got.keys() == want.keys()
    for name in want:
        _assert_close(got[name], want[name], name=name)


@pytest.mark.parametrize("eps", [0.0, 0.5])
def test_eps_matches_reference(rng, eps):
    rewards, _ = _outcome_batch(rng, 4)

    @jax.jit
    def with_eps(rewards):
        return {
            f"{fn.__name__}/{scale}": fn(rewards, group_size=4, scale=scale, eps=eps)
            for fn in (adv.grpo, adv.pass_at_k)
            for scale in SCALES
        }

    got = with_eps(rewards)
    for scale in SCALES:
        _assert_close(got[f"grpo/{scale}"], ref.grpo(rewards, 4, scale, 1, eps), name=scale)
        want = ref.pass_at_k(rewards, 4, scale, eps)
        _assert_close(got[f"pass_at_k/{scale}"], want, name=scale)


def test_remax_matches_reference(rng):
    rewards, baseline = rng.normal(size=(2, 10)).astype(np.float32)
    _assert_close(adv.remax(rewards, baseline), ref.remax(rewards, baseline), atol=0)


@pytest.mark.parametrize(("gamma", "lam", "holes"), TOKEN_HYPERS)
def test_token_estimators_match_reference(rng, gamma, lam, holes):
    token_rewards, values, mask = _token_batch(rng, holes=holes)
    got = _token(token_rewards, values, mask, gamma=gamma, lam=lam)
    want = _token_reference(token_rewards, values, mask, gamma, lam)
    assert got.keys() == want.keys()
    for name in want:
        _assert_close(got[name], want[name], name=name)


# --------------------------------------------------------------------------------------
# Hand-checked values
# --------------------------------------------------------------------------------------


def test_hand_checked_group_estimators():
    # Shapes match the reference tests so that the jitted bundles are reused.
    mask = np.ones((8, TIME), bool)
    out = _outcome(np.array([1, 0, 0, 0, 0, 1, 0, 0], np.float32), mask, group_size=4)
    # mean 0.25, unbiased std 0.5, population std sqrt(3)/4.
    np.testing.assert_allclose(out["grpo/group/ddof1"][:4], [1.5, -0.5, -0.5, -0.5], rtol=1e-5)
    pop = 0.75 / (np.sqrt(3) / 4)
    want = [pop, -pop / 3, -pop / 3, -pop / 3]
    np.testing.assert_allclose(out["grpo/group/ddof0"][:4], want, rtol=1e-5)
    np.testing.assert_allclose(out["grpo/none/ddof1"][:4], [0.75, -0.25, -0.25, -0.25])
    # Leave-one-out: 1 - 0, 0 - 1/3.
    np.testing.assert_allclose(out["rloo"][:4], [1.0, -1 / 3, -1 / 3, -1 / 3], rtol=1e-6)
    # Best row alone: gap 1 - 0, over the unbiased std 0.5 for "group".
    np.testing.assert_allclose(out["pass_at_k/group"][:4], [2.0, 0.0, 0.0, 0.0], rtol=1e-5)
    np.testing.assert_allclose(out["pass_at_k/none"][4:], [0.0, 1.0, 0.0, 0.0])

    # G = 2 over 12 rows: group 0 is [1, 0] with lengths 3 and 1, every other group constant.
    rewards = np.array([1.0, 0.0] + [1.0] * 10, np.float32)
    lengths = np.array([3, 1] + [TIME] * 10)
    mask = np.arange(TIME)[None, :] < lengths[:, None]
    out = _outcome(rewards, mask, group_size=2)
    # GPG: alpha = B / informative rows = 12 / 2.
    np.testing.assert_allclose(out["gpg"], [3.0, -3.0] + [0.0] * 10)
    # OPO: baseline (3 * 1 + 1 * 0) / 4.
    np.testing.assert_allclose(out["opo"], [0.25, -0.75] + [0.0] * 10)
    np.testing.assert_allclose(out["rloo"], [1.0, -1.0] + [0.0] * 10)
    np.testing.assert_allclose(adv.remax(np.array([1.0, 0.5]), np.array([0.5, 0.5])), [0.5, 0.0])


def test_hand_checked_gae_with_hole():
    # t=2: delta = 1 - 0.4 = 0.6; t=1 skipped; t=0: delta = 0 + 0.5 * 0.4 - 0.2 = 0,
    # gae = 0 + 0.5 * 1 * 0.6 = 0.3. Returns = gae + V on valid tokens.
    mask = np.array([[1, 0, 1]], bool)
    token_rewards = np.array([[0.0, 5.0, 1.0]], np.float32)
    values = np.array([[0.2, 9.0, 0.4]], np.float32)
    advantages, returns = adv.gae(token_rewards, values, mask, gamma=0.5, lam=1.0)
    np.testing.assert_allclose(returns, [[0.5, 0.0, 1.0]], rtol=1e-6)
    # Whitened [0.3, 0.6]: mean 0.45, unbiased var 0.045.
    z = 0.15 / np.sqrt(0.045 + 1e-8)
    np.testing.assert_allclose(advantages, [[-z, 0.0, z]], rtol=1e-5)


def test_hand_checked_reinforce_pp_with_hole():
    # Reward-to-go over valid tokens only: [1 + 2, skipped, 2] -> whitened [3, 2].
    mask = np.array([[1, 0, 1]], bool)
    token_rewards = np.array([[1.0, 100.0, 2.0]], np.float32)
    z = 0.5 / np.sqrt(0.5 + 1e-8)
    np.testing.assert_allclose(adv.reinforce_pp(token_rewards, mask), [[z, 0.0, -z]], rtol=1e-5)


# --------------------------------------------------------------------------------------
# Edge cases
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "group_size"), [(0.1, 3), (2.2, 3), (0.9, 8), (0.3, 8)])
def test_constant_group_is_exactly_zero(rng, value, group_size):
    group = np.full((group_size,), value, np.float32)
    # Sanity: naive centering leaves a rounding residue for this value, so the test bites.
    assert np.any(np.asarray(jnp.asarray(group) - jnp.mean(group)) != 0)
    rewards, mask = _outcome_batch(rng, group_size)
    rewards[:group_size] = group
    out = _outcome(rewards, mask, group_size=group_size)
    # reinforce_pp_baseline is left out: the batch whitening after the baseline shifts every
    # row by the (length-weighted) batch mean, so the spec does not make constant groups 0.
    del out["rpp_baseline"]
    for name, values in out.items():
        head = np.asarray(values[:group_size])
        assert np.all(head == 0.0), (name, head)
        assert np.any(np.asarray(values[group_size:]) != 0.0), name


def test_all_constant_batch_is_zero_without_nan():
    rewards = jnp.full((8,), 0.1, jnp.float32)
    out = _outcome(rewards, np.ones((8, TIME), bool), group_size=4)
    for name, values in out.items():
        if name != "rpp_baseline":
            np.testing.assert_array_equal(values, np.zeros(8), err_msg=name)

    @jax.jit
    def no_eps(rewards):
        return [adv.grpo(rewards, group_size=4, scale=s, eps=0.0) for s in SCALES] + [
            adv.pass_at_k(rewards, group_size=4, scale=s, eps=0.0) for s in SCALES
        ]

    for values in no_eps(rewards):
        np.testing.assert_array_equal(values, np.zeros(8))


def test_group_of_one(rng):
    rewards, mask = _outcome_batch(rng, 1)
    out = _outcome(rewards, mask, group_size=1)
    for name in ("rloo", "gpg", "opo") + tuple(k for k in out if k.startswith("grpo")):
        np.testing.assert_array_equal(out[name], np.zeros(NUM_GROUPS), err_msg=name)
    # reinforce_pp_baseline with G = 1 has no group baseline: whitened raw rewards.
    tiled = np.repeat(rewards[:, None], TIME, axis=1)
    _assert_close(out["rpp_baseline"], ref.whiten(tiled, mask))


def test_pass_at_k_ties_go_to_first_index():
    rewards = np.array([3.0, 1.0, 3.0, 0.0, 0.0, 2.0, 2.0, 1.0], np.float32)
    out = np.asarray(adv.pass_at_k(rewards, group_size=4, scale="none"))
    np.testing.assert_array_equal(out, np.zeros(8))  # shared maximum: gap 0 everywhere
    rewards = np.array([0.0, 4.0, 1.0, 4.0 - 1e-3, 1.0, 0.0, 2.0, 2.0], np.float32)
    out = np.asarray(adv.pass_at_k(rewards, group_size=4, scale="none"))
    np.testing.assert_allclose(out, [0.0, 1e-3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], rtol=1e-3)


def test_token_estimators_on_empty_masks(rng):
    gamma, lam, _ = TOKEN_HYPERS[2]
    token_rewards, values, mask = _token_batch(rng)
    mask[2] = False  # an all-masked row
    empty = np.zeros_like(mask)
    one = np.zeros_like(mask)
    one[1, 3] = True
    rewards = rng.normal(size=mask.shape[0]).astype(np.float32)
    for m in (mask, empty, one):
        outs = _token(token_rewards, values, m, gamma=gamma, lam=lam)
        outs["rpp_baseline"] = adv.reinforce_pp_baseline(rewards, m, group_size=2)
        for name, out in outs.items():
            out = np.asarray(out)
            assert np.all(np.isfinite(out)), name
            assert np.all(out[~m] == 0.0), name
    # One valid token: whitening has no spread, so x - mu = 0 there (x itself without shift).
    outs = _token(token_rewards, values, one, gamma=gamma, lam=lam)
    for name in ("gae", "reinforce_pp", "whiten"):
        np.testing.assert_array_equal(outs[name], np.zeros_like(token_rewards), err_msg=name)
    np.testing.assert_array_equal(outs["whiten_unshifted"], np.where(one, token_rewards, 0.0))
    # A lone token's GAE is its TD error against a next value of 0.
    np.testing.assert_allclose(outs["gae_returns"][1, 3], token_rewards[1, 3], rtol=1e-5)
    # OPO on a group of two empty rows falls back to the plain mean.
    out = adv.opo(np.array([1.0, 3.0, 0.0, 1.0]), np.zeros((4, 3)), group_size=2)
    np.testing.assert_allclose(out, [-1.0, 1.0, -0.5, 0.5])


def test_garbage_at_masked_positions_is_ignored(rng):
    gamma, lam, _ = TOKEN_HYPERS[2]
    token_rewards, values, mask = _token_batch(rng)
    nan_values = np.where(mask, values, np.nan).astype(np.float32)
    inf_rewards = np.where(mask, token_rewards, np.inf).astype(np.float32)
    got = _token(inf_rewards, nan_values, mask, gamma=gamma, lam=lam)
    want = _token(token_rewards, values, mask, gamma=gamma, lam=lam)
    chex.assert_trees_all_equal(got, want)


def test_padded_columns_change_nothing(rng):
    gamma, lam, _ = TOKEN_HYPERS[2]
    pad = 4
    token_rewards, values, mask = _token_batch(rng)
    batch = mask.shape[0]
    extra = 100.0 * rng.normal(size=(2, batch, pad)).astype(np.float32)
    wide_mask = np.concatenate([mask, np.zeros((batch, pad), bool)], axis=1)
    wide_r = np.concatenate([token_rewards, extra[0]], axis=1)
    wide_v = np.concatenate([values, extra[1]], axis=1)
    narrow = _token(token_rewards, values, mask, gamma=gamma, lam=lam)
    wide = _token(wide_r, wide_v, wide_mask, gamma=gamma, lam=lam)

    @jax.jit
    def masked_outcome(rewards, mask):
        return (
            adv.reinforce_pp_baseline(rewards, mask, group_size=2),
            adv.opo(rewards, mask, group_size=2),
        )

    rewards = rng.normal(size=batch).astype(np.float32)
    narrow["rpp_baseline"], narrow_opo = masked_outcome(rewards, mask)
    wide["rpp_baseline"], wide_opo = masked_outcome(rewards, wide_mask)
    for name in narrow:
        np.testing.assert_allclose(wide[name][:, :-pad], narrow[name], 1e-6, 1e-6, err_msg=name)
        np.testing.assert_array_equal(wide[name][:, -pad:], 0.0, err_msg=name)
    np.testing.assert_allclose(wide_opo, narrow_opo, rtol=1e-6)


def test_permuting_rows_within_a_group_permutes_advantages(rng):
    group_size = 8
    rewards, mask = _outcome_batch(rng, group_size)
    rewards[2 * group_size : 4 * group_size] += np.linspace(0, 0.1, 2 * group_size)  # no ties
    perm = np.concatenate([g * group_size + rng.permutation(group_size) for g in range(NUM_GROUPS)])
    got = _outcome(rewards[perm], mask[perm], group_size=group_size)
    want = _outcome(rewards, mask, group_size=group_size)
    for name in want:
        np.testing.assert_allclose(
            got[name], np.asarray(want[name])[perm], rtol=1e-5, atol=1e-6, err_msg=name
        )


# --------------------------------------------------------------------------------------
# Dtypes
# --------------------------------------------------------------------------------------


def test_int_and_bool_rewards_are_upcast_before_math(rng):
    _, mask = _outcome_batch(rng, 2)
    ints = rng.integers(-3, 4, size=mask.shape[0]).astype(np.int32)
    ints[:2] = [1, 0]
    got = _outcome(ints, mask, group_size=2)
    chex.assert_trees_all_equal(got, _outcome(ints.astype(np.float32), mask, group_size=2))
    chex.assert_type(list(got.values()), jnp.float32)
    # An int array would truncate the 0.5 of group 0.
    np.testing.assert_array_equal(got["grpo/none/ddof1"][:2], [0.5, -0.5])
    bools = np.array([True, False, False, True])
    np.testing.assert_array_equal(adv.rloo(bools, group_size=2), [1.0, -1.0, -1.0, 1.0])
    chex.assert_type(adv.reinforce_pp(np.ones((2, 3), np.int32), np.ones((2, 3))), jnp.float32)
    chex.assert_type(adv.remax(ints, ints[::-1]), jnp.float32)


def test_bf16_inputs_are_upcast_before_any_math(rng):
    """bf16 rewards / values give f32 advantages equal to f64 math on the bf16-rounded inputs
    at f32 precision (the same math in bf16 is off by up to 2^-9 relative per operation)."""
    rewards, mask = _outcome_batch(rng, 3)
    rewards = jnp.asarray(rewards, jnp.bfloat16)
    got = _outcome(rewards, mask, group_size=3)
    want = _outcome_reference(np.float64(rewards), mask, 3)
    for name in want:
        _assert_close(got[name], want[name], rtol=1e-6, atol=1e-6, name=name)
    got = adv.remax(rewards, rewards[::-1])
    _assert_close(got, np.float64(rewards) - np.float64(rewards[::-1]), rtol=1e-6, atol=1e-6)
    gamma, lam, _ = TOKEN_HYPERS[2]
    token_rewards, values, mask = _token_batch(rng)
    token_rewards, values = (jnp.asarray(x, jnp.bfloat16) for x in (token_rewards, values))
    got = _token(token_rewards, values, mask, gamma=gamma, lam=lam)
    want = _token_reference(np.float64(token_rewards), np.float64(values), mask, gamma, lam)
    for name in want:
        _assert_close(got[name], want[name], rtol=1e-6, atol=1e-6, name=name)


# --------------------------------------------------------------------------------------
# Transformations
# --------------------------------------------------------------------------------------


def test_jit_matches_eager_and_does_not_retrace(rng):
    traces = []

    def counted(rewards, token_rewards, values, mask):
        traces.append(None)
        return (
            adv.grpo(rewards, group_size=4),
            adv.gae(token_rewards, values, mask, gamma=0.9, lam=0.95),
        )

    jitted = jax.jit(counted)
    mask = _random_mask(rng, 8, 5)
    for _ in range(2):
        args = (
            rng.normal(size=8).astype(np.float32),
            *rng.normal(size=(2, 8, 5)).astype(np.float32),
            mask,
        )
        chex.assert_trees_all_close(jitted(*args), counted(*args), rtol=1e-5, atol=1e-6)
    assert len(traces) == 3  # one jit trace plus two eager calls


def test_vmap_matches_loop(rng):
    # Per-example shapes match earlier tests, so the looped calls reuse their compiles.
    rewards = rng.normal(size=(3, 8)).astype(np.float32)
    masks = np.stack([_random_mask(rng, 8, TIME) for _ in range(3)])
    gamma, lam, _ = TOKEN_HYPERS[2]
    token_batches = [_token_batch(rng) for _ in range(3)]
    token_rewards, values, token_masks = (np.stack(xs) for xs in zip(*token_batches))
    cases = [
        (functools.partial(_outcome, group_size=4), (rewards, masks)),
        (functools.partial(_token, gamma=gamma, lam=lam), (token_rewards, values, token_masks)),
    ]
    for fn, args in cases:
        batched = jax.vmap(fn)(*args)
        looped = [fn(*(x[i] for x in args)) for i in range(3)]
        looped = jax.tree.map(lambda *xs: jnp.stack(xs), *looped)
        chex.assert_trees_all_close(batched, looped, rtol=1e-5, atol=1e-6)


def test_check_grads_grpo(rng):
    rewards = jnp.asarray(rng.normal(size=8), jnp.float32)
    for scale in ("group", "batch"):  # "none" is linear in the rewards
        fn = jax.jit(functools.partial(adv.grpo, group_size=4, scale=scale))
        check_grads(fn, (rewards,), order=1, modes=("rev",), eps=1e-2, atol=1e-2, rtol=1e-2)


def test_check_grads_gae_and_reinforce_pp(rng):
    token_rewards, values, mask = _token_batch(rng, batch=4, time=6)

    @jax.jit
    def gae(token_rewards, values):
        return adv.gae(token_rewards, values, mask, gamma=0.9, lam=0.8)

    @jax.jit
    def reinforce_pp(token_rewards):
        return adv.reinforce_pp(token_rewards, mask, gamma=0.9)

    check_grads(gae, (token_rewards, values), order=1, modes=("rev",), eps=1e-2, rtol=2e-2)
    check_grads(reinforce_pp, (token_rewards,), order=1, modes=("rev",), eps=1e-2, rtol=2e-2)


def test_gradients_are_finite_and_zero_where_they_should_be(rng):
    # A constant group, a normal one, and one whose spread underflows to a zero variance in
    # f32 (the derivative of sqrt at 0 is infinite: it must not leak out as NaN).
    rewards = jnp.asarray([0.1, 0.1, 0.1, 1.0, 0.0, 2.0, 0.0, 1e-30, 0.0], jnp.float32)
    weights = jnp.asarray(rng.normal(size=9), jnp.float32)
    token_rewards, values, mask = _token_batch(rng, batch=4, time=6)
    token_weights = rng.normal(size=(4, 6)).astype(np.float32)

    @jax.jit
    def all_grads(rewards, token_rewards, values):
        grads = {}
        for scale in SCALES:
            for fn in (adv.grpo, adv.pass_at_k):
                loss = lambda r, fn=fn, scale=scale: jnp.sum(  # noqa: E731
                    weights * fn(r, group_size=3, scale=scale)
                )
                grads[f"{fn.__name__}/{scale}"] = jax.grad(loss)(rewards)

        def gae_loss(r, v):
            advantages, returns = adv.gae(r, v, mask, gamma=0.9, lam=0.9)
            return jnp.sum(token_weights * (advantages + returns))

        grads["gae"] = jax.grad(gae_loss, argnums=(0, 1))(token_rewards, values)
        return grads

    grads = all_grads(rewards, token_rewards, values)
    for name, grad in grads.items():
        for g in jax.tree.leaves(grad):
            assert np.all(np.isfinite(g)), name
        # With a batch std the constant group still moves the other groups' scale.
        if name != "gae" and not name.endswith("batch"):
            np.testing.assert_array_equal(grad[:3], 0.0, err_msg=name)
    for g in grads["gae"]:
        assert np.any(np.asarray(g)[mask] != 0.0)
        np.testing.assert_array_equal(np.asarray(g)[~mask], 0.0)


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: adv.grpo(jnp.zeros(6), group_size=4), "does not divide"),
        (lambda: adv.grpo(jnp.zeros(0), group_size=1), "at least one row"),
        (lambda: adv.grpo(jnp.zeros(6), group_size=0), "positive int"),
        (lambda: adv.rloo(jnp.zeros(6), group_size=2.0), "positive int"),
        (lambda: adv.gpg(jnp.zeros((2, 3)), group_size=1), "rank 1"),
        (lambda: adv.grpo(jnp.zeros(4), group_size=2, scale="std"), "unknown scale"),
        (lambda: adv.grpo(jnp.zeros(4), group_size=2, std_ddof=2), "unknown std_ddof"),
        (lambda: adv.grpo(jnp.zeros(4), group_size=2, eps=-1.0), "eps must be >= 0"),
        (lambda: adv.pass_at_k(jnp.zeros(4), group_size=1), "group_size >= 2"),
        (lambda: adv.pass_at_k(jnp.zeros(4), group_size=2, scale="max"), "unknown scale"),
        (lambda: adv.remax(jnp.zeros(4), jnp.zeros(3)), "shape mismatch"),
        (lambda: adv.remax(jnp.zeros((4, 1)), jnp.zeros((4, 1))), "rank 1"),
        (lambda: adv.opo(jnp.zeros(4), jnp.ones((3, 2)), group_size=2), r"\(3, 2\)"),
        (lambda: adv.opo(jnp.zeros(4), jnp.ones(4), group_size=2), "mask must have rank 2"),
        (lambda: adv.reinforce_pp_baseline(jnp.zeros(4), jnp.ones((4, 2)), group_size=3), "divide"),
        (lambda: adv.reinforce_pp(jnp.zeros((4, 3)), jnp.ones((4, 2))), r"\(4, 3\)"),
        (lambda: adv.reinforce_pp(jnp.zeros(4), jnp.ones(4)), "rank 2"),
        (lambda: adv.reinforce_pp(jnp.zeros((4, 2)), jnp.ones((4, 2)), gamma=-0.1), "gamma"),
        (lambda: adv.gae(jnp.zeros((4, 2)), jnp.zeros((4, 3)), jnp.ones((4, 2))), "values"),
        (lambda: adv.gae(jnp.zeros((4, 2)), jnp.zeros((4, 2)), jnp.ones((4, 2)), lam=-1), "lam"),
        (lambda: adv.whiten(jnp.zeros((4, 2)), jnp.ones((4, 3))), "shape mismatch"),
        (lambda: adv.group_view(jnp.zeros(()), 1), "per-row"),
    ],
)
def test_bad_inputs_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_validation_happens_at_trace_time():
    jitted = jax.jit(functools.partial(adv.grpo, group_size=3))
    with pytest.raises(ValueError, match="does not divide"):
        jitted(jnp.zeros(4))


def test_group_view_shape():
    x = jnp.arange(12.0).reshape(6, 2)
    chex.assert_shape(adv.group_view(x, 3), (2, 3, 2))
    np.testing.assert_array_equal(adv.group_view(jnp.arange(6), 2)[1], [2, 3])


# ----------------------------------------------------------------------------- GDPO


def _columns(rng, group_size, batch=8):
    columns = np.stack(
        [
            rng.integers(0, 2, batch),  # 0/1 correctness
            rng.normal(0.0, 10.0, batch),  # a wide-spread reward that GRPO's sum would favour
            rng.uniform(0.0, 1.0, batch),
        ],
        axis=1,
    ).astype(np.float32)
    columns[:group_size, 0] = 1.0  # a constant group in column 0
    return columns


@pytest.mark.parametrize("group_size", [2, 4])
@pytest.mark.parametrize("weights", [None, (1.0, 0.5, 2.0)])
def test_gdpo_matches_trl_normalize_then_sum(rng, group_size, weights):
    columns = _columns(rng, group_size)
    out = adv.gdpo(columns, group_size=group_size, weights=weights, eps=1e-4)
    chex.assert_shape(out, (8,))
    _assert_close(out, stab.gdpo_trl(columns, group_size, weights, eps=1e-4), name="gdpo")
    # Normalising then summing differs from GRPO on the summed reward.
    summed = columns @ (np.ones(3) if weights is None else np.asarray(weights))
    assert np.max(np.abs(out - adv.grpo(summed.astype(np.float32), group_size=group_size))) > 0.1


@pytest.mark.parametrize("group_size", [2, 4])
def test_gdpo_token_whitening_matches_verl_formula(rng, group_size):
    columns = _columns(rng, group_size)
    mask = _random_mask(rng, 8, 5)
    out = adv.gdpo(
        columns, mask, group_size=group_size, weights=(1.0, 0.5, 2.0), batch_norm="token"
    )
    chex.assert_shape(out, (8, 5))
    _assert_close(out, stab.gdpo_verl(columns, mask, group_size, (1.0, 0.5, 2.0)), name="gdpo")


def test_gdpo_constant_rewards_give_exactly_zero():
    columns = jnp.ones((6, 2)) * jnp.array([3.0, -1.0])
    for group_size in (1, 3):
        np.testing.assert_array_equal(adv.gdpo(columns, group_size=group_size), np.zeros(6))
    # One column constant everywhere: GDPO is GRPO of the other one, renormalised.
    rewards = jnp.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    two = jnp.stack([rewards, jnp.full(6, 7.0)], axis=1)
    np.testing.assert_allclose(
        adv.gdpo(two, group_size=3),
        adv.gdpo(rewards[:, None], group_size=3),
        rtol=1e-6,
    )
    assert np.all(
        np.isfinite(adv.gdpo(columns, jnp.zeros((6, 4)), group_size=3, batch_norm="token"))
    )


def test_gdpo_errors():
    columns = jnp.ones((6, 2))
    with pytest.raises(ValueError, match="weights"):
        adv.gdpo(columns, group_size=3, weights=(1.0,))
    with pytest.raises(ValueError, match="mask"):
        adv.gdpo(columns, group_size=3, batch_norm="token")
    with pytest.raises(ValueError, match="group_size"):
        adv.gdpo(columns, group_size=4)
    with pytest.raises(ValueError, match="rank"):
        adv.gdpo(jnp.ones(6), group_size=3)
