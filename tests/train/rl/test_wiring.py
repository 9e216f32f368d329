"""Tests that catch a broken trainer (issue 17): what the PPO / PRIME update really receives.

The estimators are tested on their own against float64 references (tests/losses/test_advantages.py,
tests/objectives); these tests check the *wiring*: one real RL step runs, the batch its
``score`` hook builds and the minibatches handed to ``update`` are captured, and their
advantages (and PPO's returns and old values) must equal float64 NumPy references computed
from the captured rollout and the networks' parameters *independently* of the trainer's
forward paths (``models.logits`` / ``models.forward`` plus the NumPy log-softmax and value
head of ``tests.reference``). A critic whose values never reach GAE, or a PRM whose process
rewards never reach PRIME's estimator, changes the advantages and fails them; each test also
checks that its reference would differ under such a bug by far more than its tolerance.

Mutation seams (looked up at call time, so a module-level monkeypatch takes effect):
``jaxrl_llm.train.rl.ppo.make_value_fn`` (called in ``PPOTrainer.compile``) and
``jaxrl_llm.losses.implicit_prm.process_rewards`` (called in ``PRIMETrainer.score``).
"""

from __future__ import annotations

import functools

import chex
import jax
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.models import heads
from jaxrl_llm.train.core import PhaseTimer
from jaxrl_llm.train.rl.ppo import PPOTrainer
from jaxrl_llm.train.rl.prime import PRIMETrainer
from tests.reference import advantages as ref_adv
from tests.reference import heads as ref_heads
from tests.reference import logprobs as ref_lp
from tests.reference import objectives as ref_obj
from tests.train.rl import rl_helpers

# float32 trainer arrays against float64 references (whitened advantages are O(1)).
ATOL = 2e-4
# A wiring bug must move the reference by this many tolerances (else the test proves nothing).
SENSITIVITY = 20


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with rl_helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


# -- independent forwards (float64 NumPy heads over the model's hidden states) ---------------


@functools.partial(jax.jit, static_argnums=1)
def _logits(params, config, tokens, mask):
    return models.logits(params, config, tokens, attention_mask=mask)


@functools.partial(jax.jit, static_argnums=1)
def _hidden(params, config, tokens, mask):
    return models.forward(params, config, tokens, attention_mask=mask)[0]


def _joined(batch):
    tokens = np.concatenate([batch.prompt_tokens, batch.completion_tokens], axis=1)
    mask = np.concatenate([batch.prompt_mask, batch.completion_mask], axis=1).astype(bool)
    return tokens.astype(np.int32), mask


def _logprobs(params, config, batch, temperature) -> np.ndarray:
    """``[B, T]`` float64 log-probs of the completion tokens (0 on padding)."""
    tokens, mask = _joined(batch)
    logits = np.asarray(_logits(params, config, tokens, mask), np.float64)
    lp, _ = ref_lp.completion_logprobs(
        logits,
        batch.prompt_tokens.shape[1],
        batch.completion_tokens,
        np.asarray(batch.completion_mask, bool),
        temperature=temperature,
    )
    return lp


def _values(value_params, value_config, batch) -> np.ndarray:
    """``[B, T]`` float64 critic values ``h_{P-1+t}·w`` (0 on padding)."""
    tokens, mask = _joined(batch)
    hidden = _hidden(value_params["backbone"], heads.backbone_config(value_config), tokens, mask)
    return ref_heads.token_values(
        np.asarray(hidden, np.float64),
        value_params["score"],
        batch.prompt_tokens.shape[1],
        np.asarray(batch.completion_mask, bool),
    )


# -- one captured step ---------------------------------------------------------------------


def _run_one_step(trainer, before_score):
    """Runs RL step 0 of a set-up trainer; returns ``(before, batch, minibatches)``.

    ``before`` is ``before_score(trainer)`` evaluated as ``score`` is entered (the parameters
    at rollout time), ``batch`` the host copy of what ``score`` returned, ``minibatches`` host
    copies of every batch handed to ``update``.
    """
    seen = {"minibatches": []}
    score, update = trainer.score, trainer.update

    def capture_score(step, samples, seqs, forwards, rewards):
        seen["before"] = before_score(trainer)
        batch, metrics = score(step, samples, seqs, forwards, rewards)
        seen["batch"] = jax.device_get(batch)
        return batch, metrics

    def capture_update(step, minibatch):
        seen["minibatches"].append(jax.device_get(minibatch))
        return update(step, minibatch)

    trainer.score, trainer.update = capture_score, capture_update
    trainer.train_step(0, PhaseTimer())
    return seen["before"], seen["batch"], seen["minibatches"]


