"""shard_batch / process_local_slice on one process with 8 fake CPU devices."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl_llm.parallel import (
    ACTIVATION_RULES,
    SAMPLING_RULES,
    batch_mesh_axes,
    make_mesh,
    process_local_slice,
    shard_batch,
)
from jaxrl_llm.types import RolloutBatch


def _host_batch(rng, rows=16):
    return {
        "x": rng.normal(size=(rows, 3)).astype(np.float32),
        "tokens": rng.integers(0, 100, size=(rows, 5)).astype(np.int32),
        "mask": rng.random(rows) < 0.5,
        "num_tokens": np.float32(37.0),
    }


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_round_trip_and_sharding(rng, axis_types):
    mesh = make_mesh(2, 2, 2, axis_types=axis_types)
    host = _host_batch(rng)
    out = shard_batch(host, mesh)
    chex.assert_trees_all_equal_structs(out, host)
    for key in ("x", "tokens", "mask"):
        assert out[key].dtype == host[key].dtype
        assert out[key].shape == host[key].shape
        np.testing.assert_array_equal(np.asarray(out[key]), host[key])
        spec = out[key].sharding.spec
        assert spec[0] == ("data", "fsdp") and all(s is None for s in spec[1:])
        # 4 batch shards of 4 rows, each held by the 2 tensor replicas.
        rows_seen = {}
        for shard in out[key].addressable_shards:
            assert shard.data.shape[0] == 4
            np.testing.assert_array_equal(np.asarray(shard.data), host[key][shard.index])
            rows_seen.setdefault(shard.index[0].indices(16)[:2], 0)
            rows_seen[shard.index[0].indices(16)[:2]] += 1
        assert rows_seen == {(0, 4): 2, (4, 8): 2, (8, 12): 2, (12, 16): 2}
    assert out["num_tokens"].shape == ()
    assert out["num_tokens"].sharding.is_fully_replicated
    assert float(out["num_tokens"]) == 37.0


def test_feeds_a_jitted_step(rng):
    mesh = make_mesh(2, 4, 1)
    host = _host_batch(rng)
    batch = shard_batch(host, mesh)
    total = jax.jit(lambda b: jnp.sum(b["x"] * b["mask"][:, None]) / b["num_tokens"])(batch)
    expected = (host["x"].astype(np.float64) * host["mask"][:, None]).sum() / 37.0
    np.testing.assert_allclose(float(total), expected, rtol=1e-6)


def test_namedtuple_batch_with_none_fields(rng):
    mesh = make_mesh(1, 8, 1)
    batch = RolloutBatch(
        completion_mask=np.ones((8, 4), bool),
        old_logprobs=rng.normal(size=(8, 4)).astype(np.float32),
        advantages=rng.normal(size=(8,)).astype(np.float32),
        num_tokens=np.float32(32.0),
    )
    out = shard_batch(batch, mesh)
    assert isinstance(out, RolloutBatch)
    assert out.ref_logprobs is None and out.returns is None
    assert out.old_logprobs.sharding.spec == P(("data", "fsdp"))
    np.testing.assert_array_equal(np.asarray(out.advantages), batch.advantages)


@pytest.mark.parametrize(
    "rules, spec0, shards",
    [
        ("fsdp", "fsdp", 2),
        (("data", "fsdp", "tensor"), ("data", "fsdp", "tensor"), 8),
        (None, None, 1),
        (SAMPLING_RULES, ("data", "fsdp"), 4),
        ({"batch": "data"}, "data", 2),
    ],
)
def test_rules_or_leading_axis_spec(rng, rules, spec0, shards):
    mesh = make_mesh(2, 2, 2)
    host = _host_batch(rng)
    out = shard_batch(host, mesh, rules=rules)
    assert out["x"].sharding.spec[0] == spec0
    assert {s.index[0].indices(16)[:2] for s in out["x"].addressable_shards} == {
        (i * 16 // shards, (i + 1) * 16 // shards) for i in range(shards)
    }
    np.testing.assert_array_equal(np.asarray(out["x"]), host["x"])


def test_non_divisible_batch_names_leaf_and_sizes(rng):
    mesh = make_mesh(2, 2, 2)
    host = {"ok": np.zeros((8, 2)), "inner": {"bad": np.zeros((6, 2))}}
    with pytest.raises(ValueError) as err:
        shard_batch(host, mesh)
    message = str(err.value)
    assert "['inner']['bad']" in message
    assert "shape (6, 2)" in message
    assert "6 rows are not divisible by the 4 batch shards" in message


def test_batch_axes_errors():
    mesh = make_mesh(2, 2, 2)
    with pytest.raises(ValueError, match="no 'batch' rule"):
        shard_batch({"x": np.zeros((8,))}, mesh, rules={"embed": "fsdp"})
    with pytest.raises(ValueError, match=re.escape("batch mesh axes ['rows'] are not in")):
        shard_batch({"x": np.zeros((8,))}, mesh, rules="rows")
    with pytest.raises(ValueError, match="must be a mesh axis name"):
        batch_mesh_axes(mesh, 3)
    assert batch_mesh_axes(mesh) == ("data", "fsdp")
    assert batch_mesh_axes(mesh, ACTIVATION_RULES) == ("data", "fsdp")


def test_process_local_slice_single_process():
    mesh = make_mesh(2, 2, 2)
    assert process_local_slice(16, mesh) == slice(0, 16)
    assert process_local_slice(16) == slice(0, 16)
    assert process_local_slice(16, mesh, rules=None) == slice(0, 16)
    with pytest.raises(ValueError, match="18 is not divisible by the 4 batch shards"):
        process_local_slice(18, mesh)
    with pytest.raises(ValueError, match="positive int"):
        process_local_slice(0, mesh)
