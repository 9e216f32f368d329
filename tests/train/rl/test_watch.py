"""A run that cannot learn is said at once and stopped with advice (issue 46, item 2).

``StepWatch`` on hand-written step metrics (warn the first step without signal, stop at the
``patience``-th in a row, a step with signal resets the count, 0 never stops, cut completions
warned once); ``group_size_gives_signal`` against the estimators' own arithmetic (GRPO's
``r - mean`` of a group of one is 0, RLOO's leave-one-out needs two); then ``jaxrl-llm train``
itself: GRPO with ``rollout.group_size=1`` warns before training and stops at
``trainer.stop_without_signal`` with one ``error:`` line and exit 2, while a run with signal
trains on.
"""

from __future__ import annotations

import logging

import pytest

from jaxrl_llm import objectives
from jaxrl_llm.train import cli
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.rl import watch
from tests.train.rl import rl_helpers

FLAT = {"advantage_min": 0.0, "advantage_max": 0.0, "zero_variance_frac": 1.0}
LIVE = {"advantage_min": -0.7, "advantage_max": 0.7, "zero_variance_frac": 0.5}


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_the_first_step_without_signal_is_warned_and_the_patience_th_stops(caplog):
    w = watch.StepWatch(patience=3, group_size=4, max_new_tokens=8)
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm"):
        w.observe(1, {**FLAT, "reward_mean": 0.0, "accuracy": 0.0})
        w.observe(2, FLAT)
        with pytest.raises(watch.NoLearningSignal) as info:
            w.observe(3, FLAT)
    (warned,) = _warnings(caplog)  # once, at the first step
    assert warned.startswith("step 1 has no learning signal: every group's completions got the")
    assert "after 3 such steps in a row" in warned
    message = str(info.value)
    assert message.startswith("no learning signal for 3 steps in a row (steps 1-3)")
    assert "trainer.stop_without_signal=0" in message and "\n" not in message


def test_a_step_with_signal_resets_the_count_and_patience_0_never_stops(caplog):
    w = watch.StepWatch(patience=2, group_size=4, max_new_tokens=8)
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm"):
        for step in range(1, 9):
            w.observe(step, FLAT if step % 2 else LIVE)  # never two flat steps in a row
    assert len(_warnings(caplog)) == 4  # each new streak is warned
    never = watch.StepWatch(patience=0, group_size=4, max_new_tokens=8)
    for step in range(1, 50):
        never.observe(step, FLAT)
    assert never.streak == 49


def test_only_exactly_zero_advantages_are_no_signal():
    assert watch.no_signal(FLAT)
    assert not watch.no_signal({"advantage_min": 0.0, "advantage_max": 1e-9})
    assert not watch.no_signal({"advantage_min": -1e-9, "advantage_max": 0.0})
    assert not watch.no_signal({})  # a trainer without advantage metrics is not judged


def test_the_diagnosis_names_group_size_1_and_equal_rewards():
    assert "rollout.group_size=1" in watch.diagnosis(FLAT, group_size=1)
    equal = watch.diagnosis({**FLAT, "reward_mean": 1.0, "accuracy": 1.0}, group_size=8)
    assert equal.startswith("every group's completions got the same reward (reward_mean 1")
    assert watch.diagnosis({**FLAT, "zero_variance_frac": 0.5}, 8) == (
        "every trained token's advantage is 0"
    )


def test_completions_cut_at_the_limit_are_warned_once(caplog):
    w = watch.StepWatch(patience=0, group_size=4, max_new_tokens=6)
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm"):
        w.observe(1, {**LIVE, "completion_clipped_frac": 0.5})  # not more than half: quiet
        w.observe(2, {**LIVE, "completion_clipped_frac": 0.98})
        w.observe(3, {**LIVE, "completion_clipped_frac": 1.0})
    assert _warnings(caplog) == [
        "step 2 cut 98% of its completions at rollout.max_new_tokens=6 (they end without the "
        "stop token): raise rollout.max_new_tokens"
    ]


@pytest.mark.parametrize(
    ("preset", "group_size", "signal"),
    [
        ("grpo", 1, False),  # r - mean(group of one) = 0
        ("grpo", 2, True),
        ("dr_grpo", 1, False),
        ("reinforce_pp", 1, True),  # a batch baseline: rows still differ
        ("ppo", 1, True),  # needs values: not probed, assumed
    ],
)
def test_group_size_gives_signal_follows_the_estimators_arithmetic(preset, group_size, signal):
    assert watch.group_size_gives_signal(objectives.make(preset), group_size) is signal


def test_train_with_group_size_1_warns_at_once_and_stops_with_advice(tmp_path, capsys, caplog):
    run_dir = tmp_path / "run"
    caplog.set_level(logging.WARNING, logger="jaxrl_llm")
    code = cli.train_main(
        [
            *rl_helpers.TINY,
            f"run_dir={run_dir}",
            "rollout.group_size=1",
            "rollout.prompts_per_step=8",
            "data.eval_size=8",
            "trainer.max_steps=6",
            "trainer.stop_without_signal=2",
            "logging.progress=false",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    warned = _warnings(caplog)
    assert warned[0].startswith(
        "rollout.group_size=1: the grpo estimator gives every completion advantage 0"
    )
    assert "step 1 has no learning signal: rollout.group_size=1: a group estimator" in warned[-1]
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert line.startswith("error: no learning signal for 2 steps in a row (steps 1-2)")
    assert "Traceback" not in err
    assert [row["step"] for row in read_metrics(run_dir)] == [1]  # stopped in step 2


def test_a_run_with_signal_is_not_warned(tmp_path, capsys, caplog):
    run_dir = tmp_path / "run"
    caplog.set_level(logging.WARNING, logger="jaxrl_llm")
    code = cli.train_main(
        [
            *rl_helpers.TINY,
            f"run_dir={run_dir}",
            rl_helpers.SHAPED_REWARDS,
            "trainer.max_steps=2",
            "trainer.stop_without_signal=1",
        ]
    )
    err = capsys.readouterr().err
    assert code == 0, err
    assert not [w for w in _warnings(caplog) if "signal" in w or "group_size" in w]
    rows = read_metrics(run_dir)
    assert len(rows) == 2 and all(r["advantage_max"] > 0 for r in rows)
