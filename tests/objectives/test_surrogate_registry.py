"""Tests of jaxrl_llm.objectives.surrogate_registry: user surrogates and ratio kinds.

User surrogates are defined here, registered from outside the package, and compared with
float64 NumPy references of their loss and gradient (tests/reference/objectives.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import objectives
from jaxrl_llm.objectives import make
from tests.objectives.helpers import (
    GRAD_ATOL,
    GRAD_RTOL,
    RTOL,
    assert_matches_reference,
    loss_and_grad,
    policy_data,
    reference_loss,
    rollout_batch,
)
from tests.reference import objectives as ref

pytestmark = pytest.mark.usefixtures("restore_registries")

# The smooth clip's indicator kinks, log(1 ± 0.2), are among the helpers' RATIO_KINKS.
EPS = 0.2


@dataclasses.dataclass(frozen=True)
class SoftClipParams:
    """The soft clip's own hyper-parameter, declared at registration."""

    eps: float = 0.2


def soft_clip(surrogate, inputs):
    """``−A·(1 + ε·tanh((r − 1)/ε))`` per token, ``ε = surrogate.params.eps``."""
    eps = surrogate.params.eps
    ratio = jnp.exp(inputs.log_ratio)
    adv = inputs.advantages[:, None] if inputs.advantages.ndim == 1 else inputs.advantages
    per_token = -adv * (1.0 + eps * jnp.tanh((ratio - 1.0) / eps))
    outside = (jnp.abs(ratio - 1.0) > eps).astype(jnp.float32)
    return per_token, {"soft_clip_frac": inputs.token_mean(outside)}


def sequence_reinforce(surrogate, inputs):
    """``mean_i(−A_i·mean_t lp)``, already reduced over the non-empty rows."""
    del surrogate
    valid = inputs.mask > 0
    lengths = jnp.maximum(jnp.sum(inputs.mask, axis=1), 1.0)
    mean_logprob = jnp.sum(jnp.where(valid, inputs.logprobs, 0.0), axis=1) / lengths
    return inputs.sequence_mean(-inputs.advantages * mean_logprob), {}


def _soft_clip_config(**overrides):
    return ref.config("grpo", surrogate=functools.partial(ref.soft_clip, eps=EPS), **overrides)


# --------------------------------------------------------------------------------------
# User surrogates against the float64 reference
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", ["token", "gspo_token"])
def test_user_surrogate_matches_reference(ratio, rng):
    objectives.register_surrogate("soft_clip", soft_clip, params=SoftClipParams)
    # The grpo preset brings k3 KL in the loss; the loss aggregates with its global normalisers.
    objective = make(
        "grpo",
        surrogate="soft_clip",
        ratio=ratio,
        entropy_coef=0.01,
        surrogate_params={"eps": EPS},
    )
    assert objective.surrogate.params == SoftClipParams(eps=EPS)
    cfg = _soft_clip_config(ratio=ratio, entropy_coef=0.01)
    assert_matches_reference(objective, cfg, policy_data(rng), per_token=True, global_norm=True)


def test_user_surrogate_under_jit_reads_its_hyper_parameter_statically(rng):
    objectives.register_surrogate("soft_clip", params=SoftClipParams)(soft_clip)  # decorator
    traces = []

    @functools.partial(jax.jit, static_argnums=0)
    def run(objective, logprobs, batch):
        traces.append(objective)
        return loss_and_grad(objective, logprobs, batch, None)

    data = policy_data(rng)
    args = (jnp.asarray(data["logprobs"]), rollout_batch(data))
    for eps in (EPS, 0.5):
        params = SoftClipParams(eps=eps)  # a typed instance works as the mapping does
        objective = make("grpo", surrogate="soft_clip", surrogate_params=params)
        loss, metrics, grad = run(objective, *args)
        cfg = ref.config("grpo", surrogate=functools.partial(ref.soft_clip, eps=eps))
        want_loss, want_metrics, want_grad = reference_loss(cfg, {**data, "entropy": None})
        np.testing.assert_allclose(float(loss), want_loss, rtol=RTOL)
        np.testing.assert_allclose(float(metrics["soft_clip_frac"]), want_metrics["soft_clip_frac"])
        np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    run(make("grpo", surrogate="soft_clip", surrogate_params={"eps": 0.5}), *args)  # cache hit
    assert len(traces) == 2


