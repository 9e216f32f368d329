"""Tests for jaxrl_llm.losses.ratios against the float64 references of tests/reference/losses.py."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxrl_llm.losses import aggregation, ratios, surrogates
from tests.reference import losses as ref

B, T = 5, 7


def _batch(rng, scale=1.0):
    lp = (rng.normal(size=(B, T)) * scale - 1.0).astype(np.float32)
    old = (lp + rng.normal(size=(B, T)) * 0.3 * scale).astype(np.float32)
    mask = ref.ragged_mask(rng, B, T, empty_rows=(1,), full_rows=(2,))
    return lp, old, mask


# ----------------------------------------------------------------------------- token_log_ratio


def test_token_log_ratio_matches_reference(rng):
    lp, _, _ = _batch(rng)
    old = (lp + rng.normal(size=(B, T)) * 15.0).astype(np.float32)  # some |Δ| beyond 20
    out = ratios.token_log_ratio(lp, old)
    chex.assert_shape(out, (B, T))
    chex.assert_type(out, jnp.float32)
    np.testing.assert_allclose(out, ref.token_log_ratio(lp, old), rtol=1e-6, atol=1e-5)
    assert np.abs(ref.token_log_ratio(lp, old)).max() == 20.0  # the clamp was exercised


def test_token_log_ratio_clamp_edges_and_gradient():
    old = jnp.zeros((1, 5))
    lp = jnp.array([[-50.0, -3.0, 0.0, 3.0, 50.0]])
    out = ratios.token_log_ratio(lp, old, clamp=3.0)
    np.testing.assert_array_equal(out, [[-3.0, -3.0, 0.0, 3.0, 3.0]])
    grad = jax.grad(lambda x: ratios.token_log_ratio(x, old, clamp=3.0).sum())(lp)
    assert grad[0, 0] == 0.0 and grad[0, 4] == 0.0  # far beyond the clamp: no gradient
    assert grad[0, 2] == 1.0


def test_token_log_ratio_check_grads(rng):
    lp, old, _ = _batch(rng)
    check_grads(ratios.token_log_ratio, (lp, old), order=1, modes=["rev"], eps=1e-3)


# ----------------------------------------------------------------------------- sequence_log_ratio


def test_sequence_log_ratio_matches_reference(rng):
    lp, old, mask = _batch(rng)
    out = ratios.sequence_log_ratio(lp, old, mask)
    chex.assert_shape(out, (B,))
    chex.assert_type(out, jnp.float32)
    np.testing.assert_allclose(out, ref.sequence_log_ratio(lp, old, mask), rtol=1e-5, atol=1e-6)
    assert out[1] == 0.0  # empty row: ratio exactly 1


def test_sequence_log_ratio_bool_mask_one_token_and_empty_batch():
    lp = jnp.array([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    old = jnp.array([[-1.5, 0.0, 0.0], [-2.0, -2.0, -2.0]])
    one = jnp.array([[True, False, False], [False, True, False]])
    np.testing.assert_allclose(ratios.sequence_log_ratio(lp, old, one), [0.5, 1.0])
    empty = jnp.zeros((2, 3), bool)
    np.testing.assert_array_equal(ratios.sequence_log_ratio(lp, old, empty), [0.0, 0.0])


def test_sequence_log_ratio_ignores_garbage_padding(rng):
    lp, old, mask = _batch(rng)
    lp_bad = np.where(mask > 0, lp, np.inf).astype(np.float32)
    old_bad = np.where(mask > 0, old, -np.inf).astype(np.float32)
    out = ratios.sequence_log_ratio(lp_bad, old_bad, mask)
    np.testing.assert_allclose(out, ratios.sequence_log_ratio(lp, old, mask), rtol=1e-6)
    grad = jax.grad(lambda x: ratios.sequence_log_ratio(x, old_bad, mask).sum())(lp_bad)
    lengths = np.maximum(mask.sum(-1, keepdims=True), 1)
    np.testing.assert_allclose(grad, mask / lengths, rtol=1e-6)
    assert np.all(np.asarray(grad)[mask == 0] == 0.0)


def test_sequence_log_ratio_padded_columns_change_nothing(rng):
    lp, old, mask = _batch(rng)
    pad = ((0, 0), (0, 3))
    out = ratios.sequence_log_ratio(
        np.pad(lp, pad, constant_values=7.0), np.pad(old, pad), np.pad(mask, pad)
    )
    np.testing.assert_array_equal(out, ratios.sequence_log_ratio(lp, old, mask))


def test_sequence_log_ratio_check_grads(rng):
    lp, old, mask = _batch(rng)

    def f(x, y):
        return ratios.sequence_log_ratio(x, y, mask)

    check_grads(f, (lp, old), order=1, modes=["rev"], eps=1e-3)


# ----------------------------------------------------------------------------- gspo_token


def test_gspo_token_value_is_the_sequence_ratio_on_every_token(rng):
    lp, old, mask = _batch(rng)
    out = ratios.gspo_token_log_ratio(lp, old, mask)
    chex.assert_shape(out, (B, T))
    np.testing.assert_allclose(out, ref.gspo_token_log_ratio(lp, old, mask), atol=1e-6)
    capped = ratios.gspo_token_log_ratio(lp + 40.0, old, mask, max_log_ratio=10.0)
    np.testing.assert_allclose(
        capped, ref.gspo_token_log_ratio(lp + 40.0, old, mask, 10.0), atol=1e-5
    )


def test_gspo_token_gradient_of_exp_is_the_sequence_ratio(rng):
    """∂/∂lp_t Σ_u m_u·exp(gspo_u) = s_i·m_t: each token's own term, scaled by s_i."""
    lp, old, mask = _batch(rng)

    def f(x):
        return jnp.sum(mask * jnp.exp(ratios.gspo_token_log_ratio(x, old, mask)))

    grad = jax.grad(f)(lp)
    s = np.exp(ref.sequence_log_ratio(lp, old, mask))
    np.testing.assert_allclose(grad, s[:, None] * mask, rtol=1e-5)


