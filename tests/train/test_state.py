"""``abstract_train_state`` is the state ``create_train_state`` makes, shapes only: the one
description ``jaxrl-llm plan`` lowers with and ``train`` allocates from."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxrl_llm import models, parallel
from jaxrl_llm.models import ModelConfig, heads
from jaxrl_llm.train.optim import make_optimizer
from jaxrl_llm.train.state import abstract_train_state, create_train_state

pytestmark = pytest.mark.needs_devices(8)

CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=4,
)


def _described(tree):
    return jax.tree.map(lambda x: (x.shape, str(x.dtype), x.sharding), tree)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_the_abstract_state_is_the_state_created(state_dtype):
    mesh = parallel.make_mesh(data=2, fsdp=4)
    optimizer = make_optimizer(1e-3, max_grad_norm=1.0, state_dtype=state_dtype)
    key = jax.random.key(0)
    state, shardings = create_train_state(CONFIG, optimizer, key=key, mesh=mesh)
    abstract, abstract_shardings = abstract_train_state(CONFIG, optimizer, mesh=mesh)
    assert abstract_shardings == shardings
    assert _described(abstract) == _described(state)
    # Parameters handed in (bf16 here) keep their dtype in both.
    params = models.init_params(CONFIG, key, dtype=jnp.bfloat16)
    given, _ = create_train_state(CONFIG, optimizer, key=key, mesh=mesh, params=params)
    shapes = jax.eval_shape(lambda: params)
    assert _described(abstract_train_state(CONFIG, optimizer, mesh=mesh, params=shapes)[0]) == (
        _described(given)
    )


def test_another_parameter_tree_needs_its_axes():
    mesh = parallel.make_mesh(data=2, fsdp=4)
    optimizer = make_optimizer(1e-3)
    init = lambda key: heads.init_scalar_params(CONFIG, key)  # noqa: E731
    axes = heads.scalar_logical_axes(CONFIG)
    state, _ = create_train_state(
        CONFIG, optimizer, key=jax.random.key(1), mesh=mesh, init_params=init, params_axes=axes
    )
    abstract, _ = abstract_train_state(
        CONFIG, optimizer, mesh=mesh, init_params=init, params_axes=axes
    )
    assert _described(abstract) == _described(state)
    with pytest.raises(ValueError, match="also needs params_axes"):
        abstract_train_state(CONFIG, optimizer, mesh=mesh, init_params=init)
