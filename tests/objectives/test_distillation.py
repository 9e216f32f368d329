"""On-policy distillation's estimators (``distill``, ``grpo_distill``) against float64 NumPy:
the teacher term ``coef * (lp_teacher - lp_old)`` per valid token, GRPO's group advantage
added on every valid token, masked positions exactly 0, and the inputs they require."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl_llm import advantages, objectives

B, T, G = 4, 5, 2


def _batch(rng):
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]], float)
    old = rng.normal(-2.0, 1.0, (B, T))
    teacher = rng.normal(-2.0, 1.0, (B, T))
    old[mask == 0] = np.nan  # padding never leaks
    rewards = np.array([1.0, 0.0, 0.5, 0.5])
    return rewards, mask, old, teacher


def test_distillation_is_the_scaled_log_prob_gap_on_valid_tokens(rng):
    _, mask, old, teacher = _batch(rng)
    got = np.asarray(advantages.distillation(old, teacher, mask, coef=0.5))
    want = np.where(mask > 0, 0.5 * (teacher - np.nan_to_num(old)), 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.all(got[mask == 0] == 0.0)


def test_distillation_refuses_shapes_that_differ(rng):
    _, mask, old, teacher = _batch(rng)
    with pytest.raises(ValueError, match="teacher_logprobs shape"):
        advantages.distillation(old, teacher[:, :3], mask)


def test_the_distill_estimator_ignores_the_reward(rng):
    rewards, mask, old, teacher = _batch(rng)
    objective = objectives.make("distill", distill_coef=2.0)
    adv, returns = objectives.compute_advantages(
        objective, rewards, mask, group_size=G, old_logprobs=old, teacher_logprobs=teacher
    )
    assert returns is None
    want = np.where(mask > 0, 2.0 * (teacher - np.nan_to_num(old)), 0.0)
    np.testing.assert_allclose(np.asarray(adv), want, rtol=1e-6, atol=1e-6)
    again, _ = objectives.compute_advantages(
        objective,
        rewards[::-1].copy(),
        mask,
        group_size=G,
        old_logprobs=old,
        teacher_logprobs=teacher,
    )
    np.testing.assert_array_equal(np.asarray(again), np.asarray(adv))


def test_grpo_distill_adds_the_group_advantage_on_every_valid_token(rng):
    rewards, mask, old, teacher = _batch(rng)
    objective = objectives.make("grpo", advantage="grpo_distill", distill_coef=0.25)
    adv, _ = objectives.compute_advantages(
        objective, rewards, mask, group_size=G, old_logprobs=old, teacher_logprobs=teacher
    )
    # GRPO by hand: groups (1, 0) and (0.5, 0.5); std with ddof 1, eps 1e-6 as the spec's.
    group = np.array([1 / np.sqrt(0.5) / 1.0, -1 / np.sqrt(0.5) / 1.0, 0.0, 0.0]) * 0.5
    outcome = np.asarray(advantages.grpo(rewards, group_size=G))
    np.testing.assert_allclose(outcome, group, rtol=1e-5)
    want = np.where(mask > 0, group[:, None] + 0.25 * (teacher - np.nan_to_num(old)), 0.0)
    np.testing.assert_allclose(np.asarray(adv), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("missing", ["old_logprobs", "teacher_logprobs"])
def test_the_estimators_name_a_missing_input(rng, missing):
    rewards, mask, old, teacher = _batch(rng)
    arrays = {"old_logprobs": old, "teacher_logprobs": teacher}
    del arrays[missing]
    with pytest.raises(ValueError, match=f"the distill estimator needs {missing}"):
        objectives.compute_advantages(
            objectives.make("distill"), rewards, mask, group_size=G, **arrays
        )


def test_distill_coef_must_not_be_negative():
    with pytest.raises(ValueError, match="distill_coef"):
        objectives.make("distill", distill_coef=-1.0)
