"""``parallel.fetch`` and ``parallel.replicate`` on one process (8 fake CPU devices); across
processes they run in ``tests/train/rl/test_multihost.py``'s two-process jobs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm import parallel

pytestmark = pytest.mark.needs_devices(8)


def test_fetch_gathers_a_sharded_array():
    mesh = parallel.make_mesh(data=2, fsdp=4)
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))
    got = parallel.fetch(sharded)
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, x)


def test_replicate_moves_keys_arrays_and_host_values_onto_the_mesh():
    trainer = parallel.make_mesh(data=2, fsdp=4)
    serving = parallel.make_mesh(data=8, fsdp=1, devices=jax.devices()[::-1])
    key = jax.device_put(jax.random.key(3), NamedSharding(trainer, PartitionSpec()))
    tree = {"key": key, "t": jnp.float32(0.5), "ids": np.array([1, 2], np.int32), "n": 7}
    out = parallel.replicate(tree, serving)
    target = NamedSharding(serving, PartitionSpec())
    for leaf in jax.tree.leaves(out):
        assert leaf.sharding == target
    np.testing.assert_array_equal(
        jax.random.key_data(out["key"]), jax.random.key_data(jax.random.key(3))
    )
    assert jax.random.key_impl(out["key"]) == jax.random.key_impl(key)
    assert float(out["t"]) == 0.5 and int(out["n"]) == 7
    np.testing.assert_array_equal(np.asarray(out["ids"]), [1, 2])
    assert parallel.replicate(tree, None) is tree
