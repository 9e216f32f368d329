"""Chunked per-token log-probs: against float64 references, full logits, and in memory; and
distillation's options (a teacher's top-k log-probs and ids, a student's log-probs gathered at
given ids), padded and packed."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import parallel
from jaxrl_llm.logprobs import (
    LogprobOutputs,
    completion_logprobs,
    default_chunk_size,
    packed_completion_logprobs,
    per_device_sizes,
    token_logprobs_from_hidden,
)
from jaxrl_llm.models import load_pretrained, logits
from jaxrl_llm.packing import plan_sequences
from jaxrl_llm.types import Sequences
from tests.models import hf_utils
from tests.reference import logprobs as ref

B, P, T = 3, 5, 7


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2"))
    torch_model = hf_utils.build_checkpoint("qwen2", path, seed=3)
    config, params = load_pretrained(path, dtype=jnp.float32)
    return torch_model, config, params


@pytest.fixture
def batch(rng):
    prompt, prompt_mask = hf_utils.padded_batch(rng, [5, 3, 1], P, vocab=128, side="left")
    completion, completion_mask = hf_utils.padded_batch(rng, [7, 4, 0], T, vocab=128, side="right")
    return prompt, prompt_mask, completion, completion_mask


def _full_logprobs(params, config, batch, temperature):
    """Materialises [B, P + T, V] logits: the straightforward version to compare against."""
    prompt, prompt_mask, completion, completion_mask = batch
    tokens = jnp.concatenate([prompt, completion], axis=1)
    mask = jnp.concatenate([prompt_mask, completion_mask], axis=1)
    z = logits(params, config, tokens, attention_mask=mask)[:, P - 1 : P - 1 + T] / temperature
    logp = jnp.take_along_axis(jax.nn.log_softmax(z), completion[..., None], axis=-1)[..., 0]
    return jnp.where(completion_mask > 0, logp, 0.0)


def test_matches_float64_transformers_reference(model, batch):
    torch_model, config, params = model
    prompt, prompt_mask, completion, completion_mask = batch
    # Reference: each row alone, unpadded, through a float64 copy of the torch model.
    want_lp, want_ent = np.zeros((B, T)), np.zeros((B, T))
    for row in range(B):
        real_prompt = prompt[row][prompt_mask[row] > 0]
        real_completion = completion[row][completion_mask[row] > 0]
        n = len(real_completion)
        if n == 0:
            continue
        seq = np.concatenate([real_prompt, real_completion])[None]
        full = hf_utils.hf_logits(torch_model, seq, np.ones_like(seq), double=True)
        lp, ent = ref.completion_logprobs(
            full, len(real_prompt), real_completion[None], np.ones((1, n)), temperature=0.7
        )
        want_lp[row, :n], want_ent[row, :n] = lp[0], ent[0]
    traces = []

    def traced(*args, temperature):
        traces.append(temperature)  # runs once per trace, not per call
        return completion_logprobs(
            params, config, *args, chunk_size=3, return_entropy=True, temperature=temperature
        )

    fn = jax.jit(traced)
    got_lp, got_ent = fn(*batch, temperature=0.7)
    chex.assert_shape([got_lp, got_ent], (B, T))
    chex.assert_type([got_lp, got_ent], jnp.float32)
    assert np.abs(want_lp).max() > 1.0
    np.testing.assert_allclose(got_lp, want_lp, atol=1e-4)
    np.testing.assert_allclose(got_ent, want_ent, atol=1e-4)
    assert np.all(np.asarray(got_lp)[completion_mask == 0] == 0)
    assert np.all(np.asarray(got_ent)[completion_mask == 0] == 0)
    # A new temperature is a traced value: no retrace (counted in Python: the C++ jit cache's
    # size, asserted before, once read 0 in a full CI run after two calls).
    fn(*batch, temperature=1.3)
    assert len(traces) == 1


def test_prompt_logprobs_match_float64_transformers_reference(model, batch):
    """``return_prompt_logprobs``: every prompt token after a row's first, from one pass."""
    torch_model, config, params = model
    prompt, prompt_mask, completion, completion_mask = batch
    want_prompt, want_completion = np.zeros((B, P)), np.zeros((B, T))
    for row in range(B):
        real_prompt = prompt[row][prompt_mask[row] > 0]
        real_completion = completion[row][completion_mask[row] > 0]
        seq = np.concatenate([real_prompt, real_completion])
        full = hf_utils.hf_logits(torch_model, seq[None], np.ones((1, len(seq))), double=True)[0]
        z = full / 0.7
        logp = (
            z
            - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
            - z.max(-1, keepdims=True)
        )
        # Position i predicts token i + 1; the row's first real token has no predictor.
        token_logp = logp[np.arange(len(seq) - 1), seq[1:]]
        n_prompt, n = len(real_prompt), len(real_completion)
        want_prompt[row, P - n_prompt + 1 :] = token_logp[: n_prompt - 1]
        want_completion[row, :n] = token_logp[n_prompt - 1 :]
    fn = jax.jit(
        functools.partial(
            completion_logprobs, params, config, chunk_size=3, return_prompt_logprobs=True
        )
    )
    got_completion, got_prompt = fn(*batch, temperature=0.7)
    chex.assert_shape(got_prompt, (B, P))
    assert np.abs(want_prompt).max() > 1.0
    np.testing.assert_allclose(got_prompt, want_prompt, atol=1e-4)
    np.testing.assert_allclose(got_completion, want_completion, atol=1e-4)
    np.testing.assert_allclose(
        got_completion, completion_logprobs(params, config, *batch, temperature=0.7), atol=1e-6
    )
    with pytest.raises(ValueError, match="cannot be combined"):
        completion_logprobs(
            params, config, *batch, return_prompt_logprobs=True, return_entropy=True
        )