def _close(trainer):
    trainer.checkpointer.close()
    trainer.metrics_writer.close()


def _check_minibatches_are_rows_of(batch, minibatches, epochs, fields):
    """Every minibatch row is a row of ``batch`` (same tokens, identical ``fields``); over the
    epochs each row is handed to ``update`` ``epochs`` times."""
    rows = batch.completion_mask.shape[0]
    keys = [
        (
            batch.prompt_tokens[i].tobytes(),
            batch.prompt_mask[i].tobytes(),
            batch.completion_tokens[i].tobytes(),
            batch.completion_mask[i].tobytes(),
        )
        for i in range(rows)
    ]
    used = np.zeros(rows, int)
    for mb in minibatches:
        for j in range(mb.completion_mask.shape[0]):
            key = (
                mb.prompt_tokens[j].tobytes(),
                mb.prompt_mask[j].tobytes(),
                mb.completion_tokens[j].tobytes(),
                mb.completion_mask[j].tobytes(),
            )
            # Identical rows (same prompt, same completion) have identical targets: any match.
            candidates = [i for i in range(rows) if keys[i] == key]
            assert candidates, "update got a row the rollout batch does not hold"
            i = min(candidates, key=lambda c: used[c])
            used[i] += 1
            for name in fields:
                np.testing.assert_array_equal(
                    getattr(mb, name)[j], getattr(batch, name)[i], err_msg=name
                )
    np.testing.assert_array_equal(used, np.full(rows, epochs))


# -- PPO: GAE of the critic's rollout-time values ----------------------------------------------


def test_ppo_update_gets_gae_of_the_rewards_kl_and_critic_values(tmp_path):
    """The ``ppo`` preset (k1 KL in the reward) with ``gamma``/``lam`` below 1, so both the
    advantages and the returns depend on the values; the reference is perturbed so that the
    KL penalty is not zero at step 0."""
    cfg = rl_helpers.tiny_config(
        rl_helpers.CONFIGS / "ppo.yaml",
        tmp_path / "run",
        rl_helpers.SHAPED_REWARDS,
        "trainer.max_steps=1",
        "objective.overrides={gamma: 0.9, lam: 0.8}",
    )
    trainer = PPOTrainer(cfg)
    try:
        trainer.setup()
        # pi_ref != pi_old, so the k1 penalty beta*(lp_old - lp_ref) enters the token rewards.
        trainer.reference = jax.tree.map(lambda x: x * 1.1, trainer.reference)
        (policy, reference, critic), batch, minibatches = _run_one_step(
            trainer,
            lambda t: jax.device_get((t.policy_params, t.reference, t.value_params)),
        )
        model_config, value_config = trainer.run.model_config, trainer.value_config
    finally:
        _close(trainer)
    objective = trainer.run.objective
    assert objective.advantage.name == "gae" and (
        objective.advantage.gamma,
        objective.advantage.lam,
    ) == (0.9, 0.8)
    assert objective.kl.placement == "reward" and objective.kl.kind == "k1"
    assert objective.kl.coef > 0

    mask = np.asarray(batch.completion_mask, bool)
    assert mask.sum(axis=1).min() >= 1 and mask.sum() >= 2 * mask.shape[0]
    temperature = cfg.rollout.temperature
    lp_old = _logprobs(policy, model_config, batch, temperature)
    lp_ref = _logprobs(reference, model_config, batch, temperature)
    np.testing.assert_allclose(batch.old_logprobs, lp_old, atol=ATOL)
    np.testing.assert_allclose(batch.ref_logprobs, lp_ref, atol=ATOL)

    # The critic (initialised from the policy's backbone) gives clearly non-zero values.
    values = _values(critic, value_config, batch)
    assert np.abs(values[mask]).mean() > 0.05, values
    np.testing.assert_allclose(batch.old_values, values, atol=ATOL)

    kl_penalty = objective.kl.coef * (lp_old - lp_ref) * mask  # k1 = lp - ref
    assert np.abs(kl_penalty[mask]).max() > 1e-3
    token_rewards = ref_obj.outcome_token_rewards(batch.rewards, mask) - kl_penalty
    want_adv, want_returns = ref_adv.gae(
        token_rewards, values, mask, gamma=objective.advantage.gamma, lam=objective.advantage.lam
    )
    chex.assert_shape([batch.advantages, batch.returns, batch.old_values], mask.shape)
    np.testing.assert_allclose(batch.advantages, want_adv, atol=ATOL, rtol=1e-4)
    np.testing.assert_allclose(batch.returns, want_returns, atol=ATOL, rtol=1e-4)

    # Zeroed values (or a dropped KL penalty) would move the targets far beyond the tolerance.
    zero_adv, zero_returns = ref_adv.gae(
        token_rewards,
        np.zeros_like(values),
        mask,
        gamma=objective.advantage.gamma,
        lam=objective.advantage.lam,
    )
    assert np.abs(zero_adv - want_adv).max() > SENSITIVITY * ATOL
    assert np.abs(zero_returns - want_returns).max() > SENSITIVITY * ATOL
    no_kl_adv, _ = ref_adv.gae(
        token_rewards + kl_penalty,
        values,
        mask,
        gamma=objective.advantage.gamma,
        lam=objective.advantage.lam,
    )
    assert np.abs(no_kl_adv - want_adv).max() > SENSITIVITY * ATOL

    # What update receives: rows of that batch, each once per epoch.
    assert len(minibatches) == cfg.trainer.epochs * cfg.trainer.minibatches
    _check_minibatches_are_rows_of(
        batch,
        minibatches,
        cfg.trainer.epochs,
        ("advantages", "returns", "old_values", "old_logprobs", "ref_logprobs", "rewards"),
    )


