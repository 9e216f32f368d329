"""``jaxrl-llm train`` dispatches on the config's ``job``: RL, preference or reward model."""

from __future__ import annotations

import json

import pytest

from jaxrl_llm import cli
from jaxrl_llm.train.checkpoint import Checkpointer
from jaxrl_llm.train.cli import resolve_job, train_main
from jaxrl_llm.train.config import TrainConfig
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.preference_config import PreferenceConfig
from tests.train import rl_helpers

CONFIGS = rl_helpers.CONFIGS
# The settings of test_preference.py: the runs share compiled programs through the cache.
TINY = (
    "sft_warmup.steps=0",
    "data.num_train=16",
    "data.eval_size=16",
    "trainer.batch_size=8",
    "trainer.learning_rate=5e-3",
    "logging.progress=false",
    "logging.plots=false",
    "logging.tensorboard=false",
    "mesh.fsdp=1",
)
PREFERENCE_CONFIGS = ("dpo.yaml", "kto.yaml", "orpo.yaml", "simpo.yaml", "cpo.yaml")


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with rl_helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


def test_train_main_runs_a_dpo_config(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = [str(CONFIGS / "dpo.yaml"), *TINY, "trainer.max_steps=2", f"run_dir={run_dir}"]
    assert train_main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["job"] == "preference" and summary["loss"] == "dpo" and summary["steps"] == 2
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    saved = load_config(PreferenceConfig, run_dir / "config.yaml")
    assert saved == load_config(PreferenceConfig, CONFIGS / "dpo.yaml", argv[1:])
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        assert ckpt.latest_step() == 2


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
    from jaxrl_llm.train.preference_config import check_config  # noqa: PLC0415

    cfg = load_config(PreferenceConfig, CONFIGS / name)
    check_config(cfg)
    assert cfg.data.task == "arithmetic" and cfg.run_dir == f"runs/{name[:-5]}"


def test_an_rl_config_may_say_job_rl():
    cfg = load_config(TrainConfig, CONFIGS / "grpo.yaml", ["job=rl"])
    assert cfg.job == "rl"


def test_an_unknown_job_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"unknown job 'sft': config key 'job' must be one of"):
        cli.main(["train", f"run_dir={tmp_path}", "job=sft"])
    path = tmp_path / "bad.yaml"
    path.write_text("job: distill\nrun_dir: x\n")
    with pytest.raises(ValueError, match=r"unknown job 'distill'"):
        cli.main(["train", str(path)])
    assert not (tmp_path / "config.yaml").exists()


def test_a_job_override_switches_the_config_schema(tmp_path):
    # The RL recipe's keys do not exist in a preference config, and the errors say so.
    with pytest.raises(ValueError, match=r"unknown config key 'objective'"):
        cli.main(["train", str(CONFIGS / "grpo.yaml"), "job=preference", f"run_dir={tmp_path}"])
    with pytest.raises(ValueError, match=r"job 'reward_model' trains with loss.name=bradley_terry"):
        cli.main(["train", str(CONFIGS / "dpo.yaml"), "job=reward_model", f"run_dir={tmp_path}"])
    with pytest.raises(ValueError, match=r"did you mean 'loss.beta'\?"):
        cli.main(["train", str(CONFIGS / "dpo.yaml"), "loss.betta=0.2", f"run_dir={tmp_path}"])
    assert not (tmp_path / "config.yaml").exists()
