"""Parallelism: the device mesh, logical-axis rule tables, batch sharding and multi-process start.

Typical use (single host or pod alike)::

    info = initialize_distributed()              # first JAX call of the program
    mesh = make_mesh(data=1, fsdp=-1, tensor=1)
    jax.set_mesh(mesh)
    shardings = logical_to_sharding(logical_axes(config), mesh, PARAM_RULES,
                                    shapes=jax.eval_shape(init))
    rows = process_local_slice(global_batch_size, mesh)   # what this process loads
    batch = shard_batch(load(rows), mesh)
"""

from jaxrl_llm.parallel.batch import (
    batch_mesh_axes,
    batch_shards,
    process_local_slice,
    shard_batch,
)
from jaxrl_llm.parallel.distributed import (
    ClusterSpec,
    DistributedInfo,
    detect_cluster,
    first_slurm_host,
    initialize_distributed,
    is_primary,
    set_trainer_processes,
    trainer_processes,
)
from jaxrl_llm.parallel.host import fetch, replicate
from jaxrl_llm.parallel.mesh import MESH_AXES, current_platform, make_mesh, resolve_mesh_shape
from jaxrl_llm.parallel.rules import (
    ACTIVATION_RULES,
    LOGICAL_AXES,
    PARAM_RULES,
    SAMPLING_RULES,
    is_logical_axes,
    logical_to_sharding,
    logical_to_spec,
    mesh_axes_of,
    mesh_context,
    spec_entry,
    with_logical_constraint,
)

__all__ = [
    "ACTIVATION_RULES",
    "LOGICAL_AXES",
    "MESH_AXES",
    "current_platform",
    "PARAM_RULES",
    "SAMPLING_RULES",
    "ClusterSpec",
    "DistributedInfo",
    "batch_mesh_axes",
    "batch_shards",
    "detect_cluster",
    "fetch",
    "first_slurm_host",
    "initialize_distributed",
    "is_primary",
    "set_trainer_processes",
    "trainer_processes",
    "is_logical_axes",
    "logical_to_sharding",
    "logical_to_spec",
    "make_mesh",
    "mesh_axes_of",
    "process_local_slice",
    "replicate",
    "resolve_mesh_shape",
    "shard_batch",
    "spec_entry",
    "mesh_context",
    "with_logical_constraint",
]
