"""The one optimizer step (``train.step``): mesh parity, micro-batch invariance (both ways of
accumulating), donation, no retrace. The RL policy step (``train.rl.policy``) is the loss under
test: on the meshes (one three-step SGD run per mesh, compared after its first and third
steps; two AdamW steps on an explicit-axes mesh, in the donation and retrace test) and for
micro-batching (every aggregation mode's full-batch and micro-batched steps, from two
programs). A toy loss checks the accumulation against float64 NumPy."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxrl_llm import objectives, parallel
from jaxrl_llm.losses import aggregation
from jaxrl_llm.train import optim
from jaxrl_llm.train.forward import make_logprob_fn
from jaxrl_llm.train.rl.policy import make_policy_step
from jaxrl_llm.train.state import TrainState, create_train_state
from jaxrl_llm.train.step import TokenBudget, Totals, jit_step, make_step
from jaxrl_llm.types import sequences_of
from tests.train.step_problem import CONFIG, host_batch


def _run(
    mesh_shape,
    steps,
    *,
    objective=None,
    micro_batches=1,
    optimizer=None,
    axis_types="auto",
    remat="none",
):
    data, fsdp, tensor = mesh_shape
    devices = jax.devices()[: data * fsdp * tensor]
    mesh = parallel.make_mesh(data, fsdp, tensor, devices=devices, axis_types=axis_types)
    objective = objective or objectives.make("grpo")
    optimizer = optimizer or optim.make_optimizer(1e-3)
    state, shardings = create_train_state(CONFIG, optimizer, key=jax.random.key(0), mesh=mesh)
    step = jit_step(
        make_policy_step(
            CONFIG,
            objective,
            optimizer,
            micro_batches=micro_batches,
            remat=remat,
            param_shardings=shardings.params,
        ),
        shardings,
    )
    params, metrics = [], []
    for i in range(steps):
        batch = parallel.shard_batch(host_batch(i), mesh)
        state, m = step(state, batch)
        params.append(jax.device_get(state.params))
        metrics.append(jax.device_get(m))
    return params, metrics, step


@pytest.fixture(scope="module")
def single_device_run():
    """Three SGD steps on one device: the params and metrics after each step."""
    return _run((1, 1, 1), 3, optimizer=optax.sgd(0.5))


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 4, 1), (2, 2, 2)])
def test_meshes_match_single_device(single_device_run, mesh_shape):
    """Three steps on the mesh: the params and loss after the first step and after the third
    (one program run three times on new batches) are the single device's."""
    expected, expected_metrics, _ = single_device_run
    params, metrics, _ = _run(mesh_shape, 3, optimizer=optax.sgd(0.5))
    for step in (0, 2):
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
            params[step],
            expected[step],
        )
        np.testing.assert_allclose(metrics[step]["loss"], expected_metrics[step]["loss"], rtol=1e-5)


@pytest.fixture(scope="module")
def aggregation_mode_updates():
    """``{(mode, micro_batches): (params, metrics)}``: one SGD step of GRPO with each
    aggregation mode from the same state and batch on a data=2 mesh, on the full batch
    (``micro_batches=1``) and in four micro-batches. The five full-batch steps compile as one
    program and the five micro-batched ones as another (one compile each, not ten): the modes
    share the forward, and nothing of a micro-batched step can be shared with its reference."""
    mesh = parallel.make_mesh(2, 1, 1, devices=jax.devices()[:2])
    optimizer = optax.sgd(1.0)
    state, shardings = create_train_state(CONFIG, optimizer, key=jax.random.key(0), mesh=mesh)
    batch = parallel.shard_batch(host_batch(0), mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    updates = {}
    for micro_batches in (1, 4):
        steps = [
            make_policy_step(
                CONFIG,
                objectives.make("grpo", aggregation=mode),
                optimizer,
                micro_batches=micro_batches,
                param_shardings=shardings.params,
            )
            for mode in aggregation.MODES
        ]

        def every_mode(state, batch, steps=steps):
            with parallel.mesh_context(mesh):  # as jit_step does
                return tuple(step(state, batch) for step in steps)

        outs = jax.jit(
            every_mode,
            in_shardings=(shardings, None),
            out_shardings=((shardings, replicated),) * len(steps),
        )(state, batch)
        for mode, (new_state, metrics) in zip(aggregation.MODES, outs, strict=True):
            updates[mode, micro_batches] = jax.device_get((new_state.params, metrics))
    return updates


@pytest.mark.parametrize("mode", aggregation.MODES)
def test_micro_batches_equal_full_batch(aggregation_mode_updates, mode):
    full, full_metrics = aggregation_mode_updates[mode, 1]
    micro, micro_metrics = aggregation_mode_updates[mode, 4]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), micro, full)
    for key in ("loss", "pg_loss", "kl", "clip_frac", "ratio_max", "ratio_min", "grad_norm"):
        np.testing.assert_allclose(micro_metrics[key], full_metrics[key], rtol=2e-5, atol=1e-7)


