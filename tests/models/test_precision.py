"""Mixed precision: f32 master weights computed through bf16 matmuls (``compute_dtype``).

The bf16 path is checked against the f32 one at bf16 tolerance (loss, log-probs and every
gradient), its matmuls are checked to really take bf16 operands, its outputs and gradients to
stay f32, and the master weights to move under a 1e-6 learning rate where bf16-stored weights
would round the update away.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.logprobs import completion_logprobs

CONFIG = models.ModelConfig(
    architecture="Qwen2ForCausalLM",  # q/k/v biases too
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    qkv_bias=True,
)
BF16 = dataclasses.replace(CONFIG, compute_dtype="bfloat16")


def _batch(rng, rows=4, prompt=6, completion=10):
    prompt_tokens = rng.integers(0, CONFIG.vocab_size, (rows, prompt)).astype(np.int32)
    prompt_mask = np.ones((rows, prompt), bool)
    prompt_mask[0, :2] = False  # left padding
    completion_tokens = rng.integers(0, CONFIG.vocab_size, (rows, completion)).astype(np.int32)
    completion_mask = np.ones((rows, completion), bool)
    completion_mask[1, 7:] = False  # right padding
    return prompt_tokens, prompt_mask, completion_tokens, completion_mask


def _params():
    params = models.init_params(CONFIG, jax.random.key(0))
    # Non-trivial norms and biases, so their casts matter.
    key = iter(jax.random.split(jax.random.key(1), 64))
    return jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(key), x.shape), params)


def _loss(params, config, batch):
    logps = completion_logprobs(params, config, *batch)
    return -jnp.sum(logps) / jnp.sum(batch[3]), logps


@pytest.mark.parametrize("compute", [None, "float32", "bfloat16"])
def test_outputs_and_gradients_stay_f32(rng, compute):
    params, batch = _params(), _batch(rng)
    config = dataclasses.replace(CONFIG, compute_dtype=compute)
    (loss, logps), grads = jax.value_and_grad(_loss, has_aux=True)(params, config, batch)
    assert loss.dtype == jnp.float32 and logps.dtype == jnp.float32
    chex.assert_trees_all_equal_dtypes(grads, params)  # gradients of the f32 masters
    hidden, _ = models.forward(params, config, jnp.asarray(batch[0]))
    assert hidden.dtype == jnp.dtype(compute or "float32")


def test_bf16_compute_agrees_with_f32_at_bf16_tolerance(rng):
    params, batch = _params(), _batch(rng)
    grad_fn = jax.value_and_grad(_loss, has_aux=True)
    (loss32, logps32), grads32 = grad_fn(params, CONFIG, batch)
    (loss16, logps16), grads16 = grad_fn(params, BF16, batch)
    # bf16 has an 8-bit mantissa (relative rounding 2^-9 ~ 2e-3); through 2 layers and a
    # log-softmax over 96 tokens the log-probs move by about 1e-2 absolute.
    np.testing.assert_allclose(loss16, loss32, rtol=1e-2)
    np.testing.assert_allclose(logps16, logps32, atol=5e-2)
    assert float(jnp.max(jnp.abs(logps16 - logps32))) > 0  # bf16 really ran
    for path, g32 in jax.tree_util.tree_flatten_with_path(grads32)[0]:
        g16 = _at(grads16, path)
        rel = float(jnp.linalg.norm(g16 - g32) / jnp.linalg.norm(g32))
        assert rel < 5e-2, (jax.tree_util.keystr(path), rel)


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def _weight_matmul_dtypes(config, params, batch):
    """Dtypes of the weight operands (shaped like a per-layer weight or the embedding /
    unembedding) of every matmul, forward and backward. Attention's score and PV products read
    no weight (the CPU backend runs them in f32 on purpose); the unembedding's backward takes
    the f32 logits' cotangent with the bf16 weight."""
    shapes = {tuple(x.shape[1:]) for x in jax.tree.leaves(params["layers"]) if x.ndim > 2}
    shapes |= {tuple(x.shape) for k, x in params.items() if k != "layers" and x.ndim == 2}
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: _loss(p, config, batch)[0]))(params)
    dtypes, count = set(), 0

    def walk(jaxpr):
        nonlocal count
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                for v in eqn.invars:
                    if tuple(v.aval.shape) in shapes:
                        dtypes.add(str(v.aval.dtype))
                        count += 1
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    return dtypes, count


def test_bf16_compute_runs_every_weight_matmul_in_bf16(rng):
    params, batch = _params(), _batch(rng)
    dtypes, count = _weight_matmul_dtypes(BF16, params, batch)
    assert dtypes == {"bfloat16"}
    assert count >= 2 * 7  # q, k, v, o, gate, up, down of the layer body, forward and backward
    assert _weight_matmul_dtypes(CONFIG, params, batch)[0] == {"float32"}


def test_master_weights_move_under_a_tiny_learning_rate(rng):
    """3 AdamW steps at lr 1e-6: f32 masters move (almost) everywhere; bf16-stored weights
    (the old ``model.dtype: bfloat16``) round most updates away, which is what the split of
    ``param_dtype`` and ``compute_dtype`` fixes."""
    from jaxrl_llm.train.optim import make_optimizer  # noqa: PLC0415

    batch = _batch(rng)

    def moved_fraction(params, config):
        opt = make_optimizer(1e-6, max_grad_norm=None)
        opt_state = opt.init(params)
        start = params

        @jax.jit
        def step(params, opt_state):
            grads = jax.grad(lambda p: _loss(p, config, batch)[0])(params)
            updates, opt_state = opt.update(grads, opt_state, params)
            return jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates), opt_state

        for _ in range(3):
            params, opt_state = step(params, opt_state)
        layers = jax.tree.leaves(start["layers"]), jax.tree.leaves(params["layers"])
        changed = sum(int(jnp.sum(a != b)) for a, b in zip(*layers))
        return changed / sum(a.size for a in layers[0])

    masters = _params()
    assert moved_fraction(masters, BF16) >= 0.9
    bf16_stored = jax.tree.map(lambda x: x.astype(jnp.bfloat16), masters)
    assert moved_fraction(bf16_stored, BF16) < 0.5


def test_generate_casts_once_and_keeps_a_compute_dtype_cache(rng):
    from jaxrl_llm import sampling  # noqa: PLC0415

    params = _params()
    prompt_tokens, prompt_mask, _, _ = _batch(rng)
    state = sampling.prefill(
        params, BF16, prompt_tokens, prompt_mask, max_new_tokens=4, pad_id=0, num_samples=2
    )
    assert state.cache.k.dtype == jnp.bfloat16
    assert state.logits.dtype == jnp.float32


def test_unknown_compute_dtype_is_refused():
    with pytest.raises(ValueError, match="compute_dtype must be None or one of"):
        dataclasses.replace(CONFIG, compute_dtype="int8")