@pytest.mark.parametrize("aggregation", ["token-sum", "seq-mean-token-mean"])
def test_user_surrogate_may_return_an_already_reduced_scalar(aggregation, rng):
    objectives.register_surrogate("seq_pg", sequence_reinforce, needs_old_logprobs=False)
    objective = make("dapo", surrogate="seq_pg", aggregation=aggregation)
    assert not objective.needs_old_logprobs
    data = policy_data(rng)
    loss, metrics, grad = loss_and_grad(
        objective, jnp.asarray(data["logprobs"]), rollout_batch(data), None
    )
    # Not aggregated again: the same value whatever the mode.
    want_loss, want_grad = ref.sequence_reinforce(
        data["logprobs"], data["row_advantages"], data["mask"]
    )
    np.testing.assert_allclose(float(loss), want_loss, rtol=RTOL)
    assert float(metrics["pg_loss"]) == float(loss)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=GRAD_RTOL, atol=GRAD_ATOL)


def test_user_ratio_kind(rng):
    @objectives.register_ratio("half")
    def half_log_ratio(ratio, logprobs, old_logprobs, mask):
        del ratio, mask
        return 0.5 * (logprobs - old_logprobs)

    assert objectives.ratios_available()[-1] == "half"
    data = policy_data(rng)
    _, metrics, _ = loss_and_grad(
        make("dapo", ratio="half"), jnp.asarray(data["logprobs"]), rollout_batch(data), None
    )
    half = 0.5 * (data["logprobs"].astype(np.float64) - data["old_logprobs"])
    want = ref.masked_mean(np.exp(half), data["mask"])
    np.testing.assert_allclose(float(metrics["ratio_mean"]), want, rtol=RTOL)


# --------------------------------------------------------------------------------------
# Registration rules
# --------------------------------------------------------------------------------------


def test_registration_returns_the_function_and_lists_the_name():
    assert objectives.register_surrogate("soft_clip", soft_clip) is soft_clip
    assert objectives.surrogates_available() == (
        "ppo_clip",
        "cispo",
        "sapo",
        "gmpo",
        "reinforce",
        "dppo_tv",
        "dppo_kl",
        "kl_cov",
        "clip_cov",
        "soft_clip",
    )
    assert objectives.SURROGATES["soft_clip"].fn is soft_clip
    assert "soft_clip" in objectives.SURROGATES
    with pytest.raises(TypeError):
        objectives.SURROGATES["other"] = objectives.SURROGATES["soft_clip"]  # read-only view


def test_duplicate_registration_is_refused_unless_overridden():
    objectives.register_surrogate("soft_clip", soft_clip)
    with pytest.raises(ValueError, match="'soft_clip' is already registered.*override=True"):
        objectives.register_surrogate("soft_clip", sequence_reinforce)
    with pytest.raises(ValueError, match="'ppo_clip' is already registered"):
        objectives.register_surrogate("ppo_clip", soft_clip)
    with pytest.raises(ValueError, match="'token' is already registered"):
        objectives.register_ratio("token", lambda *args: args[1])
    objectives.register_surrogate("soft_clip", sequence_reinforce, override=True)
    assert objectives.SURROGATES["soft_clip"].fn is sequence_reinforce


def test_overriding_a_built_in_changes_the_presets_that_use_it(rng):
    data = policy_data(rng)
    args = (jnp.asarray(data["logprobs"]), rollout_batch(data), None)
    before, _, _ = loss_and_grad(make("dapo"), *args)
    reinforce, _, _ = loss_and_grad(make("dapo", surrogate="reinforce"), *args)
    objectives.register_surrogate("ppo_clip", objectives.SURROGATES["reinforce"].fn, override=True)
    after, _, _ = loss_and_grad(make("dapo"), *args)
    assert float(after) == float(reinforce) != float(before)


def test_unknown_surrogate_lists_the_registered_names():
    objectives.register_surrogate("soft_clip", soft_clip)
    with pytest.raises(
        ValueError, match=r"unknown surrogate 'sofft_clip'.*'ppo_clip'.*'soft_clip'"
    ):
        make("grpo", surrogate="sofft_clip")
    objectives.unregister_surrogate("soft_clip")
    with pytest.raises(ValueError, match="unknown surrogate 'soft_clip'"):
        make("grpo", surrogate="soft_clip")


