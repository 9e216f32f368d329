"""RL config: the micro-batch token budget (``trainer.micro_batch_tokens``), resolved and used."""

from __future__ import annotations

import dataclasses

import pytest

from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.rl.config import (
    CPU_FORWARD_TOKENS,
    CPU_MICRO_BATCH_TOKENS,
    TrainConfig,
    TrainerSection,
    check_config,
    forward_micro_batching,
    micro_batching,
)
from jaxrl_llm.train.rl.run import run
from jaxrl_llm.train.step import TokenBudget
from tests.train.rl import rl_helpers


def test_auto_budget_is_on_for_cpu_only():
    trainer = TrainerSection(micro_batches=2)
    assert micro_batching(trainer, "cpu") == TokenBudget(CPU_MICRO_BATCH_TOKENS, minimum=2)
    assert micro_batching(trainer, "tpu") == 2
    assert micro_batching(trainer, "gpu") == 2


def test_explicit_budget_applies_everywhere_and_null_turns_it_off():
    explicit = TrainerSection(micro_batches=1, micro_batch_tokens=8192)
    assert micro_batching(explicit, "tpu") == TokenBudget(8192, minimum=1)
    off = TrainerSection(micro_batches=3, micro_batch_tokens=None)
    assert micro_batching(off, "cpu") == 3


def test_forwards_take_the_budget_without_the_floor():
    trainer = TrainerSection(micro_batches=4)
    # auto on CPU: a larger budget than the update's (a forward keeps no activations).
    assert forward_micro_batching(trainer, "cpu") == TokenBudget(CPU_FORWARD_TOKENS)
    assert CPU_FORWARD_TOKENS == 4 * CPU_MICRO_BATCH_TOKENS == 16384
    # micro_batches sizes the update's kept activations; a frozen forward runs whole.
    assert forward_micro_batching(trainer, "tpu") == 1
    # A budget the user sets is the forwards' too.
    explicit = TrainerSection(micro_batches=4, micro_batch_tokens=2048)
    assert forward_micro_batching(explicit, "cpu") == TokenBudget(2048)


@pytest.mark.parametrize("value", ["0", "-4", "many"])
def test_bad_budgets_name_the_key(value):
    cfg = load_config(TrainConfig, None, ["run_dir=x", f"trainer.micro_batch_tokens={value}"])
    with pytest.raises(ValueError, match="trainer.micro_batch_tokens must be 'auto', null or"):
        check_config(cfg)


@pytest.mark.parametrize("value", ["auto", "null", "2048"])
def test_good_budgets_load(value):
    cfg = load_config(TrainConfig, None, ["run_dir=x", f"trainer.micro_batch_tokens={value}"])
    check_config(cfg)
    expected = {"auto": "auto", "null": None, "2048": 2048}[value]
    assert cfg.trainer.micro_batch_tokens == expected


@pytest.mark.slow
def test_the_trainer_updates_in_the_budgeted_micro_batches(tmp_path):
    """A 1-position budget: one row per micro-batch (16 rows -> 16), reported per step."""
    cfg = rl_helpers.tiny_config(
        None, tmp_path / "run", "trainer.max_steps=1", "trainer.micro_batch_tokens=1"
    )
    run(cfg)
    (row,) = read_metrics(tmp_path / "run")
    assert row["micro_batches"] == cfg.rollout.prompts_per_step * cfg.rollout.group_size == 16
    assert row["grad_norm"] > 0.0 or row["advantage_std"] == 0.0


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("rollout.engine=paged", r"rollout.engine must be one of \('static', 'continuous'\)"),
        ("rollout.slots=0", "rollout.slots"),
        ("rollout.burst=0", "rollout.burst"),
        ("rollout.tensor_parallel=0", r"rollout.tensor_parallel must be one of \('auto', 'tr"),
        ("rollout.tensor_parallel=fsdp", "rollout.tensor_parallel must be one of"),
    ],
)
def test_bad_rollout_engine_settings_name_the_key(override, match):
    cfg = load_config(TrainConfig, None, ["run_dir=x", override])
    with pytest.raises(ValueError, match=match):
        check_config(cfg)


def test_bad_rollout_logprobs_setting_names_the_key():
    cfg = load_config(TrainConfig, None, ["run_dir=x", "rollout.logprobs=trainer"])
    with pytest.raises(
        ValueError, match=r"rollout.logprobs must be one of \('recompute', 'sampler'\)"
    ):
        check_config(cfg)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("trainer.eval_k=0", "trainer.eval_k must be >= 1"),
        ("trainer.eval_temperature=-0.5", "trainer.eval_temperature must be >= 0"),
    ],
)
def test_bad_eval_settings_name_the_key(override, match):
    cfg = load_config(TrainConfig, None, ["run_dir=x", override])
    with pytest.raises(ValueError, match=match):
        check_config(cfg)


@pytest.mark.parametrize("value", ["0", "-0.3", "1.5", "nan"])
def test_a_bad_expected_length_fraction_names_the_key(value):
    cfg = load_config(TrainConfig, None, ["run_dir=x"])
    rollout = dataclasses.replace(cfg.rollout, expected_length_fraction=float(value))
    cfg = dataclasses.replace(cfg, rollout=rollout)
    with pytest.raises(ValueError, match=r"rollout.expected_length_fraction must be in \(0, 1\]"):
        check_config(cfg)


@pytest.mark.parametrize(("value", "expected"), [("null", None), ("0.3", 0.3), ("1", 1)])
def test_a_good_expected_length_fraction_loads(value, expected):
    cfg = load_config(TrainConfig, None, ["run_dir=x", f"rollout.expected_length_fraction={value}"])
    check_config(cfg)
    assert cfg.rollout.expected_length_fraction == expected