def test_chunked_equals_full_values_and_gradients(model, batch, rng):
    _, config, params = model
    weights = rng.normal(size=(B, T)).astype(np.float32)

    def chunked_loss(params, chunk_size):
        lp = completion_logprobs(params, config, *batch, temperature=0.8, chunk_size=chunk_size)
        return jnp.sum(lp * weights)

    def full_loss(params):
        return jnp.sum(_full_logprobs(params, config, batch, 0.8) * weights)

    @jax.jit
    def all_versions(params):
        return (
            jax.value_and_grad(full_loss)(params),
            jax.value_and_grad(chunked_loss)(params, 3),
            jax.value_and_grad(chunked_loss)(params, None),
        )

    (full, grad_full), (c3, grad_c3), (c_auto, grad_auto) = all_versions(params)
    np.testing.assert_allclose(c3, full, rtol=1e-5)
    np.testing.assert_allclose(c_auto, full, rtol=1e-5)
    chex.assert_trees_all_close(grad_c3, grad_full, atol=2e-5, rtol=1e-4)
    chex.assert_trees_all_close(grad_auto, grad_full, atol=2e-5, rtol=1e-4)


def test_masked_completion_tokens_change_nothing(model, batch, rng):
    _, config, params = model
    prompt, prompt_mask, completion, completion_mask = batch
    fn = jax.jit(functools.partial(completion_logprobs, params, config, chunk_size=4))
    base = fn(*batch)
    garbage = np.where(completion_mask > 0, completion, rng.integers(0, 128, completion.shape))
    np.testing.assert_array_equal(fn(prompt, prompt_mask, garbage, completion_mask), base)


def test_bf16_params_close_to_f32(model, batch):
    _, config, params = model
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    fn = jax.jit(completion_logprobs, static_argnums=1)
    want = fn(params, config, *batch)
    got = fn(bf16, config, *batch)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.exp(got), np.exp(want), atol=2e-2)