def test_unregister_refuses_built_ins_and_unknown_names():
    with pytest.raises(ValueError, match="built in"):
        objectives.unregister_surrogate("ppo_clip")
    with pytest.raises(ValueError, match="built in"):
        objectives.unregister_ratio("gspo_token")
    with pytest.raises(ValueError, match="no surrogate 'never_registered'.*ppo_clip"):
        objectives.unregister_surrogate("never_registered")


def test_bad_registrations_are_refused():
    with pytest.raises(ValueError, match=r"needs a name.*@register_surrogate\('my_surrogate'\)"):
        objectives.register_surrogate(soft_clip)
    with pytest.raises(ValueError, match="must be callable"):
        objectives.register_surrogate("soft_clip", "soft_clip")
    with pytest.raises(ValueError, match="non-empty str"):
        objectives.register_surrogate("", soft_clip)
    assert "soft_clip" not in objectives.SURROGATES


def test_registration_flags_drive_objective_validation():
    objectives.register_surrogate("token_only", soft_clip, ratios=("token",))
    with pytest.raises(ValueError, match="'token_only' takes no 'gspo_token' ratio"):
        make("grpo", surrogate="token_only", ratio="gspo_token")
    objectives.register_surrogate("soft_clip", soft_clip)
    with pytest.raises(ValueError, match=r"clip_low=None.*'soft_clip'.*\['cispo'\]"):
        make("grpo", surrogate="soft_clip", clip_low=None)
    objectives.register_surrogate("unbounded", soft_clip, clip_low_optional=True)
    assert make("grpo", surrogate="unbounded", clip_low=None).surrogate.clip_low is None
    assert make("grpo", surrogate="unbounded").needs_old_logprobs


def test_declared_params_are_typed_defaulted_and_checked():
    objectives.register_surrogate("soft_clip", soft_clip, params=SoftClipParams)
    assert make("grpo", surrogate="soft_clip").surrogate.params == SoftClipParams()
    objective = make("grpo", surrogate="soft_clip", surrogate_params={"eps": 0.3})
    assert objective.surrogate.params == SoftClipParams(eps=0.3)
    assert hash(objective) == hash(
        make("grpo", surrogate="soft_clip", surrogate_params=objective.surrogate.params)
    )
    with pytest.raises(
        ValueError, match=r"unknown parameter\(s\) \['epss'\] of surrogate 'soft_clip'.*\['eps'\]"
    ):
        make("grpo", surrogate="soft_clip", surrogate_params={"epss": 0.3})
    with pytest.raises(ValueError, match="surrogate 'ppo_clip' declares no parameters"):
        make("grpo", surrogate_params={"eps": 0.3})
    with pytest.raises(ValueError, match="extra is gone.*surrogate_params"):
        make("grpo", extra={"eps": 0.3})


def test_params_must_be_a_frozen_dataclass_type():
    @dataclasses.dataclass
    class Mutable:
        eps: float = 0.2

    for bad in (Mutable, dict, SoftClipParams()):
        with pytest.raises(ValueError, match="params must be a frozen dataclass type"):
            objectives.register_surrogate("soft_clip", soft_clip, params=bad)
    assert "soft_clip" not in objectives.SURROGATES


def _row_shaped_loss(surrogate, inputs):
    return inputs.logprobs[:, 0], {}


def _shadowing_metric(surrogate, inputs):
    return inputs.logprobs, {"loss": jnp.float32(0.0)}


def _loss_without_metrics(surrogate, inputs):
    return inputs.logprobs


@pytest.mark.parametrize(
    "surrogate, match",
    [
        (_row_shaped_loss, r"shape \(6,\); expected a per-token \[B, T\]"),
        (_shadowing_metric, r"metrics \['loss'\]"),
        (_loss_without_metrics, r"must return \(loss, metrics\)"),
    ],
)
def test_malformed_surrogate_output_is_a_clear_error(surrogate, match, rng):
    objectives.register_surrogate("broken", surrogate)
    data = policy_data(rng)
    with pytest.raises(ValueError, match=match):
        objectives.policy_loss(
            make("dapo", surrogate="broken"), jnp.asarray(data["logprobs"]), rollout_batch(data)
        )