def test_gspo_token_jacobian_is_diagonal_on_valid_tokens(rng):
    lp, old, mask = _batch(rng)
    jac = jax.jacrev(lambda x: ratios.gspo_token_log_ratio(x, old, mask))(lp)
    chex.assert_shape(jac, (B, T, B, T))
    expected = np.einsum("bt,bc,tu->btcu", mask, np.eye(B), np.eye(T))
    np.testing.assert_array_equal(jac, expected)


def test_gspo_token_cap_stops_the_gradient(rng):
    lp, old, mask = _batch(rng)
    grad = jax.grad(
        lambda x: jnp.sum(ratios.gspo_token_log_ratio(x, old - 30.0, mask, max_log_ratio=10.0))
    )(lp)
    np.testing.assert_array_equal(grad, np.zeros_like(lp))


def test_gspo_token_garbage_padding_stays_out(rng):
    lp, old, mask = _batch(rng)
    lp_bad = np.where(mask > 0, lp, np.inf).astype(np.float32)
    out = ratios.gspo_token_log_ratio(lp_bad, old, mask)
    np.testing.assert_allclose(out, ratios.gspo_token_log_ratio(lp, old, mask), rtol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(ratios.gspo_token_log_ratio(x, old, mask) * mask))(lp_bad)
    np.testing.assert_array_equal(grad, mask)


def test_gspo_sequence_objective_is_not_length_weighted():
    """Pitfall: GSPO with seq-mean-token-mean is the mean over sequences of the sequence-level
    clipped objective, whatever the lengths (a token mean would weight long rows more)."""
    lp = jnp.array([[-1.0, -1.0, -1.0, -1.0], [-2.0, 0.0, 0.0, 0.0]])
    old = jnp.array([[-1.1, -1.1, -1.1, -1.1], [-2.0001, 0.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 1, 1], [1, 0, 0, 0]], jnp.float32)
    adv = jnp.array([1.0, -2.0])
    log_ratio = ratios.gspo_token_log_ratio(lp, old, mask)
    per_token = surrogates.ppo_clip(log_ratio, adv, clip_low=3e-4, clip_high=4e-4)
    loss = aggregation.aggregate(per_token, mask, "seq-mean-token-mean")
    s = np.exp(ref.sequence_log_ratio(lp, old, mask))
    seq_loss = ref.ppo_clip(np.log(s)[:, None], np.asarray(adv), 3e-4, 4e-4)[:, 0]
    np.testing.assert_allclose(loss, seq_loss.mean(), rtol=1e-5)


# ----------------------------------------------------------------------------- bf16 inputs


def _assert_f32_math(got, want, name):
    """f32 output equal to the f64 reference at f32 precision (bf16 math is ~1e-3 off)."""
    chex.assert_type(got, jnp.float32)
    np.testing.assert_allclose(np.float64(got), want, rtol=1e-6, atol=1e-6, err_msg=name)


