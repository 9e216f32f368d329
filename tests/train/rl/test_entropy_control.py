"""An adaptive entropy coefficient in RL runs (issue 47: ``objective.overrides.entropy_target``,
Skywork-OR1 / TRL's ``use_adaptive_entropy``): the coefficient is train state.

With a target above any entropy the tiny policy reaches, every optimizer step raises the
coefficient by ``delta``; the bonus applies from the second step (TRL: not before an entropy
was measured). By hand, with ``entropy_coef = c0`` and one optimizer step a step, step ``n``
(1-based) applies ``0`` at ``n = 1`` and ``c0 + (n - 1) * delta`` after. A run stopped after 2
steps and resumed applies what the uninterrupted run applies at step 3 (the coefficient is in
the checkpoint), and LoRA and PPO's joint optimizer carry it too.
"""

from __future__ import annotations

import pytest

from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.rl.config import make_objective
from jaxrl_llm.train.rl.run import trainer_class
from tests.train.rl import rl_helpers

pytestmark = pytest.mark.slow

C0, DELTA = 0.001, 0.01
OBJECTIVE = (
    "objective.overrides={entropy_target: 10.0, entropy_coef: 0.001, "
    "entropy_coef_delta: 0.01, entropy_coef_bounds: [0.0, 1.0]}"
)


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with rl_helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


def _fit(run_dir, *extra):
    cfg = rl_helpers.tiny_config(
        None,
        run_dir,
        rl_helpers.SHAPED_REWARDS,
        OBJECTIVE,
        "model.compute_dtype=float32",
        "checkpoint.every_steps=1",
        *extra,
    )
    trainer_class(make_objective(cfg.objective))(cfg).fit()
    return [row["entropy_coef"] for row in read_metrics(run_dir)]


def test_the_coefficient_rises_each_step_and_resumes(tmp_path):
    want = [0.0, C0 + DELTA, C0 + 2 * DELTA]
    assert _fit(tmp_path / "whole", "trainer.max_steps=3") == pytest.approx(want, abs=1e-7)
    _fit(tmp_path / "resumed", "trainer.max_steps=2")
    resumed = _fit(tmp_path / "resumed", "trainer.max_steps=3", "resume=true")
    assert resumed[-1] == pytest.approx(want[-1], abs=1e-7)


@pytest.mark.parametrize(
    "extra",
    [
        ("model.lora={rank: 4, alpha: 8.0, targets: [q, v]}",),
        ("objective.name=ppo", "critic.optimizer=joint", "critic.warmup_steps=0"),
    ],
    ids=["lora", "ppo_joint"],
)
def test_lora_and_ppo_carry_the_coefficient(tmp_path, extra):
    got = _fit(tmp_path / "run", "trainer.max_steps=2", *extra)
    assert got == pytest.approx([0.0, C0 + DELTA], abs=1e-7)
