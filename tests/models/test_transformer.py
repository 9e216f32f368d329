"""The Flax transformer against transformers (PyTorch), the KV cache, remat and axes."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.models import (
    KVCache,
    Transformer,
    forward,
    init_cache,
    init_params,
    logical_axes,
    logits,
    unembed,
)
from jaxrl_llm.models.transformer import merge, param_shapes
from jaxrl_llm.sampling import layout
from tests.models import hf_utils

NAMES = sorted(hf_utils.VARIANTS)
LOGICAL_NAMES = {
    "batch",
    "embed",
    "mlp",
    "heads",
    "kv_heads",
    "head_dim",
    "vocab",
    "layers",
    "cache_seq",
    "expert",
}

jit_logits = jax.jit(logits, static_argnums=1)
jit_forward = jax.jit(forward, static_argnums=1, static_argnames="remat")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (torch model, config, f32 params) for each tiny variant."""
    loaded = hf_utils.load_variants(tmp_path_factory, NAMES, first_seed=0)
    return {
        name: (torch_model, config, params)
        for name, (torch_model, config, params, _) in loaded.items()
    }


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("side", ["right", "left"])
def test_logits_match_transformers(models, name, side, rng):
    torch_model, config, params = models[name]
    tokens, mask = hf_utils.padded_batch(rng, [12, 7, 1], 12, vocab=config.vocab_size, side=side)
    want = hf_utils.hf_logits(torch_model, tokens, mask)
    got = np.asarray(jit_logits(params, config, tokens, attention_mask=mask))
    chex.assert_shape(got, (3, 12, config.vocab_size))
    real = mask.astype(bool)
    assert np.abs(want[real]).max() > 3.0  # logits are far from uniform: the test can fail
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=1e-4)


def test_left_and_right_padding_equal_unpadded(models, rng):
    _, config, params = models["llama"]
    seq = rng.integers(3, config.vocab_size, size=6).astype(np.int32)
    alone = np.asarray(jit_logits(params, config, seq[None]))[0]
    pads = np.zeros(4, np.int32)
    tokens = np.stack([np.concatenate([pads, seq]), np.concatenate([seq, pads + 7])])
    mask = np.stack([np.r_[pads, np.ones(6, np.int32)], np.r_[np.ones(6, np.int32), pads]])
    padded = np.asarray(jit_logits(params, config, tokens, attention_mask=mask))
    np.testing.assert_allclose(padded[0, 4:], alone, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(padded[1, :6], alone, atol=2e-5, rtol=1e-5)


def test_kv_cache_prefill_and_decode_equal_full_forward(models, rng):
    _, config, params = models["qwen3"]
    prompt_lengths, width, steps = [6, 3, 1], 6, 4
    prompt, prompt_mask = hf_utils.padded_batch(
        rng, prompt_lengths, width, vocab=config.vocab_size, side="left"
    )
    new = rng.integers(3, config.vocab_size, size=(3, steps)).astype(np.int32)
    full_tokens = np.concatenate([prompt, new], axis=1)
    full_mask = np.concatenate([prompt_mask, np.ones((3, steps), np.int32)], axis=1)
    want, _ = jit_forward(params, config, full_tokens, attention_mask=full_mask)
    want = np.asarray(want)

    cache = init_cache(config, 3, width + steps + 2, dtype=jnp.float32)
    hidden, cache = jit_forward(
        params, config, prompt, attention_mask=prompt_mask, cache=cache, cache_index=0
    )
    real = prompt_mask.astype(bool)
    np.testing.assert_allclose(np.asarray(hidden)[real], want[:, :width][real], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.mask)[:, :width], real)
    positions = prompt_mask.sum(axis=1, keepdims=True)
    for step in range(steps):
        hidden, cache = jit_forward(
            params,
            config,
            new[:, step : step + 1],
            positions=positions + step,
            cache=cache,
            cache_index=jnp.int32(width + step),
        )
        np.testing.assert_allclose(np.asarray(hidden)[:, 0], want[:, width + step], atol=1e-5)
    assert np.asarray(cache.mask)[:, width : width + steps].all()
    assert not np.asarray(cache.mask)[:, width + steps :].any()


