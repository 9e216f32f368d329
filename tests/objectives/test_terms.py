"""Tests of jaxrl_llm.objectives.terms: value_loss, sft_loss, combine."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import objectives
from jaxrl_llm.objectives import make
from jaxrl_llm.types import LossOutput, RolloutBatch
from tests.objectives.helpers import (
    LENGTHS,
    B,
    T,
    embed,
    mask_of,
    policy_data,
    push_away,
    rollout_batch,
)
from tests.reference import objectives as ref

# --------------------------------------------------------------------------------------
# combine / sft_loss
# --------------------------------------------------------------------------------------


def test_sft_loss_is_the_token_mean_nll(rng):
    data = policy_data(rng)
    out = jax.jit(objectives.sft_loss)(jnp.asarray(data["logprobs"]), jnp.asarray(data["mask"]))
    want = ref.sft_loss(data["logprobs"], data["mask"])
    np.testing.assert_allclose(float(out.loss), want, rtol=1e-6)
    np.testing.assert_allclose(float(out.metrics["nll"]), want, rtol=1e-6)
    empty = objectives.sft_loss(jnp.ones((2, 3)), jnp.zeros((2, 3)))
    assert float(empty.loss) == 0.0
    with pytest.raises(ValueError, match="logprobs"):
        objectives.sft_loss(jnp.ones((2, 3)), jnp.ones((2, 4)))


def test_combine_weights_terms_and_prefixes_metrics():
    terms = {
        "policy": LossOutput(jnp.float32(2.0), {"clip_frac": jnp.float32(0.25)}),
        "sft": LossOutput(jnp.float32(3.0), {"nll": jnp.float32(3.0)}),
    }
    out = objectives.combine(terms, {"sft": 0.5})
    assert float(out.loss) == pytest.approx(3.5)
    assert set(out.metrics) == {"policy/clip_frac", "policy/loss", "sft/nll", "sft/loss", "loss"}
    assert float(out.metrics["policy/clip_frac"]) == 0.25
    assert float(out.metrics["sft/loss"]) == 3.0  # unweighted
    assert float(out.metrics["loss"]) == pytest.approx(3.5)
    assert float(objectives.combine(terms).loss) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="kl"):
        objectives.combine(terms, {"kl": 1.0})
    with pytest.raises(ValueError, match="at least one"):
        objectives.combine({})


def test_combined_gradient_is_the_weighted_sum(rng):
    data = policy_data(rng)
    batch = rollout_batch(data)
    mask = jnp.asarray(data["mask"])
    objective = make("dapo")

    def total(lp):
        return objectives.combine(
            {
                "policy": objectives.policy_loss(objective, lp, batch),
                "sft": objectives.sft_loss(lp, mask),
            },
            {"sft": 0.3},
        ).loss

    lp = jnp.asarray(data["logprobs"])
    grad = jax.grad(total)(lp)
    _, _, want_policy = ref.policy_loss(
        ref.config("dapo"),
        data["logprobs"],
        data["old_logprobs"],
        data["row_advantages"],
        data["mask"],
    )
    want_sft = -data["mask"] / data["mask"].sum()
    np.testing.assert_allclose(np.asarray(grad), want_policy + 0.3 * want_sft, atol=1e-6)


# --------------------------------------------------------------------------------------
# value_loss
# --------------------------------------------------------------------------------------


def _value_data(rng):
    mask = mask_of(LENGTHS)
    old_values = rng.normal(0.0, 1.0, mask.shape)
    values = old_values + push_away(rng.normal(0.0, 0.7, mask.shape), np.array([-0.5, 0.5]))
    returns = old_values + rng.normal(0.0, 1.0, mask.shape)
    return mask, *(x.astype(np.float32) for x in (values, old_values, returns))


@pytest.mark.parametrize(
    "overrides, global_norm",
    [({}, False), ({"aggregation": "seq-mean-token-mean", "value_clip": 0.3}, True)],
)
def test_value_loss_matches_reference(overrides, global_norm, rng):
    mask, values, old_values, returns = _value_data(rng)
    if overrides.get("value_clip") == 0.3:
        values = (old_values + push_away(values - old_values, np.array([-0.3, 0.3]))).astype(
            np.float32
        )
    num_tokens, num_seqs = ref.normalisers(mask) if global_norm else (None, None)
    batch = RolloutBatch(
        completion_mask=jnp.asarray(mask),
        old_logprobs=jnp.zeros(mask.shape),
        advantages=jnp.zeros(mask.shape[:1]),
        old_values=jnp.asarray(old_values),
        returns=jnp.asarray(returns),
        num_tokens=None if num_tokens is None else jnp.float32(num_tokens),
        num_seqs=None if num_seqs is None else jnp.float32(num_seqs),
    )
    objective = make("ppo", **overrides)

    def loss_fn(v):
        out = objectives.value_loss(objective, v, batch)
        return out.loss, out.metrics

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(values))
    want_loss, want_metrics, want_grad = ref.value_loss(
        ref.config("ppo", **overrides),
        values,
        old_values,
        returns,
        mask,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
    )
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    assert 0.0 < want_metrics["vf_clipfrac"] < 1.0  # both branches exercised
    for key, want in want_metrics.items():
        np.testing.assert_allclose(float(metrics[key]), want, rtol=1e-5, atol=1e-7, err_msg=key)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-7)


def test_value_loss_hand_case_and_errors():
    # v = 1, v_old = 0, R = 2, c = 0.5: clip(v) = 0.5; max(1, 2.25) / 2 = 1.125, clipped.
    batch = RolloutBatch(
        completion_mask=embed([[1.0, 1.0, 0.0]], 0.0),
        old_logprobs=jnp.zeros((B, T)),
        advantages=jnp.zeros((B,)),
        old_values=embed([[0.0, 0.0, 0.0]], 3.0),
        returns=embed([[2.0, 0.0, 9.0]], -4.0),
    )
    # Second token: v = 2, R = 0: max(4, 0.25) / 2 = 2, unclipped.
    values = embed([[1.0, 2.0, 5.0]], 1.0)
    out = objectives.value_loss(make("ppo"), values, batch)
    assert float(out.loss) == pytest.approx((1.125 + 2.0) / 2)
    assert float(out.metrics["vf_clipfrac"]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="old_values"):
        objectives.value_loss(make("ppo"), values, batch._replace(old_values=None))


def test_value_loss_of_an_all_masked_batch_is_zero_and_finite():
    batch = RolloutBatch(
        completion_mask=jnp.zeros((B, T)),
        old_logprobs=jnp.zeros((B, T)),
        advantages=jnp.zeros((B,)),
        old_values=jnp.ones((B, T)),
        returns=jnp.full((B, T), 3.0),
    )
    out = objectives.value_loss(make("ppo"), jnp.full((B, T), 2.0), batch)
    assert float(out.loss) == 0.0
    chex.assert_tree_all_finite(out.metrics)
