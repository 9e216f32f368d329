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


def pytest_collection_modifyitems(config, items):
    """The mutation check (tests/test_mutation.py) runs last: its child sessions reuse the
    compilation cache the rest of the suite filled."""
    last = [item for item in items if item.nodeid.endswith("test_every_mutant_is_killed")]
    items[:] = [item for item in items if item not in last] + last
