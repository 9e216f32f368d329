"""A mixture-of-experts policy update adds ``aux_coef · LB + z_coef · Z`` (``train.rl.policy``).

The router losses come from the router logits of the forward that gives the log-probs, over the
real tokens only (prompt and completion; packed: the packed real slots), in f32. Checked against
float64 NumPy (``tests.reference.router_losses``) on router logits from an independent
``models.forward``: coefficient 0 leaves the loss exactly as before, the metrics are the
references, packed equals padded, and over K micro-batches the summed metrics are the
completion-token-weighted mean ``sum_k (n_k / N) · L_k`` (one micro-batch: the full batch).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm import models, objectives
from jaxrl_llm.logprobs import completion_logprobs
from jaxrl_llm.packing import plan_sequences
from jaxrl_llm.train.packing import plan_micro_batches
from jaxrl_llm.train.rl.policy import (
    RouterLoss,
    make_policy_loss_fn,
    make_policy_step,
    router_loss,
    with_totals,
)
from jaxrl_llm.train.state import TrainState
from jaxrl_llm.train.step import totals_of
from jaxrl_llm.types import RolloutBatch
from tests.reference.router_losses import router_losses
from tests.train import moe_problem, step_problem

MOE = dataclasses.replace(moe_problem.MOE, router_aux_loss_coef=0.001)
KEYS = ("moe/load_balancing_loss", "moe/router_z_loss")


@functools.lru_cache(maxsize=1)
def _params():
    """Random weights, the router's scaled up so routing is far from uniform."""
    params = models.init_params(MOE, jax.random.key(0))
    layers = dict(params["layers"], router=params["layers"]["router"] * 20.0)
    return {**params, "layers": layers}


def _batch(seed: int = 0) -> RolloutBatch:
    return jax.tree.map(jnp.asarray, step_problem.host_batch(seed))


@jax.jit
def _router_logits(params, tokens, mask):
    return models.forward(params, MOE, tokens, attention_mask=mask, outputs=("router_logits",))[2]


def _reference(batch: RolloutBatch, top_k: int = 2):
    """float64 ``(LB, Z)`` from the router logits of an independent padded forward."""
    tokens = jnp.concatenate([batch.prompt_tokens, batch.completion_tokens], axis=1)
    mask = np.concatenate([batch.prompt_mask, batch.completion_mask], axis=1).astype(bool)
    logits = _router_logits(_params(), tokens, jnp.asarray(mask))
    lb, z, _, _ = router_losses(np.asarray(logits), mask, top_k)
    return lb, z


def test_zero_coefficients_leave_the_loss_exactly_and_report_the_references():
    objective = objectives.make("grpo")
    batch, params = _batch(), _params()
    totals = totals_of(batch.completion_mask)
    loss_fn = make_policy_loss_fn(MOE, objective, router=RouterLoss(0.0, 0.0))
    loss, metrics = loss_fn(params, batch, totals)
    # The loss before the router losses existed: log-probs -> objectives.policy_loss.
    logprobs, entropy = completion_logprobs(
        params,
        MOE,
        batch.prompt_tokens,
        batch.prompt_mask,
        batch.completion_tokens,
        batch.completion_mask,
        return_entropy=True,
    )
    before = objectives.policy_loss(
        objective, logprobs, with_totals(batch, totals), entropy=entropy
    ).loss
    assert float(loss) == float(before)
    lb, z = _reference(batch)
    np.testing.assert_allclose(float(metrics[KEYS[0]]), lb, rtol=1e-5)
    np.testing.assert_allclose(float(metrics[KEYS[1]]), z, rtol=1e-5)
    assert lb > 2.0 + 1e-3  # routing is unbalanced: the value is not the uniform minimum k


def test_coefficients_add_the_weighted_losses_and_their_gradients():
    objective = objectives.make("grpo")
    batch, params = _batch(), _params()
    totals = totals_of(batch.completion_mask)
    base = make_policy_loss_fn(MOE, objective, router=RouterLoss(0.0, 0.0))
    weighted = make_policy_loss_fn(MOE, objective, router=RouterLoss(0.5, 0.25))
    (loss0, metrics), grads0 = jax.value_and_grad(base, has_aux=True)(params, batch, totals)
    (loss1, metrics1), grads1 = jax.value_and_grad(weighted, has_aux=True)(params, batch, totals)
    lb, z = _reference(batch)
    np.testing.assert_allclose(float(loss1 - loss0), 0.5 * lb + 0.25 * z, rtol=1e-4)
    assert float(metrics1["loss"]) == float(loss1)  # the logged loss is what is minimised
    # Only the router losses differ: their gradient reaches the router (and the layers below).
    router_diff = grads1["layers"]["router"] - grads0["layers"]["router"]
    assert float(jnp.abs(router_diff).max()) > 1e-4
    np.testing.assert_array_equal(grads1["lm_head"], grads0["lm_head"])
    # No coefficient given: the checkpoint's aux weight (0.001), no z-loss.
    default = make_policy_loss_fn(MOE, objective)(params, batch, totals)[0]
    np.testing.assert_allclose(float(default - loss0), 0.001 * lb, rtol=1e-3)
    assert set(KEYS) <= set(metrics)


