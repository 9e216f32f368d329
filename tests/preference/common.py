"""Shared shapes and helpers of the preference tests."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

N = 16
LOG2 = math.log(2.0)

# Most tests run eagerly on purpose: with the shapes they share ([N] f32, one token batch shape),
# every primitive compiles once per file, where a jit per loss configuration would compile
# again for each. The jit tests cover the compiled path.


def _tile(values, n=N):
    """A short hand-made pattern repeated to the shared length ``N``."""
    return np.resize(np.asarray(values), n)


def _grad_of_sum(fn, argnums, **static):
    return jax.grad(lambda *a, **k: jnp.sum(fn(*a, **static, **k)), argnums=argnums)
