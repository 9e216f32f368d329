"""The policy update against an independent reference: loss, clipping, AdamW and schedule.

``make_policy_step`` with ``make_optimizer`` (weight decay on, global-norm clipping active, a
warm-up + cosine schedule) must move the parameters exactly as a reference written here:

- the GRPO / PPO-clip token-mean loss with a k3 KL term, in plain ``jnp`` on the model's
  per-token log-probs (the forward is the library's transformer, tested against HF elsewhere;
  the ratio, clip, KL and aggregation are not the library's), differentiated by ``jax.grad``;
- global-norm clipping, AdamW (bias-corrected moments, decoupled weight decay as
  ``optax.adamw`` applies it, ``p -= lr·(m̂/(√v̂ + ε) + wd·p)``) and the learning-rate schedule,
  all written out in float64 NumPy.

Several steps on different batches, so the second moment, the bias correction and the
schedule's step count all matter. A learning rate off by any factor, a lost clip, a lost weight
decay or a schedule read at the wrong step moves the parameters elsewhere.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import logprobs, models, objectives, parallel
from jaxrl_llm.train import optim
from jaxrl_llm.train.rl.policy import make_policy_step
from jaxrl_llm.train.state import create_train_state
from jaxrl_llm.train.step import jit_step
from tests.train import helpers
from tests.train.step_problem import CONFIG, host_batch

STEPS = 4
# Optimizer: peak lr, warm-up over 2 steps then cosine decay to 0 at step 6.
LR, WARMUP, TOTAL = 3e-3, 2, 6
WEIGHT_DECAY = 0.1
MAX_GRAD_NORM = 0.05  # well below the raw gradient norm: clipping is active on every step
# b2 = 0.95 (not 0.999): optax forms the bias correction 1 − b2^t in float32, and at b2 = 0.999
# and t = 2 that difference of nearby numbers alone is off by ~1e-5 relative.
B1, B2 = 0.9, 0.95
# Adam's epsilon comparable to the clipped gradient's entries, so the gradient's scale (and
# hence the clip) shows in the update instead of being divided away.
EPS = 1e-5
# Objective: PPO-clip with asymmetric bounds, k3 KL in the loss, token-mean aggregation.
CLIP_LOW, CLIP_HIGH, KL_COEF = 0.2, 0.28, 0.04
OBJECTIVE = objectives.make(
    "grpo",
    clip_low=CLIP_LOW,
    clip_high=CLIP_HIGH,
    kl_kind="k3",
    kl_coef=KL_COEF,
    aggregation="token-mean",
)


def reference_lr(t: int) -> float:
    """Learning rate of optimizer step ``t`` (0-based): linear warm-up from 0, cosine to 0."""
    if t < WARMUP:
        return LR * t / WARMUP
    progress = min(t - WARMUP, TOTAL - WARMUP) / (TOTAL - WARMUP)
    return LR * 0.5 * (1.0 + math.cos(math.pi * progress))


def _policy_logprobs(params, batch):
    """The model's per-token completion log-probs (the library's forward, tested elsewhere)."""
    return logprobs.completion_logprobs(
        params,
        CONFIG,
        batch.prompt_tokens,
        batch.prompt_mask,
        batch.completion_tokens,
        batch.completion_mask,
    )


def reference_loss(params, batch):
    """Token-mean ``max(−A·r, −A·clip(r, 1−ε_lo, 1+ε_hi)) + β·k3`` in plain ``jnp``."""
    lp = _policy_logprobs(params, batch)
    mask = batch.completion_mask.astype(jnp.float32)
    adv = batch.advantages[:, None]
    ratio = jnp.exp(lp - batch.old_logprobs)
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH)
    surrogate = jnp.maximum(unclipped, clipped)
    x = batch.ref_logprobs - lp
    k3 = jnp.exp(x) - x - 1.0
    per_token = surrogate + KL_COEF * k3
    loss = jnp.sum(per_token * mask) / jnp.sum(mask)
    # clip_frac: the tokens whose clipped branch is the active one (zero gradient there).
    return loss, jnp.sum((clipped > unclipped) * mask) / jnp.sum(mask)


_reference_grad = jax.jit(jax.value_and_grad(reference_loss, has_aux=True))


def _f64(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), jax.device_get(tree))


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    # Shared with the trainer tests, and with the mutation check's child sessions.
    with helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


@pytest.fixture(scope="module")
def initial_params():
    """float32 parameters both runs start from (the library's as "pretrained" parameters)."""
    return jax.device_get(models.init_params(CONFIG, jax.random.key(0)))


def _reference_optimizer_step(params, mu, nu, grads, norm, t):
    """Global-norm clip → Adam moments → bias correction → ``p -= lr·(m̂/(√v̂ + ε) + wd·p)``."""
    scale = 1.0 if norm < MAX_GRAD_NORM else MAX_GRAD_NORM / norm
    grads = jax.tree.map(lambda g: g * scale, grads)
    mu = jax.tree.map(lambda m, g: B1 * m + (1 - B1) * g, mu, grads)
    nu = jax.tree.map(lambda v, g: B2 * v + (1 - B2) * g**2, nu, grads)
    lr = reference_lr(t)

    def adamw(p, m, v):
        m_hat = m / (1 - B1 ** (t + 1))
        v_hat = v / (1 - B2 ** (t + 1))
        return p - lr * (m_hat / (np.sqrt(v_hat) + EPS) + WEIGHT_DECAY * p)

    return jax.tree.map(adamw, params, mu, nu), mu, nu


@pytest.fixture(scope="module")
def reference_run(initial_params):
    """The float64 NumPy trajectory: ``(params at steps 0..STEPS, per-step loss / clip / norm)``."""
    params = _f64(initial_params)
    mu = jax.tree.map(np.zeros_like, params)
    nu = jax.tree.map(np.zeros_like, params)
    trajectory, infos = [params], []
    for t in range(STEPS):
        batch = jax.tree.map(jnp.asarray, host_batch(t))
        (loss, clip_frac), grads = _reference_grad(
            jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params), batch
        )
        grads = _f64(grads)
        norm = math.sqrt(sum(float(np.sum(g**2)) for g in jax.tree.leaves(grads)))
        params, mu, nu = _reference_optimizer_step(params, mu, nu, grads, norm, t)
        trajectory.append(params)
        infos.append({"loss": float(loss), "clip_frac": float(clip_frac), "grad_norm": norm})
    return trajectory, infos


