"""A learned reward model's scores as the RL reward: ``reward_model.normalize``.

``train.rl.context.normalize_scores`` against hand formulas in float64 NumPy — ``batch``:
``z_i = (s_i − mean(s)) / (std(s) + 1e-6)`` with the population std (divide by n) and the
epsilon added to the std, computed in float64 and returned as float32; ``none``: the scores as
float32 — and its edge cases. Then the wiring: an RL step whose reward is a saved reward model
(``reward_model.normalize=batch``, the default) puts ``weight · z`` of that model's scores of the
sampled completions into the update's batch.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from jaxrl_llm.models import heads
from jaxrl_llm.train.core import PhaseTimer
from jaxrl_llm.train.rl import context
from jaxrl_llm.train.rl.config import RM_NORMALIZE, check_config
from jaxrl_llm.train.rl.trainer import RLTrainer
from jaxrl_llm.train.setup import build_policy
from tests.train.rl import rl_helpers

EPSILON = 1e-6


def z_scores(scores) -> np.ndarray:
    """``(s − mean) / (sqrt(Σ (s − mean)² / n) + 1e-6)``, by hand in float64."""
    values = [float(s) for s in scores]
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / n)
    return np.array([(v - mean) / (std + EPSILON) for v in values])


def test_the_modes_are_batch_and_none():
    assert set(RM_NORMALIZE) == {"batch", "none"}


@pytest.mark.parametrize("size", [2, 3, 16, 257])
def test_batch_is_the_z_score_over_the_batch(rng, size):
    scores = rng.normal(3.0, 2.0, size=size).astype(np.float32)
    got = context.normalize_scores(scores, "batch")
    assert got.dtype == np.float32 and got.shape == (size,)
    np.testing.assert_allclose(got, z_scores(scores), rtol=1e-6, atol=1e-7)
    assert abs(float(np.mean(got, dtype=np.float64))) < 1e-6


def test_batch_uses_the_population_std_with_the_epsilon_added_to_it():
    # Two scores 2 apart: the population std is 1 (the sample std would be √2).
    got = context.normalize_scores(np.array([1.0, 3.0]), "batch")
    np.testing.assert_allclose(got, [-1.0 / (1.0 + EPSILON), 1.0 / (1.0 + EPSILON)], rtol=1e-7)
    # A spread as small as the epsilon: (±1e-6) / (1e-6 + 1e-6) = ±0.5 (an epsilon inside a
    # square root, sqrt(var + eps), would give ±0.001).
    got = context.normalize_scores(np.array([0.0, 2e-6]), "batch")
    np.testing.assert_allclose(got, [-0.5, 0.5], rtol=1e-6)


def test_batch_is_computed_in_float64():
    # Scores 1e9 + {0, 1, 2, 3}: float32 cannot tell them apart (its spacing there is 64).
    scores = 1e9 + np.arange(4.0)
    got = context.normalize_scores(scores, "batch")
    want = (np.arange(4.0) - 1.5) / (math.sqrt(1.25) + EPSILON)
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_none_returns_the_scores_as_float32(rng, dtype):
    scores = rng.normal(-1.0, 5.0, size=12).astype(dtype)
    got = context.normalize_scores(scores, "none")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, scores.astype(np.float32))


@pytest.mark.parametrize("value", [0.0, 3.7, -2.5e6])
def test_equal_scores_give_zeros_not_nan(value):
    # No spread: (s − mean) is exactly 0 and the epsilon keeps the division finite.
    got = context.normalize_scores(np.full(8, value), "batch")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, np.zeros(8, np.float32))


def test_a_lone_score_or_an_empty_batch_passes_through():
    # One score has no spread to whiten: kept as it is; an empty batch stays empty (no NaN
    # warning from the mean of nothing).
    np.testing.assert_array_equal(context.normalize_scores(np.array([4.25]), "batch"), [4.25])
    empty = context.normalize_scores(np.zeros(0), "batch")
    assert empty.dtype == np.float32 and empty.shape == (0,)


def test_an_unknown_mode_is_refused_naming_the_key(tmp_path):
    cfg = rl_helpers.tiny_config(None, tmp_path, "reward_model.normalize=zscore")
    with pytest.raises(ValueError, match=r"reward_model.normalize must be one of"):
        check_config(cfg)


# -- wiring: an RL step with a saved reward model as its reward -------------------------------

RM_WEIGHT = 0.5


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with rl_helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A random scalar-head model over the policy's tokenizer, its head drawn with std 1 so its
    scores spread far from a z-score (mean ≠ 0, std ≠ 1)."""
    path = tmp_path_factory.mktemp("rm") / "hf"
    cfg = rl_helpers.tiny_config(None, path.parent / "unused")
    tokenizer, model_config, _ = build_policy(cfg, None)
    params = heads.init_scalar_params(model_config, jax.random.key(3), score_std=1.0)
    heads.save_scalar_model(path, model_config, params, tokenizer=tokenizer)
    return path


