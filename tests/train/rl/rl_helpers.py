"""Shared pieces of the RL-job tests: tiny configs, run checks (rows, summary, run directory).

The compilation cache and the other job-independent helpers live in ``tests.train.helpers``.
"""

from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import pytest

from jaxrl_llm.train.checkpoint import Checkpointer
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.rl.config import TrainConfig, make_objective
from jaxrl_llm.train.rl.spec import resolve
from jaxrl_llm.train.rl.updates import on_policy_update
from jaxrl_llm.train.setup import build_policy
from tests.train.helpers import (  # noqa: F401  (re-exported for the RL tests)
    CONFIGS,
    cache_env,
    persistent_compilation_cache,
    read_json,
    read_jsonl,
    single_device_env,
    without_timing,
)

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

# The phases every RL step times (``time/<phase>`` seconds), and those that count tokens
# (``tokens_per_s/<phase>``); ``tokens_per_s`` is the sampler's throughput, as the bar shows.
STEP_PHASES = ("rollout", "scoring", "logprobs", "advantages", "update")
TOKEN_PHASES = ("rollout", "logprobs", "update")
TIMING_KEYS = (
    *(f"time/{p}" for p in STEP_PHASES),
    "time/step",
    *(f"tokens_per_s/{p}" for p in TOKEN_PHASES),
    "tokens_per_s",
)

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
SAMPLE_KEYS = {"step", "prompt", "completion", "reward", "correct"}


def distillation_teacher(path: str | os.PathLike, alphabet: str | None = None, seed: int = 3):
    """A transformers Llama with random weights saved at ``path`` with the built-in character
    tokenizer (``alphabet``: another one): a teacher for ``objective.name=distill`` on the built-in
    task. Returns the torch model."""
    from jaxrl_llm import data  # noqa: PLC0415
    from tests.models import hf_utils  # noqa: PLC0415

    alphabet = alphabet or data.ARITHMETIC_ALPHABET
    return hf_utils.build_char_checkpoint("llama", path, alphabet, seed=seed)


def tiny_config(
    config_path: str | os.PathLike | None, run_dir: str | os.PathLike, *overrides: str
) -> TrainConfig:
    """A YAML config (or the defaults) with the tiny settings, ``run_dir`` and ``overrides``."""
    return load_config(TrainConfig, config_path, [*TINY, f"run_dir={run_dir}", *overrides])


def expected_keys(cfg: TrainConfig) -> set[str]:
    """The keys a step row of this config must hold."""
    objective = make_objective(cfg.objective)
    keys = {"step", *ROW_KEYS}
    if objective.surrogate.name in CLIPPING_SURROGATES:
        keys.add("clip_frac")
    if objective.needs_reference and objective.kl.kind is not None:
        keys.add("kl")
    if objective.advantage.dynamic_sampling:
        keys.update(DYNAMIC_KEYS)
    return keys


def model_vocab_size(cfg: TrainConfig) -> int:
    """The vocabulary size of the model a built-in-task config trains."""
    _, model_config, _ = build_policy(cfg, None)
    return model_config.vocab_size


