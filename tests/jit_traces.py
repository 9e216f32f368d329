"""Counting JAX traces: how the suite checks that a jitted function does not recompile.

A jit's ``_cache_size()`` reads JAX's C++ dispatch cache, one LRU of 8192 entries shared by
every jitted function of the process; late in a long pytest worker it is full, and a function's
entry can be gone by the time a test reads it (``_cache_size() == 0`` although nothing
recompiled). A trace is the event that matters: JAX traces a function again exactly when it
needs a new program for it. :func:`count_traces` records the traces JAX reports through
``jax.monitoring`` (its ``jaxpr_trace_duration`` event, one per trace of a jitted function).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

#: The event JAX records once per trace of a jitted function (``jax._src.dispatch``).
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"


@contextlib.contextmanager
def count_traces(*names: str) -> Iterator[list[str]]:
    """Yields a list that collects the name of every function traced in the block (only those
    named ``names`` when given)."""
    traced: list[str] = []

    def listener(event: str, duration: float, **kwargs) -> None:
        del duration
        name = str(kwargs.get("fun_name", ""))
        if event == TRACE_EVENT and (not names or name in names):
            traced.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield traced
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