def _library_run(initial_params, mesh_shape, micro_batches, *, on_policy=False, steps=STEPS):
    data, fsdp, tensor = mesh_shape
    mesh = parallel.make_mesh(data, fsdp, tensor, devices=jax.devices()[: data * fsdp * tensor])
    optimizer = optim.make_optimizer(
        LR,
        schedule="cosine",
        warmup_steps=WARMUP,
        total_steps=TOTAL,
        weight_decay=WEIGHT_DECAY,
        b1=B1,
        b2=B2,
        eps=EPS,
        max_grad_norm=MAX_GRAD_NORM,
    )
    state, shardings = create_train_state(
        CONFIG, optimizer, key=jax.random.key(0), mesh=mesh, params=initial_params
    )
    step = jit_step(
        make_policy_step(
            CONFIG,
            OBJECTIVE,
            optimizer,
            micro_batches=micro_batches,
            param_shardings=shardings.params,
        ),
        shardings,
    )
    trajectory, metrics = [_f64(state.params)], []
    for t in range(steps):
        batch = host_batch(t)
        if on_policy:
            batch = batch._replace(old_logprobs=None)
        state, m = step(state, parallel.shard_batch(batch, mesh))
        trajectory.append(_f64(state.params))
        metrics.append(jax.device_get(m))
    return trajectory, metrics


def _assert_update_matches(got_before, got_after, want_before, want_after, what):
    """Per leaf: ``‖Δ_got − Δ_want‖ ≤ 1e-5·‖Δ_want‖`` plus the f32 rounding of the stored params.

    ``got_after`` is float32 parameters; storing ``p + Δ`` in float32 rounds by up to half an
    ulp of ``p`` (one unit of 1e-7 for the unit norm scales), which the tolerance allows for.
    """
    for path, gb, ga, wb, wa in zip(
        [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(got_before)],
        jax.tree.leaves(got_before),
        jax.tree.leaves(got_after),
        jax.tree.leaves(want_before),
        jax.tree.leaves(want_after),
        strict=True,
    ):
        got, want = ga - gb, wa - wb
        rounding = np.spacing(np.abs(ga).astype(np.float32)).astype(np.float64)
        err = np.linalg.norm(got - want)
        bound = 1e-5 * np.linalg.norm(want) + np.linalg.norm(rounding)
        assert err <= bound, (
            f"{what} {path}: |Δ − Δ_ref| = {err:.3e} > {bound:.3e} (|Δ_ref| = "
            f"{np.linalg.norm(want):.3e}, |Δ| = {np.linalg.norm(got):.3e})"
        )


