"""Test-wide setup: 8 fake CPU devices for sharding tests, set before JAX is imported."""

import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def rng():
    """A NumPy generator with a fixed seed, fresh for every test."""
    return np.random.default_rng(0)


def pytest_runtest_setup(item):
    """``cpu_only``: the test checks the CPU backend's own behaviour; ``needs_devices(n)``: it
    builds an ``n``-device mesh. Both skip elsewhere (e.g. on one GPU), where CI never runs."""
    cpu_only = item.get_closest_marker("cpu_only")
    needs = item.get_closest_marker("needs_devices")
    if cpu_only is None and needs is None:
        return
    import jax  # noqa: PLC0415  (after XLA_FLAGS above)

    if cpu_only is not None and jax.default_backend() != "cpu":
        pytest.skip(f"checks the CPU backend; this run's is {jax.default_backend()}")
    if needs is not None and jax.device_count() < needs.args[0]:
        pytest.skip(f"needs {needs.args[0]} devices, this run has {jax.device_count()}")


def pytest_collection_modifyitems(config, items):
    """The mutation check (tests/test_mutation.py) runs last: its child sessions reuse the
    compilation cache the rest of the suite filled."""
    last = [item for item in items if item.nodeid.endswith("test_every_mutant_is_killed")]
    items[:] = [item for item in items if item not in last] + last
