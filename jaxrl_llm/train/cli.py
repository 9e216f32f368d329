"""``jaxrl-llm train [CONFIG.yaml] [dotted.key=value ...]``.

The config's top-level ``job`` (or a ``job=...`` override; default ``rl``) picks the trainer:
``rl`` runs the RL loop (``train.config.TrainConfig``), ``preference`` and ``reward_model`` run
offline preference training (``train.preference_config.PreferenceConfig``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import yaml

from jaxrl_llm.train.config import TrainConfig
from jaxrl_llm.train.config_io import load_config, parse_yaml

JOBS = ("rl", "preference", "reward_model")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxrl-llm train",
        description=(
            "Run a training job. With no CONFIG, the built-in tiny CPU task: a tiny Llama-shaped "
            "model learns arithmetic (SFT warm-up, then GRPO). The config's top-level `job` "
            "picks the trainer: rl (default), preference (DPO / KTO / ORPO / SimPO / CPO) or "
            "reward_model (Bradley-Terry)."
        ),
        epilog="Overrides: run_dir=PATH seed=N trainer.max_steps=N checkpoint.every_steps=N "
        "resume=true mesh.data=2 mesh.fsdp=2 mesh.tensor=2 objective.name=dapo job=preference "
        "loss.name=kto ...",
    )
    parser.add_argument("config", nargs="?", help="YAML config (default: the built-in task)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    return parser


def resolve_job(config_path: str | os.PathLike | None, overrides: Sequence[str]) -> str:
    """The job a config runs: the last ``job=...`` override, else its top-level ``job``.

    A missing or unreadable file is left to ``load_config`` to report.

    Raises:
      ValueError: a job that is not one of ``JOBS``.
    """
    job: Any = "rl"
    if config_path is not None and os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            try:
                data = parse_yaml(f.read())
            except yaml.YAMLError:
                data = None
        if isinstance(data, dict) and "job" in data:
            job = data["job"]
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key.strip() == "job":
            job = parse_yaml(value)
    if job not in JOBS:
        raise ValueError(f"unknown job {job!r}: config key 'job' must be one of {JOBS}")
    return job


def train_main(argv: Sequence[str] | None = None) -> int:
    """Parses the command line, resolves the config and runs the job."""
    args = _parser().parse_args(argv)
    config_path, overrides = args.config, list(args.overrides)
    if config_path is not None and "=" in config_path:
        config_path, overrides = None, [config_path, *overrides]
    job = resolve_job(config_path, overrides)
    if job == "rl":
        cfg = load_config(TrainConfig, config_path, overrides)
    else:
        from jaxrl_llm.train.preference_config import PreferenceConfig  # noqa: PLC0415

        cfg = load_config(PreferenceConfig, config_path, overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # orbax logs every save step at INFO through absl.
    logging.getLogger("absl").setLevel(logging.WARNING)
    # JAX starts only when a job runs.
    if job == "rl":
        from jaxrl_llm.train.loop import run  # noqa: PLC0415
    else:
        from jaxrl_llm.train.preference import run  # noqa: PLC0415

    summary = run(cfg)
    print(json.dumps(summary, indent=2))
    return 0