@pytest.mark.parametrize("chunk_size", [1, 2, 5, 6, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_from_hidden_against_reference(rng, chunk_size, temperature):
    hidden = rng.normal(size=(2, 6, 8)).astype(np.float32)
    w = rng.normal(size=(8, 11)).astype(np.float32)
    targets = rng.integers(0, 11, size=(2, 6))
    mask = rng.random((2, 6)) < 0.7
    lp, ent = token_logprobs_from_hidden(
        hidden,
        lambda h: h @ w,
        targets,
        mask=mask,
        temperature=temperature,
        chunk_size=chunk_size,
        return_entropy=True,
    )
    want_lp, want_ent = ref.token_logprobs(
        hidden.astype(np.float64) @ w, targets, mask, temperature=temperature
    )
    np.testing.assert_allclose(lp, want_lp, atol=1e-5)
    np.testing.assert_allclose(ent, want_ent, atol=1e-5)


def test_from_hidden_gradients(rng):
    hidden = jnp.asarray(rng.normal(size=(2, 5, 4)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 9)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 9, size=(2, 5)))
    mask = jnp.asarray([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1]], bool)

    def loss(hidden, w, chunk_size):
        lp, ent = token_logprobs_from_hidden(
            hidden,
            lambda h: h @ w,
            targets,
            mask=mask,
            chunk_size=chunk_size,
            return_entropy=True,
        )
        return jnp.sum(lp) + 0.3 * jnp.sum(ent)

    def full(hidden, w):
        logp = jax.nn.log_softmax(hidden @ w)
        lp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
        return jnp.sum(jnp.where(mask, lp + 0.3 * ent, 0.0))

    grads = jax.grad(loss, argnums=(0, 1))(hidden, w, 2)
    chex.assert_trees_all_close(grads, jax.grad(full, argnums=(0, 1))(hidden, w), atol=1e-5)
    # Masked positions get exactly zero gradient.
    assert np.all(np.asarray(grads[0])[~np.asarray(mask)] == 0)


def _max_intermediate_size(jaxpr):
    biggest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            biggest = max(biggest, int(np.prod(getattr(var.aval, "shape", ()))))
        for param in eqn.params.values():
            subs = param if isinstance(param, list | tuple) else [param]
            for sub in subs:
                inner = getattr(sub, "jaxpr", None)
                if isinstance(sub, jax.extend.core.Jaxpr):
                    biggest = max(biggest, _max_intermediate_size(sub))
                elif inner is not None:
                    biggest = max(biggest, _max_intermediate_size(inner))
    return biggest


def test_full_logits_are_never_materialised(rng):
    batch, length, dim, vocab, chunk = 2, 64, 4, 1000, 8
    hidden = jnp.zeros((batch, length, dim))
    w = jnp.zeros((dim, vocab))
    targets = jnp.zeros((batch, length), jnp.int32)

    def loss(hidden, w, chunk_size):
        return jnp.sum(
            token_logprobs_from_hidden(hidden, lambda h: h @ w, targets, chunk_size=chunk_size)
        )

    grad = jax.grad(loss, argnums=(0, 1))
    chunked = _max_intermediate_size(jax.make_jaxpr(grad, static_argnums=2)(hidden, w, chunk).jaxpr)
    whole = _max_intermediate_size(jax.make_jaxpr(grad, static_argnums=2)(hidden, w, length).jaxpr)
    assert whole >= batch * length * vocab  # the probe sees [B, T, V] when it exists
    assert chunked <= batch * chunk * vocab


def test_default_chunk_size():
    # 2^25 f32 logits per device: 2^25 / (8 * 32000) = 131 -> 128.
    assert default_chunk_size(8, 1024, 32000) == 128
    assert default_chunk_size(1, 10, 100) == 10
    assert default_chunk_size(512, 4096, 152064) == 8
    for batch, length, vocab in [(8, 1024, 32000), (4, 300, 50000), (1, 5000, 1000)]:
        chunk = default_chunk_size(batch, length, vocab)
        assert 1 <= chunk <= length
        assert chunk == length or chunk & (chunk - 1) == 0


def test_chunk_budget_is_per_device():
    """Rows split over data x fsdp and the vocabulary over tensor before budgeting, so a
    global batch on many devices does not shrink the chunks (and multiply the loop's trips)."""
    assert per_device_sizes(64, 32000) == (64, 32000)  # no mesh in context
    mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
    with parallel.mesh_context(mesh):
        assert per_device_sizes(64, 32000) == (16, 16000)
        assert per_device_sizes(6, 32001) == (2, 16001)  # ceil: the largest shard


