"""Shared pieces of the RL-loop tests: tiny configs, a shared compilation cache, run checks.

The loop compiles a sampler, a log-prob program and a policy step per run; most programs are
the same from one tiny run to the next, so the tests share a persistent compilation cache
(in the session's temporary directory) and only an objective's own programs compile anew.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

from jaxrl_llm import objectives
from jaxrl_llm.train.checkpoint import Checkpointer
from jaxrl_llm.train.config import TrainConfig
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.loop import build_policy

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"

# One device (conftest fakes 8), no SFT, 4 prompts x 4 samples, 16 held-out prompts.
TINY = (
    "sft_warmup.steps=0",
    "data.eval_size=16",
    "data.num_train=200",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "logging.progress=false",
    "logging.plots=false",
    "logging.tensorboard=false",
    "mesh.fsdp=1",
)

# An untrained policy almost never answers correctly, so math_match alone gives all-zero
# advantages and zero gradients; a length penalty makes groups differ and the update non-trivial.
SHAPED_REWARDS = (
    "rewards=[{name: math_match}, {name: overlong, kwargs: {max_tokens: 6, buffer_tokens: 4}}]"
)

# Wall-clock metrics: they differ between otherwise identical runs.
TIMING_PREFIX = "time/"
TIMING_KEYS = ("time/rollout", "time/logprobs", "time/update", "time/step", "tokens_per_s")

# Keys every step row has, whatever the objective (issue 7).
ROW_KEYS = (
    "reward_mean",
    "reward_std",
    "accuracy",
    "advantage_mean",
    "advantage_std",
    "advantage_min",
    "advantage_max",
    "approx_kl",
    "entropy",
    "completion_length_mean",
    "completion_length_max",
    "completion_clipped_frac",
    "zero_variance_frac",
    *TIMING_KEYS,
)
CLIPPING_SURROGATES = ("ppo_clip", "cispo", "gmpo")
DYNAMIC_KEYS = ("dynamic/dropped_groups", "dynamic/filled_groups", "dynamic/attempts")


def tiny_config(
    config_path: str | os.PathLike | None, run_dir: str | os.PathLike, *overrides: str
) -> TrainConfig:
    """A YAML config (or the defaults) with the tiny settings, ``run_dir`` and ``overrides``."""
    return load_config(TrainConfig, config_path, [*TINY, f"run_dir={run_dir}", *overrides])


@contextlib.contextmanager
def persistent_compilation_cache(directory: str | os.PathLike) -> Iterator[None]:
    """Enables JAX's on-disk compilation cache for every program, then restores the settings."""
    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    previous = {name: getattr(jax.config, name) for name in names}
    jax.config.update("jax_compilation_cache_dir", os.fspath(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        for name, value in previous.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


def cache_env(directory: str | os.PathLike) -> dict[str, str]:
    """Environment variables giving a subprocess the same compilation cache."""
    return {
        "JAX_COMPILATION_CACHE_DIR": os.fspath(directory),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def without_timing(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metric rows without the wall-clock keys."""
    return [
        {k: v for k, v in row.items() if not k.startswith(TIMING_PREFIX) and k != "tokens_per_s"}
        for row in rows
    ]


def expected_keys(cfg: TrainConfig) -> set[str]:
    """The keys a step row of this config must hold."""
    objective = objectives.make(cfg.objective.name, **dict(cfg.objective.overrides))
    keys = {"step", *ROW_KEYS}
    if objective.surrogate in CLIPPING_SURROGATES:
        keys.add("clip_frac")
    if objective.needs_reference and objective.kl_kind is not None:
        keys.add("kl")
    if objective.dynamic_sampling:
        keys.update(DYNAMIC_KEYS)
    return keys


def model_vocab_size(cfg: TrainConfig) -> int:
    """The vocabulary size of the model a built-in-task config trains."""
    _, model_config, _ = build_policy(cfg, None)
    return model_config.vocab_size


def check_rows(
    rows: Sequence[dict[str, float]], cfg: TrainConfig, *, vocab_size: int | None = None
) -> None:
    """One finite row per step with the expected keys, each value in its possible range.

    ``vocab_size`` bounds the entropy; ``None`` = the built-in model's.
    """
    vocab_size = model_vocab_size(cfg) if vocab_size is None else vocab_size
    assert [row["step"] for row in rows] == list(range(1, cfg.trainer.max_steps + 1))
    keys = expected_keys(cfg)
    prompts = cfg.rollout.prompts_per_step
    for row in rows:
        step = row["step"]
        missing = keys - set(row)
        assert not missing, f"step {step} lacks {sorted(missing)}"
        bad = {k: v for k, v in row.items() if not math.isfinite(v)}
        assert not bad, f"step {step}: non-finite metrics {bad}"
        assert 0.0 <= row["accuracy"] <= 1.0
        assert row["reward_std"] >= 0.0
        assert row["advantage_min"] <= row["advantage_mean"] + 1e-6
        assert row["advantage_mean"] <= row["advantage_max"] + 1e-6
        assert row["advantage_std"] >= 0.0
        # zero_variance_frac counts whole groups of the first draw.
        assert 0.0 <= row["zero_variance_frac"] <= 1.0
        groups = row["zero_variance_frac"] * prompts
        assert math.isclose(groups, round(groups), abs_tol=1e-6)
        assert 0.0 <= row["completion_clipped_frac"] <= 1.0
        assert 0.0 <= row["completion_length_mean"] <= row["completion_length_max"]
        assert row["completion_length_max"] <= cfg.rollout.max_new_tokens
        assert 0.0 <= row["entropy"] <= math.log(vocab_size) + 1e-4
        if "clip_frac" in keys:
            assert 0.0 <= row["clip_frac"] <= 1.0
        for key in TIMING_KEYS:
            assert row[key] >= 0.0, key
        assert row["time/step"] >= row["time/rollout"]
        assert row["tokens_per_s"] > 0.0
        if "dynamic/dropped_groups" in keys:
            for key in DYNAMIC_KEYS:
                assert row[key] == int(row[key]) >= 0, key
            assert row["dynamic/filled_groups"] <= prompts


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def check_summary(run_dir: pathlib.Path, summary: dict[str, Any], cfg: TrainConfig) -> None:
    """summary.json equals the returned summary and holds both evaluations."""
    assert read_json(run_dir / "summary.json") == summary
    for phase in ("eval_before_rl", "eval_after_rl"):
        result = summary[phase]
        assert set(result) >= {"accuracy", "reward_mean"}, phase
        assert 0.0 <= result["accuracy"] <= 1.0
        assert math.isfinite(result["reward_mean"])
    assert summary["steps"] == cfg.trainer.max_steps
    assert summary["objective"] == cfg.objective.name


def check_run_dir(run_dir: pathlib.Path, cfg: TrainConfig, summary: dict[str, Any]) -> None:
    """config.yaml reloads equal, metrics/summary are complete, the last step is checkpointed."""
    assert load_config(TrainConfig, run_dir / "config.yaml") == cfg
    check_summary(run_dir, summary, cfg)
    assert (run_dir / "checkpoints").is_dir()
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        assert ckpt.latest_step() == cfg.trainer.max_steps
