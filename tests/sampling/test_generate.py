"""Tests for jaxrl_llm.sampling.generate on a tiny random model.

Compiles are the cost here (2 CPU cores), so every test reuses one model, one batch shape and a
handful of static settings: (G=1, top_k=0), (G=3, top_k=0) and (G=1, top_k=1).
"""

import dataclasses
import functools
import importlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.logprobs import completion_logprobs
from jaxrl_llm.models import ModelConfig, logits
from tests.jit_traces import count_traces
from tests.reference import sampling as ref
from tests.sampling import random_params

# The package exports the function `generate`, which shadows the submodule's attribute.
gen = importlib.import_module("jaxrl_llm.sampling.generate")

MAX_NEW = 10
PAD = 0
LENGTHS = (3, 7, 12, 9)
WIDTH = 12  # bucketed to 16


@pytest.fixture(scope="module")
def model():
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    params = random_params(config)
    return config, params


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    tokens = np.full((len(LENGTHS), WIDTH), PAD, np.int32)
    mask = np.zeros((len(LENGTHS), WIDTH), bool)
    for row, length in enumerate(LENGTHS):
        tokens[row, WIDTH - length :] = rng.integers(1, 61, size=length)
        mask[row, WIDTH - length :] = True
    return tokens, mask


def _run(model, prompts, **kwargs):
    """``generate``; ``kwargs``: its arguments and ``SamplingOptions``'s fields."""
    config, params = model
    fields = {f.name for f in dataclasses.fields(gen.SamplingOptions)}
    sampling = {"eos_ids": (), "pad_id": PAD} | {k: kwargs.pop(k) for k in fields & set(kwargs)}
    options = dict(key=jax.random.key(0), max_new_tokens=MAX_NEW)
    sampling = gen.SamplingOptions(**sampling)
    return gen.generate(params, config, *prompts, sampling=sampling, **{**options, **kwargs})


def _states(model, prompts, *, eos_ids, temperature=0.0, key=0):
    """Prefill + decode by hand, returning the final state (to read ``step``)."""
    config, params = model
    sampling = gen.sampling_params(temperature=temperature, eos_ids=eos_ids, pad_id=PAD)
    tokens, mask = gen.pad_prompts(*prompts, pad_id=PAD)
    state = gen.prefill(params, config, tokens, mask, max_new_tokens=MAX_NEW, pad_id=PAD)
    assert int(state.step) == 0
    return gen.decode(params, config, state, key=jax.random.key(key), sampling=sampling)


@pytest.fixture(scope="module")
def full_logits(model):
    """Full (no cache) forward logits ``[1, WIDTH + MAX_NEW, V]``: one compiled shape."""
    config, params = model
    return jax.jit(functools.partial(logits, params, config))


@pytest.fixture(scope="module")
def score(model):
    """``completion_logprobs`` of the model, jitted (temperature traced): [4, 12] + [4, 10]."""
    config, params = model
    return jax.jit(functools.partial(completion_logprobs, params, config))


@pytest.fixture(scope="module")
def full_logits_fn(full_logits):
    """Last-position logits of an unpadded sequence by a full (no cache) forward pass."""
    width = WIDTH + MAX_NEW

    def next_logits(sequence):
        tokens = np.zeros((1, width), np.int32)
        mask = np.zeros((1, width), bool)
        tokens[0, : len(sequence)] = sequence
        mask[0, : len(sequence)] = True  # right padding: causal, so real positions are exact
        return np.asarray(full_logits(tokens, attention_mask=mask)[0, len(sequence) - 1])

    return next_logits


@pytest.fixture(scope="module")
def greedy(model, prompts):
    return _run(model, prompts, temperature=0.0)


def _unpadded(prompts, row):
    tokens, mask = prompts
    return tokens[row][mask[row]].tolist()


def test_greedy_with_cache_equals_full_recomputation(greedy, prompts, full_logits_fn):
    chex.assert_shape([greedy.tokens, greedy.logprobs, greedy.mask], (len(LENGTHS), MAX_NEW))
    assert greedy.tokens.dtype == jnp.int32 and greedy.mask.dtype == jnp.bool_
    chex.assert_type(greedy.logprobs, jnp.float32)
    assert bool(greedy.mask.all())
    for row in range(len(LENGTHS)):
        prompt = _unpadded(prompts, row)
        want = ref.greedy_by_recomputation(full_logits_fn, prompt, MAX_NEW, eos=set())
        assert greedy.tokens[row].tolist() == want, row
        # Greedy log-probs are reported under temperature 1.
        sequence = prompt + want
        for t, token in enumerate(want):
            lp = ref.log_softmax(full_logits_fn(sequence[: len(prompt) + t]))[token]
            np.testing.assert_allclose(greedy.logprobs[row, t], lp, atol=2e-4)


