"""Sampling on a (data=2, fsdp=2, tensor=2) mesh of the 8 fake CPU devices (tests/conftest.py)."""

import importlib

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.models import logical_axes
from jaxrl_llm.parallel import PARAM_RULES, logical_to_sharding, make_mesh
from jaxrl_llm.sampling import SamplingOptions, generate, layout
from tests.sampling import SHARDED_QWEN2, random_params

gen = importlib.import_module("jaxrl_llm.sampling.generate")

MAX_NEW = 6
ROWS = ("data", "fsdp")


def _assert_spec(x, mesh, *spec):
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec)), x.ndim), x.sharding


PAD = 0


@pytest.fixture(scope="module")
def setup():
    if jax.device_count() < 8:
        pytest.skip("needs the 8 fake CPU devices set up by tests/conftest.py")
    config = SHARDED_QWEN2
    params = random_params(config)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    shardings = logical_to_sharding(logical_axes(config), mesh, PARAM_RULES, shapes=params)
    sharded = jax.device_put(params, shardings)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 64, size=(4, 10)).astype(np.int32)
    mask = np.ones((4, 10), bool)
    mask[1, :4] = mask[3, :7] = False
    return config, params, sharded, mesh, tokens, mask


def test_sharded_generation_matches_single_device(setup):
    config, params, sharded, mesh, tokens, mask = setup
    for temperature in (0.0, 1.0):
        kwargs = dict(
            key=jax.random.key(1),
            max_new_tokens=MAX_NEW,
            sampling=SamplingOptions(eos_ids=(), pad_id=PAD, temperature=temperature),
        )
        single = generate(params, config, tokens, mask, **kwargs)
        multi = generate(sharded, config, tokens, mask, mesh=mesh, **kwargs)
        np.testing.assert_array_equal(multi.tokens, single.tokens)
        np.testing.assert_allclose(multi.logprobs, single.logprobs, atol=1e-5)
        _assert_spec(multi.tokens, mesh, ROWS, None)


def test_sharded_generation_over_decode_windows(setup):
    """64 new tokens decode in two windows of the cache on the mesh as on one device; the
    returned cache is whole and keeps the sampling rules' sharding."""
    config, params, sharded, mesh, tokens, mask = setup
    assert layout.decode_windows(sharded, 64) == (32, 64)
    kwargs = dict(
        key=jax.random.key(2),
        max_new_tokens=64,
        sampling=SamplingOptions(eos_ids=(), pad_id=PAD, temperature=1.0),
    )
    single = generate(params, config, tokens, mask, **kwargs)
    multi = generate(sharded, config, tokens, mask, mesh=mesh, **kwargs)
    np.testing.assert_array_equal(multi.tokens, single.tokens)
    np.testing.assert_allclose(multi.logprobs, single.logprobs, atol=1e-5)
    sampling = gen.sampling_params(temperature=1.0, eos_ids=(), pad_id=PAD)
    padded = gen.pad_prompts(tokens, mask, pad_id=PAD)
    with jax.set_mesh(mesh):
        state = gen.prefill(sharded, config, *padded, max_new_tokens=64, pad_id=PAD, mesh=mesh)
        state = gen.decode(
            sharded, config, state, key=jax.random.key(2), sampling=sampling, mesh=mesh
        )
    assert state.cache.k.shape[3] == padded[0].shape[1] + 64
    _assert_spec(state.cache.k, mesh, None, ROWS, "tensor", None, None)
    _assert_spec(state.cache.mask, mesh, ROWS, None)
    np.testing.assert_array_equal(state.tokens, single.tokens)


def test_state_follows_sampling_rules(setup):
    config, _, sharded, mesh, tokens, mask = setup
    sampling = gen.sampling_params(temperature=1.0, eos_ids=(), pad_id=PAD)
    padded = gen.pad_prompts(tokens, mask, pad_id=PAD)
    with jax.set_mesh(mesh):
        state = gen.prefill(sharded, config, *padded, max_new_tokens=MAX_NEW, pad_id=PAD, mesh=mesh)
        state = gen.decode(
            sharded, config, state, key=jax.random.key(0), sampling=sampling, mesh=mesh
        )
    _assert_spec(state.cache.k, mesh, None, ROWS, "tensor", None, None)
    _assert_spec(state.cache.v, mesh, None, ROWS, "tensor", None, None)
    _assert_spec(state.cache.mask, mesh, ROWS, None)
    _assert_spec(state.done, mesh, ROWS)
    _assert_spec(state.logits, mesh, ROWS, "tensor")
    assert int(state.step) == MAX_NEW


def test_batch_not_divisible_by_mesh_raises(setup):
    config, _, sharded, mesh, tokens, mask = setup
    with pytest.raises(ValueError, match="not divisible"):
        generate(
            sharded,
            config,
            tokens[:3],
            mask[:3],
            key=jax.random.key(0),
            max_new_tokens=MAX_NEW,
            sampling=SamplingOptions(eos_ids=(), pad_id=PAD),
            mesh=mesh,
        )
    assert jax.sharding.get_abstract_mesh().empty, "the failed call left its mesh set"
