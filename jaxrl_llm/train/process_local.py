"""Checkpoint leaves that live on one process's devices in a multi-process job.

A sampler on processes of its own (``train.rl.remote``) leaves the trainer's whole state on
one process. orbax refuses such arrays ("host local": it takes a multi-process job's arrays to
span processes), so ``train.checkpoint`` writes them from host memory (``to_host``), reads
them into host buffers (``host_target``) and places them on their devices (``placed``). A PRNG
key travels as its key data. Every other leaf (and every leaf of a one-process job) passes
through unchanged.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxrl_llm import parallel

PyTree = Any


def is_process_local(x: Any) -> bool:
    """A leaf of a multi-process job with trainer processes named
    (``parallel.set_trainer_processes``) that lives on this process's devices alone."""
    if jax.process_count() == 1 or parallel.trainer_processes() is None:
        return False
    sharding = getattr(x, "sharding", None)
    return sharding is not None and sharding.is_fully_addressable


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def to_host(tree: PyTree) -> PyTree:
    """``tree`` with its process-local leaves as host NumPy arrays (keys: their data)."""

    def host(x):
        if not is_process_local(x):
            return x
        return np.asarray(jax.device_get(jax.random.key_data(x) if _is_key(x) else x))

    return jax.tree.map(host, tree)


def host_target(abstract: PyTree) -> PyTree:
    """The restore target of ``abstract``: host buffers for its process-local leaves."""

    def target(x):
        if not is_process_local(x):
            return x
        data = jax.eval_shape(jax.random.key_data, x) if _is_key(x) else x
        return np.empty(data.shape, data.dtype)

    return jax.tree.map(target, abstract)


def placed(tree: PyTree, abstract: PyTree) -> PyTree:
    """A restored ``tree`` with its process-local leaves on ``abstract``'s shardings."""

    def place(x, a):
        if not is_process_local(a):
            return x
        if _is_key(a):  # the key's implementation rides on its dtype
            x = jax.random.wrap_key_data(x, impl=getattr(a.dtype, "_impl", None))
        return jax.device_put(x, a.sharding)

    return jax.tree.map(place, tree, abstract)
