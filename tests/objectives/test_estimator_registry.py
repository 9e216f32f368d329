"""Tests of jaxrl_llm.objectives.estimator_registry: user advantage estimators.

User estimators are defined here, registered from outside the package, and compared with
float64 NumPy references (tests/reference/objectives.py), through ``compute_advantages`` and
the jitted ``advantage_fn``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import objectives
from jaxrl_llm.objectives import make
from tests.objectives.helpers import G, compute, rollout_data
from tests.reference import objectives as ref

pytestmark = pytest.mark.usefixtures("restore_registries")


@dataclasses.dataclass(frozen=True)
class MinBaselineParams:
    """The estimator's own hyper-parameter, declared at registration."""

    scale: float = 1.0


def min_baseline(advantage, inputs):
    """``scale·(r_i − min_{j∈g} r_j)`` on the KL-penalised sequence rewards."""
    groups = inputs.sequence_rewards().reshape(-1, inputs.group_size)
    advantages = advantage.params.scale * (groups - groups.min(axis=1, keepdims=True))
    return advantages.reshape(-1), None


def discounted_minus_values(advantage, inputs):
    """Returns ``R_t = Σ_{u≥t} γ^(u−t)·r_u`` of the token rewards; advantages ``R − V``."""
    positions = jnp.arange(inputs.mask.shape[1])
    offsets = positions[None, :] - positions[:, None]  # [t, u] = u - t
    discounts = jnp.where(offsets >= 0, advantage.gamma ** jnp.maximum(offsets, 0), 0.0)
    returns = (inputs.token_rewards() @ discounts.T) * inputs.mask
    return (returns - inputs.values) * inputs.mask, returns


def _run_both(objective, roll, **arrays):
    """``compute_advantages`` and the jitted ``advantage_fn`` on the same rollout."""
    eager = compute(objective, roll, **arrays)
    inputs = {
        "old_logprobs": roll["old"],
        "ref_logprobs": roll["ref"],
        "values": roll["values"],
        **arrays,
    }
    jitted = objectives.advantage_fn(objective, group_size=G)(
        roll["rewards"], roll["mask"], **inputs
    )
    return eager, jitted


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_user_sequence_estimator_matches_reference(kl_coef, rng):
    objectives.register_estimator("min_baseline", min_baseline, params=MinBaselineParams)
    objective = make(
        "grpo",
        advantage="min_baseline",
        kl_kind="k1",
        kl_coef=kl_coef,
        kl_placement="reward",
        advantage_params={"scale": 2.0},
    )
    roll = rollout_data(rng)
    penalised = roll["rewards"] - kl_coef * np.sum(
        (roll["old"].astype(np.float64) - roll["ref"]) * roll["mask"], axis=1
    )
    want = ref.min_baseline_advantages(penalised, group_size=G, scale=2.0)
    for advantages, returns in _run_both(objective, roll):
        assert returns is None
        np.testing.assert_allclose(np.asarray(advantages), want, rtol=1e-5, atol=1e-6)


def test_user_token_estimator_with_returns_matches_reference(rng):
    objectives.register_estimator("discounted", discounted_minus_values, requires=("values",))
    objective = make("ppo", advantage="discounted", gamma=0.9)  # k1 KL in the reward, 0.05
    assert objective.needs_critic
    roll = rollout_data(rng)
    mask = roll["mask"]
    token_rewards = (
        ref.outcome_token_rewards(roll["rewards"], mask)
        - 0.05 * (roll["old"].astype(np.float64) - roll["ref"]) * mask
    )
    want_returns = ref.discounted_returns(token_rewards, mask, gamma=0.9)
    want = (want_returns - roll["values"]) * mask
    for advantages, returns in _run_both(objective, roll):
        np.testing.assert_allclose(np.asarray(returns), want_returns, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(advantages), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="the discounted estimator needs values"):
        compute(objective, roll, values=None)


def test_registration_rules():
    assert objectives.register_estimator("min_baseline", min_baseline) is min_baseline
    assert objectives.estimators_available()[-1] == "min_baseline"
    assert objectives.ADVANTAGES is objectives.ESTIMATORS
    assert objectives.ADVANTAGES["min_baseline"].fn is min_baseline
    with pytest.raises(ValueError, match="'min_baseline' is already registered"):
        objectives.register_estimator("min_baseline", discounted_minus_values)
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        objectives.register_estimator("grpo", min_baseline)
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'min_basline'.*'grpo'"):
        make("grpo", advantage="min_basline")
    with pytest.raises(ValueError, match="built in"):
        objectives.unregister_estimator("prime")
    objectives.unregister_estimator("min_baseline")
    with pytest.raises(ValueError, match="unknown advantage estimator 'min_baseline'"):
        make("grpo", advantage="min_baseline")


def test_bad_registrations_are_refused():
    with pytest.raises(ValueError, match=r"unknown inputs \['critic'\]"):
        objectives.register_estimator("mine", min_baseline, requires=("critic",))
    with pytest.raises(ValueError, match="min_group_size"):
        objectives.register_estimator("mine", min_baseline, min_group_size=0)
    with pytest.raises(ValueError, match="needs a name"):
        objectives.register_estimator(min_baseline)
    assert "mine" not in objectives.ESTIMATORS


def test_registration_flags_reach_the_objective():
    objectives.register_estimator(
        "prm_like", min_baseline, requires="process_rewards", needs_reference=True
    )
    objective = make("dapo", advantage="prm_like")
    assert objective.needs_reference and not objective.needs_critic
    assert objectives.ESTIMATORS["prm_like"].requires == ("process_rewards",)


def test_malformed_estimator_output_is_a_clear_error(rng):
    objectives.register_estimator("bare", lambda advantage, inputs: inputs.rewards)
    objectives.register_estimator("wide", lambda advantage, inputs: (inputs.rewards[:3], None))
    roll = rollout_data(rng)
    with pytest.raises(ValueError, match=r"'bare' must return \(advantages, returns \| None\)"):
        compute(make("dapo", advantage="bare"), roll)
    with pytest.raises(ValueError, match=r"advantages must have shape \[B\]"):
        compute(make("dapo", advantage="wide"), roll)
