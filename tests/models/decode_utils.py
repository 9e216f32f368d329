"""Cached decoding one token at a time, shared by the model families' decode tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models import forward, init_cache
from jaxrl_llm.sampling import layout

jit_forward = jax.jit(forward, static_argnums=1, static_argnames="remat")


def decode_all(params, config, tokens, mask, prompt_width, *, unstacked):
    """Prefill ``tokens[:, :prompt_width]`` into a cache, then feed the rest one token at a time:
    the hidden states ``[B, S - prompt_width, D]`` of the decoded tokens."""
    batch, seq = tokens.shape
    cache = init_cache(config, batch, seq + 2, dtype=jnp.float32)
    _, cache = jit_forward(
        params,
        config,
        tokens[:, :prompt_width],
        attention_mask=mask[:, :prompt_width],
        cache=cache,
        cache_index=0,
    )
    if unstacked:
        params = layout.unstack_layers(params)
        cache = layout.unstack_cache(cache)
    positions = mask[:, :prompt_width].sum(axis=1, keepdims=True)
    out = []
    for step in range(seq - prompt_width):
        column = prompt_width + step
        hidden, cache = jit_forward(
            params,
            config,
            tokens[:, column : column + 1],
            positions=positions + step,
            cache=cache,
            cache_index=jnp.int32(column),
        )
        out.append(np.asarray(hidden)[:, 0])
    return np.stack(out, axis=1)