def test_errors(model, batch):
    _, config, params = model
    prompt, prompt_mask, completion, completion_mask = batch
    with pytest.raises(ValueError, match="P >= 1"):
        completion_logprobs(
            params, config, prompt[:, :0], prompt_mask[:, :0], completion, completion_mask
        )
    with pytest.raises(ValueError, match="batch of completion_tokens"):
        completion_logprobs(
            params, config, prompt[:2], prompt_mask[:2], completion, completion_mask
        )
    with pytest.raises(ValueError, match="shape mismatch"):
        completion_logprobs(params, config, prompt, prompt_mask, completion, completion_mask[:, :3])
    with pytest.raises(ValueError, match="temperature"):
        completion_logprobs(params, config, *batch, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        completion_logprobs(params, config, *batch, chunk_size=0)
    with pytest.raises(TypeError, match=r"unknown log-prob option\(s\) \['temprature'\]"):
        completion_logprobs(params, config, *batch, temprature=0.5)
    with pytest.raises(ValueError, match=r"\[B, T, D\]"):
        token_logprobs_from_hidden(jnp.zeros((2, 3, 4)), lambda h: h, jnp.zeros((2, 4), int))


# --- Distillation's options: a teacher's top-k, a student's log-probs of given ids ---------


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_top_k_and_gathered_against_reference(rng, chunk_size, temperature):
    hidden = rng.normal(size=(2, 6, 8)).astype(np.float32)
    w = rng.normal(size=(8, 11)).astype(np.float32)
    targets = rng.integers(0, 11, size=(2, 6))
    mask = rng.random((2, 6)) < 0.7
    ids = rng.integers(0, 11, size=(2, 6, 3))
    out = token_logprobs_from_hidden(
        hidden,
        lambda h: h @ w,
        targets,
        mask=mask,
        temperature=temperature,
        chunk_size=chunk_size,
        return_entropy=True,
        top_k=4,
        gather_ids=ids,
    )
    assert isinstance(out, LogprobOutputs)
    chex.assert_shape([out.top_logprobs, out.top_ids], (2, 6, 4))
    chex.assert_shape(out.gathered, (2, 6, 3))
    logp = ref.log_softmax(hidden.astype(np.float64) @ w / temperature)
    want_ids = np.argsort(-logp, axis=-1, kind="stable")[..., :4]
    want_lp, want_ent = ref.token_logprobs(
        hidden.astype(np.float64) @ w, targets, mask, temperature=temperature
    )
    np.testing.assert_allclose(out.logprobs, want_lp, atol=1e-5)
    np.testing.assert_allclose(out.entropy, want_ent, atol=1e-5)
    assert out.top_ids.dtype == jnp.int32 and out.top_logprobs.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out.top_ids)[mask], want_ids[mask])
    np.testing.assert_allclose(
        np.asarray(out.top_logprobs)[mask],
        np.take_along_axis(logp, want_ids, -1)[mask],
        atol=1e-5,
    )
    np.testing.assert_allclose(
        np.asarray(out.gathered)[mask], np.take_along_axis(logp, ids, -1)[mask], atol=1e-5
    )
    for field in (out.top_logprobs, out.top_ids, out.gathered):  # exactly 0 off the mask
        np.testing.assert_array_equal(np.asarray(field)[~mask], 0)


def test_gathered_gradients_equal_the_full_logits(rng):
    hidden = jnp.asarray(rng.normal(size=(2, 5, 4)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 9)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 9, size=(2, 5)))
    ids = jnp.asarray(rng.integers(0, 9, size=(2, 5, 3)))
    weights = jnp.asarray(rng.normal(size=(2, 5, 3)), jnp.float32)
    mask = jnp.asarray([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1]], bool)

    def loss(hidden, w, chunk_size):
        out = token_logprobs_from_hidden(
            hidden, lambda h: h @ w, targets, mask=mask, chunk_size=chunk_size, gather_ids=ids
        )
        return jnp.sum(out.gathered * weights) + jnp.sum(out.logprobs)

    def full(hidden, w):
        logp = jax.nn.log_softmax(hidden @ w)
        picked = jnp.take_along_axis(logp, ids, axis=-1) * weights
        lp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(mask, lp + picked.sum(-1), 0.0))

    grads = jax.grad(loss, argnums=(0, 1))(hidden, w, 2)
    chex.assert_trees_all_close(grads, jax.grad(full, argnums=(0, 1))(hidden, w), atol=1e-5)
    assert np.all(np.asarray(grads[0])[~np.asarray(mask)] == 0)


