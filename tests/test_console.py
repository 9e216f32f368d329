"""A quiet start (``jaxrl_llm.console``): on a CPU machine no command prints JAX's backend
probing or libtpu's initialisation errors (the ``[tpu]`` extra, installed for ``plan``), so a
user error is the one ``error:`` line the README promises (issue 46).

The commands run as a user runs them: a subprocess without the test session's
``JAX_PLATFORMS=cpu`` or its 8 fake devices.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jaxrl_llm import console
from tests.train.helpers import single_device_env


def _user_env() -> dict[str, str]:
    return {k: v for k, v in single_device_env().items() if k != "JAX_PLATFORMS"}


def _jaxrl_llm(*args: str, cwd) -> subprocess.CompletedProcess:
    code = "import sys; from jaxrl_llm.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=_user_env(),
        cwd=cwd,
    )


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    """The built-in tiny model (random weights) as a Hugging Face directory."""
    import jax

    from jaxrl_llm.models.transformer import init_params
    from jaxrl_llm.train import export, setup
    from jaxrl_llm.train.rl.config import TrainConfig

    path = tmp_path_factory.mktemp("console") / "hf"
    tokenizer, config, _ = setup.build_policy(TrainConfig(), None)
    params = init_params(config, jax.random.key(0))
    export.export_policy(path, config, params, tokenizer, stop_ids=(tokenizer.eos_token_id,))
    return path


def test_train_user_error_after_the_backend_starts_is_one_line(tmp_path):
    result = _jaxrl_llm("train", f"run_dir={tmp_path / 'run'}", "mesh.data=3", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "error: cannot fill mesh axis 'fsdp': the other sizes {'data': 3, 'fsdp': -1, "
        "'tensor': 1} multiply to 3, which does not divide the 1 devices"
    ]


def test_eval_user_error_after_the_backend_starts_is_one_line(tmp_path, policy_dir):
    config = tmp_path / "eval.yaml"
    config.write_text(f"model: {{path: {policy_dir}}}\nmesh: {{data: 3}}\n")
    result = _jaxrl_llm("eval", str(config), "--k", "1", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot fill mesh axis"), lines


def test_generate_prints_only_its_completions_and_their_figures(tmp_path, policy_dir):
    argv = ("generate", str(policy_dir), "1+2=", "--max-new-tokens", "2", "--temperature", "0")
    result = _jaxrl_llm(*argv, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("1 requests, "), lines


def test_cpu_without_accelerators_only_where_jax_would_find_none(monkeypatch):
    from jax._src import hardware_utils

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("JAX_FORCE_TPU_INIT", raising=False)
    monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (4, 5))
    assert not console.cpu_without_accelerators()  # a TPU VM: JAX takes its TPU
    assert "JAX_PLATFORMS" not in os.environ
    monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (0, 0))
    monkeypatch.setattr(hardware_utils, "has_visible_nvidia_gpu", lambda: False)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert not console.cpu_without_accelerators()  # the user's choice stands
    assert os.environ["JAX_PLATFORMS"] == "cuda"
    monkeypatch.delenv("JAX_PLATFORMS")
    if console.importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed: nothing to quieten")
    assert console.cpu_without_accelerators()
    assert os.environ["JAX_PLATFORMS"] == "cpu"


# Allocates and frees 48 MiB (over glibc's largest mmap threshold, 32 MiB) ten times with
# malloc, as XLA:CPU does, touching every page, and prints the minor page faults that took:
# glibc's default maps the block fresh each time (48 MiB / 4 KiB pages = 12,288 faults a time);
# the heap reuses it.
_REALLOC_FAULTS = """
import ctypes, resource, sys
from jaxrl_llm import console
kept = console.keep_large_host_buffers() if sys.argv[1] == "tuned" else False
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
size = 48 << 20
def cycle():
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
cycle()
before = faults()
for _ in range(10):
    cycle()
print(kept, faults() - before)
"""


def _realloc_faults(mode: str, **env: str) -> tuple[bool, int]:
    result = subprocess.run(
        [sys.executable, "-c", _REALLOC_FAULTS, mode],
        capture_output=True,
        text=True,
        timeout=120,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}, **env},
    )
    assert result.returncode == 0, result.stderr
    kept, faults = result.stdout.split()
    return kept == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_cpu_run_reuses_large_host_buffers_instead_of_faulting_them_in_per_call():
    untuned = _realloc_faults("default", JAX_PLATFORMS="cpu")[1]
    kept, tuned = _realloc_faults("tuned", JAX_PLATFORMS="cpu")
    assert kept
    pages = 10 * (48 << 20) // 4096
    assert untuned >= pages // 2, untuned  # mapped fresh every time (4 KiB pages)
    assert tuned < pages // 20, tuned  # the first block's pages, reused


def test_large_host_buffers_are_left_to_accelerators_and_to_a_user_who_tuned_malloc(
    monkeypatch,
):
    from jax._src import hardware_utils

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert not console.keep_large_host_buffers()
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    assert not console.keep_large_host_buffers()
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (4, 5))
    assert not console.keep_large_host_buffers()  # a TPU VM, JAX_PLATFORMS unset
    # (Where it applies, the test above runs it in a process of its own.)
