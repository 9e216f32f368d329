"""What every ``jaxrl-llm`` command shares on the console: our log lines on stderr, a quiet
start (no other library's advisories), and the exceptions a command reports as one ``error:``
line (exit 2) rather than a traceback."""

from __future__ import annotations

import logging
import os
import warnings

#: Errors of the user's input (config, data, paths): one ``error:`` line, exit code 2.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, KeyError)


def log_to_stderr() -> None:
    """Our INFO lines on stderr with their time, unless logging is configured already. Called
    before a subcommand's module is imported: importing orbax logs through absl, whose first
    record configures the root logger at WARNING (and this call would then do nothing)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")


def quiet_start() -> None:
    """Logging for a CLI run: our INFO lines, nobody else's advisories.

    A CPU run otherwise opens with JAX's note that no GPU/TPU backend was found, and, without
    PyTorch, transformers' note that only tokenizers are available; neither means anything to
    a JAX training run. Real warnings from our own code still show.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    log_to_stderr()
    for name in ("jax", "absl", "transformers", "orbax", "tensorboardX", "matplotlib"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="transformers")
    warnings.filterwarnings("ignore", category=FutureWarning)


__all__ = ["USER_ERRORS", "log_to_stderr", "quiet_start"]