def test_layer_remat_gives_the_same_update(single_device_run):
    """``remat="layer"`` recomputes each layer in the backward pass: same numbers, less memory."""
    expected, expected_metrics, _ = single_device_run
    params, metrics, _ = _run((1, 1, 1), 1, optimizer=optax.sgd(0.5), remat="layer")
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
        params[0],
        expected[0],
    )
    np.testing.assert_allclose(metrics[0]["grad_norm"], expected_metrics[0]["grad_norm"], rtol=1e-5)


def test_adamw_on_an_explicit_mesh_matches_single_device_and_does_not_retrace():
    """Two AdamW steps on an explicit-axes (2, 2, 2) mesh: the state keeps its types, every
    incoming leaf is donated, the second call reuses the first's program, and the params are
    those of the same two steps on one device."""
    mesh = parallel.make_mesh(2, 2, 2, axis_types="explicit")
    assert all(t == AxisType.Explicit for t in mesh.axis_types)
    optimizer = optim.make_optimizer(1e-3)
    objective = objectives.make("grpo")
    state, shardings = create_train_state(CONFIG, optimizer, key=jax.random.key(0), mesh=mesh)
    policy_step = make_policy_step(CONFIG, objective, optimizer, param_shardings=shardings.params)
    traces = []

    def traced_step(*args):  # runs once per trace
        traces.append(1)
        return policy_step(*args)

    step = jit_step(traced_step, shardings)
    types_before = jax.tree.map(jax.typeof, state)
    with jax.set_mesh(mesh):
        for i in range(2):
            old_leaves = jax.tree.leaves(state)
            state, metrics = step(state, parallel.shard_batch(host_batch(i), mesh))
            kept = [leaf.shape for leaf in old_leaves if not leaf.is_deleted()]
            assert not kept, f"every leaf of the incoming state must be donated, kept {kept}"
    assert jax.tree.map(jax.typeof, state) == types_before
    assert len(traces) == 1  # the second call reuses the first's program
    assert np.isfinite(float(metrics["loss"]))
    # Adam divides by sqrt(v): elements whose gradient is ~0 amplify reduction-order noise, so the
    # comparison is on the update as a whole (relative norm), not per element.
    one = _run((1, 1, 1), 2)[0][-1]
    many = jax.device_get(state.params)
    diff = jax.tree.leaves(jax.tree.map(lambda a, b: np.linalg.norm(a - b), one, many))
    norm = jax.tree.leaves(jax.tree.map(np.linalg.norm, one))
    assert max(d / n for d, n in zip(diff, norm)) < 1e-4


def test_state_is_born_sharded():
    mesh = parallel.make_mesh(2, 2, 2)
    optimizer = optim.make_optimizer(1e-3)
    state, shardings = create_train_state(CONFIG, optimizer, key=jax.random.key(0), mesh=mesh)
    embed = state.params
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(shardings)):
        assert leaf.sharding == sharding
    # Adam's moments follow their parameter's sharding; the step count is replicated.
    mu = state.opt_state[1][0].mu
    same = jax.tree.map(lambda m, p: m.sharding.is_equivalent_to(p.sharding, m.ndim), mu, embed)
    assert all(jax.tree.leaves(same))
    assert any(s.spec != jax.sharding.PartitionSpec() for s in jax.tree.leaves(shardings.opt_state))


def test_non_divisible_shapes_raise():
    mesh = parallel.make_mesh(1, 1, 8)
    with pytest.raises(
        ValueError,
        match=r"params\['layers'\]\['wk'\]: dim 2 \('kv_heads'\) of size 2 .* mesh axis "
        r"'tensor' of size 8",
    ):
        create_train_state(CONFIG, optim.make_optimizer(), key=jax.random.key(0), mesh=mesh)
    mesh = parallel.make_mesh(8, 1, 1)
    with pytest.raises(ValueError, match="12"):
        parallel.shard_batch(host_batch(0, batch=12), mesh)
    step = make_policy_step(CONFIG, objectives.make("grpo"), optax.sgd(0.1), micro_batches=3)
    state, _ = create_train_state(CONFIG, optax.sgd(0.1), key=jax.random.key(0), mesh=mesh)
    with pytest.raises(ValueError, match="micro_batches=3"):
        jax.jit(step)(state, jax.tree.map(jnp.asarray, host_batch(0)))


