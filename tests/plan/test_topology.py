"""Topology names, per-chip specs, deviceless devices and out-of-HBM compiles.

Expected shapes are Google's published slice shapes (Cloud TPU v4 / v5p / v5e / v6e docs);
expected specs are the published per-chip numbers; the compiler's usable-HBM limits are checked
against real deviceless compiles (skipped without libtpu).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.plan import topology
from jaxrl_llm.plan.topology import (
    GiB,
    get_devices,
    libtpu_available,
    parse_hbm_oom,
    resolve_topology,
    try_compile,
)

needs_libtpu = pytest.mark.skipif(
    not libtpu_available(),
    reason="libtpu not importable (pip install 'jax[tpu]'): no deviceless TPU topologies",
)

# Cloud accelerator type -> (JAX topology, chips), from Google's slice tables.
CLOUD_SHAPES = {
    "v5litepod-1": ("v5e:1x1", 1),
    "v5litepod-4": ("v5e:2x2", 4),
    "v5litepod-8": ("v5e:2x4", 8),
    "v5e-16": ("v5e:4x4", 16),
    "v5litepod-32": ("v5e:4x8", 32),
    "v5litepod-64": ("v5e:8x8", 64),
    "v5litepod-128": ("v5e:8x16", 128),
    "v5litepod-256": ("v5e:16x16", 256),
    "v6e-4": ("v6e:2x2", 4),
    "v6e-256": ("v6e:16x16", 256),
    "v4-8": ("v4:2x2x1", 4),
    "v4-16": ("v4:2x2x2", 8),
    "v4-32": ("v4:2x2x4", 16),
    "v4-64": ("v4:2x4x4", 32),
    "v4-128": ("v4:4x4x4", 64),
    "v4-512": ("v4:4x8x8", 256),
    "v4-4096": ("v4:8x16x16", 2048),
    "v5p-8": ("v5p:2x2x1", 4),
    "v5p-16": ("v5p:2x2x2", 8),
    "v5p-128": ("v5p:4x4x4", 64),
    "v5p-640": ("v5p:4x4x20", 320),
    "v5p-1152": ("v5p:4x12x12", 576),
    "v5p-2560": ("v5p:8x8x20", 1280),
    "v5p-3456": ("v5p:12x12x12", 1728),
    "v5p-12288": ("v5p:16x16x24", 6144),
}


@pytest.mark.parametrize("cloud", sorted(CLOUD_SHAPES))
def test_cloud_names_map_to_googles_slice_shapes(cloud):
    jax_name, chips = CLOUD_SHAPES[cloud]
    spec = resolve_topology(cloud)
    assert (spec.jax_topology_name, spec.chips) == (jax_name, chips)
    # The raw name resolves to the same slice, named the canonical Cloud way.
    again = resolve_topology(jax_name)
    assert again == resolve_topology(again.cloud_name)
    assert again.jax_topology_name == jax_name and again.chips == chips


@pytest.mark.parametrize(
    "name, cloud, shape, wrap",
    [
        ("v5e:4x4", "v5litepod-16", (4, 4), (False, False, False)),
        ("V5E:8x16", "v5litepod-128", (8, 16), (False, True, False)),
        ("v6e:16x16", "v6e-256", (16, 16), (True, True, False)),
        ("v5p:2x2x4", "v5p-32", (2, 2, 4), (False, False, False)),
        ("v5:2x2x1", "v5p-8", (2, 2, 1), (False, False, False)),
        ("v4:2x2x2", "v4-16", (2, 2, 2), (False, False, False)),
        ("v4:4x4x8", "v4-256", (4, 4, 8), (True, True, True)),
        ("v5e:4x4x1", "v5litepod-16", (4, 4), (False, False, False)),
    ],
)
def test_raw_names_shape_and_wraparound(name, cloud, shape, wrap):
    spec = resolve_topology(name)
    assert (spec.cloud_name, spec.shape, spec.wrap) == (cloud, shape, wrap)


@pytest.mark.parametrize(
    "name, hbm, peak, hbm_bw, ici_per_chip, cores",
    [
        ("v4-8", 32 * GiB, 275e12, 1.2e12, 600e9, 2),
        ("v5e-4", 16 * GiB, 197e12, 819e9, 400e9, 1),
        ("v5p-8", 95 * GiB, 459e12, 2765e9, 1200e9, 2),
        ("v6e-4", 32 * GiB, 918e12, 1638e9, 800e9, 1),
    ],
)
def test_published_chip_specs(name, hbm, peak, hbm_bw, ici_per_chip, cores):
    spec = resolve_topology(name)
    assert spec.hbm_bytes_per_chip == hbm
    assert spec.peak_bf16_flops_per_chip == peak
    assert spec.hbm_bandwidth_bytes_per_s == hbm_bw
    # Cloud docs: bidirectional ICI bandwidth per chip (v4: 6 links x 50 GB/s x 2 ways).
    assert spec.ici_bandwidth_bytes_per_s_per_chip == ici_per_chip
    assert spec.ici_ring_bandwidth_bytes_per_s == 2 * spec.ici_bandwidth_bytes_per_s_per_link
    assert spec.cores_per_chip == cores
    assert spec.usable_hbm_bytes_per_chip <= hbm + GiB


@pytest.mark.parametrize(
    "bad", ["v3-8", "tpu", "v4-6", "v4-12", "v5e-2", "v5e-512", "v5e:3x3", "v4:2x2", "v5e:32x32"]
)
def test_unknown_or_invalid_names_raise_listing_accepted_forms(bad):
    with pytest.raises(ValueError, match="accepted forms|pod"):
        resolve_topology(bad)


def test_non_string_name_raises():
    with pytest.raises(ValueError, match="must be a str"):
        resolve_topology(8)


def test_parse_hbm_oom_reads_gib_sizes():
    message = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (16.00G) exceeds available HBM (15.75G)."
    )
    assert parse_hbm_oom(message) == (16 * GiB, round(15.75 * GiB))
    assert parse_hbm_oom("some other error") is None


def test_get_devices_explains_a_missing_libtpu(monkeypatch):
    def missing(**kwargs):
        raise RuntimeError("JAX TPU support not installed; cannot generate TPU topology.")

    monkeypatch.setattr(topology.topologies, "get_topology_desc", missing)
    with pytest.raises(RuntimeError, match="pip install 'jax\\[tpu\\]'"):
        get_devices(resolve_topology("v5e-4"))


def test_libtpu_starts_with_the_slices_type_and_one_worker_then_the_variables_go(monkeypatch):
    """Off a TPU VM libtpu asks for the accelerator type and worker hostnames at start-up (and
    prints C++ errors without them): ``get_devices`` gives it the planned slice's type and one
    local worker while it builds the topology, leaving a user's own values and the
    environment afterwards as they were."""
    seen = {}
    keys = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "TPU_SKIP_MDS_QUERY")

    def desc(**kwargs):
        seen.update({key: os.environ.get(key) for key in keys})
        raise RuntimeError("TPU support not installed")  # stop here: no libtpu needed

    monkeypatch.setattr(topology.topologies, "get_topology_desc", desc)
    monkeypatch.setattr(topology, "_tpu_attached", lambda: False)
    for key in keys:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "true")  # the user's
    with pytest.raises(RuntimeError, match="needs libtpu"):
        get_devices(resolve_topology("v5e:4x4"))
    assert seen == {
        "TPU_ACCELERATOR_TYPE": "v5litepod-16",
        "TPU_WORKER_HOSTNAMES": "localhost",
        "TPU_SKIP_MDS_QUERY": "true",
    }
    assert {key: os.environ.get(key) for key in keys} == {
        "TPU_ACCELERATOR_TYPE": None,
        "TPU_WORKER_HOSTNAMES": None,
        "TPU_SKIP_MDS_QUERY": "true",
    }
    # On a machine with TPU chips libtpu finds its own: nothing is set.
    monkeypatch.setattr(topology, "_tpu_attached", lambda: True)
    with pytest.raises(RuntimeError, match="needs libtpu"):
        get_devices(resolve_topology("v5e:4x4"))
    assert seen["TPU_ACCELERATOR_TYPE"] is None and seen["TPU_WORKER_HOSTNAMES"] is None


@needs_libtpu
@pytest.mark.parametrize(
    "name, kind",
    [
        ("v5e:2x2", "TPU v5 lite"),
        ("v5e-1", "TPU v5 lite"),
        ("v4-8", "TPU v4"),
        ("v5p-8", "TPU v5"),
        ("v6e-8", "TPU v6 lite"),
        ("v5litepod-256", "TPU v5 lite"),
    ],
)
def test_get_devices_gives_one_device_per_chip(name, kind):
    spec = resolve_topology(name)
    devices = get_devices(spec)
    assert len(devices) == spec.chips
    assert {d.device_kind for d in devices} == {kind}
    # Megacore: one device per chip, so every device sits on core 0 of its own chip.
    assert len({tuple(d.coords) for d in devices}) == spec.chips


@needs_libtpu
@pytest.mark.parametrize("name", ["v5e-1", "v4-8", "v5p-8", "v6e-4"])
def test_usable_hbm_matches_the_compiler_and_oom_is_reported(name):
    spec = resolve_topology(name)
    devices = get_devices(spec)
    mesh = Mesh(np.array(devices), ("x",), axis_types=(AxisType.Explicit,))
    # x * 2 needs input + output = 2 x 64 GiB a chip: over every chip's HBM.
    rows = 64 * GiB * spec.chips // (4 * 4096)
    x = jax.ShapeDtypeStruct((rows, 4096), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    outcome = try_compile(jax.jit(lambda a: a * 2).lower(x))
    assert outcome.compiled is None and "Ran out of memory" in outcome.error
    assert outcome.required_bytes == 128 * GiB
    # The compiler prints GiB with two decimals.
    assert abs(outcome.available_bytes - spec.usable_hbm_bytes_per_chip) <= 0.005 * GiB


@needs_libtpu
def test_try_compile_returns_the_compiled_program_when_it_fits():
    spec = resolve_topology("v5e:2x2")
    mesh = Mesh(np.array(get_devices(spec)), ("x",), axis_types=(AxisType.Explicit,))
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    outcome = try_compile(jax.jit(lambda a: a * 2).lower(x))
    assert outcome.error is None and outcome.seconds > 0
    assert outcome.compiled.memory_analysis().argument_size_in_bytes == 16 * 128 * 4