def test_eos_stops_rows_independently_and_loop_exits_early(model, prompts, greedy):
    tokens = np.asarray(greedy.tokens)
    # One EOS id first seen in row 0 at column 2, another first seen in row 1 at column 5.
    eos = {int(tokens[0, 2]), int(tokens[1, 5])}
    stop = []
    for row in range(len(LENGTHS)):
        hits = [t for t in range(MAX_NEW) if tokens[row, t] in eos]
        stop.append(hits[0] + 1 if hits else MAX_NEW)
    state = _states(model, prompts, eos_ids=tuple(sorted(eos)))
    for row, length in enumerate(stop):
        assert state.tokens[row, :length].tolist() == tokens[row, :length].tolist()
        assert bool(state.mask[row, :length].all()), "mask must include the EOS token"
        assert state.tokens[row, length:].tolist() == [PAD] * (MAX_NEW - length)
        assert not bool(state.mask[row, length:].any())
        assert not bool(jnp.any(state.logprobs[row, length:]))
        np.testing.assert_allclose(
            state.logprobs[row, :length], greedy.logprobs[row, :length], atol=1e-6
        )
    # The loop ran until the last row finished, or to MAX_NEW.
    assert int(state.step) == max(stop)
    ended = [any(t in eos for t in tokens[row]) for row in range(len(LENGTHS))]
    assert state.done.tolist() == ended

    # Every row done early: the loop exits before filling all columns.
    early = {int(tokens[row, 1]) for row in range(len(LENGTHS))}
    state = _states(model, prompts, eos_ids=tuple(sorted(early)))
    assert int(state.step) <= 2 < MAX_NEW
    assert bool(state.done.all())
    assert not bool(state.mask[:, 2:].any())


def test_eos_in_first_token(model, prompts, greedy):
    first = int(greedy.tokens[0, 0])
    out = _run(model, prompts, temperature=0.0, eos_ids=first)
    assert out.tokens[0].tolist() == [first] + [PAD] * (MAX_NEW - 1)
    assert out.mask[0].tolist() == [True] + [False] * (MAX_NEW - 1)


def test_logprobs_match_completion_logprobs(model, prompts, full_logits, score):
    eos = (5, 17)
    out = _run(
        model, prompts, temperature=0.7, top_p=0.9, min_p=0.05, eos_ids=eos, key=jax.random.key(3)
    )
    want = score(*prompts, out.tokens, out.mask, temperature=jnp.float32(0.7))
    np.testing.assert_allclose(out.logprobs, want, atol=1e-4)
    assert not bool(jnp.any(jnp.where(out.mask, 0.0, out.logprobs)))
    # Every sampled token lies in the truncated support of its step's full-recompute logits.
    sequence = np.concatenate([prompts[0], np.asarray(out.tokens)], axis=1)
    seq_mask = np.concatenate([prompts[1], np.asarray(out.mask)], axis=1)
    for row in range(len(LENGTHS)):
        step_logits = np.asarray(
            full_logits(sequence[row : row + 1], attention_mask=seq_mask[row : row + 1])[0]
        )
        for t in np.flatnonzero(np.asarray(out.mask[row])):
            probs = ref.truncated_probs(
                step_logits[WIDTH + t - 1], temperature=0.7, top_p=0.9, min_p=0.05
            )
            assert probs[int(out.tokens[row, t])] > 0, (row, t)


