"""``jaxrl-llm train`` from the command line: a tiny run end to end, and user errors.

A user error (an unknown or mistyped key, a missing config or data file) exits with status 2
after one ``error:`` line naming the problem, and leaves no run directory behind.
"""

from __future__ import annotations

import json
import re

import pytest

from jaxrl_llm import cli
from jaxrl_llm.train.checkpoint import Checkpointer
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.rl.config import TrainConfig
from tests.train.helpers import assert_user_error
from tests.train.rl import rl_helpers


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with rl_helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


@pytest.mark.parametrize("config", [None, "grpo.yaml"], ids=["defaults", "grpo.yaml"])
def test_train_runs_end_to_end_and_prints_the_summary(tmp_path, capsys, config):
    run_dir = tmp_path / "run"
    overrides = [
        *rl_helpers.TINY,
        f"run_dir={run_dir}",
        "seed=3",
        "trainer.max_steps=2",
        "checkpoint.every_steps=1",
    ]
    config_path = None if config is None else rl_helpers.CONFIGS / config
    argv = ["train", *overrides] if config is None else ["train", str(config_path), *overrides]

    assert cli.main(argv) == 0

    summary = json.loads(capsys.readouterr().out)
    cfg = load_config(TrainConfig, config_path, overrides)
    assert cfg.seed == 3 and cfg.trainer.max_steps == 2
    rl_helpers.check_run_dir(run_dir, cfg, summary)
    rl_helpers.check_rows(read_metrics(run_dir), cfg)
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [1, 2]


def test_train_help_lists_the_overrides(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "jaxrl-llm train" in out
    for key in ("run_dir=", "seed=", "trainer.max_steps=", "checkpoint.every_steps="):
        assert key in out


@pytest.mark.parametrize(
    ("override", "message"),
    [
        pytest.param(
            "trainer.max_step=2",
            r"unknown config key 'trainer.max_step'; did you mean 'trainer.max_steps'\?",
            id="unknown_key",
        ),
        pytest.param(
            "rollout.group_sise=4", r"did you mean 'rollout.group_size'\?", id="misspelt_key"
        ),
        pytest.param(
            "trainer.max_steps=two",
            r"config key 'trainer.max_steps' expects an int, got str",
            id="int",
        ),
        pytest.param(
            "rollout.temperature=hot",
            r"config key 'rollout.temperature' expects a float",
            id="float",
        ),
        pytest.param("logging.plots=3", r"config key 'logging.plots' expects a bool", id="bool"),
    ],
)
def test_config_errors_name_the_key(tmp_path, capsys, override, message):
    run_dir = tmp_path / "run"
    assert_user_error(capsys, ["train", f"run_dir={run_dir}", override], message)
    assert not run_dir.exists()


def test_an_override_without_a_value_is_refused(capsys):
    assert_user_error(
        capsys,
        ["train", str(rl_helpers.CONFIGS / "grpo.yaml"), "trainer.max_steps"],
        r"malformed override 'trainer.max_steps'",
    )


def test_errors_in_a_yaml_file_name_the_dotted_key(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("trainer:\n  learning_rate: 1e-3\nrollout:\n  group_sise: 4\n")
    run_dir = tmp_path / "run"
    argv = ["train", str(path), f"run_dir={run_dir}"]
    assert_user_error(capsys, argv, r"did you mean 'rollout.group_size'\?")
    path.write_text("rollout:\n  prompts_per_step: [4]\n")
    assert_user_error(capsys, argv, r"config key 'rollout.prompts_per_step' expects an int")
    assert not run_dir.exists()


def test_a_missing_config_file_is_reported(tmp_path, capsys):
    assert_user_error(capsys, ["train", str(tmp_path / "missing.yaml")], "config file not found")


def test_a_missing_data_file_is_reported_and_leaves_no_run_directory(tmp_path, capsys):
    run_dir = tmp_path / "run"
    missing = tmp_path / "missing.jsonl"
    argv = [
        "train",
        str(rl_helpers.CONFIGS / "grpo.yaml"),
        *rl_helpers.TINY,
        f"run_dir={run_dir}",
        "data.task=jsonl",
        f"data.train_path={missing}",
    ]
    line = assert_user_error(capsys, argv, re.escape(str(missing)))
    assert "Traceback" not in line
    assert not run_dir.exists()


def test_an_existing_run_directory_is_kept_on_a_user_error(tmp_path, capsys):
    """The run directory is removed only when the refused run created it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    argv = [*rl_helpers.TINY, f"run_dir={run_dir}", "data.task=jsonl"]
    assert_user_error(capsys, ["train", *argv], r"data.task=jsonl needs data.train_path")
    assert (run_dir / "notes.txt").read_text() == "mine"


def nan_reward(prompt, completion, example):
    """A user's reward that returns NaN (the run must say so in one line, issue 46)."""
    return float("nan")


def test_a_failing_reward_is_one_error_line_and_its_traceback_goes_to_the_run_log(tmp_path, capsys):
    run_dir = tmp_path / "run"
    reward = f"{__name__}:nan_reward"
    argv = [*rl_helpers.TINY, f"run_dir={run_dir}", "trainer.max_steps=1"]
    capsys.readouterr()
    assert cli.main(["train", *argv, f"rewards=[{{name: {reward}}}]"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    lines = captured.err.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, captured.err
    assert re.fullmatch(
        rf"error: reward '{reward}' on row \d+ returned nan, expected a finite real number",
        errors[0],
    )
    # The rest is the completion it failed on, indented under it, and where the traceback is.
    assert all(line.startswith("  ") for line in lines[lines.index(errors[0]) + 1 :])
    log = run_dir / "error.log"
    assert lines[-1] == f"  traceback: {log} (--debug prints it here)"
    assert "Traceback" in log.read_text() and "RewardError" in log.read_text()


def test_debug_shows_a_user_errors_traceback(tmp_path):
    with pytest.raises(ValueError, match="unknown config key 'trainer.max_step'"):
        cli.main(["train", f"run_dir={tmp_path / 'run'}", "--debug", "trainer.max_step=2"])
