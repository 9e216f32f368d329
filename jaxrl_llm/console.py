"""What every ``jaxrl-llm`` command shares on the console: our log lines on stderr, a quiet
start (no other library's advisories, no backend probing on a CPU machine), and the exceptions
a command reports as one ``error:`` line (exit 2) rather than a traceback."""

from __future__ import annotations

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
    try:
        from jax._src import hardware_utils  # noqa: PLC0415  (JAX's own probe, no backend)

        tpu_chips = hardware_utils.num_available_tpu_chips_and_device_id()[0]
        gpu = hardware_utils.has_visible_nvidia_gpu() or os.path.exists("/dev/kfd")
    except (ImportError, AttributeError, OSError):  # another JAX: leave the choice to it
        return False
    if tpu_chips or gpu:
        return False
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # imported already: its config read the environment then
        sys.modules["jax"].config.update("jax_platforms", "cpu")
    return True


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


__all__ = ["USER_ERRORS", "cpu_without_accelerators", "log_to_stderr", "quiet_start"]
