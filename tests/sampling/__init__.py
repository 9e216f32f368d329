"""Tests for jaxrl_llm.sampling, and a fast random-parameter builder they share."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models import ModelConfig, param_shapes

# A Qwen2-shaped model small enough for 8-device meshes: 4 heads and 2 kv-heads split by a
# tensor axis of 2, biases on q/k/v.
SHARDED_QWEN2 = ModelConfig(
    architecture="Qwen2ForCausalLM",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    qkv_bias=True,
)


def random_params(config, seed=0):
    """Parameters with O(1) logits, drawn in NumPy from ``param_shapes`` (no JAX compiles).

    Norm scales are 1 and biases 0.1·N(0, 1); embeddings (and the LM head) 0.5·N(0, 1); other
    matrices N(0, 1/D). Unlike the 0.02 init this gives next-token entropies of a few nats at
    most, so greedy decoding has no near-ties and sampling differs from both uniform and argmax.
    """
    rng = np.random.default_rng(seed)
    std = 1.0 / np.sqrt(config.hidden_size)

    def draw(path, shape):
        name = str(path[-1].key)
        if "norm" in name:
            return jnp.ones(shape.shape, jnp.float32)
        scale = 0.1 if name.startswith("b") else 0.5 if name in ("embed", "lm_head") else std
        return jnp.asarray(scale * rng.standard_normal(shape.shape), jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, param_shapes(config))
