"""Tests for jaxrl_llm.sampling.strategies against the float64 references in tests/reference."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.sampling import strategies
from tests.reference import sampling as ref

# Jitted once per module: eager op-by-op dispatch of the cond branches is slow on 2 cores.
sample_tokens = jax.jit(strategies.sample_tokens, static_argnames="top_k")
truncate_logits = jax.jit(strategies.truncate_logits, static_argnames="top_k")
token_logprobs = jax.jit(strategies.token_logprobs)

CONFIGS = [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=4),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=1.3, top_k=6, top_p=0.9, min_p=0.05),
    dict(temperature=0.5, top_p=0.6, min_p=0.02),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_truncate_logits_matches_reference(rng, config):
    logits = rng.normal(scale=2.0, size=(6, 20)).astype(np.float32)
    out = truncate_logits(jnp.asarray(logits), **config)
    chex.assert_shape(out, (6, 20))
    chex.assert_type(out, jnp.float32)
    for row in range(6):
        want = ref.truncated_probs(logits[row], **config)
        np.testing.assert_array_equal(np.isfinite(out[row]), want > 0)
        got = np.asarray(jax.nn.softmax(out[row]), np.float64)
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_truncate_logits_hand_checked():
    logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))

    def support(**kw):
        return np.flatnonzero(np.isfinite(truncate_logits(logits, **kw))).tolist()

    assert support() == [0, 1, 2, 3]
    assert support(top_k=3) == [0, 1, 2]
    assert support(top_p=0.75) == [0, 1]  # mass before token 2 is 0.8 >= 0.75
    assert support(top_p=0.4) == [0]  # the most likely token is always kept
    assert support(min_p=0.35) == [0, 1]  # threshold 0.175
    assert support(min_p=0.2) == [0, 1, 2]  # threshold 0.1
    # top-p on the renormalised top-2: {0.625, 0.375}; 0.625 < 0.7 keeps both.
    assert support(top_k=2, top_p=0.7) == [0, 1]
    assert support(top_k=2, top_p=0.6) == [0]


def test_top_p_one_keeps_negligible_tail():
    # The exclusive cumulative sum rounds to 1.0 before the tail; top_p=1 must still keep it.
    logits = jnp.concatenate([jnp.zeros(1), jnp.full((30,), -40.0)])
    assert bool(jnp.all(jnp.isfinite(truncate_logits(logits, top_p=1.0))))
    assert bool(jnp.all(jnp.isfinite(truncate_logits(logits, top_k=31, top_p=1.0))))


@functools.partial(jax.jit, static_argnames="top_k")
def _draw_many(logits, keys, temperature, top_p, min_p, *, top_k):
    """One draw per key; the scalars are traced, so configs differing only in them share one
    compiled program."""
    return jax.vmap(
        lambda k: strategies.sample_tokens(
            logits, k, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
        )
    )(keys)


def _draw(logits, num, seed=0, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    keys = jax.random.split(jax.random.key(seed), num)
    scalars = (jnp.float32(temperature), jnp.float32(top_p), jnp.float32(min_p))
    return np.asarray(_draw_many(logits, keys, *scalars, top_k=top_k))


SAMPLED_CONFIGS = [
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=4),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=1.3, top_k=6, top_p=0.9, min_p=0.05),
    dict(temperature=0.8, top_p=0.9, min_p=0.03),
]


@pytest.mark.parametrize("config", SAMPLED_CONFIGS)
def test_sampled_frequencies_match_truncated_softmax(config):
    vocab, num = 10, 40_000
    logits = np.linspace(2.0, -2.5, vocab).astype(np.float32)[
        np.array([3, 0, 7, 1, 9, 2, 5, 8, 4, 6])
    ]
    draws = _draw(jnp.asarray(logits), num, **config)
    chex.assert_shape(draws, (num,))
    assert draws.dtype == np.int32
    counts = np.bincount(draws, minlength=vocab)
    want = ref.truncated_probs(logits, **config)
    assert counts[want == 0].sum() == 0, "sampled a truncated token"
    stat, dof = ref.chi_square(counts, want)
    assert dof >= 2
    assert stat < ref.chi_square_critical(dof), (stat, dof)
    # The test has power: the untruncated (or unscaled) softmax is rejected by the same statistic.
    wrong = ref.truncated_probs(logits, temperature=1.0 if config["temperature"] != 1.0 else 2.0)
    wrong_stat, wrong_dof = ref.chi_square(counts, wrong)
    assert wrong_stat > ref.chi_square_critical(wrong_dof)


def test_rows_sample_independent_distributions():
    logits = jnp.array([[0.0, 5.0, -5.0], [5.0, -5.0, 0.0]])
    draws = sample_tokens(jnp.tile(logits, (2000, 1)), jax.random.key(1), temperature=1.0).reshape(
        2000, 2
    )
    assert np.mean(np.asarray(draws[:, 0]) == 1) > 0.95
    assert np.mean(np.asarray(draws[:, 1]) == 0) > 0.95


def test_greedy_and_top_k_one(rng):
    logits = jnp.asarray(rng.normal(size=(16, 50)).astype(np.float32))
    greedy = np.argmax(np.asarray(logits), axis=-1)
    key = jax.random.key(3)
    np.testing.assert_array_equal(sample_tokens(logits, key, temperature=0.0), greedy)
    for temperature in (0.0, 0.3, 1.0, 5.0):
        for seed in range(3):
            got = sample_tokens(
                logits, jax.random.key(seed), temperature=temperature, top_k=1, top_p=0.5
            )
            np.testing.assert_array_equal(got, greedy)
    # Ties: greedy and top-k=1 both take the lowest id.
    tied = jnp.array([[1.0, 3.0, 3.0, 0.0]])
    assert int(sample_tokens(tied, key, temperature=0.0)[0]) == 1
    assert int(sample_tokens(tied, key, top_k=1)[0]) == 1


def test_sampling_is_deterministic_given_key(rng):
    logits = jnp.asarray(rng.normal(size=(8, 30)).astype(np.float32))
    a = sample_tokens(logits, jax.random.key(7), top_p=0.9)
    b = sample_tokens(logits, jax.random.key(7), top_p=0.9)
    c = sample_tokens(logits, jax.random.key(8), top_p=0.9)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_bf16_logits_computed_in_f32(rng):
    logits = jnp.asarray(rng.normal(size=(4, 25)), dtype=jnp.bfloat16)
    out = truncate_logits(logits, temperature=0.3, top_p=0.9)
    chex.assert_type(out, jnp.float32)
    want = truncate_logits(logits.astype(jnp.float32), temperature=0.3, top_p=0.9)
    np.testing.assert_array_equal(out, want)
    lp = token_logprobs(logits, jnp.zeros(4, jnp.int32), temperature=0.3)
    chex.assert_type(lp, jnp.float32)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0, 2.5])
def test_token_logprobs_full_distribution(rng, temperature):
    logits = rng.normal(scale=3.0, size=(3, 5, 40)).astype(np.float32)
    tokens = rng.integers(0, 40, size=(3, 5))
    got = token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), temperature=temperature)
    chex.assert_shape(got, (3, 5))
    want = np.take_along_axis(ref.log_softmax(logits, temperature), tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_changing_scalars_does_not_recompile(rng):
    traces = []

    @jax.jit
    def fn(logits, key, temperature, top_p, min_p):
        traces.append(1)
        return sample_tokens(
            logits, key, temperature=temperature, top_k=0, top_p=top_p, min_p=min_p
        )

    logits = jnp.asarray(rng.normal(size=(4, 30)).astype(np.float32))
    key = jax.random.key(0)
    fn(logits, key, jnp.float32(1.0), jnp.float32(1.0), jnp.float32(0.0))
    out = fn(logits, key, jnp.float32(0.0), jnp.float32(0.5), jnp.float32(0.2))
    fn(logits, key, jnp.float32(0.6), jnp.float32(0.9), jnp.float32(0.0))
    assert len(traces) == 1
    np.testing.assert_array_equal(out, np.argmax(np.asarray(logits), -1))


def test_invalid_arguments_raise():
    logits = jnp.zeros((2, 5))
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="top_k"):
        strategies.sample_tokens(logits, key, top_k=6)
    with pytest.raises(ValueError, match="top_k"):
        strategies.sample_tokens(logits, key, top_k=-1)
    with pytest.raises(ValueError, match="top_k"):
        strategies.sample_tokens(logits, key, top_k=2.5)
    with pytest.raises(ValueError, match="top_p"):
        strategies.sample_tokens(logits, key, top_p=0.0)
    with pytest.raises(ValueError, match="min_p"):
        strategies.truncate_logits(logits, min_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        strategies.sample_tokens(logits, key, temperature=-1.0)
    with pytest.raises(ValueError, match="temperature must be a scalar"):
        strategies.sample_tokens(logits, key, temperature=jnp.ones(2))
    with pytest.raises(ValueError, match=r"logits must be \[..., V\]"):
        strategies.sample_tokens(jnp.float32(1.0), key)
    with pytest.raises(ValueError, match=r"tokens shape \(3,\)"):
        strategies.token_logprobs(logits, jnp.zeros(3, jnp.int32))


@pytest.mark.parametrize("block", [3, 4])
def test_blocked_categorical_frequencies(block):
    # Blocks of 3 or 4 over V=10 exercise padding, -inf tokens and a fully -inf block.
    logits = np.array([0.5, -np.inf, 1.2, -0.3, -np.inf, -np.inf, -np.inf, 0.9, 2.0, -1.0])
    if block == 4:
        logits[4:8] = -np.inf  # block 1 entirely truncated
    num = 40_000
    keys = jax.random.split(jax.random.key(block), num)
    draw = jax.jit(jax.vmap(lambda k: strategies.categorical(k, jnp.asarray(logits), block=block)))
    counts = np.bincount(np.asarray(draw(keys)), minlength=10)
    want = ref.truncated_probs(logits)
    assert counts[want == 0].sum() == 0
    stat, dof = ref.chi_square(counts, want)
    assert stat < ref.chi_square_critical(dof), (stat, dof)


def test_blocked_categorical_is_used_for_large_vocabularies():
    # V=1000 > 2 blocks: the mass sits on three tokens in three different blocks.
    logits = np.full((1000,), -np.inf, np.float32)
    logits[[5, 400, 999]] = [0.0, np.log(2.0), np.log(3.0)]
    draws = sample_tokens(jnp.tile(jnp.asarray(logits), (30_000, 1)), jax.random.key(0))
    counts = np.array([(np.asarray(draws) == t).sum() for t in (5, 400, 999)])
    assert counts.sum() == 30_000
    stat, dof = ref.chi_square(counts, np.array([1.0, 2.0, 3.0]) / 6.0)
    assert stat < ref.chi_square_critical(dof), counts


def test_top_p_ties_at_the_cutoff_are_kept_on_both_paths():
    # probs ~ (0.42, 0.42, 0.16): the nucleus for top_p=0.3 is one token by mass, but its tie
    # has the same logit, so both are kept, with or without top-k.
    logits = jnp.array([1.0, 0.0, 1.0])
    for top_k in (0, 3):
        kept = np.isfinite(truncate_logits(logits, top_k=top_k, top_p=0.3))
        assert kept.tolist() == [True, False, True], top_k


def test_full_vocabulary_nucleus_equals_sorted_rule(rng):
    # The bisection path (top_k=0) and the sorted path (top_k=V) agree on random logits,
    # including large negative and -inf entries.
    logits = rng.normal(scale=4.0, size=(32, 300)).astype(np.float32)
    logits[:, :20] = -np.inf
    logits[:, 20:40] -= 60.0
    probs = np.exp(ref.log_softmax(logits))
    for top_p in (0.05, 0.5, 0.9, 0.999):
        full = np.isfinite(truncate_logits(jnp.asarray(logits), top_p=top_p))
        sorted_path = np.isfinite(truncate_logits(jnp.asarray(logits), top_k=300, top_p=top_p))
        # Where they differ, the token's mass-above must sit on the cut-off within f32 rounding
        # (the cumulative sum and the bisection's masked sums round differently).
        for row, col in np.argwhere(full != sorted_path):
            mass_above = probs[row][logits[row] > logits[row, col]].sum()
            assert abs(mass_above - top_p) < 1e-6, (top_p, row, col, mass_above)
        assert (full != sorted_path).sum() <= 2


def test_first_argmax_equals_numpy_argmax(rng):
    logits = rng.normal(size=(7, 300)).astype(np.float32)
    logits[1, [5, 17, 250]] = 9.0  # ties: the lowest index wins
    logits[2, :] = -np.inf
    logits[2, 40] = 0.0
    logits[3, [3, 100]] = np.inf
    logits[4, [8, 60]] = np.nan  # NaN wins, as in jnp.argmax / np.argmax
    got = np.asarray(jax.jit(strategies.first_argmax)(jnp.asarray(logits)))
    chex.assert_type(got, np.int32)
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
    assert got[1] == 5 and got[2] == 40 and got[3] == 3 and got[4] == 8
