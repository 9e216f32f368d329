"""Tests for jaxrl_llm.losses.aggregation against the float64 references of
tests/reference/losses.py."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxrl_llm.losses.aggregation import MODES, aggregate, normalisers, sequence_mean
from tests.reference import losses as ref

B, T = 6, 5


def _batch(rng):
    values = rng.normal(size=(B, T)).astype(np.float32)
    mask = ref.ragged_mask(rng, B, T, empty_rows=(3,), full_rows=(0,))
    return values, mask


def test_modes_exported():
    assert MODES == (
        "token-mean",
        "token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
    )


@pytest.mark.parametrize("mode", MODES)
def test_matches_reference(rng, mode):
    values, mask = _batch(rng)
    out = aggregate(values, mask, mode)
    chex.assert_shape(out, ())
    chex.assert_type(out, jnp.float32)
    np.testing.assert_allclose(out, ref.aggregate(values, mask, mode), rtol=1e-5, atol=1e-7)
    kw = {"num_tokens": 11.0, "num_seqs": 4, "norm_constant": 3.0}
    np.testing.assert_allclose(
        aggregate(values, mask.astype(bool), mode, **kw),
        ref.aggregate(values, mask, mode, **kw),
        rtol=1e-5,
        atol=1e-7,
    )


def test_hand_checked_values():
    values = jnp.array([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0], [7.0, 7.0, 7.0]])
    mask = jnp.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]], bool)
    assert aggregate(values, mask, "token-sum") == 10.0
    assert aggregate(values, mask, "token-mean") == 2.5
    np.testing.assert_allclose(aggregate(values, mask, "seq-mean-token-mean"), 3.0, rtol=1e-6)
    assert aggregate(values, mask, "seq-mean-token-sum") == 5.0
    # Dr.GRPO divides by the number of sequences AND the constant (not the constant alone).
    np.testing.assert_allclose(aggregate(values, mask, "seq-mean-token-sum-norm"), 5.0 / 3.0)
    assert aggregate(values, mask, "seq-mean-token-sum-norm", norm_constant=10) == 0.5


@pytest.mark.parametrize("mode", MODES)
def test_all_masked_batch_is_zero_with_zero_gradient(mode):
    values = jnp.full((3, 4), 5.0)
    mask = jnp.zeros((3, 4), bool)
    out, grad = jax.value_and_grad(aggregate)(values, mask, mode)
    assert out == 0.0
    np.testing.assert_array_equal(grad, np.zeros((3, 4)))


@pytest.mark.parametrize("mode", MODES)
def test_one_valid_token(mode):
    values = jnp.arange(8.0).reshape(2, 4)
    mask = jnp.zeros((2, 4)).at[1, 2].set(1.0)
    expected = 6.0 / 4.0 if mode == "seq-mean-token-sum-norm" else 6.0
    np.testing.assert_allclose(aggregate(values, mask, mode), expected, rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_masked_positions_get_exactly_zero_gradient_even_for_garbage(rng, mode):
    values, mask = _batch(rng)
    garbage = np.where(mask > 0, values, 1e30).astype(np.float32)
    garbage[3, :2] = [np.inf, -np.inf]  # row 3 is empty
    out, grad = jax.value_and_grad(aggregate)(garbage, mask, mode)
    np.testing.assert_allclose(out, aggregate(values, mask, mode), rtol=1e-6)
    grad = np.asarray(grad)
    assert np.all(grad[mask == 0] == 0.0)
    assert np.all(grad[mask > 0] != 0.0)


@pytest.mark.parametrize("mode", MODES)
def test_check_grads(rng, mode):
    values, mask = _batch(rng)
    f = functools.partial(aggregate, mask=mask, mode=mode)
    check_grads(f, (values,), order=2, modes=["rev"], eps=1e-3)


def test_normalisers(rng):
    _, mask = _batch(rng)
    num_tokens, num_seqs = normalisers(mask)
    chex.assert_type((num_tokens, num_seqs), jnp.float32)
    assert (float(num_tokens), float(num_seqs)) == ref.normalisers(mask)
    assert tuple(map(float, normalisers(jnp.zeros((2, 3), bool)))) == (0.0, 0.0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_micro", [2, 6])  # 6: one row each, incl. an empty one
def test_micro_batches_sum_to_the_full_batch(rng, mode, num_micro):
    """K row micro-batches aggregated with the full-batch normalisers sum to the full-batch
    loss, and so do their gradients (gradient accumulation is exact)."""
    values, mask = _batch(rng)
    num_tokens, num_seqs = normalisers(mask)

    def full(v):
        return aggregate(v, mask, mode, norm_constant=4.0)

    def accumulated(v):
        total = 0.0
        for rows in np.split(np.arange(B), num_micro):
            total += aggregate(
                v[rows],
                mask[rows],
                mode,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
                norm_constant=4.0,
            )
        return total

    np.testing.assert_allclose(accumulated(values), full(values), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(
        jax.grad(accumulated)(values), jax.grad(full)(values), rtol=1e-5, atol=1e-8
    )


def test_micro_batch_means_without_global_normaliser_are_wrong():
    """The pitfall the normalisers prevent: averaging per-micro-batch token means."""
    values = jnp.ones((2, 4)) * jnp.array([[1.0], [3.0]])
    mask = jnp.array([[1, 1, 1, 1], [1, 0, 0, 0]], jnp.float32)
    local = 0.5 * sum(aggregate(values[i : i + 1], mask[i : i + 1], "token-mean") for i in (0, 1))
    assert local == 2.0
    assert aggregate(values, mask, "token-mean") == 7.0 / 5.0


@pytest.mark.parametrize("mode", MODES)
def test_padding_rows_and_columns_change_nothing(rng, mode):
    values, mask = _batch(rng)
    base = aggregate(values, mask, mode, norm_constant=4.0)
    extra_rows = aggregate(
        np.concatenate([values, np.full((2, T), 9.0, np.float32)]),
        np.concatenate([mask, np.zeros((2, T), np.float32)]),
        mode,
        norm_constant=4.0,
    )
    np.testing.assert_allclose(extra_rows, base, rtol=1e-6)
    pad = ((0, 0), (0, 3))
    wide_values, wide_mask = np.pad(values, pad, constant_values=9.0), np.pad(mask, pad)
    np.testing.assert_allclose(
        aggregate(wide_values, wide_mask, mode, norm_constant=4.0), base, rtol=1e-6
    )
    if mode == "seq-mean-token-sum-norm":
        # The default constant is the padded width T: padding columns rescale by T / T'.
        np.testing.assert_allclose(
            aggregate(wide_values, wide_mask, mode),
            aggregate(values, mask, mode) * T / (T + 3),
            rtol=1e-6,
        )


@pytest.mark.parametrize("mode", MODES)
def test_traced_normalisers_do_not_recompile(rng, mode):
    values, mask = _batch(rng)
    traces = []

    @functools.partial(jax.jit, static_argnames="mode")
    def f(v, m, n_tok, n_seq, const, mode):
        traces.append(None)
        return aggregate(v, m, mode, num_tokens=n_tok, num_seqs=n_seq, norm_constant=const)

    for n_tok, n_seq, const in [(10.0, 3.0, 5.0), (20.0, 6.0, 8.0)]:
        got = f(values, mask, jnp.float32(n_tok), jnp.float32(n_seq), jnp.float32(const), mode)
        want = ref.aggregate(values, mask, mode, n_tok, n_seq, const)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert len(traces) == 1


def test_vmap(rng):
    values, mask = _batch(rng)
    stacked = jax.vmap(lambda v, m: aggregate(v, m, "seq-mean-token-mean"))(
        np.stack([values, 2 * values]), np.stack([mask, mask])
    )
    np.testing.assert_allclose(stacked, np.array([1.0, 2.0]) * float(stacked[0]), rtol=1e-6)


@pytest.mark.parametrize("mask_dtype", [np.float32, bool, jnp.bfloat16])
def test_bf16_values_are_upcast_before_any_math(rng, mask_dtype):
    """bf16 per-token losses give f32 results equal to f64 math on the bf16-rounded values
    (sums in bf16 are off by up to 2^-9 relative per addition)."""
    data = ref.bf16_batch(rng)
    values, values64 = jnp.asarray(data["values"]), np.float64(data["values"])
    mask = jnp.asarray(data["mask"]).astype(mask_dtype)
    assert values.dtype == jnp.bfloat16
    n_tok, n_seq = normalisers(mask)
    chex.assert_type([n_tok, n_seq], jnp.float32)
    assert (n_tok, n_seq) == ref.normalisers(data["mask"])
    for mode in MODES:
        for kw in ({}, {"num_tokens": n_tok + 3, "num_seqs": n_seq + 1, "norm_constant": 7.0}):
            out = aggregate(values, mask, mode, **kw)
            chex.assert_type(out, jnp.float32)
            want = ref.aggregate(
                values64, data["mask"], mode, **{k: float(v) for k, v in kw.items()}
            )
            np.testing.assert_allclose(np.float64(out), want, rtol=1e-6, atol=1e-6, err_msg=mode)
    seq_values = jnp.asarray(data["advantages"])
    out = sequence_mean(seq_values, mask)
    chex.assert_type(out, jnp.float32)
    want = ref.sequence_mean(np.float64(data["advantages"]), data["mask"])
    np.testing.assert_allclose(np.float64(out), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mask_dtype", [np.float32, jnp.bfloat16])
def test_bf16_counts_beyond_256_stay_exact(mask_dtype):
    """bf16 holds integers exactly only up to 256 (1201 rounds to 1200): counts and sums kept
    in bf16 go wrong on real batches. 1201 valid tokens of a constant loss 0.75."""
    lengths = np.array([[400], [0], [301], [400], [100]])
    mask = jnp.asarray(np.arange(400)[None, :] < lengths).astype(mask_dtype)
    values = jnp.full(mask.shape, 0.75, jnp.bfloat16)
    assert normalisers(mask) == (1201.0, 4.0)
    assert aggregate(values, mask, "token-sum") == 900.75
    assert aggregate(values, mask, "token-mean") == 0.75
    assert aggregate(values, mask, "seq-mean-token-mean") == 0.75
    assert aggregate(values, mask, "seq-mean-token-sum") == 900.75 / 4
    np.testing.assert_allclose(
        aggregate(values, mask, "seq-mean-token-sum-norm"), 900.75 / 4 / 400, rtol=1e-7
    )


def test_sequence_mean(rng):
    _, mask = _batch(rng)
    seq_values = rng.normal(size=B).astype(np.float32)
    seq_values_bad = seq_values.copy()
    seq_values_bad[3] = np.inf  # row 3 is empty
    out, grad = jax.value_and_grad(sequence_mean)(seq_values_bad, mask)
    np.testing.assert_allclose(out, ref.sequence_mean(seq_values, mask), rtol=1e-6)
    assert grad[3] == 0.0 and np.all(np.delete(np.asarray(grad), 3) == 1.0 / (B - 1))
    _, num_seqs = normalisers(mask)
    halves = sum(
        sequence_mean(seq_values[rows], mask[rows], num_seqs=num_seqs)
        for rows in np.split(np.arange(B), 2)
    )
    np.testing.assert_allclose(halves, out, rtol=1e-6)
    assert sequence_mean(seq_values, np.zeros_like(mask)) == 0.0


def test_errors(rng):
    values, mask = _batch(rng)
    with pytest.raises(ValueError, match="unknown mode 'seq-mean'"):
        aggregate(values, mask, "seq-mean")
    with pytest.raises(ValueError, match=r"\(6, 4\).*\(6, 5\)"):
        aggregate(values[:, :4], mask, "token-mean")
    with pytest.raises(ValueError, match="rank 2"):
        aggregate(values[0], mask[0], "token-mean")
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate(values, mask, "token-mean", num_tokens=jnp.ones(2))
    with pytest.raises(ValueError, match="num_seqs"):
        aggregate(values, mask, "seq-mean-token-sum", num_seqs=-1)
    with pytest.raises(ValueError, match="norm_constant"):
        aggregate(values, mask, "seq-mean-token-sum-norm", norm_constant=0)
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate(values, mask, "token-mean", num_tokens=True)
    with pytest.raises(ValueError, match="seq_values"):
        sequence_mean(values[:, 0][:4], mask)
    with pytest.raises(ValueError, match="rank 2"):
        normalisers(mask[0])
