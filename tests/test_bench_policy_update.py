"""``bench.grpo_rollout_batch`` / ``bench.grpo_update``: the GRPO update the step benchmarks
(``benchmarks/bench_train_step.py``, ``benchmarks/bench_packing.py``) time.

The batch is checked against float64 NumPy draws in the documented order and the float64 GRPO
reference (``tests.reference.advantages``); the update by hand: AdamW's first step moves every
weight with a gradient by about the learning rate, LoRA trains the adapters only, and the
state's bytes are the weights' and the two moments'.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrl_llm import bench, models, parallel
from tests.reference import advantages as ref_advantages
from tests.train import step_problem

VOCAB = 50


def _masks():
    """3 left-padded prompts of width 4, 4 right-padded completions of width 5 (one empty)."""
    prompt_mask = np.arange(4)[None, :] >= np.array([0, 2, 3, 1])[:, None]
    completion_mask = np.arange(5)[None, :] < np.array([5, 0, 2, 3])[:, None]
    return prompt_mask, completion_mask


def test_rollout_batch_is_the_documented_draws():
    prompt_mask, completion_mask = _masks()
    got = bench.grpo_rollout_batch(
        np.random.default_rng(7), prompt_mask, completion_mask, VOCAB, group_size=2
    )
    rng = np.random.default_rng(7)  # old, ref, rewards, prompt tokens, completion tokens
    old = -np.log(np.float64(VOCAB)) + 0.1 * rng.standard_normal((4, 5))
    ref = old + 0.05 * rng.standard_normal((4, 5))
    rewards = rng.integers(0, 2, size=4).astype(np.float64)
    prompt_tokens = rng.integers(1, VOCAB, (4, 4))
    completion_tokens = rng.integers(1, VOCAB, (4, 5))
    np.testing.assert_allclose(got.old_logprobs, np.where(completion_mask, old, 0.0), rtol=1e-6)
    np.testing.assert_allclose(got.ref_logprobs, np.where(completion_mask, ref, 0.0), rtol=1e-6)
    np.testing.assert_allclose(
        got.advantages, ref_advantages.grpo(rewards, group_size=2), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_array_equal(got.prompt_tokens, np.where(prompt_mask, prompt_tokens, 0))
    np.testing.assert_array_equal(
        got.completion_tokens, np.where(completion_mask, completion_tokens, 0)
    )
    assert got.prompt_tokens.dtype == got.completion_tokens.dtype == np.int32
    assert got.old_logprobs.dtype == got.ref_logprobs.dtype == got.advantages.dtype == np.float32
    assert got.prompt_mask is prompt_mask and got.completion_mask is completion_mask
    # Padding is 0 everywhere (the empty completion row included).
    assert not got.old_logprobs[1].any() and not got.completion_tokens[1].any()


def test_rollout_batch_rejects_bad_input():
    prompt_mask, completion_mask = _masks()
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="rows"):
        bench.grpo_rollout_batch(rng, prompt_mask[:2], completion_mask, VOCAB, group_size=2)
    with pytest.raises(ValueError, match=r"\[B, P\] and \[B, T\]"):
        bench.grpo_rollout_batch(rng, prompt_mask[0], completion_mask, VOCAB, group_size=2)
    with pytest.raises(ValueError, match="vocab"):
        bench.grpo_rollout_batch(rng, prompt_mask, completion_mask, 1, group_size=2)
    with pytest.raises(ValueError, match="group_size"):
        bench.grpo_rollout_batch(rng, prompt_mask, completion_mask, VOCAB, group_size=3)


def _update(lora_rank=None, compute_entropy=True):
    config = step_problem.CONFIG
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    params = models.init_params(config, jax.random.key(0))
    update = bench.grpo_update(
        config,
        params,
        mesh,
        learning_rate=1e-3,
        key=jax.random.key(1),
        compute_entropy=compute_entropy,
        lora_rank=lora_rank,
    )
    batch = parallel.shard_batch(step_problem.host_batch(0), mesh)
    return params, update, batch


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_update_is_adamw_at_the_learning_rate_on_every_weight():
    params, update, batch = _update()
    before = jax.device_get(update.state.params)
    # The weights and AdamW's two f32 moments, plus a few scalar counters.
    assert 3 * _bytes(params) <= update.state_bytes <= 3 * _bytes(params) + 64
    state, metrics = update(batch)
    assert state is update.state and np.isfinite(float(metrics["loss"]))
    assert "entropy" in metrics
    moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - b), state.params, before)
    # AdamW's first step: lr * g / (|g| + eps), about lr wherever the gradient is not tiny.
    largest = max(float(m.max()) for m in jax.tree.leaves(moved))
    assert 0.9e-3 < largest <= 1.0e-3 * (1 + 1e-5)
    assert update.temp_bytes(batch) > 0


def test_lora_update_trains_the_adapters_on_a_frozen_base():
    params, update, batch = _update(lora_rank=2, compute_entropy=False)
    base = jax.device_get(update.frozen)
    adapters = jax.device_get(update.state.params)
    adapter_bytes = _bytes(adapters)
    assert 0 < adapter_bytes < _bytes(params) // 10
    assert _bytes(base) == _bytes(params)
    assert 3 * adapter_bytes + _bytes(base) <= update.state_bytes
    assert update.state_bytes <= 3 * adapter_bytes + _bytes(base) + 64
    state, metrics = update(batch)
    assert "entropy" not in metrics and np.isfinite(float(metrics["loss"]))
    for a, b in zip(jax.tree.leaves(update.frozen), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    moved = [
        float(np.abs(np.asarray(a) - b).max())
        for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(adapters), strict=True)
    ]
    assert 0.9e-3 < max(moved) <= 1.0e-3 * (1 + 1e-5)
