"""Tests of jaxrl_llm.objectives.estimation: compute_advantages and advantage_fn."""

from __future__ import annotations

import importlib

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import objectives
from jaxrl_llm.losses import advantages as adv_lib
from jaxrl_llm.objectives import make
from tests.objectives.helpers import B, G, T, compute, rollout_data
from tests.reference import objectives as ref

# --------------------------------------------------------------------------------------
# Advantages from an objective
# --------------------------------------------------------------------------------------


SEQUENCE_ESTIMATORS = {
    "grpo": lambda r, m: adv_lib.grpo(r, group_size=G),
    "rloo": lambda r, m: adv_lib.rloo(r, group_size=G),
    "gpg": lambda r, m: adv_lib.gpg(r, group_size=G),
    "pass_at_k": lambda r, m: adv_lib.pass_at_k(r, group_size=G),
    "opo": lambda r, m: adv_lib.opo(r, m, group_size=G),
    "reinforce_pp_baseline": lambda r, m: adv_lib.reinforce_pp_baseline(r, m, group_size=G),
    "remax": lambda r, m: adv_lib.remax(r, jnp.asarray([0.5, 0.5, 0.5, 1.0, 1.0, 1.0])),
}


@pytest.mark.parametrize("estimator", list(SEQUENCE_ESTIMATORS))
def test_compute_advantages_calls_the_estimator(estimator, rng):
    roll = rollout_data(rng)
    got, returns = compute(make("dapo", advantage=estimator), roll)
    want = SEQUENCE_ESTIMATORS[estimator](jnp.asarray(roll["rewards"]), jnp.asarray(roll["mask"]))
    assert returns is None
    chex.assert_shape(got, want.shape)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)


def test_compute_advantages_forwards_hyper_parameters(rng):
    roll = rollout_data(rng)
    rewards = jnp.asarray(roll["rewards"])
    got, _ = compute(make("dr_grpo"), roll)
    np.testing.assert_allclose(got, adv_lib.grpo(rewards, group_size=G, scale="none"), atol=1e-7)
    got, _ = compute(make("grpo", std_ddof=0, advantage_scale="batch"), roll)
    want = adv_lib.grpo(rewards, group_size=G, scale="batch", std_ddof=0)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_outcome_token_rewards_puts_the_reward_on_the_last_valid_token():
    mask = np.asarray([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0]], bool)
    rewards = np.asarray([0.5, 5.0, -1.25, 2.0], np.float32)
    got = objectives.outcome_token_rewards(jnp.asarray(rewards), jnp.asarray(mask))
    chex.assert_type(got, jnp.float32)
    want = np.asarray([[0, 0.5, 0, 0], [0, 0, 0, 0], [0, 0, 0, -1.25], [0, 0, 2.0, 0]])
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(want, ref.outcome_token_rewards(rewards, mask))
    # Integer rewards are not truncated into an integer array.
    got = objectives.outcome_token_rewards(jnp.asarray([3, 1, 2, 7]), jnp.asarray(mask))
    assert got.dtype == jnp.float32 and float(got[0, 1]) == 3.0
    with pytest.raises(ValueError, match="rewards"):
        objectives.outcome_token_rewards(jnp.zeros((3,)), jnp.asarray(mask))


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_token_level_estimators_without_kl(gamma, rng):
    roll = rollout_data(rng)
    mask = jnp.asarray(roll["mask"])
    outcome = jnp.asarray(ref.outcome_token_rewards(roll["rewards"], roll["mask"]), jnp.float32)
    got, returns = compute(make("reinforce_pp", kl_coef=0.0, gamma=gamma), roll)
    assert returns is None
    np.testing.assert_allclose(got, adv_lib.reinforce_pp(outcome, mask, gamma=gamma), atol=1e-6)
    got, returns = compute(make("ppo", kl_coef=0.0, gamma=gamma, lam=0.95), roll)
    want, want_returns = adv_lib.gae(outcome, roll["values"], mask, gamma=gamma, lam=0.95)
    np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(returns, want_returns, atol=1e-6)


@pytest.mark.parametrize("name", ["reinforce_pp", "ppo"])
def test_kl_in_reward_subtracts_beta_k1_of_old_and_ref(name, rng):
    roll = rollout_data(rng)
    objective = make(name)
    beta = ref.config(name)["kl_coef"]
    token_rewards = (
        ref.outcome_token_rewards(roll["rewards"], roll["mask"])
        - beta * (roll["old"].astype(np.float64) - roll["ref"]) * roll["mask"]
    ).astype(np.float32)
    mask = jnp.asarray(roll["mask"])
    got, returns = compute(objective, roll)
    if name == "reinforce_pp":
        want, want_returns = adv_lib.reinforce_pp(token_rewards, mask), None
    else:
        want, want_returns = adv_lib.gae(token_rewards, roll["values"], mask)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if want_returns is not None:
        np.testing.assert_allclose(returns, want_returns, rtol=1e-5, atol=1e-6)
    # The penalty matters: without it the advantages differ.
    no_kl, _ = compute(make(name, kl_coef=0.0), roll)
    assert not np.allclose(np.asarray(no_kl), np.asarray(got), atol=1e-4)