def test_kv_cache_multi_token_chunk_and_default_positions(models, rng):
    _, config, params = models["mistral"]
    prompt, prompt_mask = hf_utils.padded_batch(
        rng, [5, 2], 5, vocab=config.vocab_size, side="left"
    )
    more = rng.integers(3, config.vocab_size, size=(2, 3)).astype(np.int32)
    full, _ = jit_forward(
        params,
        config,
        np.concatenate([prompt, more], axis=1),
        attention_mask=np.concatenate([prompt_mask, np.ones((2, 3), np.int32)], axis=1),
    )
    cache = init_cache(config, 2, 8, dtype=jnp.float32)
    _, cache = jit_forward(
        params, config, prompt, attention_mask=prompt_mask, cache=cache, cache_index=0
    )
    # Without positions, the cache's real slots before cache_index are counted.
    hidden, _ = jit_forward(params, config, more, cache=cache, cache_index=5)
    np.testing.assert_allclose(hidden, np.asarray(full)[:, 5:], atol=1e-5)


@pytest.mark.parametrize("unstacked", [False, True])
def test_kv_cache_with_a_write_slot_per_row(models, rng, unstacked):
    """Rows at different cache slots (continuous batching): each row's decode equals its own
    full forward, whatever slot it sits at and whatever the other rows hold."""
    _, config, params = models["qwen2"]
    lengths, width, steps = [4, 2, 5], 8, 3
    prompts = [rng.integers(3, config.vocab_size, size=n).astype(np.int32) for n in lengths]
    new = rng.integers(3, config.vocab_size, size=(3, steps)).astype(np.int32)
    # Row b's prompt sits right-aligned at slots [start_b, start_b + n_b): other starts per row.
    starts = np.array([0, 3, 1])
    cache = init_cache(config, 3, width + steps, dtype=jnp.float32)
    tokens = np.zeros((3, width), np.int32)
    mask = np.zeros((3, width), bool)
    for b, (start, prompt) in enumerate(zip(starts, prompts)):
        tokens[b, start : start + len(prompt)] = prompt
        mask[b, start : start + len(prompt)] = True
    _, cache = jit_forward(params, config, tokens, attention_mask=mask, cache=cache, cache_index=0)
    call_params = params
    if unstacked:
        call_params = layout.unstack_layers(params)
        cache = cache._replace(k=layout.unstack_cache(cache).k, v=layout.unstack_cache(cache).v)
    slots = jnp.asarray(starts + np.array(lengths), jnp.int32)  # each row's next free slot
    positions = np.array(lengths)[:, None]
    got = []
    for step in range(steps):
        hidden, cache = jit_forward(
            call_params,
            config,
            new[:, step : step + 1],
            positions=positions + step,
            cache=cache,
            cache_index=slots + step,
        )
        got.append(np.asarray(hidden)[:, 0])
    for b, prompt in enumerate(prompts):
        full = np.concatenate([prompt, new[b]])[None]
        want, _ = jit_forward(params, config, full)
        np.testing.assert_allclose(
            np.stack([g[b] for g in got]), np.asarray(want)[0, len(prompt) :], atol=1e-5
        )
    mask = np.asarray(cache.mask)
    for b in range(3):
        real = np.zeros(width + steps, bool)
        real[starts[b] : starts[b] + lengths[b] + steps] = True
        np.testing.assert_array_equal(mask[b], real)


