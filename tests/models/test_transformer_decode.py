"""Decoding through the KV cache with stacked and per-layer (unrolled) layouts."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import ModelConfig, forward, init_cache, init_params
from jaxrl_llm.sampling.layout import stack_cache, unstack_cache, unstack_layers

jit_forward = jax.jit(forward, static_argnums=1)

CONFIG = ModelConfig(
    architecture="Qwen2ForCausalLM",
    vocab_size=53,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    qkv_bias=True,
)


@pytest.fixture(scope="module")
def decoded():
    """Prefill + 3 decode steps, with stacked and with per-layer (unrolled) layouts."""
    params = init_params(CONFIG, jax.random.key(0))
    rng = np.random.default_rng(3)
    prompt = rng.integers(1, CONFIG.vocab_size, size=(3, 5)).astype(np.int32)
    prompt_mask = np.ones((3, 5), bool)
    prompt_mask[1, :2] = prompt_mask[2, :4] = False
    steps = rng.integers(1, CONFIG.vocab_size, size=(3, 3)).astype(np.int32)
    positions = prompt_mask.sum(axis=1, keepdims=True)
    runs = {}
    for name, split in (("stacked", False), ("split", True)):
        weights = unstack_layers(params) if split else params
        cache = init_cache(CONFIG, 3, 9, dtype=jnp.float32)
        cache = unstack_cache(cache) if split else cache
        hidden, cache = jit_forward(
            weights, CONFIG, prompt, attention_mask=prompt_mask, cache=cache, cache_index=0
        )
        outputs = [np.asarray(hidden)[:, -1]]
        for t in range(steps.shape[1]):
            hidden, cache = jit_forward(
                weights,
                CONFIG,
                steps[:, t : t + 1],
                positions=positions + t,
                cache=cache,
                cache_index=jnp.int32(5 + t),
            )
            outputs.append(np.asarray(hidden)[:, 0])
        runs[name] = (np.stack(outputs, axis=1), cache)
    full_tokens = np.concatenate([prompt, steps], axis=1)
    full_mask = np.concatenate([prompt_mask, np.ones((3, 3), bool)], axis=1)
    full, _ = jit_forward(params, CONFIG, full_tokens, attention_mask=full_mask)
    return runs, np.asarray(full)[:, 4:]


def test_split_layout_decodes_like_the_stacked_scan(decoded):
    runs, _ = decoded
    (stacked, stacked_cache), (split, split_cache) = runs["stacked"], runs["split"]
    assert isinstance(split_cache.k, tuple) and len(split_cache.k) == CONFIG.num_hidden_layers
    np.testing.assert_allclose(split, stacked, atol=1e-5, rtol=1e-5)
    restacked = stack_cache(split_cache)
    chex.assert_trees_all_close(restacked, stacked_cache, atol=1e-5, rtol=1e-5)
    assert (
        np.asarray(stacked_cache.mask)[:, 5:8].all()
        and not np.asarray(stacked_cache.mask)[:, 8].any()
    )


def test_cached_decoding_equals_full_forward(decoded):
    runs, full = decoded
    for outputs, _ in runs.values():
        np.testing.assert_allclose(outputs, full, atol=1e-5, rtol=1e-5)


def test_layouts_must_agree():
    params = init_params(CONFIG, jax.random.key(0))
    tokens = jnp.ones((2, 1), jnp.int32)
    stacked = init_cache(CONFIG, 2, 4)
    with pytest.raises(ValueError, match="per-layer arrays"):
        forward(unstack_layers(params), CONFIG, tokens, cache=stacked, cache_index=0)
    with pytest.raises(ValueError, match="per-layer arrays"):
        forward(params, CONFIG, tokens, cache=unstack_cache(stacked), cache_index=0)
    split = unstack_layers(params)
    with pytest.raises(ValueError, match="unstacked params do not match"):
        forward({**split, "layers": split["layers"][:2]}, CONFIG, tokens)
    short = unstack_cache(stacked)._replace(k=unstack_cache(stacked).k[:2])
    with pytest.raises(ValueError, match=r"\[L, B, K, S_max, H\]"):
        forward(split, CONFIG, tokens, cache=short, cache_index=0)


def test_unstack_and_stack_round_trip():
    params = init_params(CONFIG, jax.random.key(1))
    split = unstack_layers(params)
    assert unstack_layers(split) is split
    chex.assert_trees_all_equal(
        jax.tree.map(lambda *xs: jnp.stack(xs), *split["layers"]), params["layers"]
    )
    cache = init_cache(CONFIG, 2, 4, dtype=jnp.float32)
    cache = cache._replace(k=jax.random.normal(jax.random.key(2), cache.k.shape))
    split_cache = unstack_cache(cache)
    assert stack_cache(cache) is cache and unstack_cache(split_cache) is split_cache
    chex.assert_trees_all_equal(stack_cache(split_cache), cache)
