"""What every ``jaxrl-llm`` command shares on the console: our log lines on stderr, a quiet
start (no other library's advisories, no backend probing on a CPU machine, a host allocator
that keeps large buffers on a CPU-only one), and the exceptions a command reports as one
``error:`` line (exit 2) rather than a traceback."""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import logging
import os
import sys
import warnings

#: Errors of the user's input (config, data, paths): one ``error:`` line, exit code 2.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, KeyError)


def log_to_stderr() -> None:
    """Our INFO lines on stderr with their time, unless logging is configured already. Called
    before a subcommand's module is imported: importing orbax logs through absl, whose first
    record configures the root logger at WARNING (and this call would then do nothing)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")


def _accelerator_attached() -> bool | None:
    """Whether a TPU or GPU is attached (JAX's own probe: PCI ids of TPU chips, NVIDIA / ROCm
    device files, no backend started); None where this JAX cannot tell."""
    try:
        from jax._src import hardware_utils  # noqa: PLC0415  (JAX's own probe, no backend)

        tpu_chips = hardware_utils.num_available_tpu_chips_and_device_id()[0]
        gpu = hardware_utils.has_visible_nvidia_gpu() or os.path.exists("/dev/kfd")
    except (ImportError, AttributeError, OSError):
        return None
    return bool(tpu_chips or gpu)


def cpu_without_accelerators() -> bool:
    """Sets ``JAX_PLATFORMS=cpu`` where libtpu is installed on a machine without a TPU or a
    GPU, unless the user chose the platforms (``JAX_PLATFORMS``, ``JAX_FORCE_TPU_INIT``);
    returns whether it did.

    JAX otherwise probes every installed backend, and loading libtpu (the ``[tpu]`` extra,
    which ``jaxrl-llm plan``'s deviceless compiles need) on a CPU machine prints lines of
    initialisation errors before anything else. The check is JAX's own (PCI ids of attached
    TPU chips, NVIDIA / ROCm device files), so a TPU or GPU machine is left alone. Call it
    before the first JAX computation.
    """
    if "JAX_PLATFORMS" in os.environ or "JAX_FORCE_TPU_INIT" in os.environ:
        return False
    if importlib.util.find_spec("libtpu") is None:
        return False
    if _accelerator_attached() is not False:  # one is, or another JAX: leave the choice to it
        return False
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # imported already: its config read the environment then
        sys.modules["jax"].config.update("jax_platforms", "cpu")
    return True


# glibc's mallopt parameters (<malloc.h>).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: On a CPU-only run, blocks up to this size come from the heap (and freed ones stay there).
CPU_MMAP_THRESHOLD = 1 << 30
# What a user sets to tune glibc's allocator themselves (then left alone).
_MALLOC_ENV = ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_large_host_buffers() -> bool:
    """On a CPU-only run under glibc, serves blocks up to ``CPU_MMAP_THRESHOLD`` from the heap
    and keeps freed memory there (``mallopt``); returns whether it did.

    XLA:CPU allocates some kernels' scratch per call (a matmul's packed operands: a decode
    step's attention packs each layer's KV cache). glibc maps a block over its mmap threshold
    (32 MiB at most) fresh from the kernel and unmaps it on free, so such a call page-faults
    all of it in again every time: sampling 256 completions of up to 512 tokens from 64 slots
    ran 2x slower, a third of its time in the kernel (benchmarks/RESULTS.md, "GRPO step vs
    TRL GRPOTrainer"). Left alone: a run with an accelerator (its buffers are not host
    memory), another C library, and a user who tuned malloc (``GLIBC_TUNABLES``,
    ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``).
    """
    if any(name in os.environ for name in _MALLOC_ENV):
        return False
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms != "cpu" and (platforms or _accelerator_attached() is not False):
        return False
    path = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(path) if path else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        return False
    if mallopt is None or not hasattr(libc, "gnu_get_libc_version"):  # glibc's alone
        return False
    return bool(
        mallopt(_M_MMAP_THRESHOLD, CPU_MMAP_THRESHOLD)
        and mallopt(_M_TRIM_THRESHOLD, 2 * CPU_MMAP_THRESHOLD)
    )


def quiet_start() -> None:
    """Logging for a CLI run: our INFO lines, nobody else's advisories.

    A CPU run otherwise opens with JAX's note that no GPU/TPU backend was found (and with the
    ``[tpu]`` extra, libtpu's initialisation errors: :func:`cpu_without_accelerators`), and,
    without PyTorch, transformers' note that only tokenizers are available; none means anything
    to a JAX job. Real warnings from our own code still show. Call it before the first JAX
    computation.
    """
    cpu_without_accelerators()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    log_to_stderr()
    for name in ("jax", "absl", "transformers", "orbax", "tensorboardX", "matplotlib"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="transformers")
    warnings.filterwarnings("ignore", category=FutureWarning)


__all__ = [
    "CPU_MMAP_THRESHOLD",
    "USER_ERRORS",
    "cpu_without_accelerators",
    "keep_large_host_buffers",
    "log_to_stderr",
    "quiet_start",
]