# -- PRIME: RLOO over the implicit PRM's process rewards plus RLOO over outcomes ----------------


def test_prime_update_gets_advantages_of_the_implicit_process_rewards(tmp_path):
    """``prime.update=before`` (the paper's order): the PRM takes one step on the step's labels,
    then scores the rollouts; the process rewards are ``beta*(lp_prm - lp_ref)`` from the PRM's
    parameters after that step and the reference's."""
    cfg = rl_helpers.tiny_config(
        rl_helpers.CONFIGS / "prime.yaml",
        tmp_path / "run",
        rl_helpers.SHAPED_REWARDS,
        "trainer.max_steps=1",
        "prime.update=before",
        "prime.learning_rate=1.0e-2",
        "objective.overrides={prime_beta: 0.5}",
    )
    trainer = PRIMETrainer(cfg)
    try:
        trainer.setup()
        (policy, reference), batch, minibatches = _run_one_step(
            trainer, lambda t: jax.device_get((t.policy_params, t.reference))
        )
        # The PRM is updated inside score (before scoring) and not again in the step.
        prm = jax.device_get(trainer.prm_state.params)
        model_config = trainer.run.model_config
    finally:
        _close(trainer)
    objective = trainer.run.objective
    assert objective.advantage.name == "prime" and objective.advantage.prime_beta == 0.5
    # No KL in the reward: the reference below has no KL term.
    assert objective.kl.placement != "reward" or not objective.kl.coef

    mask = np.asarray(batch.completion_mask, bool)
    assert mask.sum(axis=1).min() >= 1
    temperature = cfg.rollout.temperature
    if trainer.on_policy:  # one epoch, one minibatch: the update takes its own log-probs
        assert batch.old_logprobs is None
    else:
        np.testing.assert_allclose(
            batch.old_logprobs, _logprobs(policy, model_config, batch, temperature), atol=ATOL
        )
    lp_ref = _logprobs(reference, model_config, batch, temperature)
    np.testing.assert_allclose(batch.ref_logprobs, lp_ref, atol=ATOL)
    lp_prm = _logprobs(prm, model_config, batch, temperature)
    dense = objective.advantage.prime_beta * (lp_prm - lp_ref) * mask
    # The trained PRM has moved away from the reference: the process rewards are not all ~0.
    assert np.abs(dense[mask]).mean() > 1e-3, dense

    group_size = cfg.rollout.group_size
    want_adv, _ = ref_obj.prime_advantages(batch.rewards, dense, mask, group_size=group_size)
    chex.assert_shape(batch.advantages, mask.shape)
    np.testing.assert_allclose(batch.advantages, want_adv, atol=ATOL, rtol=1e-4)
    zero_adv, _ = ref_obj.prime_advantages(
        batch.rewards, np.zeros_like(dense), mask, group_size=group_size
    )
    assert np.abs(zero_adv - want_adv).max() > SENSITIVITY * ATOL

    assert len(minibatches) == cfg.trainer.epochs * cfg.trainer.minibatches
    carried = ("advantages", "rewards") + (() if trainer.on_policy else ("old_logprobs",))
    _check_minibatches_are_rows_of(batch, minibatches, cfg.trainer.epochs, carried)
