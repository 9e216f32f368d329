"""Every recipe config in configs/ runs a few RL steps of the built-in task (issue 7).

Each YAML is loaded as it is, plus the tiny settings of ``rl_helpers.TINY`` (and, except for
DAPO whose YAML has its own, a length-shaped reward so that the updates are not all zero).
A run must leave a complete run directory: one finite metrics row per step with the issue's
keys, a summary with both evaluations, a config.yaml that reloads equal, and a checkpoint.
"""

from __future__ import annotations

import pathlib

import pytest

from jaxrl_llm import objectives
from jaxrl_llm.train.config_io import load_config, parse_yaml
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.rl.config import TrainConfig
from jaxrl_llm.train.rl.run import run
from tests.train.rl import rl_helpers

# One config per preset of objectives.available().
RECIPES = objectives.available()
# PPO's critic warm-up would leave the policy untouched (and its metrics absent) for 2 steps.
EXTRA = {"ppo": ("critic.warmup_steps=0", "trainer.epochs=1", "trainer.minibatches=1")}
STEPS = 2


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with rl_helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


def test_every_built_in_recipe_config_is_covered():
    """An RL recipe added to configs/ must be added here (the real-model config, the tool task
    and preference and reward-model jobs have their own tests)."""
    built_in = {
        path.stem
        for path in rl_helpers.CONFIGS.glob("*.yaml")
        if not path.stem.startswith("qwen")
        and path.stem not in ("tiny_cpu", "tool_calculator", "carry_slips")
        and (parse_yaml(path.read_text()) or {}).get("job", "rl") == "rl"
    }
    assert built_in == set(RECIPES) == set(objectives.available())


def _recipe_config(name: str, run_dir):
    extra = () if name == "dapo" else (rl_helpers.SHAPED_REWARDS,)
    if name in ("distill", "distill_gkd"):  # a teacher on disk, with the built-in tokenizer
        teacher = pathlib.Path(run_dir).parent / "teacher"
        rl_helpers.distillation_teacher(teacher)
        extra = (f"teacher.path={teacher}",)
    return rl_helpers.tiny_config(
        rl_helpers.CONFIGS / f"{name}.yaml",
        run_dir,
        f"trainer.max_steps={STEPS}",
        *extra,
        *EXTRA.get(name, ()),
    )


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_runs_and_leaves_a_complete_run_dir(tmp_path, name):
    cfg = _recipe_config(name, tmp_path / name)
    assert cfg.objective.name == name
    summary = run(cfg)

    run_dir = tmp_path / name
    rl_helpers.check_run_dir(run_dir, cfg, summary)
    rows = read_metrics(run_dir)
    rl_helpers.check_rows(rows, cfg)
    objective = objectives.make(name, **dict(cfg.objective.overrides))
    first = rows[0]
    # One epoch of one minibatch: the update sees the policy that sampled, so the recomputed
    # log-probs must match the ones the step computes (ratio 1).
    assert abs(first["approx_kl"]) < 1e-5
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    if objective.needs_reference and objective.kl.kind is not None:
        # The frozen reference is the initial policy.
        assert abs(first["kl"]) < 1e-5
    # The shaped rewards differ within some group (the teacher's log-probs differ from the
    # student's), so the objective has a gradient.
    if objective.advantage.name == "none":  # GKD: the JSD term is the whole signal
        assert first["distill/jsd"] > 0.0
    else:
        if objective.advantage.name != "distill":
            assert first["reward_std"] > 0.0
        assert first["advantage_std"] > 0.0
    assert first["grad_norm"] > 0.0
    if objective.advantage.name in ("grpo", "rloo", "gpg", "reinforce_pp"):
        # Group baselines sum to zero within each group; REINFORCE++ whitens over the batch.
        assert abs(first["advantage_mean"]) < 1e-5
    rows_per_step = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    # The step must see every sampled token.
    assert first["num_tokens"] == pytest.approx(first["completion_length_mean"] * rows_per_step)


def test_tiny_cpu_config_matches_the_defaults():
    """configs/tiny_cpu.yaml documents what ``jaxrl-llm train`` runs with no config."""
    from_yaml = load_config(TrainConfig, rl_helpers.CONFIGS / "tiny_cpu.yaml", ["run_dir=x"])
    assert from_yaml == load_config(TrainConfig, None, ["run_dir=x"])