def test_completion_top_k_and_gathered_packed_equal_padded(model, batch, rng):
    """The model's top-k against its full logits, and packed rows (two sequences a row) equal
    to padded ones in the top-k, the gathered log-probs and their parameter gradients."""
    _, config, params = model
    prompt, prompt_mask, completion, completion_mask = batch
    seqs = Sequences(*batch)
    plan = plan_sequences(prompt_mask, completion_mask)
    assert plan.flat("segment_ids").max() >= 2
    options = dict(temperature=0.7, chunk_size=3)
    padded = completion_logprobs(params, config, *batch, top_k=5, **options)
    tokens = jnp.concatenate([prompt, completion], axis=1)
    attention = jnp.concatenate([prompt_mask, completion_mask], axis=1)
    z = logits(params, config, tokens, attention_mask=attention)[:, P - 1 : P - 1 + T] / 0.7
    want_top, want_ids = jax.lax.top_k(jax.nn.log_softmax(z), 5)
    valid = completion_mask > 0
    np.testing.assert_array_equal(np.asarray(padded.top_ids)[valid], np.asarray(want_ids)[valid])
    np.testing.assert_allclose(
        np.asarray(padded.top_logprobs)[valid], np.asarray(want_top)[valid], atol=1e-5
    )
    packed = packed_completion_logprobs(params, config, seqs, plan, top_k=5, **options)
    np.testing.assert_array_equal(np.asarray(packed.top_ids), np.asarray(padded.top_ids))
    for got, want in zip(packed[:3], padded[:3]):  # logprobs, entropy (None), top log-probs
        if want is not None:
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    weights = rng.normal(size=(B, T, 5)).astype(np.float32)

    def loss(params, packed):
        kwargs = dict(gather_ids=padded.top_ids, **options)
        if packed:
            out = packed_completion_logprobs(params, config, seqs, plan, **kwargs)
        else:
            out = completion_logprobs(params, config, *batch, **kwargs)
        return jnp.sum(out.gathered * weights), out.gathered

    grad = jax.jit(jax.grad(loss, has_aux=True), static_argnums=1)
    want_grads, want = grad(params, False)
    got_grads, got = grad(params, True)
    np.testing.assert_allclose(np.asarray(want), np.asarray(padded.top_logprobs), atol=1e-5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    chex.assert_trees_all_close(got_grads, want_grads, atol=1e-5, rtol=1e-4)


def test_top_k_and_gathering_never_materialise_full_logits(rng):
    batch, length, dim, vocab, chunk = 2, 64, 4, 1000, 8
    hidden = jnp.zeros((batch, length, dim))
    w = jnp.zeros((dim, vocab))
    targets = jnp.zeros((batch, length), jnp.int32)
    ids = jnp.zeros((batch, length, 16), jnp.int32)

    def loss(hidden, w, chunk_size):
        out = token_logprobs_from_hidden(
            hidden, lambda h: h @ w, targets, chunk_size=chunk_size, top_k=16, gather_ids=ids
        )
        return jnp.sum(out.gathered) + jnp.sum(out.top_logprobs)

    grad = jax.grad(loss, argnums=(0, 1))
    chunked = _max_intermediate_size(jax.make_jaxpr(grad, static_argnums=2)(hidden, w, chunk).jaxpr)
    assert chunked <= batch * chunk * vocab


def test_distillation_options_are_checked(model, batch):
    _, config, params = model
    ids = jnp.zeros((B, T, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, 128\]"):
        completion_logprobs(params, config, *batch, top_k=0)
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, 128\]"):
        completion_logprobs(params, config, *batch, top_k=129)
    with pytest.raises(ValueError, match=r"gather_ids \(3, 4, 2\) must be \[B, T, k\]"):
        completion_logprobs(params, config, *batch, gather_ids=ids[:, :4])
    with pytest.raises(ValueError, match="gather_ids must hold integer token ids"):
        completion_logprobs(params, config, *batch, gather_ids=ids.astype(jnp.float32))
    with pytest.raises(ValueError, match="cannot be combined with top_k or gather_ids"):
        completion_logprobs(params, config, *batch, top_k=2, return_prompt_logprobs=True)
