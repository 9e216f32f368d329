"""On-policy distillation's estimators (``distill``, ``grpo_distill``) against float64 NumPy:
the teacher term ``coef * (lp_teacher - lp_old)`` per valid token, GRPO's group advantage
added on every valid token, masked positions exactly 0, and the inputs they require.

GKD's JSD loss term (``Objective.distill_loss="jsd"``): ``policy_loss`` plus ``coef ·
agg(JSD_β)`` of the student's and teacher's top-k log-probs, renormalised, against a float64
transcription (``tests.objectives.helpers.reference_top_k_jsd``) with every aggregation mode
and β at both ends and between, mixed with GRPO; micro-batches summing to the batch; empty
masks and k = 1; the ``distill_gkd`` preset and its ``none`` estimator."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import objectives
from jaxrl_llm.losses import advantages
from jaxrl_llm.types import RolloutBatch
from tests.objectives.helpers import AGGREGATIONS, assert_matches_reference, policy_data
from tests.reference import objectives as ref

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


# --------------------------------------------------------------------------------------
# GKD's JSD as a loss term (Objective.distill_loss="jsd"), the distill_gkd preset and the
# "none" estimator
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_the_jsd_term_mixes_with_grpo_as_the_float64_reference(rng, beta, aggregation):
    """GRPO's loss plus ``coef * agg(JSD_β)`` over the teacher's top-k, renormalised, with the
    whole batch's normalisers; the gradient w.r.t. the sampled-token log-probs is GRPO's."""
    objective = objectives.make(
        "grpo", distill_loss="jsd", jsd_beta=beta, distill_loss_coef=0.3, aggregation=aggregation
    )
    assert objective.needs_teacher
    assert_matches_reference(
        objective,
        ref.config("grpo", aggregation=aggregation),
        policy_data(rng),
        per_token=True,
        global_norm=True,
    )


def test_the_distill_gkd_preset_is_the_jsd_alone(rng):
    objective = objectives.make("distill_gkd")
    assert (objective.advantage.name, objective.distill.loss, objective.distill.jsd_beta) == (
        "none",
        "jsd",
        0.5,
    )
    assert (objective.distill.top_k, objective.distill.coef) == (None, 1.0)
    assert objective.needs_teacher and not objective.needs_reference
    data = policy_data(rng)
    assert_matches_reference(
        objective,
        ref.config("grpo", kl_kind=None, kl_coef=0.0, aggregation="token-mean"),
        data,
        global_norm=True,
    )
    rewards, mask, old, teacher = _batch(rng)
    adv, _ = objectives.compute_advantages(objective, rewards, mask, group_size=G)
    np.testing.assert_array_equal(np.asarray(adv), np.zeros(B))


def _jsd_case(rng, rows=6, width=5, k=3):
    mask = np.ones((rows, width), np.float32)
    mask[1, 2:] = mask[3, :] = mask[4, 4:] = 0
    lp = jnp.asarray(-rng.uniform(0.1, 2.0, (rows, width)), jnp.float32)
    batch = RolloutBatch(
        completion_mask=jnp.asarray(mask),
        old_logprobs=lp,
        advantages=jnp.zeros(rows, jnp.float32),  # distill_gkd's: the JSD alone
        teacher_top_logprobs=jnp.asarray(rng.normal(-2.0, 1.0, (rows, width, k)), jnp.float32),
    )
    student = jnp.asarray(rng.normal(-2.0, 1.0, (rows, width, k)), jnp.float32)
    return lp, batch, student, mask


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_of_the_jsd_term_sum_to_the_full_batch(rng, aggregation):
    objective = objectives.make("distill_gkd", aggregation=aggregation, distill_loss_coef=0.7)
    lp, batch, student, mask = _jsd_case(rng)
    num_tokens, num_seqs = (jnp.float32(x) for x in ref.normalisers(mask))
    batch = batch._replace(num_tokens=num_tokens, num_seqs=num_seqs)

    def run(rows):
        part = jax.tree.map(lambda x: x[rows] if jnp.ndim(x) else x, batch)

        def loss(s):
            out = objectives.policy_loss(objective, lp[rows], part, student_top_logprobs=s)
            return out.loss, out.metrics

        (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(student[rows])
        return float(value), metrics, np.asarray(grad)

    full = run(np.arange(6))
    halves = [run(np.arange(0, 6, 2)), run(np.arange(1, 6, 2))]
    assert sum(h[0] for h in halves) == pytest.approx(full[0], rel=1e-6)
    for key in ("distill/jsd", "distill/jsd_loss"):
        assert sum(float(h[1][key]) for h in halves) == pytest.approx(float(full[1][key]), 1e-6)
    grad = np.zeros_like(full[2])
    grad[0::2], grad[1::2] = halves[0][2], halves[1][2]
    np.testing.assert_allclose(grad, full[2], rtol=1e-6, atol=1e-9)
    assert not np.any(full[2][mask == 0]) and np.any(full[2] != 0)


def test_an_all_masked_batch_and_one_token_give_zero_and_no_nan(rng):
    lp, batch, student, mask = _jsd_case(rng)
    objective = objectives.make("distill_gkd")

    def loss_and_grads(b, s):
        def loss(x):
            return objectives.policy_loss(objective, lp, b, student_top_logprobs=x).loss

        return jax.value_and_grad(loss)(s)

    empty = batch._replace(completion_mask=jnp.zeros_like(batch.completion_mask))
    value, grad = loss_and_grads(empty, student.at[0, 0].set(jnp.nan))
    assert float(value) == 0.0 and not np.any(np.asarray(grad))
    one = batch._replace(teacher_top_logprobs=batch.teacher_top_logprobs[..., :1])
    value, grad = loss_and_grads(one, student[..., :1])  # k = 1: both sides are certain
    assert float(value) == 0.0 and np.all(np.isfinite(np.asarray(grad)))


def test_the_jsd_term_names_what_is_missing_or_wrong(rng):
    lp, batch, student, _ = _jsd_case(rng)
    objective = objectives.make("distill_gkd")
    with pytest.raises(ValueError, match="needs batch.teacher_top_logprobs"):
        objectives.policy_loss(objective, lp, batch)
    with pytest.raises(ValueError, match="needs batch.teacher_top_logprobs"):
        objectives.policy_loss(
            objective, lp, batch._replace(teacher_top_logprobs=None), student_top_logprobs=student
        )
    with pytest.raises(ValueError, match=r"shape mismatch: student_logprobs\(6, 5, 2\)"):
        objectives.policy_loss(objective, lp, batch, student_top_logprobs=student[..., :2])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"distill_loss": "kl"}, "distill_loss"),
        ({"distill_loss": "jsd", "jsd_beta": 1.5}, r"jsd_beta must be in \[0, 1\]"),
        ({"distill_loss": "jsd", "distill_top_k": 0}, "distill_top_k must be an int >= 1"),
        ({"distill_loss": "jsd", "distill_top_k": 2.5}, "distill_top_k must be an int >= 1"),
        ({"distill_loss": "jsd", "distill_loss_coef": -1.0}, "distill_loss_coef"),
    ],
)
def test_bad_jsd_settings_are_named(overrides, match):
    with pytest.raises(ValueError, match=match):
        objectives.make("grpo", **overrides)