def test_logprob_fn_gives_ratio_one_on_policy():
    mesh = parallel.make_mesh(2, 2, 2)
    state, shardings = create_train_state(
        CONFIG, optim.make_optimizer(), key=jax.random.key(0), mesh=mesh
    )
    batch = parallel.shard_batch(host_batch(0), mesh)
    old = make_logprob_fn(CONFIG, param_shardings=shardings.params)(
        state.params, sequences_of(batch)
    )
    step = make_policy_step(CONFIG, objectives.make("grpo", kl_coef=0.0), optax.sgd(0.0))
    _, metrics = jax.jit(step)(state, batch._replace(old_logprobs=old))
    np.testing.assert_allclose(metrics["ratio_max"], 1.0, rtol=1e-5)
    np.testing.assert_allclose(metrics["ratio_min"], 1.0, rtol=1e-5)
    assert float(metrics["clip_frac"]) == 0.0


# -- make_step on a toy loss -------------------------------------------------------------------


class ToyBatch(NamedTuple):
    x: jax.Array  # [B, D]
    completion_mask: jax.Array  # [B, T]


def _toy_batch(rows=8, dim=3, length=4):
    rng = np.random.default_rng(0)
    lengths = np.array([0, 1, 4, 2, 3, 4, 1, 2])[:rows]  # row 0 empty
    mask = np.arange(length)[None] < lengths[:, None]
    return ToyBatch(rng.normal(size=(rows, dim)).astype(np.float32), mask)


def _toy_sum_loss(params, batch, totals: Totals | None):
    """``Σ_i n_i·(x_i·w)² / N_tok``: a token-weighted loss normalised by the whole batch."""
    tokens = jnp.sum(batch.completion_mask, axis=1).astype(jnp.float32)
    pred = batch.x @ params["w"]
    loss = jnp.sum(tokens * pred**2) / totals.num_tokens
    return loss, {"loss": loss, "pred_max": jnp.max(pred), "rows": jnp.float32(len(pred))}


def _toy_mean_loss(params, batch, totals):
    """``mean_i (x_i·w − 1)²``: a mean over rows (the preference losses' shape)."""
    assert totals is None
    loss = jnp.mean((batch.x @ params["w"] - 1.0) ** 2)
    return loss, {"loss": loss}


def _toy_state(optimizer, w):
    params = {"w": jnp.asarray(w, jnp.float32)}
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), jax.random.key(0))


@pytest.mark.parametrize("micro_batches", [1, 2, 4])
def test_summed_micro_batches_give_the_full_batch_update(micro_batches):
    lr, w = 0.1, np.array([0.5, -1.0, 2.0])
    batch = _toy_batch()
    step = jax.jit(make_step(_toy_sum_loss, optax.sgd(lr), micro_batches=micro_batches))
    state, metrics = step(_toy_state(optax.sgd(lr), w), batch)
    x = batch.x.astype(np.float64)
    tokens = batch.completion_mask.sum(axis=1).astype(np.float64)
    pred = x @ w
    grad = 2.0 * (tokens * pred) @ x / tokens.sum()
    np.testing.assert_allclose(state.params["w"], w - lr * grad, rtol=1e-5)
    np.testing.assert_allclose(metrics["loss"], np.sum(tokens * pred**2) / tokens.sum(), rtol=1e-5)
    np.testing.assert_allclose(metrics["grad_norm"], np.linalg.norm(grad), rtol=1e-5)
    # Metrics are summed over micro-batches, except *_max (max) ...
    np.testing.assert_allclose(metrics["pred_max"], pred.max(), rtol=1e-5)
    assert float(metrics["rows"]) == len(pred)
    # ... and the whole batch's token count is reported.
    assert float(metrics["num_tokens"]) == tokens.sum()
    assert int(state.step) == 1


