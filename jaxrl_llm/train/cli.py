"""``jaxrl-llm train [CONFIG.yaml] [dotted.key=value ...]``."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence

from jaxrl_llm.train.config import TrainConfig
from jaxrl_llm.train.config_io import load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxrl-llm train",
        description=(
            "Run an RL job. With no CONFIG, the built-in tiny CPU task: a tiny Llama-shaped model "
            "learns arithmetic (SFT warm-up, then GRPO)."
        ),
        epilog="Overrides: run_dir=PATH seed=N trainer.max_steps=N checkpoint.every_steps=N "
        "resume=true mesh.data=2 mesh.fsdp=2 mesh.tensor=2 objective.name=dapo ...",
    )
    parser.add_argument("config", nargs="?", help="YAML config (default: the built-in task)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    return parser


def train_main(argv: Sequence[str] | None = None) -> int:
    """Parses the command line, resolves the config and runs the job."""
    args = _parser().parse_args(argv)
    config_path, overrides = args.config, list(args.overrides)
    if config_path is not None and "=" in config_path:
        config_path, overrides = None, [config_path, *overrides]
    cfg = load_config(TrainConfig, config_path, overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # orbax logs every save step at INFO through absl.
    logging.getLogger("absl").setLevel(logging.WARNING)
    from jaxrl_llm.train.loop import run  # noqa: PLC0415  (JAX starts only when a job runs)

    summary = run(cfg)
    print(json.dumps(summary, indent=2))
    return 0
