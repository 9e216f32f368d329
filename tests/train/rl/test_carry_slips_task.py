"""The carry_slips task (``data.task: carry_slips``, ``configs/carry_slips.yaml``, issue 47):
the arithmetic prompts, with a warm-up on demonstrations that drop the units column's carry.

The learning run itself (warm-up → GRPO, ≥ 25 points of held-out accuracy) takes minutes and
is in benchmarks/RESULTS.md; here: the config, its checks, the loaded task, and a smoke run.
"""

from __future__ import annotations

import pytest

from jaxrl_llm import data
from jaxrl_llm.data.carry_slips import SLIP_RATE, slipped_answer
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.rl import tasks
from jaxrl_llm.train.rl.config import DataSection, TrainConfig, check_config
from jaxrl_llm.train.rl.run import run
from tests.train.rl import rl_helpers

CONFIG = rl_helpers.CONFIGS / "carry_slips.yaml"


def test_the_config_is_the_default_grpo_recipe_on_the_task():
    cfg = load_config(TrainConfig, CONFIG, [])
    default = load_config(TrainConfig, None, [])
    assert cfg.data == DataSection(task="carry_slips")  # the default task's sizes
    # The default task's GRPO settings; the schedule and the depth differ.
    assert cfg.objective == default.objective and cfg.rollout == default.rollout
    assert cfg.trainer.learning_rate == default.trainer.learning_rate
    assert (cfg.trainer.max_steps, cfg.sft_warmup.steps) == (300, 6000)
    assert cfg.model.tiny.num_hidden_layers == 3
    check_config(cfg)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.ops=['+', '*']"], r"data.task=carry_slips takes data.ops from \('\+', '-'\)"),
        (["data.task=carry_slip"], "data.task must be one of"),
    ],
)
def test_bad_settings_are_refused(overrides, message):
    cfg = load_config(TrainConfig, CONFIG, overrides)
    with pytest.raises(ValueError, match=message):
        check_config(cfg)


def test_the_loaded_task_holds_the_arithmetic_prompts_with_slipped_demonstrations():
    cfg = load_config(TrainConfig, CONFIG, ["data.num_train=2000", "data.eval_size=64"])
    train, held_out = tasks.load_task(cfg.data, seed=0)
    plain = tasks.load_task(
        load_config(TrainConfig, None, ["data.num_train=2000", "data.eval_size=64"]).data, seed=0
    )
    assert (len(train), len(held_out)) == (2000, 64)
    assert [(e.prompt, e.answer) for e in train + held_out] == [
        (e.prompt, e.answer) for e in plain[0] + plain[1]
    ]

    def slip(e):
        a, b = e.extra["operands"]
        return slipped_answer(a, e.extra["op"], b)

    carrying = [e for e in train if slip(e) is not None]
    slipped = sum(e.extra["slipped"] for e in carrying)
    assert abs(slipped / len(carrying) - SLIP_RATE) < 0.05
    for e in train:
        assert e.answer == str(eval(e.prompt[:-1]))
        # What the SFT warm-up trains on (train.rl.episodes.demonstration_batches).
        assert data.demonstration(e) == (str(slip(e)) if e.extra["slipped"] else e.answer)


def test_a_short_run_warms_up_on_the_slips_and_trains(tmp_path):
    """A few warm-up and GRPO steps of the recipe at tiny sizes (seconds)."""
    cfg = rl_helpers.tiny_config(
        CONFIG,
        tmp_path / "run",
        "sft_warmup.steps=20",
        "sft_warmup.batch_size=16",
        "trainer.max_steps=2",
        "trainer.eval_every=0",
        "checkpoint.every_steps=2",
    )
    summary = run(cfg)
    assert summary["sft_warmup_steps"] == 20
    assert set(summary["eval_before_rl"]) >= {"accuracy"} <= set(summary["eval_after_rl"])
    rows = rl_helpers.read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