def test_packed_equals_padded():
    objective = objectives.make("grpo")
    batch, params = _batch(1), _params()
    totals = totals_of(batch.completion_mask)
    loss_fn = make_policy_loss_fn(MOE, objective, router=RouterLoss(0.1, 0.01))
    padded_loss, padded = loss_fn(params, batch, totals)
    plan = plan_sequences(np.asarray(batch.prompt_mask), np.asarray(batch.completion_mask))
    packed_loss, packed = loss_fn(params, batch._replace(packing=plan), totals)
    for key in KEYS:
        np.testing.assert_allclose(float(packed[key]), float(padded[key]), rtol=1e-5)
    np.testing.assert_allclose(float(packed_loss), float(padded_loss), rtol=1e-5, atol=1e-6)


def test_micro_batches_sum_to_the_token_weighted_mean():
    """K = 2 strided micro-batches, padded and packed: sum_k (n_k / N) · L_k (K = 1, the full
    batch's value, is the other tests')."""
    objective = objectives.make("grpo")
    batch, params = _batch(2), _params()
    mask = np.asarray(batch.completion_mask, np.float64)
    want = np.zeros(2)
    for part in range(2):
        rows = slice(part, None, 2)
        sub = jax.tree.map(lambda x, rows=rows: x[rows], batch)
        want += mask[rows].sum() / mask.sum() * np.asarray(_reference(sub))
    step = make_policy_step(
        MOE, objective, optax.sgd(0.0), micro_batches=2, router=RouterLoss(0.1, 0.01)
    )
    state = TrainState(
        jnp.zeros((), jnp.int32), params, optax.sgd(0.0).init(params), jax.random.key(1)
    )
    plan = plan_micro_batches(np.asarray(batch.prompt_mask), mask, micro_batches=2, shards=1)
    for run in (batch, batch._replace(packing=plan)):
        _, metrics = jax.jit(step)(state, run)
        for key, value in zip(KEYS, want, strict=True):
            np.testing.assert_allclose(float(metrics[key]), value, rtol=1e-5, err_msg=key)


def test_coefficients_resolve_and_dense_models_refuse_them():
    assert router_loss(MOE) == RouterLoss(0.001, 0.0)
    assert router_loss(MOE, 0.0, 1e-3) == RouterLoss(0.0, 1e-3)
    dense = step_problem.CONFIG
    assert router_loss(dense) is None and router_loss(dense, 0.0, 0.0) is None
    with pytest.raises(ValueError, match="router_aux_loss_coef.*dense"):
        router_loss(dense, 0.01)
    with pytest.raises(ValueError, match="router_z_loss_coef must be a finite number >= 0"):
        router_loss(MOE, None, float("nan"))
    with pytest.raises(ValueError, match="dense: pass router=None"):
        make_policy_loss_fn(dense, objectives.make("grpo"), router=RouterLoss(0.1))
    # A dense policy's update reports no router metrics.
    batch = jax.tree.map(jnp.asarray, step_problem.host_batch(0))
    params = models.init_params(dense, jax.random.key(0))
    _, metrics = make_policy_loss_fn(dense, objectives.make("grpo"))(
        params, batch, totals_of(batch.completion_mask)
    )
    assert not set(KEYS) & set(metrics)


def test_a_tiny_moe_run_reports_the_router_losses(tmp_path):
    """Two GRPO steps of the built-in model as a 4-expert mixture with the config's
    coefficients: every step row holds both router losses, and the loss the step reports is
    the policy loss plus the weighted router losses (the keys reach the update)."""
    from jaxrl_llm.train.metrics import read_metrics  # noqa: PLC0415
    from jaxrl_llm.train.rl.config import make_objective  # noqa: PLC0415
    from jaxrl_llm.train.rl.run import run  # noqa: PLC0415
    from tests.train.rl import rl_helpers  # noqa: PLC0415

    cfg = rl_helpers.tiny_config(
        rl_helpers.CONFIGS / "grpo.yaml",
        tmp_path / "run",
        rl_helpers.SHAPED_REWARDS,
        "model.tiny.experts=4",
        "trainer.max_steps=2",
        "model.router_aux_loss_coef=0.5",
        "model.router_z_loss_coef=0.1",
    )
    run(cfg)
    objective = make_objective(cfg.objective)
    assert objective.entropy.coef == 0.0 and not objective.entropy.adaptive
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(rows) == 2
    for row in rows:
        lb, z = row["moe/load_balancing_loss"], row["moe/router_z_loss"]
        assert np.isfinite(lb) and np.isfinite(z) and lb > 0.0 and z > 0.0, row
        # grpo.yaml's loss: pg + kl_coef * kl (no entropy bonus), then the router terms.
        policy = row["pg_loss"] + objective.kl.coef * row.get("kl_loss", 0.0)
        want = policy + 0.5 * lb + 0.1 * z
        assert row["loss"] == pytest.approx(want, rel=1e-4, abs=1e-6), row
