"""PPO with a critic (issue 8): value step, joint step, explained variance, the PPO run.

The critic is the transformer with a scalar head (``models.heads``); GAE comes from
``objectives.compute_advantages`` (tested against float64 references elsewhere); here the
pieces are wired together: the value loss fits returns, the critic saves and reloads, a run
resumes exactly, and PPO on the built-in task improves held-out accuracy.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models, objectives, parallel
from jaxrl_llm.models import heads
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.optim import make_optimizer
from jaxrl_llm.train.rl.ppo import (
    PPOTrainer,
    explained_variance,
    make_joint_step,
    make_value_fn,
    make_value_step,
)
from jaxrl_llm.train.setup import build_policy
from jaxrl_llm.train.state import create_train_state
from jaxrl_llm.train.step import jit_step
from jaxrl_llm.types import RolloutBatch, sequences_of
from tests.train.rl import rl_helpers
from tests.train.rl.critic_problem import CONFIG


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with rl_helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


def _batch(seed=0, rows=8, prompt=5, length=6):
    rng = np.random.default_rng(seed)
    prompt_mask = np.ones((rows, prompt), bool)
    prompt_mask[::2, :2] = False  # left padding
    lengths = rng.integers(1, length + 1, rows)
    mask = np.arange(length)[None] < lengths[:, None]
    returns = rng.normal(size=(rows, length)).astype(np.float32) * mask
    return RolloutBatch(
        completion_mask=mask,
        old_logprobs=np.zeros((rows, length), np.float32),
        advantages=rng.normal(size=(rows, length)).astype(np.float32) * mask,
        prompt_tokens=rng.integers(0, CONFIG.vocab_size, (rows, prompt)).astype(np.int32),
        prompt_mask=prompt_mask,
        completion_tokens=rng.integers(0, CONFIG.vocab_size, (rows, length)).astype(np.int32),
        old_values=np.zeros((rows, length), np.float32),
        returns=returns,
    )


def _value_state(optimizer, mesh):
    params = heads.init_scalar_params(CONFIG, jax.random.key(1))
    return create_train_state(
        CONFIG,
        optimizer,
        key=jax.random.key(2),
        mesh=mesh,
        params=params,
        params_axes=heads.scalar_logical_axes(CONFIG),
    )


def _reference_explained_variance(values, returns, mask):
    m = np.asarray(mask, bool)
    r = np.asarray(returns, np.float64)[m]
    v = np.asarray(values, np.float64)[m]
    return 1.0 - np.var(r - v) / np.var(r)


def test_explained_variance_matches_reference_and_edge_cases(rng):
    returns = rng.normal(size=(4, 5))
    values = returns + 0.3 * rng.normal(size=(4, 5))
    mask = rng.random((4, 5)) > 0.3
    got = explained_variance(values, returns, mask)
    assert got == pytest.approx(_reference_explained_variance(values, returns, mask), rel=1e-9)
    # Masked positions do not count, whatever they hold.
    junk = np.where(mask, values, 1e6)
    assert explained_variance(junk, returns, mask) == pytest.approx(got, rel=1e-9)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    # A constant critic explains nothing; constant returns and an empty mask give 0, not NaN.
    assert explained_variance(np.full_like(returns, 3.0), returns, mask) == pytest.approx(0.0)
    assert explained_variance(values, np.ones_like(returns), mask) == 0.0
    assert explained_variance(values, returns, np.zeros_like(mask)) == 0.0


def test_value_step_fits_the_returns_and_reports_value_metrics():
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    objective = objectives.make("ppo", value_clip=100.0)
    optimizer = make_optimizer(1e-2, max_grad_norm=None)
    state, shardings = _value_state(optimizer, mesh)
    step = jit_step(
        make_value_step(CONFIG, objective, optimizer, param_shardings=shardings.params), shardings
    )
    batch = _batch()
    losses = []
    for _ in range(30):
        state, metrics = step(state, batch)
        losses.append(float(metrics["vf_loss"]))
    assert set(metrics) >= {"vf_loss", "vf_clipfrac", "value_mean", "grad_norm"}
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.5 * losses[0]
    values = np.asarray(make_value_fn(CONFIG)(state.params, sequences_of(batch)))
    # Masked positions hold exactly 0; the fit explains most of the returns' variance.
    assert np.all(values[~batch.completion_mask] == 0.0)
    assert explained_variance(values, batch.returns, batch.completion_mask) > 0.5


def test_value_clip_fraction_matches_reference():
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    clip = 1e-2
    objective = objectives.make("ppo", value_clip=clip)
    optimizer = make_optimizer(1e-1, max_grad_norm=None)
    state, shardings = _value_state(optimizer, mesh)
    step = jit_step(make_value_step(CONFIG, objective, optimizer), shardings)
    batch = _batch()
    state, _ = step(state, batch)
    values = np.asarray(make_value_fn(CONFIG)(state.params, sequences_of(batch)), np.float64)
    # PPO's vf_clipfrac: share of valid tokens where the clipped branch is the larger loss.
    old = np.zeros_like(values)
    clipped = np.clip(values, old - clip, old + clip)
    returns = np.asarray(batch.returns, np.float64)
    mask = batch.completion_mask
    want = np.mean(((clipped - returns) ** 2 > (values - returns) ** 2)[mask])
    _, metrics = step(state, batch._replace(old_values=old.astype(np.float32)))
    assert float(metrics["vf_clipfrac"]) == pytest.approx(want, abs=1e-6)
    assert 0.0 < want < 1.0


def test_joint_step_updates_policy_and_value_with_one_optimizer():
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    objective = objectives.make("ppo")
    optimizer = make_optimizer(1e-2)
    policy = models.init_params(CONFIG, jax.random.key(0))
    params = {"policy": policy, "value": heads.init_scalar_params(CONFIG, jax.random.key(1))}
    state, shardings = create_train_state(
        CONFIG,
        optimizer,
        key=jax.random.key(2),
        mesh=mesh,
        params=params,
        params_axes={
            "policy": models.logical_axes(CONFIG),
            "value": heads.scalar_logical_axes(CONFIG),
        },
    )
    step = jit_step(make_joint_step(CONFIG, objective, optimizer), shardings)
    batch = _batch()
    new_state, metrics = step(state, batch)
    assert {"pg_loss", "vf_loss", "total_loss", "clip_frac"} <= set(metrics)
    assert float(metrics["total_loss"]) == pytest.approx(
        float(metrics["loss"]) + objective.value.coef * float(metrics["vf_loss"]), rel=1e-5
    )
    for name in ("policy", "value"):
        moved = jax.tree.map(
            lambda a, b: bool(jnp.any(a != b)), params[name], new_state.params[name]
        )
        assert any(jax.tree.leaves(moved)), f"{name} parameters did not move"


def _ppo_config(run_dir, *extra):
    return rl_helpers.tiny_config(
        rl_helpers.CONFIGS / "ppo.yaml",
        run_dir,
        rl_helpers.SHAPED_REWARDS,
        "trainer.max_steps=3",
        "critic.warmup_steps=1",
        *extra,
    )


class RecordingPPOTrainer(PPOTrainer):
    """Keeps the policy's and the critic's parameters as each step starts (host copies)."""

    def train_step(self, step, timer):
        if not hasattr(self, "before_step"):
            self.before_step = []
        self.before_step.append(jax.device_get((self.policy_params, self.value_params)))
        return super().train_step(step, timer)


@pytest.mark.slow
@pytest.mark.parametrize(
    "optimizer, init",
    # The critic's initial parameters and its optimizer are independent: each run has one of
    # each (``critic.init=reward_model`` has both optimizers below).
    [("separate", "policy"), ("joint", "random")],
    ids=["separate_policy_init", "joint_random_init"],
)
def test_ppo_run_warm_up_metrics_critic_saved_and_resume_exact(tmp_path, optimizer, init):
    """A 3-step run (critic warm-up of 1 step), its critic initialised from the policy or at
    random: its warm-up step leaves the policy in place and moves the critic, the rows hold
    finite value metrics, the critic is saved and reloads, and a run stopped after 2 steps
    resumes to the same metrics and critic."""
    straight_dir = tmp_path / "straight"
    critic = (f"critic.optimizer={optimizer}", f"critic.init={init}")
    cfg = _ppo_config(straight_dir, *critic)
    trainer = RecordingPPOTrainer(cfg)
    trainer.fit()
    # The critic's warm-up step (step 1): the policy did not move, the critic did.
    (initial, initial_values), (warmed, warmed_values) = trainer.before_step[:2]
    same = jax.tree.map(np.array_equal, initial, warmed)
    assert all(jax.tree.leaves(same))
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), initial_values, warmed_values)
    assert any(jax.tree.leaves(moved))
    rows = read_metrics(straight_dir)
    assert len(rows) == 3
    # Warm-up step: only the critic learns.
    assert "vf_loss" in rows[0] and "pg_loss" in rows[1]
    assert "pg_loss" not in rows[0]
    for row in rows:
        for key in ("vf_loss", "vf_clipfrac", "critic/explained_variance"):
            assert math.isfinite(row[key]), (key, row)
    # The critic is saved in the HF scalar-head layout and reloads to the same values.
    config, params = heads.load_scalar_model(straight_dir / "critic")
    host = jax.device_get(trainer.value_params)
    chex_equal = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), params, host)
    assert all(jax.tree.leaves(chex_equal))
    assert config.vocab_size == trainer.run.model_config.vocab_size
    # Beside it, the policy, as every job leaves it.
    assert (straight_dir / "hf" / "config.json").is_file()

    # 2 steps, stop, resume to 3: the same metrics (minus wall clock) and the same critic.
    resumed_dir = tmp_path / "resumed"
    PPOTrainer(_ppo_config(resumed_dir, *critic, "trainer.max_steps=2")).fit()
    resumed = PPOTrainer(_ppo_config(resumed_dir, *critic, "resume=true"))
    resumed.fit()
    assert rl_helpers.without_timing(read_metrics(resumed_dir)) == rl_helpers.without_timing(rows)
    same = jax.tree.map(
        lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
        jax.device_get(resumed.value_params),
        host,
    )
    assert all(jax.tree.leaves(same))


@pytest.mark.parametrize("optimizer", ["separate", "joint"])
def test_a_critic_initialised_from_a_reward_model(tmp_path, optimizer):
    """``critic.init=reward_model`` loads a saved scalar-head model (here a random one with a
    smaller MLP than the policy's, so the value model's own config must be used throughout)."""
    cfg = _ppo_config(tmp_path / "run", f"critic.optimizer={optimizer}", "trainer.max_steps=2")
    tokenizer, policy_config, _ = build_policy(cfg, None)
    rm_config = dataclasses.replace(policy_config, intermediate_size=32)
    rm_params = heads.init_scalar_params(rm_config, jax.random.key(5))
    heads.save_scalar_model(tmp_path / "rm", rm_config, rm_params, tokenizer=tokenizer)
    trainer = PPOTrainer(
        _ppo_config(
            tmp_path / "run",
            f"critic.optimizer={optimizer}",
            "trainer.max_steps=2",
            "critic.init=reward_model",
            f"critic.path={tmp_path / 'rm'}",
        )
    )
    trainer.fit()
    assert trainer.value_config.intermediate_size == 32
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2 and all(math.isfinite(r["vf_loss"]) for r in rows)
    saved_config, _ = heads.load_scalar_model(tmp_path / "run" / "critic")
    assert saved_config.intermediate_size == 32


def test_ppo_config_errors(tmp_path):
    with pytest.raises(ValueError, match="critic.init"):
        PPOTrainer(_ppo_config(tmp_path / "a", "critic.init=nonsense"))
    with pytest.raises(ValueError, match="critic.path"):
        PPOTrainer(_ppo_config(tmp_path / "b", "critic.init=reward_model"))
    with pytest.raises(ValueError, match="critic.optimizer"):
        PPOTrainer(_ppo_config(tmp_path / "c", "critic.optimizer=shared"))
    with pytest.raises(ValueError, match="gae"):
        PPOTrainer(rl_helpers.tiny_config(rl_helpers.CONFIGS / "grpo.yaml", tmp_path / "d"))
