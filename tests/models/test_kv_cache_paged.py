"""The paged KV cache (``models.kv_cache.PagedKVCache``): a prefill and decode steps through a
block table, with rows sharing blocks and blocks out of order, give the contiguous cache's
hidden states; writes land in the table's blocks only; bad shapes are refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import (
    ModelConfig,
    PagedKVCache,
    forward,
    init_cache,
    init_paged_cache,
    init_params,
)
from jaxrl_llm.models.kv_cache import read_pages, write_pages
from jaxrl_llm.sampling.layout import unstack_cache, unstack_layers

CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=61,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)


def test_write_then_read_pages_is_a_numpy_block_table():
    rng = np.random.default_rng(0)
    pool = np.zeros((2, 5, 4, 3), np.float32)  # K=2, N=5 blocks of P=4 slots, H=3
    table = np.array([[3, 0, 5], [1, 5, 2]], np.int32)  # 5 = unmapped
    new = rng.normal(size=(2, 6, 2, 3)).astype(np.float32)  # [B, S, K, H]
    start = np.array([1, 2], np.int32)
    got = np.asarray(write_pages(jnp.asarray(pool), jnp.asarray(new), None, start, table))
    want = pool.copy()
    for b in range(2):
        for s in range(6):
            slot = start[b] + s
            block = table[b, slot // 4] if slot // 4 < 3 else 5
            if block < 5:
                want[:, block, slot % 4] = new[b, s]
    np.testing.assert_array_equal(got, want)
    # Stacked over layers: layer 1 gets the same writes, layer 0 none.
    stacked = np.zeros((2, *pool.shape), np.float32)
    layered = write_pages(jnp.asarray(stacked), jnp.asarray(new), jnp.int32(1), start, table)
    np.testing.assert_array_equal(np.asarray(layered), np.stack([pool, want]))
    read = np.asarray(read_pages(jnp.asarray(got), jnp.asarray(table)))
    assert read.shape == (2, 2, 12, 3)  # [K, B, S_max, H]
    for b in range(2):
        for s in range(12):
            block = table[b, s // 4]
            if block < 5:
                np.testing.assert_array_equal(read[:, b, s], got[:, block, s % 4])


@pytest.mark.parametrize("per_layer", [False, True])
def test_paged_prefill_and_decode_match_the_contiguous_cache(per_layer):
    params = init_params(CONFIG, jax.random.key(1), dtype=jnp.float32)
    rng = np.random.default_rng(1)
    batch, prompt, steps, block = 3, 8, 5, 4
    width = prompt + 12  # 5 blocks a row; 13 slots used
    tokens = rng.integers(1, CONFIG.vocab_size, size=(batch, prompt + steps)).astype(np.int32)
    tokens[2, :prompt] = tokens[0, :prompt]  # rows 0 and 2 share a prompt ...
    mask = np.ones((batch, prompt), bool)
    mask[1, :3] = False  # left padding
    dense = init_cache(CONFIG, batch, width, dtype=jnp.float32)
    paged = init_paged_cache(CONFIG, batch, width, blocks=12, block_size=block, dtype=jnp.float32)
    # ... and its two blocks; blocks out of order; each row's unused last block unmapped (12).
    table = np.array([[7, 2, 5, 8, 12], [4, 0, 1, 9, 12], [7, 2, 10, 11, 12]], np.int32)
    paged = paged._replace(table=jnp.asarray(table))
    if per_layer:
        params_used = unstack_layers(params)
        dense, paged = unstack_cache(dense), unstack_cache(paged)
    else:
        params_used = params
    want, dense = forward(
        params_used, CONFIG, tokens[:, :prompt], attention_mask=mask, cache=dense, cache_index=0
    )
    got, paged = forward(
        params_used, CONFIG, tokens[:, :prompt], attention_mask=mask, cache=paged, cache_index=0
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    index = jnp.full((batch,), prompt, jnp.int32)
    position = jnp.asarray(mask.sum(1), jnp.int32)
    for i in range(steps):
        token = jnp.asarray(tokens[:, prompt + i : prompt + i + 1])
        args = dict(positions=(position + i)[:, None], cache_index=index + i)
        want, dense = forward(params_used, CONFIG, token, cache=dense, **args)
        got, paged = forward(params_used, CONFIG, token, cache=paged, **args)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    assert isinstance(paged, PagedKVCache)