def test_bf16_cache_is_close(models, rng):
    _, config, params = models["qwen2"]
    tokens, mask = hf_utils.padded_batch(rng, [5, 3], 5, vocab=config.vocab_size, side="left")
    want, _ = jit_forward(params, config, tokens, attention_mask=mask)
    cache = init_cache(config, 2, 5)
    assert cache.k.dtype == jnp.bfloat16
    got, cache = jit_forward(
        params, config, tokens, attention_mask=mask, cache=cache, cache_index=0
    )
    assert cache.k.dtype == jnp.bfloat16
    real = mask.astype(bool)
    scale = np.abs(np.asarray(want)[real]).max()
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-2 * scale)


def test_bf16_forward_close_to_f32(models, rng):
    _, config, params = models["qwen3"]
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    tokens, mask = hf_utils.padded_batch(rng, [10, 6], 10, vocab=config.vocab_size, side="left")
    want = np.asarray(jax.nn.log_softmax(jit_logits(params, config, tokens, attention_mask=mask)))
    got_logits = jit_logits(bf16, config, tokens, attention_mask=mask)
    assert got_logits.dtype == jnp.float32
    got = np.asarray(jax.nn.log_softmax(got_logits))
    real = mask.astype(bool)
    # Compare probabilities (what sampling and log-prob ratios see): within 3e-2 of f32 (bf16
    # rounds each weight and activation by up to 2^-9 relative; the worst of 2048 probabilities
    # here moves 0.021 with the blocked CPU attention, 0.02 with XLA's).
    np.testing.assert_allclose(np.exp(got[real]), np.exp(want[real]), atol=3e-2)
    hidden = jax.eval_shape(lambda p: forward(p, config, tokens, attention_mask=mask)[0], bf16)
    assert hidden.dtype == jnp.bfloat16


