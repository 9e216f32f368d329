"""Host batches to global, batch-sharded arrays: each process feeds only its own rows.

On a pod every process runs the same program but loads a different slice of the global batch;
``process_local_slice`` says which rows, ``shard_batch`` assembles the per-process rows into one
global ``jax.Array`` through ``jax.make_array_from_process_local_data``. On a single process the
two reduce to "all rows" and a ``device_put``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm.parallel.rules import (
    ACTIVATION_RULES,
    MeshAxes,
    Rules,
    mesh_axes_of,
    present_mesh_axes,
    spec_entry,
)


def batch_mesh_axes(mesh: Mesh, rules: Rules | MeshAxes = ACTIVATION_RULES) -> tuple[str, ...]:
    """The mesh axes that split the leading (batch) dim: ``rules["batch"]`` or a given entry.

    Args:
      mesh: the device mesh.
      rules: a rule table (its ``"batch"`` entry is used), or directly a mesh axis, a tuple of
        mesh axes, or ``None`` (replicate the batch).

    Returns:
      The mesh axes, major to minor (``()`` when replicated).

    Raises:
      ValueError: the table has no ``"batch"`` rule, or an axis is not in the mesh.
    """
    if isinstance(rules, Mapping):
        if "batch" not in rules:
            raise ValueError(f"rule table has no 'batch' rule; it maps {tuple(rules)}")
        axes = mesh_axes_of(rules["batch"], name="rule for logical axis 'batch'")
    else:
        axes = mesh_axes_of(rules, name="batch mesh axes")
    axes = present_mesh_axes(axes, mesh.axis_names)  # an optional axis (expert) may be absent
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"batch mesh axes {missing} are not in the mesh axes {mesh.axis_names}")
    return axes


def _local_shard_count(mesh: Mesh, axes: tuple[str, ...]) -> int:
    """Distinct batch shards held by this process's devices (1 when the batch is replicated)."""
    dims = [mesh.axis_names.index(a) for a in axes]
    pid = jax.process_index()
    coords = {
        tuple(index[d] for d in dims)
        for index, device in np.ndenumerate(mesh.devices)
        if device.process_index == pid
    }
    if not coords:
        raise ValueError(
            f"process {pid} owns none of the mesh's {mesh.devices.size} devices, so it cannot "
            "feed a batch shard"
        )
    return len(coords)


def batch_shards(mesh: Mesh, rules: Rules | MeshAxes = ACTIVATION_RULES) -> int:
    """Number of shards the batch dimension splits into (``data x fsdp`` with the default rules)."""
    return math.prod(mesh.shape[a] for a in batch_mesh_axes(mesh, rules))


def process_local_slice(
    global_batch_size: int, mesh: Mesh | None = None, *, rules: Rules | MeshAxes = ACTIVATION_RULES
) -> slice:
    """The rows ``[start, stop)`` of the global batch that this process must load.

    With a mesh: the union of the row blocks that this process's devices hold under the
    batch sharding (``rows = ∪_{d local} index_d``), which is what ``shard_batch`` expects
    from it. Without one: an even split by process index, ``[p·B/P, (p+1)·B/P)``, which is
    the same thing for meshes from ``make_mesh`` whose batch axes run across processes.

    Args:
      global_batch_size: ``B``, rows of the global batch.
      mesh: the device mesh (recommended).
      rules: as in ``batch_mesh_axes``.

    Returns:
      A ``slice`` of length ``B / (number of processes holding distinct rows)``.

    Raises:
      ValueError: ``B`` does not divide into the batch shards / processes, or this process's
        rows are not one contiguous block.
    """
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive int, got {global_batch_size!r}")
    if mesh is None:
        count, index = jax.process_count(), jax.process_index()
        if global_batch_size % count:
            raise ValueError(
                f"global batch size {global_batch_size} is not divisible by the {count} processes"
            )
        rows = global_batch_size // count
        return slice(index * rows, (index + 1) * rows)
    axes = batch_mesh_axes(mesh, rules)
    shards = math.prod(mesh.shape[a] for a in axes)
    if global_batch_size % shards:
        raise ValueError(
            f"global batch size {global_batch_size} is not divisible by the {shards} batch shards "
            f"(mesh axes {axes})"
        )
    sharding = NamedSharding(mesh, PartitionSpec(spec_entry(axes)))
    blocks = sorted(
        {
            index[0].indices(global_batch_size)[:2]
            for index in sharding.addressable_devices_indices_map((global_batch_size,)).values()
        }
    )
    for (_, stop), (start, _) in zip(blocks, blocks[1:]):
        if stop != start:
            raise ValueError(
                f"process {jax.process_index()} holds the non-contiguous row blocks {blocks} of "
                "the batch; order the mesh devices so each process's devices are adjacent along "
                "the batch axes"
            )
    return slice(blocks[0][0], blocks[-1][1])


def shard_batch(host_batch: Any, mesh: Mesh, *, rules: Rules | MeshAxes = ACTIVATION_RULES) -> Any:
    """Assembles this process's rows into global arrays sharded over the batch mesh axes.

    Every leaf ``[b, ...]`` (this process's ``b`` rows, see ``process_local_slice``) becomes a
    global ``[B, ...]`` array with ``PartitionSpec(batch_axes)``: ``B = b / k · n`` where ``n``
    is the number of batch shards and ``k`` the number this process holds; other dims are
    replicated. Scalar leaves (global normalisers such as ``num_tokens``) are replicated and must
    be equal on every process. Built on ``jax.make_array_from_process_local_data``.

    Args:
      host_batch: a pytree (dict, NamedTuple such as ``RolloutBatch``) of host arrays.
      mesh: the device mesh.
      rules: a rule table (its ``"batch"`` entry is used) or directly the batch mesh axes.

    Returns:
      The pytree of global ``jax.Array`` s, same structure and dtypes.

    Raises:
      ValueError: naming the leaf path and sizes, when a leaf's leading dim does not divide
        into this process's batch shards.
    """
    axes = batch_mesh_axes(mesh, rules)
    shards = math.prod(mesh.shape[a] for a in axes)
    local_shards = _local_shard_count(mesh, axes)
    batch_sharding = NamedSharding(mesh, PartitionSpec(spec_entry(axes)))
    replicated = NamedSharding(mesh, PartitionSpec())
    leaves, treedef = jax.tree_util.tree_flatten_with_path(host_batch)
    out = []
    for path, leaf in leaves:
        data = np.asarray(leaf)
        if data.ndim == 0:
            out.append(jax.make_array_from_process_local_data(replicated, data, ()))
            continue
        rows = data.shape[0]
        if rows % local_shards:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path) or 'batch'} of shape {data.shape}: "
                f"{rows} rows are not divisible by the {local_shards} batch shards of this "
                f"process (mesh axes {axes} = {shards} shards in all)"
            )
        global_shape = (rows // local_shards * shards, *data.shape[1:])
        out.append(jax.make_array_from_process_local_data(batch_sharding, data, global_shape))
    return jax.tree_util.tree_unflatten(treedef, out)