def test_same_key_same_output_and_scalars_do_not_recompile(model, prompts):
    a = _run(model, prompts, temperature=1.0, key=jax.random.key(11))
    programs = (gen.prefill_program.__wrapped__.__name__, gen.decode_program.__wrapped__.__name__)
    with count_traces(*programs) as traced:
        b = _run(model, prompts, temperature=1.0, key=jax.random.key(11))
        c = _run(model, prompts, temperature=1.0, key=jax.random.key(12))
        d = _run(model, prompts, temperature=0.3, top_p=0.5, min_p=0.1, eos_ids=(1, 2, 3), pad_id=1)
        # A narrower batch lands in the same 16-column bucket.
        narrower = _run(model, (prompts[0][:, -9:], prompts[1][:, -9:]), temperature=0.5)
    assert traced == []
    assert narrower.tokens.shape == a.tokens.shape
    for field in ("tokens", "logprobs", "mask"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert not np.array_equal(a.tokens, c.tokens)
    assert d.tokens.shape == a.tokens.shape


def test_sampling_at_temperature_one_is_not_greedy(model, prompts, greedy):
    out = _run(model, prompts, temperature=1.0, key=jax.random.key(5))
    assert not np.array_equal(out.tokens, greedy.tokens)
    assert bool(out.mask.all())


def test_top_k_one_equals_greedy(model, prompts, greedy, score):
    for seed in (0, 1):
        out = _run(model, prompts, temperature=1.3, top_k=1, key=jax.random.key(seed))
        np.testing.assert_array_equal(out.tokens, greedy.tokens)
        # Log-probs are still those of the full distribution at temperature 1.3.
        want = score(*prompts, out.tokens, out.mask, temperature=jnp.float32(1.3))
        np.testing.assert_allclose(out.logprobs, want, atol=1e-4)


def test_groups_are_contiguous_independent_and_prefilled_once(
    model, prompts, greedy, score, monkeypatch
):
    calls = []

    def recording_forward(*args, **kwargs):
        calls.append(args[2].shape)
        return forward(*args, **kwargs)

    forward = gen.forward
    monkeypatch.setattr(gen, "forward", recording_forward)
    # `forward` is only called while tracing: start from empty jit caches, so that the traces
    # below happen whatever ran before in this process (another test, or this one, may have
    # compiled the same programs already).
    gen.prefill_program.clear_cache()
    gen.decode_program.clear_cache()
    groups = 3
    out = _run(model, prompts, temperature=1.0, num_samples=groups, key=jax.random.key(2))
    # One trace of the prefill on the N prompts (not N*G rows), one of the decode step.
    assert calls == [(len(LENGTHS), 16), (len(LENGTHS) * groups, 1)]
    chex.assert_shape([out.tokens, out.logprobs, out.mask], (len(LENGTHS) * groups, MAX_NEW))
    for prompt in range(len(LENGTHS)):
        rows = out.tokens[prompt * groups : (prompt + 1) * groups]
        assert len({tuple(r) for r in rows.tolist()}) == groups, "group rows must differ"
    repeated = [np.repeat(x, groups, axis=0) for x in prompts]
    for rows in np.split(np.arange(len(LENGTHS) * groups), groups):  # reuse the [4, .] program
        want = score(
            *(x[rows] for x in repeated),
            out.tokens[rows],
            out.mask[rows],
            temperature=jnp.float32(1.0),
        )
        np.testing.assert_allclose(out.logprobs[rows], want, atol=1e-4)

    # Greedy groups: all G rows of prompt g equal the single greedy completion of prompt g.
    same = _run(model, prompts, temperature=0.0, num_samples=groups)
    np.testing.assert_array_equal(same.tokens, np.repeat(greedy.tokens, groups, axis=0))
    assert len(calls) == 2, "another temperature must not retrace"


def test_bucketing():
    assert [gen.bucket_length(n) for n in (1, 3, 4, 5, 8, 9, 15, 16, 17, 33, 100)] == [
        4,
        4,
        4,
        8,
        8,
        16,
        16,
        16,
        32,
        64,
        128,
    ]
    assert gen.bucket_length(10, buckets=(8, 24, 12)) == 12
    with pytest.raises(ValueError, match="exceeds the largest bucket 24"):
        gen.bucket_length(30, buckets=(8, 24))
    tokens, mask = gen.pad_prompts(np.ones((2, 5), np.int32), np.ones((2, 5), bool), pad_id=7)
    chex.assert_shape([tokens, mask], (2, 8))
    assert tokens[0, :3].tolist() == [7] * 3 and not bool(mask[:, :3].any())


def test_sampling_params_pad_eos_ids():
    one = gen.sampling_params(eos_ids=3, pad_id=0)
    five = gen.sampling_params(eos_ids=(3, 4, 5, 6, 7), pad_id=0)
    assert one.eos_ids.tolist() == [3, -1, -1, -1]
    assert five.eos_ids.tolist() == [3, 4, 5, 6, 7, -1, -1, -1]
    assert gen.sampling_params(eos_ids=(), pad_id=0).eos_ids.tolist() == [-1] * 4


def test_invalid_inputs_raise(model, prompts):
    tokens, mask = prompts
    right = np.flip(mask, axis=1)
    with pytest.raises(ValueError, match="left-padded"):
        _run(model, (tokens, right))
    holes = mask.copy()
    holes[2, -3] = False
    with pytest.raises(ValueError, match=r"left-padded: rows \[2\]"):
        _run(model, (tokens, holes))
    with pytest.raises(ValueError, match=r"prompt_mask shape \(4, 11\)"):
        _run(model, (tokens, mask[:, 1:]))
    with pytest.raises(ValueError, match="prompt_tokens must be integer"):
        _run(model, (tokens.astype(np.float32), mask))
    with pytest.raises(ValueError, match="max_new_tokens"):
        _run(model, prompts, max_new_tokens=0)
    with pytest.raises(ValueError, match="num_samples"):
        _run(model, prompts, num_samples=0)
    with pytest.raises(ValueError, match="top_k"):
        _run(model, prompts, top_k=62)
    with pytest.raises(ValueError, match="temperature"):
        _run(model, prompts, temperature=-0.5)
    with pytest.raises(ValueError, match="top_p"):
        _run(model, prompts, top_p=1.5)
    with pytest.raises(ValueError, match="eos_ids"):
        _run(model, prompts, eos_ids=(-3,))
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        gen.pad_prompts(*prompts, pad_id=PAD, buckets=(8,))
