"""A deviceless TPU mesh for ahead-of-time compiles in tests (libtpu's topology description,
no TPU needed)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType


def v5e_2x2_mesh(monkeypatch, shape: tuple[int, int, int]) -> jax.sharding.Mesh:
    """A ``(data, fsdp, tensor)`` mesh of ``shape`` over a v5e 2x2 slice's 4 chips."""
    return tpu_mesh(monkeypatch, "v5e:2x2", shape)


def tpu_mesh(monkeypatch, topology: str, shape: tuple[int, int, int]) -> jax.sharding.Mesh:
    """A ``(data, fsdp, tensor)`` mesh of ``shape`` over the chips of ``topology`` (libtpu's
    name, e.g. ``"v5p:2x2x1"``)."""
    from jax.experimental import topologies

    # Another process of this machine may hold libtpu's lockfile (any JAX program started
    # without JAX_PLATFORMS=cpu takes it); a deviceless topology needs no exclusive access.
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    topology = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    return jax.sharding.Mesh(
        np.array(topology.devices).reshape(shape),
        ("data", "fsdp", "tensor"),
        axis_types=(AxisType.Auto,) * 3,
    )
