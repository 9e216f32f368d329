"""The KV cache: head-major layout, its logical axes, slot writes and layer slices."""

import chex
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models import CACHE_AXES, ModelConfig, init_cache
from jaxrl_llm.models.kv_cache import layer_slice, write_slots

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


def test_cache_layout_is_head_major():
    cache = init_cache(CONFIG, 5, 11, dtype=jnp.float32)
    chex.assert_shape([cache.k, cache.v], (3, 5, 2, 11, 8))
    assert CACHE_AXES.k == ("layers", "batch", "kv_heads", "cache_seq", "head_dim")
    assert CACHE_AXES.k == CACHE_AXES.v and CACHE_AXES.mask == ("batch", "cache_seq")


def test_write_slots_puts_new_keys_head_major_at_the_slots(rng):
    new = rng.normal(size=(2, 3, 2, 4)).astype(np.float32)  # [B, S, K, H]
    per_layer = np.zeros((2, 2, 6, 4), np.float32)  # [B, K, S_max, H]
    got = np.asarray(write_slots(jnp.asarray(per_layer), jnp.asarray(new), None, 2))
    want = per_layer.copy()
    want[:, :, 2:5] = new.transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(got, want)

    stacked = np.zeros((3, 2, 2, 6, 4), np.float32)  # [L, B, K, S_max, H]
    got = np.asarray(write_slots(jnp.asarray(stacked), jnp.asarray(new), jnp.int32(1), 3))
    want = stacked.copy()
    want[1, :, :, 3:6] = new.transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(layer_slice(jnp.asarray(want), jnp.int32(1))), want[1])
