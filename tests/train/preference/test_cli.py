"""``jaxrl-llm train`` dispatches on the config's ``job``: RL, preference or reward model.

User errors exit 2 with one ``error:`` line; a run refused after it opened its directory (and
before its first checkpoint) leaves no directory behind.
"""

from __future__ import annotations

import json

import pytest

from jaxrl_llm.train.checkpoint import Checkpointer
from jaxrl_llm.train.cli import resolve_job, train_main
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.preference.config import PreferenceConfig, check_config
from jaxrl_llm.train.rl.config import TrainConfig
from tests.train import helpers
from tests.train.helpers import assert_user_error
from tests.train.preference.preference_helpers import TINY  # test_trainer.py's settings

CONFIGS = helpers.CONFIGS
PREFERENCE_CONFIGS = ("dpo.yaml", "kto.yaml", "orpo.yaml", "simpo.yaml", "cpo.yaml")


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


def test_train_main_runs_a_dpo_config(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = [
        str(CONFIGS / "dpo.yaml"),
        *TINY,
        "trainer.max_steps=2",
        "logging.plots=true",
        f"run_dir={run_dir}",
    ]
    assert train_main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["job"] == "preference" and summary["loss"] == "dpo" and summary["steps"] == 2
    assert summary["hf"] == str(run_dir / "hf")
    assert (run_dir / "hf" / "config.json").is_file()
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    # Every row times its phases (the preference step is one "update" phase).
    for row in rows:
        assert row["time/step"] >= row["time/update"] > 0.0
    saved = load_config(PreferenceConfig, run_dir / "config.yaml")
    assert saved == load_config(PreferenceConfig, CONFIGS / "dpo.yaml", argv[1:])
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        assert ckpt.latest_step() == 2
    # The preference job's curves, its timeline, and the held-out accuracy from the
    # evaluations before and after training (no evaluation row in between).
    pngs = {p.name for p in (run_dir / "plots").glob("*.png")}
    curves = {"loss.png", "rewards_accuracies.png", "rewards_margins.png", "time_step.png"}
    assert pngs == curves | {"eval_rewards_accuracies.png", "timeline.png"}
    for name in pngs:
        assert (run_dir / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("config", "overrides", "job"),
    [
        (None, [], "rl"),
        ("grpo.yaml", [], "rl"),
        ("dpo.yaml", [], "preference"),
        ("reward_model.yaml", [], "reward_model"),
        ("grpo.yaml", ["job=rl"], "rl"),
        ("dpo.yaml", ["job=reward_model"], "reward_model"),
        (None, ["job=preference", "job=rl"], "rl"),
    ],
)
def test_the_job_comes_from_the_yaml_or_an_override(config, overrides, job):
    path = None if config is None else CONFIGS / config
    assert resolve_job(path, overrides) == job


@pytest.mark.parametrize("name", [*PREFERENCE_CONFIGS, "reward_model.yaml"])
def test_every_preference_config_loads_and_passes_its_checks(name):
    cfg = load_config(PreferenceConfig, CONFIGS / name)
    check_config(cfg)
    assert cfg.data.task == "arithmetic" and cfg.run_dir == f"runs/{name[:-5]}"


def test_an_rl_config_may_say_job_rl():
    cfg = load_config(TrainConfig, CONFIGS / "grpo.yaml", ["job=rl"])
    assert cfg.job == "rl"


def test_an_unknown_job_is_an_error(tmp_path, capsys):
    message = r"unknown job 'sft': config key 'job' must be one of"
    assert_user_error(capsys, ["train", f"run_dir={tmp_path}", "job=sft"], message)
    path = tmp_path / "bad.yaml"
    path.write_text("job: distill\nrun_dir: x\n")
    assert_user_error(capsys, ["train", str(path)], r"unknown job 'distill'")
    assert not (tmp_path / "config.yaml").exists()


def test_a_job_override_switches_the_config_schema(tmp_path, capsys):
    # The RL recipe's keys do not exist in a preference config, and the errors say so.
    grpo, dpo = str(CONFIGS / "grpo.yaml"), str(CONFIGS / "dpo.yaml")
    run_dir = f"run_dir={tmp_path}"
    assert_user_error(
        capsys, ["train", grpo, "job=preference", run_dir], r"unknown config key 'objective'"
    )
    assert_user_error(
        capsys,
        ["train", dpo, "job=reward_model", run_dir],
        r"job 'reward_model' trains with loss.name=bradley_terry",
    )
    assert_user_error(
        capsys, ["train", dpo, "loss.betta=0.2", run_dir], r"did you mean 'loss.beta'\?"
    )
    assert not (tmp_path / "config.yaml").exists()


def test_a_run_refused_after_opening_its_directory_leaves_none(tmp_path, capsys):
    """KTO's SFT warm-up trains on desirable completions: data with none is refused when the
    warm-up starts, after the run directory was opened; the directory goes with the run."""
    records = [
        {"prompt": f"{a}+{a}=", "completion": str(2 * a + 1), "label": False} for a in range(8)
    ]
    data_path = tmp_path / "undesirable.jsonl"
    data_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    run_dir = tmp_path / "run"
    argv = [
        "train",
        str(CONFIGS / "kto.yaml"),
        *TINY,
        f"run_dir={run_dir}",
        "data.task=jsonl",
        "data.unpaired=true",
        f"data.train_path={data_path}",
        f"data.eval_path={data_path}",
        "data.eval_size=8",
        "sft_warmup.steps=1",
        "sft_warmup.batch_size=8",
    ]
    assert_user_error(capsys, argv, r"sft_warmup needs desirable examples")
    assert not run_dir.exists()
