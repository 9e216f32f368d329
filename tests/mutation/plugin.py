"""Pytest plugin (``-p tests.mutation.plugin``): plants the mutant ``$JAXRL_MUTANT`` on load.

Loaded by ``-p``, this module is imported before any conftest or test module, so names other
modules import with ``from ... import`` are patched before they are bound. The patches live
for the whole (child) pytest process and are undone at exit.
"""

from __future__ import annotations

import os

import pytest

# The same 8 fake CPU devices as tests/conftest.py, set before the mutant imports JAX.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.mutation.mutants import MUTANTS  # noqa: E402

_patch = pytest.MonkeyPatch()
_name = os.environ.get("JAXRL_MUTANT")
if _name:
    by_name = {m.name: m for m in MUTANTS}
    if _name not in by_name:
        raise pytest.UsageError(f"unknown mutant {_name!r}; known: {sorted(by_name)}")
    by_name[_name].apply(_patch)


def pytest_report_header(config):
    return f"mutant: {_name or '(none)'}"


def pytest_unconfigure(config):
    _patch.undo()
