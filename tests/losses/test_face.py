"""The loss layer's face: ``jaxrl_llm.losses`` gathers the pure loss modules, and their old
paths at the package root stay the same module objects (one registry, one function each)."""

import importlib
import subprocess
import sys

import pytest

import jaxrl_llm
from jaxrl_llm import losses

MOVED = sorted(jaxrl_llm.MOVED_TO_LOSSES.items())


@pytest.mark.parametrize(("old", "new"), MOVED)
def test_every_old_path_is_the_new_module(old, new):
    module = getattr(losses, new)
    assert module.__name__ == f"jaxrl_llm.losses.{new}"
    assert importlib.import_module(f"jaxrl_llm.{old}") is module
    assert getattr(jaxrl_llm, old) is module
    assert new in losses.__all__


def test_from_imports_through_old_paths_give_the_same_objects():
    from jaxrl_llm.advantages import grpo  # noqa: PLC0415
    from jaxrl_llm.masked_stats import masked_mean  # noqa: PLC0415

    from jaxrl_llm import advantages, kl  # noqa: PLC0415

    assert kl is losses.kl
    assert advantages is losses.advantages
    assert grpo is losses.advantages.grpo
    assert masked_mean is losses.masked.masked_mean
    submodule = importlib.import_module("jaxrl_llm.advantages._outcome")
    assert submodule is sys.modules["jaxrl_llm.losses.advantages._outcome"]


def test_unknown_names_still_fail():
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        jaxrl_llm.nothing  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("jaxrl_llm.nothing")


def test_importing_the_package_does_not_import_jax():
    code = "import sys, jaxrl_llm; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_face_lists_each_module_once():
    assert sorted(losses.__all__) == sorted(set(losses.__all__))
    assert sorted(set(jaxrl_llm.MOVED_TO_LOSSES.values())) == sorted(losses.__all__)