@pytest.mark.parametrize("name", ["qwen3", "qwen2_moe"])
def test_remat_gives_same_values_and_gradients(models, rng, name):
    _, config, params = models[name]
    tokens, mask = hf_utils.padded_batch(rng, [8, 5], 8, vocab=config.vocab_size, side="left")
    weights = rng.normal(size=(2, 8, config.hidden_size)).astype(np.float32)

    def loss(params, remat):
        hidden, _ = forward(params, config, tokens, attention_mask=mask, remat=remat)
        return jnp.sum(hidden * weights * mask[..., None])

    both = jax.jit(
        lambda p: (jax.value_and_grad(loss)(p, "none"), jax.value_and_grad(loss)(p, "layer"))
    )
    (plain, grad_plain), (remat, grad_remat) = both(params)
    np.testing.assert_allclose(remat, plain, rtol=1e-6)
    assert "remat" in str(jax.make_jaxpr(loss, static_argnums=1)(params, "layer"))
    assert "remat" not in str(jax.make_jaxpr(loss, static_argnums=1)(params, "none"))
    chex.assert_trees_all_close(grad_remat, grad_plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_logical_axes_match_params(models, name):
    _, config, params = models[name]
    axes = logical_axes(config)
    is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
    assert jax.tree.structure(axes, is_leaf=is_axes) == jax.tree.structure(params)
    ranks = jax.tree.map(lambda a, p: len(a) == p.ndim, axes, params, is_leaf=is_axes)
    assert all(jax.tree.leaves(ranks))
    for leaf in jax.tree.leaves(axes, is_leaf=is_axes):
        assert set(leaf) - {None} <= LOGICAL_NAMES  # None: an unnamed dim (a [D, 1] gate)
    assert axes["embed"] == ("vocab", "embed")
    assert axes["layers"]["wq"] == ("layers", "embed", "heads", "head_dim")
    assert axes["layers"]["wk"] == ("layers", "embed", "kv_heads", "head_dim")
    if config.is_moe:
        assert axes["layers"]["router"] == ("layers", "embed", "expert")
        assert axes["layers"]["expert_w_gate"] == ("layers", "expert", "embed", "mlp")
        assert axes["layers"]["expert_w_down"] == ("layers", "expert", "mlp", "embed")
        assert "w_down" not in axes["layers"]
    else:
        assert axes["layers"]["w_down"] == ("layers", "mlp", "embed")
    assert ("lm_head" in axes) != config.tie_word_embeddings


def test_init_params_shapes_dtype_and_jit(models):
    _, config, params = models["qwen3"]
    init = jax.jit(init_params, static_argnums=0, static_argnames="dtype")(
        config, jax.random.key(0), dtype=jnp.bfloat16
    )
    chex.assert_trees_all_equal_shapes(init, params)
    assert {x.dtype for x in jax.tree.leaves(init)} == {jnp.dtype(jnp.bfloat16)}
    chex.assert_trees_all_equal_shapes_and_dtypes(init, param_shapes(config, jnp.bfloat16))
    assert np.all(np.asarray(init["layers"]["attn_norm"]) == 1)
    assert np.all(np.asarray(init["layers"]["bq"]) == 0)
    wq = np.asarray(init["layers"]["wq"], np.float32)
    assert 0.015 < wq.std() < 0.025
    assert not np.allclose(wq[0], wq[1])  # layers get different keys


def test_model_is_an_nnx_module_holding_the_params(models, rng):
    _, config, params = models["llama"]
    model = merge(params, config)
    assert isinstance(model, Transformer)
    chex.assert_trees_all_equal(nnx.to_pure_dict(nnx.state(model)), params)
    # Tied embeddings: the unembedding is E^T, in f32 whatever the hidden dtype.
    hidden = rng.normal(size=(2, 3, config.hidden_size)).astype(np.float32)
    want = hidden @ np.asarray(params["embed"]).T
    np.testing.assert_allclose(unembed(params, config, hidden), want, atol=1e-4, rtol=1e-5)
    bf16 = unembed(params, config, jnp.asarray(hidden, jnp.bfloat16))
    assert bf16.dtype == jnp.float32


def test_forward_does_not_recompile(models, rng):
    _, config, params = models["mistral"]
    traces = []

    def traced(p, t, m):
        traces.append(1)  # runs only when jit traces (the C++ dispatch cache's size reads 0
        return logits(p, config, t, attention_mask=m)  # late in some xdist workers)

    fn = jax.jit(traced)
    for _ in range(2):
        tokens, mask = hf_utils.padded_batch(rng, [5, 2], 5, vocab=config.vocab_size, side="left")
        fn(params, tokens, mask).block_until_ready()
    assert len(traces) == 1


def test_errors(models):
    _, config, params = models["mistral"]
    tokens = jnp.zeros((2, 4), jnp.int32)
    with pytest.raises(ValueError, match="rank 2"):
        forward(params, config, jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="attention_mask"):
        forward(params, config, tokens, attention_mask=jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="positions"):
        forward(params, config, tokens, positions=jnp.ones((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="remat"):
        forward(params, config, tokens, remat="everything")
    cache = init_cache(config, 2, 8)
    with pytest.raises(ValueError, match="cache_index"):
        forward(params, config, tokens, cache=cache)
    with pytest.raises(ValueError, match="one slot per row"):
        forward(params, config, tokens, cache=cache, cache_index=jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="without a cache"):
        forward(params, config, tokens, cache_index=0)
    with pytest.raises(ValueError, match="do not fit"):
        forward(
            params,
            config,
            jnp.zeros((2, 9), jnp.int32),
            cache=init_cache(config, 2, 8),
            cache_index=0,
        )
    with pytest.raises(ValueError, match=r"\[L, B, K, S_max, H\]"):
        forward(params, config, tokens, cache=init_cache(config, 3, 8), cache_index=0)
    with pytest.raises(ValueError, match="params do not match"):
        forward({"embed": params["embed"]}, config, tokens)
    other = dataclasses.replace(config, qk_norm=True)
    with pytest.raises(ValueError, match="params do not match"):
        forward(params, other, tokens)
    assert isinstance(cache, KVCache) and cache.mask.dtype == jnp.bool_