def test_bf16_inputs_are_upcast_before_any_math(rng):
    """bf16 log-probs give f32 results equal to f64 math on the bf16-rounded inputs."""
    data = ref.bf16_batch(rng)
    lp, old, mask = (jnp.asarray(data[k]) for k in ("logprobs", "old_logprobs", "mask"))
    lp64, old64 = np.float64(data["logprobs"]), np.float64(data["old_logprobs"])
    assert lp.dtype == old.dtype == jnp.bfloat16
    cases = {
        "token": (ratios.token_log_ratio(lp, old), ref.token_log_ratio(lp64, old64)),
        "token/clamp": (
            ratios.token_log_ratio(lp, old, clamp=2.5),
            ref.token_log_ratio(lp64, old64, 2.5),
        ),
        "sequence": (
            ratios.sequence_log_ratio(lp, old, mask),
            ref.sequence_log_ratio(lp64, old64, data["mask"]),
        ),
        "sequence/bf16 mask": (
            ratios.sequence_log_ratio(lp, old, mask.astype(jnp.bfloat16)),
            ref.sequence_log_ratio(lp64, old64, data["mask"]),
        ),
        "gspo_token": (
            ratios.gspo_token_log_ratio(lp, old, mask),
            ref.gspo_token_log_ratio(lp64, old64, data["mask"]),
        ),
        "gspo_token/cap": (
            ratios.gspo_token_log_ratio(lp, old, mask, max_log_ratio=0.2),
            ref.gspo_token_log_ratio(lp64, old64, data["mask"], 0.2),
        ),
    }
    assert np.abs(cases["token/clamp"][1]).max() == 2.5  # the clamp binds
    assert cases["gspo_token/cap"][1].max() == 0.2  # so does the cap
    for name, (got, want) in cases.items():
        _assert_f32_math(got, want, name)


def test_bf16_gradient_is_the_rounded_f32_gradient(rng):
    """The cotangent reaching a bf16 input is bf16, within bf16 rounding of the exact one."""
    data = ref.bf16_batch(rng)
    lp, old, mask = (jnp.asarray(data[k]) for k in ("logprobs", "old_logprobs", "mask"))

    def f(x):
        return jnp.sum(mask * jnp.exp(ratios.gspo_token_log_ratio(x, old, mask)))

    grad = jax.grad(f)(lp)
    assert grad.dtype == jnp.bfloat16
    s = np.exp(ref.sequence_log_ratio(np.float64(data["logprobs"]), data["old_logprobs"], mask))
    np.testing.assert_allclose(np.float64(grad), s[:, None] * data["mask"], rtol=2**-8)


# ----------------------------------------------------------------------------- jit / vmap / errors


def test_jit_vmap_and_no_recompile(rng):
    lp, old, mask = _batch(rng)
    traces = []

    @jax.jit
    def f(x, y, m):
        traces.append(None)
        return (
            ratios.token_log_ratio(x, y),
            ratios.sequence_log_ratio(x, y, m),
            ratios.gspo_token_log_ratio(x, y, m),
        )

    first = f(lp, old, mask)
    f(lp + 1.0, old, mask)
    assert len(traces) == 1
    chex.assert_trees_all_close(
        first,
        (
            ratios.token_log_ratio(lp, old),
            ratios.sequence_log_ratio(lp, old, mask),
            ratios.gspo_token_log_ratio(lp, old, mask),
        ),
    )
    stacked = [np.stack([x, x * 0.5]) for x in (lp, old, mask)]
    batched = jax.vmap(ratios.sequence_log_ratio)(*stacked)
    chex.assert_shape(batched, (2, B))
    np.testing.assert_allclose(
        batched[1], ratios.sequence_log_ratio(lp * 0.5, old * 0.5, mask * 0.5), rtol=1e-6
    )


def test_errors(rng):
    lp, old, mask = _batch(rng)
    with pytest.raises(ValueError, match="clamp"):
        ratios.token_log_ratio(lp, old, clamp=0.0)
    with pytest.raises(ValueError, match=r"\(5, 7\)"):
        ratios.token_log_ratio(lp, old[:, :3])
    with pytest.raises(ValueError, match="rank 2"):
        ratios.token_log_ratio(lp[0], old[0])
    with pytest.raises(ValueError, match="mask"):
        ratios.sequence_log_ratio(lp, old, mask[:, :3])
    with pytest.raises(ValueError, match="old_logprobs"):
        ratios.sequence_log_ratio(lp, old[:4], mask)
    with pytest.raises(ValueError, match="max_log_ratio"):
        ratios.gspo_token_log_ratio(lp, old, mask, max_log_ratio=-1.0)