class _Stop(Exception):
    """Raised once the step's batch is built: the update itself is not under test."""


def _first_batch(reward_model_dir, run_dir, monkeypatch, *overrides):
    """The samples of step 1 and the ``RolloutBatch`` the update would get."""
    cfg = rl_helpers.tiny_config(
        rl_helpers.CONFIGS / "grpo.yaml",
        run_dir,
        "rewards=[{name: math_match, weight: 0.0}]",
        f"reward_model.path={reward_model_dir}",
        f"reward_model.weight={RM_WEIGHT}",
        "rollout.max_new_tokens=4",
        *overrides,
    )
    trainer = RLTrainer(cfg)
    try:
        trainer.setup()
        seen = {}
        score = trainer.score

        def spy(step, samples, seqs, forwards, rewards):
            batch, metrics = score(step, samples, seqs, forwards, rewards)
            seen["samples"], seen["batch"] = samples, batch
            raise _Stop

        monkeypatch.setattr(trainer, "score", spy)
        with pytest.raises(_Stop):
            trainer.train_step(1, PhaseTimer())
    finally:
        trainer.checkpointer.close()
        trainer.metrics_writer.close()
    return cfg, seen["samples"], seen["batch"]


def _raw_scores(reward_model_dir, samples) -> np.ndarray:
    """The saved model's scores of the sampled completions (the library's forward)."""
    rm_config, rm_params = heads.load_scalar_model(reward_model_dir)
    score = jax.jit(heads.sequence_scores, static_argnums=1)
    return np.asarray(
        score(
            rm_params,
            rm_config,
            samples.prompt_tokens,
            samples.prompt_mask,
            samples.completion_tokens,
            samples.completion_mask,
        ),
        np.float64,
    )


def test_an_rl_step_feeds_z_scored_reward_model_scores_into_its_batch(
    reward_model_dir, tmp_path, monkeypatch
):
    cfg, samples, batch = _first_batch(reward_model_dir, tmp_path / "run", monkeypatch)
    assert cfg.reward_model.normalize == "batch"  # the default
    rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    raw = _raw_scores(reward_model_dir, samples)
    assert raw.shape == (rows,)
    # The scores are far from whitened already, so raw scores in the batch would show.
    assert abs(raw.mean()) > 0.1 or abs(raw.std() - 1.0) > 0.1, (raw.mean(), raw.std())
    want = z_scores(raw)
    np.testing.assert_allclose(samples.components["reward_model"], want, rtol=1e-4, atol=1e-4)
    # The rule reward has weight 0: the whole reward is weight · z, in the host samples and in
    # the device batch the update reads.
    np.testing.assert_allclose(samples.rewards, RM_WEIGHT * want, rtol=1e-4, atol=1e-4)
    batch_rewards = np.asarray(jax.device_get(batch.rewards))
    assert batch_rewards.shape == (rows,)
    np.testing.assert_allclose(batch_rewards, RM_WEIGHT * want, rtol=1e-4, atol=1e-4)
    assert abs(batch_rewards.mean()) < 1e-5
    np.testing.assert_allclose(batch_rewards.std(), RM_WEIGHT, rtol=1e-4)