def test_kl_in_reward_for_a_sequence_estimator_uses_the_row_sum(rng):
    roll = rollout_data(rng)
    objective = make("grpo", kl_kind="k1", kl_coef=0.1, kl_placement="reward")
    penalised = roll["rewards"] - 0.1 * np.sum((roll["old"] - roll["ref"]) * roll["mask"], axis=1)
    got, _ = compute(objective, roll)
    want = adv_lib.grpo(jnp.asarray(penalised, jnp.float32), group_size=G)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_prime_matches_reference(rng):
    roll = rollout_data(rng)
    got, returns = compute(make("prime"), roll)
    chex.assert_shape((got, returns), (B, T))
    want, want_returns = ref.prime_advantages(
        roll["rewards"], roll["process"], roll["mask"], group_size=G
    )
    np.testing.assert_allclose(returns, want_returns, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got)[roll["mask"] == 0])


def test_prime_sign_on_a_constructed_case():
    # Groups of two equal-length rows; in each, the first row has the better outcome and the
    # better process rewards. Copies of one symmetric group keep the batch mean at 0.
    mask = np.ones((B, T), np.float32)
    better = np.linspace(0.05, 0.3, T, dtype=np.float32)
    process = np.tile(np.stack([better, -better]), (B // 2, 1))
    rewards = jnp.asarray(np.tile([1.0, 0.0], B // 2))
    got, returns = objectives.compute_advantages(
        make("prime"), rewards, mask, group_size=2, process_rewards=process
    )
    chex.assert_shape((got, returns), (B, T))
    assert np.all(np.asarray(returns)[0::2] > 0) and np.all(np.asarray(returns)[1::2] < 0)
    assert np.all(np.asarray(got)[0::2] > 0) and np.all(np.asarray(got)[1::2] < 0)


def test_compute_advantages_errors(rng):
    roll = rollout_data(rng)
    with pytest.raises(ValueError, match="values"):
        compute(make("ppo"), roll, values=None)
    with pytest.raises(ValueError, match="process_rewards"):
        compute(make("prime"), roll, process_rewards=None)
    with pytest.raises(ValueError, match="baseline_rewards"):
        compute(make("dapo", advantage="remax"), roll, baseline_rewards=None)
    for missing in ("old_logprobs", "ref_logprobs"):
        with pytest.raises(ValueError, match="old_logprobs and ref_logprobs"):
            compute(make("reinforce_pp"), roll, **{missing: None})
    with pytest.raises(ValueError, match="group_size"):
        objectives.compute_advantages(make("grpo"), roll["rewards"], roll["mask"], group_size=4)
    with pytest.raises(ValueError, match="rewards"):
        objectives.compute_advantages(make("grpo"), np.zeros(5), roll["mask"], group_size=1)
    with pytest.raises(ValueError, match="group_size"):
        objectives.compute_advantages(
            make("prime"),
            roll["rewards"],
            roll["mask"],
            group_size=1,
            process_rewards=roll["process"],
        )


# --------------------------------------------------------------------------------------
# advantage_fn: the objective and group size bound once per run
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["grpo", "ppo", "prime"])
def test_advantage_fn_equals_compute_advantages(name, rng, monkeypatch):
    roll = rollout_data(rng)
    # Traces counted (not the jit's C++ cache, which global state can bypass: a full CI run
    # once saw it empty after two calls).
    module = importlib.import_module("jaxrl_llm.objectives.estimation")
    traces, bound = [], module._bound_advantages
    monkeypatch.setattr(
        module, "_bound_advantages", lambda *a, **k: traces.append(1) or bound(*a, **k)
    )
    fn = objectives.advantage_fn(make(name), group_size=G)
    arrays = {"old_logprobs": roll["old"], "ref_logprobs": roll["ref"]}
    arrays.update(values=roll["values"], process_rewards=roll["process"])
    got, got_returns = fn(roll["rewards"], roll["mask"], **arrays)
    want, want_returns = compute(make(name), roll)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
    assert (got_returns is None) == (want_returns is None)
    if want_returns is not None:
        np.testing.assert_allclose(np.asarray(got_returns), np.asarray(want_returns), rtol=1e-6)
    # New values of the same shapes: no recompile.
    fn(roll["rewards"] + 1.0, roll["mask"], **arrays)
    assert len(traces) == 1


@pytest.mark.parametrize(
    "name, group_size, match",
    [
        ("prime", 1, r"prime estimator needs group_size >= 2.*group_size=1"),
        ("dapo", 1, r"pass_at_k estimator needs group_size >= 2.*group_size=1"),
        ("grpo", 0, "group_size must be a positive Python int, got 0"),
        ("grpo", 3.0, "group_size must be a positive Python int, got 3.0"),
        ("grpo", True, "group_size must be a positive Python int, got True"),
    ],
)
def test_advantage_fn_checks_the_group_size_when_built(name, group_size, match):
    objective = make(name, advantage="pass_at_k") if name == "dapo" else make(name)
    with pytest.raises(ValueError, match=match):
        objectives.advantage_fn(objective, group_size=group_size)


def test_advantage_fn_checks_the_batch_against_the_group_size_when_traced(rng):
    roll = rollout_data(rng)
    fn = objectives.advantage_fn(make("grpo"), group_size=4)
    with pytest.raises(ValueError, match="group_size=4 does not divide the batch size B=6"):
        fn(roll["rewards"], roll["mask"])


def test_advantage_fn_refuses_unknown_inputs_and_non_objectives(rng):
    roll = rollout_data(rng)
    fn = objectives.advantage_fn(make("grpo"), group_size=G)
    with pytest.raises(ValueError, match=r"unknown advantage input\(s\) \['value'\]"):
        fn(roll["rewards"], roll["mask"], value=roll["values"])
    with pytest.raises(ValueError, match="needs an Objective, got str"):
        objectives.advantage_fn("grpo", group_size=G)
