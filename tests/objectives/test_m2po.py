"""M2PO's second-moment mask through ``policy_loss`` (``Objective.m2_threshold``): values,
gradients and metrics against the float64 references of tests/reference/objectives.py and
tests/reference/m2po.py (AReaL's rule), on several presets and aggregation modes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from jaxrl_llm import objectives
from jaxrl_llm.objectives import make
from tests.objectives.helpers import (
    AGGREGATIONS,
    GRAD_ATOL,
    GRAD_RTOL,
    RTOL,
    loss_and_grad,
    policy_data,
    rollout_batch,
)
from tests.reference import m2po as m2ref
from tests.reference import objectives as ref

ATOL = 1e-5
TAU = 0.1


def _reference(name, data, keep, **overrides):
    """The preset's float64 loss with the masked tokens' advantages zeroed: each per-token
    surrogate below is 0, with a 0 gradient, at ``A = 0`` (M2PO multiplies it by ``M``), and
    the normalisers keep every token."""
    cfg = ref.config(name, **overrides)
    adv = np.where(keep > 0, data["token_advantages"], 0.0)
    return ref.policy_loss(
        cfg,
        data["logprobs"],
        data["old_logprobs"],
        adv,
        data["mask"],
        ref_logprobs=data["ref_logprobs"],
        entropy=data["entropy"],
    )


@pytest.mark.parametrize(
    "name,mode",
    [("dapo", m) for m in AGGREGATIONS] + [(n, None) for n in ("grpo", "cispo", "sapo", "gpg")],
)
def test_m2po_policy_loss_matches_reference(rng, name, mode):
    data = policy_data(rng)
    overrides = {} if mode is None else {"aggregation": mode}
    objective = make(name, m2_threshold=TAU, **overrides)
    batch = rollout_batch(data, per_token=True)
    loss, metrics, grad = loss_and_grad(
        objective, jnp.asarray(data["logprobs"]), batch, jnp.asarray(data["entropy"])
    )
    lp, old, mask = data["logprobs"], data["old_logprobs"], data["mask"]
    keep = m2ref.m2po_mask(lp - old, mask, TAU)
    assert 0 < keep.sum() < mask.sum() - 1  # some tokens masked, not AReaL's keep-one fallback
    want_loss, _, want_grad = _reference(name, data, keep, **overrides)
    np.testing.assert_allclose(float(loss), want_loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    if name != "grpo":  # grpo's KL term keeps every token
        assert not np.any(np.asarray(grad)[(keep == 0) & (mask > 0)])
    np.testing.assert_allclose(
        float(metrics["m2po_m2"]), m2ref.second_moment(lp - old, mask), rtol=RTOL
    )
    np.testing.assert_allclose(
        float(metrics["m2po_masked_frac"]), ref.masked_mean(1.0 - keep, mask), rtol=RTOL
    )


def test_m2po_measures_against_the_sampler(rng):
    """With ``batch.rollout_logprobs`` the log-ratio is ``log π_θ − log π_sampler`` (AReaL's
    proximal − behaviour log-probs while the parameters are the proximal policy's)."""
    data = policy_data(rng)
    lp, mask = data["logprobs"], data["mask"]
    # On-policy for the surrogate (old = lp) but a stale sampler: only M2PO masks anything.
    data = dict(data, old_logprobs=lp)
    sampling = (lp + rng.normal(0.0, 0.4, lp.shape)).astype(np.float32)
    batch = rollout_batch(data, per_token=True)._replace(rollout_logprobs=jnp.asarray(sampling))
    objective = make("dapo", m2_threshold=TAU)
    loss, metrics, grad = loss_and_grad(objective, jnp.asarray(lp), batch, None)
    keep = m2ref.m2po_mask(lp - sampling, mask, TAU)
    assert 0 < keep.sum() < mask.sum() - 1
    want_loss, _, want_grad = _reference("dapo", dict(data, entropy=None), keep)
    np.testing.assert_allclose(float(loss), want_loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    np.testing.assert_allclose(
        float(metrics["m2po_m2"]), m2ref.second_moment(lp - sampling, mask), rtol=RTOL
    )


def test_m2po_edge_cases_give_no_nan(rng):
    data = policy_data(rng)
    lp = jnp.asarray(data["logprobs"])
    # Every token far off: AReaL's fallback keeps the one of smallest (log r)².
    far = dict(data, old_logprobs=data["logprobs"] - 5.0)
    objective = make("dapo", m2_threshold=1e-6)
    loss, metrics, grad = loss_and_grad(objective, lp, rollout_batch(far), None)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grad)))
    assert np.count_nonzero(np.asarray(grad)) == 1
    # An empty batch: zero loss, zero gradient, zero metrics.
    empty = dict(data, mask=np.zeros_like(data["mask"]))
    loss, metrics, grad = loss_and_grad(objective, lp, rollout_batch(empty), None)
    assert float(loss) == 0.0 and not np.any(np.asarray(grad))
    assert float(metrics["m2po_m2"]) == 0.0 and float(metrics["m2po_masked_frac"]) == 0.0
    # Already under the threshold: the preset's loss exactly.
    batch = rollout_batch(data)
    loose = objectives.policy_loss(make("dapo", m2_threshold=1e6), lp, batch)
    plain = objectives.policy_loss(make("dapo"), lp, batch)
    assert float(loose.loss) == float(plain.loss)
    assert float(loose.metrics["m2po_masked_frac"]) == 0.0


def test_m2po_keeps_micro_batches_additive(rng):
    """Per (micro-)batch mask, as AReaL's per micro-batch loss: each half's mask is its own,
    and the halves' losses add up to the whole batch's with those masks."""
    data = policy_data(rng)
    objective = make("dapo", m2_threshold=TAU)
    full = rollout_batch(data, per_token=True, global_norm=True)
    lp = jnp.asarray(data["logprobs"])
    total, keep = 0.0, np.zeros_like(data["mask"])
    for rows in (slice(0, 3), slice(3, 6)):
        part = jax.tree.map(lambda x, r=rows: x if jnp.ndim(x) == 0 else x[r], full)
        total += float(objectives.policy_loss(objective, lp[rows], part).loss)
        keep[rows] = m2ref.m2po_mask(
            data["logprobs"][rows] - data["old_logprobs"][rows], data["mask"][rows], TAU
        )
    want, _, _ = _reference("dapo", data, keep)
    np.testing.assert_allclose(total, want, rtol=RTOL, atol=ATOL)


def test_m2po_under_jit(rng):
    data = policy_data(rng)
    objective = make("grpo", m2_threshold=TAU)
    batch = rollout_batch(data, per_token=True)
    run = jax.jit(lambda lp, b: objectives.policy_loss(objective, lp, b).loss)
    keep = m2ref.m2po_mask(data["logprobs"] - data["old_logprobs"], data["mask"], TAU)
    want, _, _ = _reference("grpo", dict(data, entropy=None), keep)
    np.testing.assert_allclose(
        float(run(jnp.asarray(data["logprobs"]), batch)), want, rtol=RTOL, atol=ATOL
    )


def test_m2_threshold_is_validated_and_configured():
    from jaxrl_llm.train.rl.config import ObjectiveSection, make_objective  # noqa: PLC0415

    for bad in (0.0, -0.04, float("nan")):
        with pytest.raises(ValueError, match="m2_threshold"):
            make("grpo", m2_threshold=bad)
    section = ObjectiveSection(**yaml.safe_load("{name: dapo, overrides: {m2_threshold: 0.04}}"))
    objective = make_objective(section)
    assert objective.selection.m2_threshold == 0.04 and not objective.needs_entropy
    hash(objective)
