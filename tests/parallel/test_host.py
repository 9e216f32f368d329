"""``parallel.fetch`` and ``parallel.replicate`` on one process (8 fake CPU devices); across
processes they run in ``tests/train/rl/test_multihost.py``'s two-process jobs."""

from __future__ import annotations

import json

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


@pytest.mark.slow
def test_replicate_and_fetch_across_two_processes(tmp_path):
    """Two processes of 4 CPU devices (``host_worker``): a typed key committed to a mesh that
    spans them, a scalar, host values and an array split over this process's devices are
    replicated onto another such mesh; an array sharded across the processes is fetched whole
    on each, and refused by ``replicate`` (no process holds all of it)."""
    from tests.parallel import launcher

    outputs = launcher.launch("tests.parallel.host_worker", log_dir=tmp_path, timeout_s=600)
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    key_data = np.asarray(jax.random.key_data(jax.random.key(3))).tolist()
    for index, result in enumerate(results):
        assert result["process"] == index
        assert result["on_target"] and result["key_impl_kept"]
        assert result["key_data"] == key_data
        assert (result["t"], result["ids"], result["n"]) == (0.5, [1, 2], 7)
        assert result["local_whole"] == np.arange(8).tolist()
        assert result["rows_fetched"] == np.arange(16).reshape(8, 2).tolist()
        assert "across processes cannot be replicated" in result["refused"]