def _check_timing(row: dict[str, float], cfg: TrainConfig, reference: bool) -> None:
    """Phase seconds add up within the step; each throughput is its phase's tokens / seconds."""
    step = row["step"]
    for key in TIMING_KEYS:
        assert row[key] >= 0.0, key
    evaluated = bool(cfg.trainer.eval_every) and step % cfg.trainer.eval_every == 0
    assert ("time/evaluation" in row) == evaluated, step
    assert ("eval/accuracy" in row) == evaluated, step
    # A checkpoint's time shows in the row after it (a fresh run's rows only).
    saved_before = step > 1 and (step - 1) % cfg.checkpoint.every_steps == 0
    assert ("time/checkpoint" in row) == saved_before, step
    inside = sum(row.get(f"time/{p}", 0.0) for p in (*STEP_PHASES, "evaluation"))
    assert row["time/step"] >= inside
    # Tokens of the step's batch: sampled once, scored by the policy (and the reference), then
    # seen once per epoch by the update.
    tokens = row["completion_length_mean"] * cfg.rollout.prompts_per_step * cfg.rollout.group_size
    # The behaviour forward is skipped for an on-policy update (one epoch, one minibatch).
    behaviour = 0 if on_policy_update(resolve(cfg, training=False)) else 1
    teacher = int(cfg.teacher.path is not None)  # on-policy distillation's teacher forward
    passes = {
        "rollout": 1,
        "logprobs": behaviour + reference + teacher,
        "update": cfg.trainer.epochs,
    }
    for phase, count in passes.items():
        got = row[f"tokens_per_s/{phase}"] * row[f"time/{phase}"]
        assert got == pytest.approx(tokens * count, rel=1e-6), (phase, got, tokens * count)
    assert row["tokens_per_s"] == row["tokens_per_s/rollout"]
    assert row["tokens_per_s"] > 0.0


def check_rows(
    rows: Sequence[dict[str, float]], cfg: TrainConfig, *, vocab_size: int | None = None
) -> None:
    """One finite row per step with the expected keys, each value in its possible range.

    ``vocab_size`` bounds the entropy; ``None`` = the built-in model's.
    """
    vocab_size = model_vocab_size(cfg) if vocab_size is None else vocab_size
    assert [row["step"] for row in rows] == list(range(1, cfg.trainer.max_steps + 1))
    keys = expected_keys(cfg)
    reference = make_objective(cfg.objective).needs_reference
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
        _check_timing(row, cfg, reference)
        if "dynamic/dropped_groups" in keys:
            for key in DYNAMIC_KEYS:
                assert row[key] == int(row[key]) >= 0, key
            assert row["dynamic/filled_groups"] <= prompts


def check_summary(run_dir: pathlib.Path, summary: dict[str, Any], cfg: TrainConfig) -> None:
    """summary.json equals the returned summary and holds both evaluations and ``hf``."""
    assert read_json(run_dir / "summary.json") == summary
    for phase in ("eval_before_rl", "eval_after_rl"):
        result = summary[phase]
        assert set(result) >= {"accuracy", "reward_mean"}, phase
        assert 0.0 <= result["accuracy"] <= 1.0
        assert math.isfinite(result["reward_mean"])
    assert summary["job"] == "rl"
    assert summary["steps"] == cfg.trainer.max_steps
    assert summary["objective"] == cfg.objective.name
    assert pathlib.Path(summary["hf"]) == run_dir / "hf"


def check_samples(run_dir: pathlib.Path, cfg: TrainConfig) -> list[dict[str, Any]]:
    """``samples.jsonl``: one row per held-out prompt and evaluation, the steps in order."""
    rows = read_jsonl(run_dir / "samples.jsonl")
    assert rows, "samples.jsonl is empty"
    for row in rows:
        assert set(row) == SAMPLE_KEYS, row
        assert isinstance(row["prompt"], str) and isinstance(row["completion"], str)
        assert isinstance(row["correct"], bool) and math.isfinite(row["reward"])
    steps = [row["step"] for row in rows]
    assert steps == sorted(steps)
    assert len(rows) % cfg.data.eval_size == 0
    return rows


def check_run_dir(run_dir: pathlib.Path, cfg: TrainConfig, summary: dict[str, Any]) -> None:
    """config.yaml reloads equal, metrics/summary/samples are complete, the last step is
    checkpointed and the final policy is a Hugging Face checkpoint in ``hf/``."""
    assert load_config(TrainConfig, run_dir / "config.yaml") == cfg
    check_summary(run_dir, summary, cfg)
    check_samples(run_dir, cfg)
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (run_dir / "hf" / name).is_file(), name
    assert (run_dir / "checkpoints").is_dir()
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        assert ckpt.latest_step() == cfg.trainer.max_steps