@pytest.mark.parametrize("micro_batches", [1, 2, 4])
def test_averaged_micro_batches_give_the_full_batch_update(micro_batches):
    lr, w = 0.1, np.array([0.5, -1.0, 2.0])
    batch = _toy_batch()
    step = jax.jit(
        make_step(_toy_mean_loss, optax.sgd(lr), micro_batches=micro_batches, accumulate="mean")
    )
    state, metrics = step(_toy_state(optax.sgd(lr), w), batch)
    x = batch.x.astype(np.float64)
    residual = x @ w - 1.0
    grad = 2.0 * residual @ x / len(x)
    np.testing.assert_allclose(state.params["w"], w - lr * grad, rtol=1e-5)
    np.testing.assert_allclose(metrics["loss"], np.mean(residual**2), rtol=1e-5)
    assert "num_tokens" not in metrics


@pytest.mark.parametrize(
    ("budget", "rows", "seq_len", "devices", "expected"),
    [
        # 256 rows x 40 positions (the GRPO benchmark's update): 2 x 128 x 40 = 5120 > 4096,
        # 4 x 64 x 40 = 2560 <= 4096.
        (TokenBudget(4096), 256, 40, 1, 4),
        (TokenBudget(2048), 256, 40, 1, 8),
        # The default task's 256 x 14 = 3584 positions fit in one.
        (TokenBudget(4096), 256, 14, 1, 1),
        # The configured micro_batches is a floor.
        (TokenBudget(4096, minimum=2), 256, 14, 1, 2),
        # Per device: 16 rows over 4 devices, 100 positions each, 100 per device -> 1 row per
        # device per micro-batch -> K = 4.
        (TokenBudget(100), 16, 100, 4, 4),
        # The budget is per device: 16 rows over 2 devices, 200 per device -> 2 rows per device
        # -> 4 rows per micro-batch -> K = 4 (a global budget would give 8).
        (TokenBudget(200), 16, 100, 2, 4),
        # Too small a budget: the fewest rows that still split over the devices (8 / 4 = 2).
        (TokenBudget(10), 8, 40, 2, 4),
        # 12 rows over 1 device: 12 x 5 = 60 > 50, 6 x 5 = 30 <= 50 -> K = 2; K = 5 skipped.
        (TokenBudget(50), 12, 5, 1, 2),
        # No count >= 4 leaves 8 rows splitting over 4 devices: the floor (the trainer's
        # batch-size check names the key).
        (TokenBudget(1, minimum=4), 8, 3, 4, 4),
    ],
)
def test_token_budget_picks_the_micro_batch_count(budget, rows, seq_len, devices, expected):
    assert budget.micro_batches(rows, seq_len, devices) == expected


def test_token_budget_rejects_bad_sizes():
    with pytest.raises(ValueError, match="tokens >= 1"):
        TokenBudget(0).micro_batches(8, 4)
    with pytest.raises(ValueError, match="must be >= 1"):
        TokenBudget(16).micro_batches(8, 0)


def test_token_budget_step_gives_the_full_batch_update():
    """K from the batch's shape (8 rows x 4 positions, 8 per micro-batch -> K = 4), same update."""
    lr, w = 0.1, np.array([0.5, -1.0, 2.0])
    batch = _toy_batch(rows=8, length=4)

    def loss_fn(params, micro, totals):
        loss, metrics = _toy_sum_loss(params, micro, totals)
        return loss, {**metrics, "parts": jnp.float32(1.0)}  # summed: the scan's length

    step = jax.jit(make_step(loss_fn, optax.sgd(lr), micro_batches=TokenBudget(8)))
    state, metrics = step(_toy_state(optax.sgd(lr), w), batch)
    x = batch.x.astype(np.float64)
    tokens = batch.completion_mask.sum(axis=1).astype(np.float64)
    grad = 2.0 * (tokens * (x @ w)) @ x / tokens.sum()
    np.testing.assert_allclose(state.params["w"], w - lr * grad, rtol=1e-5)
    assert float(metrics["parts"]) == 4 and int(metrics["micro_batches"]) == 4
    assert float(metrics["rows"]) == 8


def test_make_step_checks_its_arguments():
    with pytest.raises(ValueError, match="micro_batches must be >= 1, got 0"):
        make_step(_toy_sum_loss, optax.sgd(0.1), micro_batches=0)
    with pytest.raises(ValueError, match=r"accumulate must be one of \('sum', 'mean'\)"):
        make_step(_toy_sum_loss, optax.sgd(0.1), accumulate="max")
    step = make_step(_toy_sum_loss, optax.sgd(0.1), micro_batches=3)
    with pytest.raises(ValueError, match="micro_batches=3 does not divide the batch size B=8"):
        jax.jit(step)(_toy_state(optax.sgd(0.1), np.zeros(3)), _toy_batch())
