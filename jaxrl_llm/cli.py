"""The ``jaxrl-llm`` command line.

Subcommands are looked up lazily so ``jaxrl-llm --help`` starts without importing JAX.
Each subcommand module exposes ``<name>_main(argv) -> int`` and parses its own flags.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

from jaxrl_llm import __version__, user_code
from jaxrl_llm.console import keep_large_host_buffers, log_to_stderr, quiet_start

# subcommand -> (module, function, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "bench": ("jaxrl_llm.bench", "bench_main", "time loss presets (and your own) under jit"),
}


def _register_optional() -> None:
    """Adds the subcommands whose modules are present in this installation."""
    optional = {
        "train": ("jaxrl_llm.train.cli", "train_main", "run an RL / SFT / preference job"),
        "generate": ("jaxrl_llm.sampling.cli", "generate_main", "sample completions from a model"),
        "export": (
            "jaxrl_llm.train.cli",
            "export_main",
            "write a Hugging Face checkpoint of a run's policy",
        ),
        "eval": (
            "jaxrl_llm.train.rl.evaluate",
            "eval_main",
            "pass@k, maj@k, mean@k of a run's policy on held-out prompts",
        ),
        "sweep": (
            "jaxrl_llm.train.sweep",
            "sweep_main",
            "train objective variants x seeds and compare them in a table and a plot",
        ),
        "plan": (
            "jaxrl_llm.plan.cli",
            "plan_main",
            "compile a job for a TPU topology without one: memory, step time, MFU",
        ),
    }
    for name, (module, func, help_text) in optional.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            SUBCOMMANDS[name] = (module, func, help_text)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jaxrl-llm`` console script."""
    log_to_stderr()
    _register_optional()  # imports the subcommands' packages
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="jaxrl-llm",
        description="RL post-training of language models in JAX/Flax.",
    )
    parser.add_argument("--version", action="version", version=f"jaxrl-llm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, _, help_text) in sorted(SUBCOMMANDS.items()):
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in SUBCOMMANDS:
        args = parser.parse_args(argv)  # handles --help / --version / errors
        parser.print_help()
        return 0 if args.command is None and not argv else 2
    module, func, _ = SUBCOMMANDS[argv[0]]
    # The user's modules a config names (rewards, environments, losses) import from the working
    # directory and from the config's directory, without PYTHONPATH.
    config = next((a for a in argv[1:2] if a.endswith((".yaml", ".yml"))), None)
    user_code.add_search_paths(os.getcwd(), *([os.path.dirname(config) or "."] if config else []))
    quiet_start()  # before the subcommand starts JAX: no backend probing on a CPU machine
    keep_large_host_buffers()  # a CPU-only run's allocator (after quiet_start chose CPU)
    return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