def test_reference_problem_exercises_every_piece(reference_run):
    """The clip, the PPO clip and the warm-up actually bind on this problem."""
    trajectory, infos = reference_run
    for info in infos:
        assert info["grad_norm"] > 2 * MAX_GRAD_NORM
        assert 0.05 < info["clip_frac"] < 0.95
    assert reference_lr(0) == 0.0 and 0 < reference_lr(1) < LR and reference_lr(3) < LR
    # Step 0 has lr 0 (warm-up from 0): the parameters stay, the moments fill.
    jax.tree.map(np.testing.assert_array_equal, trajectory[1], trajectory[0])


@pytest.mark.parametrize(
    ("mesh_shape", "micro_batches"), [((1, 1, 1), 1), ((2, 1, 1), 2)], ids=["full", "micro2"]
)
def test_policy_update_matches_float64_reference(
    initial_params, reference_run, mesh_shape, micro_batches
):
    want, infos = reference_run
    got, metrics = _library_run(initial_params, mesh_shape, micro_batches)
    np.testing.assert_array_equal(
        np.concatenate([x.ravel() for x in jax.tree.leaves(got[0])]),
        np.concatenate([x.ravel() for x in jax.tree.leaves(want[0])]),
    )
    for t in range(STEPS):
        _assert_update_matches(got[t], got[t + 1], want[t], want[t + 1], f"step {t}")
        # The reported grad norm is the raw (pre-clip) one; loss and clip fraction as the
        # reference's. With the clip active the update cannot see the loss's scale (a loss
        # doubled is clipped to the same step): the raw norm is what pins it.
        np.testing.assert_allclose(metrics[t]["grad_norm"], infos[t]["grad_norm"], rtol=1e-5)
        np.testing.assert_allclose(metrics[t]["loss"], infos[t]["loss"], rtol=1e-5)
        np.testing.assert_allclose(metrics[t]["clip_frac"], infos[t]["clip_frac"], rtol=1e-6)


def on_policy_reference_loss(params, batch):
    """The same objective at ratio 1: ``-A·∇log π`` plus the KL term's gradient, so the value is
    ``−A + β·k3`` per token and the gradient that of ``−A·log π + β·k3`` (no clip can bind)."""
    lp = _policy_logprobs(params, batch)
    mask = batch.completion_mask.astype(jnp.float32)
    x = batch.ref_logprobs - lp
    k3 = jnp.exp(x) - x - 1.0
    adv = batch.advantages[:, None]
    gradient_carrier = -adv * lp + KL_COEF * k3
    value = -adv + KL_COEF * k3
    n = jnp.sum(mask)
    return jnp.sum(gradient_carrier * mask) / n, jnp.sum(value * mask) / n


def test_on_policy_update_takes_its_own_logprobs(initial_params):
    """``old_logprobs=None``: the update's own log-probs, held fixed (ratio 1, clip inactive),
    as TRL's GRPOTrainer does with one update per batch: matches float64 AdamW on the gradient of
    ``−A·log π + β·k3`` for two steps (step 0 has lr 0), full batch and 2 micro-batches."""
    params = _f64(initial_params)
    mu, nu = jax.tree.map(np.zeros_like, params), jax.tree.map(np.zeros_like, params)
    want, losses = [params], []
    grad_fn = jax.jit(jax.grad(on_policy_reference_loss, has_aux=True))
    for t in range(2):
        batch = jax.tree.map(jnp.asarray, host_batch(t)._replace(old_logprobs=None))
        grads, value = grad_fn(jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params), batch)
        grads = _f64(grads)
        norm = math.sqrt(sum(float(np.sum(g**2)) for g in jax.tree.leaves(grads)))
        params, mu, nu = _reference_optimizer_step(params, mu, nu, grads, norm, t)
        want.append(params)
        losses.append(float(value))
    for mesh_shape, micro_batches in (((1, 1, 1), 1), ((2, 1, 1), 2)):
        got, metrics = _library_run(
            initial_params, mesh_shape, micro_batches, on_policy=True, steps=2
        )
        for t in range(2):
            _assert_update_matches(got[t], got[t + 1], want[t], want[t + 1], f"on-policy {t}")
            np.testing.assert_allclose(metrics[t]["loss"], losses[t], rtol=1e-5)
            assert metrics[t]["clip_frac"] == 0.0
