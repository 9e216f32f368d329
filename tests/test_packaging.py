"""One install per backend (issue 46, item 6): the ``cuda`` and ``tpu`` extras name JAX's own
backend extras at the project's JAX floor, and the README's install lines name those extras."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _jax_floor() -> str:
    (jax,) = [d for d in PROJECT["dependencies"] if re.match(r"jax\s*>=", d)]
    return jax.split(">=")[1]


def test_backend_extras_are_jax_backend_extras_at_the_floor():
    provided = set(importlib.metadata.metadata("jax").get_all("Provides-Extra"))
    extras = PROJECT["optional-dependencies"]
    for extra, jax_extra in (("cuda", "cuda12"), ("tpu", "tpu")):
        assert extras[extra] == [f"jax[{jax_extra}]>={_jax_floor()}"]
        assert jax_extra in provided  # the installed JAX still offers that backend extra


def test_readme_installs_each_backend():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for extra in ("cuda", "tpu"):
        assert f'pip install -e ".[{extra}]"' in readme
