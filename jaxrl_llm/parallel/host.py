"""Moving small values between the host and a mesh that may span processes.

In a multi-process job every process runs the same Python, and a global array may live partly
on devices this process cannot address. Two moves the host side needs everywhere:

* ``fetch``: a global array as one NumPy array on every process (an all-gather across
  processes when the array spans them);
* ``replicate``: host values, or arrays committed to another layout, as arrays replicated
  over a mesh. ``jax.device_put`` refuses a multi-process target for a typed PRNG key or an
  array committed elsewhere; such leaves are rebuilt from this process's copy (every process
  holds the same value) with ``jax.make_array_from_process_local_data``.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def fetch(x: jax.Array) -> np.ndarray:
    """A global array as a host NumPy array on every process."""
    if jax.process_count() > 1 and not x.is_fully_addressable:
        if x.sharding.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils  # noqa: PLC0415 (only multi-process)

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def replicate(tree: Any, mesh: Mesh | None) -> Any:
    """``tree``'s leaves (arrays, NumPy arrays, scalars, PRNG keys) replicated on ``mesh``
    (``tree`` unchanged without a mesh).

    Raises:
      ValueError: a leaf sharded across processes (not replicated): no process holds all of it.
    """
    if mesh is None:
        return tree
    target = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: _replicated(x, target), tree)


def _replicated(x: Any, target: NamedSharding) -> Any:
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _replicated(jax.random.key_data(x), target)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    if isinstance(x, jax.Array) and x.sharding == target:
        return x
    if target.is_fully_addressable:
        return jax.device_put(x, target)
    if isinstance(x, jax.Array):
        if x.is_fully_addressable:  # all of it on this process's devices, split or not
            x = np.asarray(x)
        elif x.sharding.is_fully_replicated:
            x = x.addressable_data(0)
        else:
            raise ValueError(
                f"a {x.shape} array sharded as {x.sharding.spec} across processes cannot be "
                "replicated from this process's shards"
            )
    return jax.make_array_from_process_local_data(target, np.asarray(x))
