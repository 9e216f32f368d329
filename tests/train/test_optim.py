"""``train.optim``: the learning-rate schedules' values, and the optimizer stepping by them.

Values are hand-computed from the documented formulas (linear warm-up from 0 over
``warmup_steps``, then constant / linear / cosine decay to ``final_fraction·peak`` at
``total_steps``); the optimizer is checked on losses whose AdamW trajectory is known in closed
form (a constant gradient) or written out in float64 NumPy (a quadratic).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.train import optim

PEAK, WARMUP, TOTAL = 0.1, 4, 12
COS_QUARTER = 0.5 * (1 + math.cos(math.pi / 4))  # cosine factor a quarter into the decay

# step -> learning rate, by hand: peak 0.1, warm-up 4 steps, decay over steps 4..12.
# Checkpoints: step 0, mid-warm-up, end of warm-up, a quarter and half into the decay, the end,
# past the end.
EXPECTED = {
    ("constant", 0.0): {0: 0.0, 2: 0.05, 4: 0.1, 6: 0.1, 8: 0.1, 12: 0.1, 40: 0.1},
    ("linear", 0.0): {0: 0.0, 2: 0.05, 4: 0.1, 6: 0.075, 8: 0.05, 12: 0.0, 40: 0.0},
    # final_fraction 0.1: the decay ends at 0.01 = peak·(f + (1 − f)·shape).
    ("linear", 0.1): {0: 0.0, 2: 0.05, 4: 0.1, 6: 0.0775, 8: 0.055, 12: 0.01, 40: 0.01},
    ("cosine", 0.0): {
        0: 0.0,
        2: 0.05,
        4: 0.1,
        6: 0.1 * COS_QUARTER,
        8: 0.05,
        12: 0.0,
        40: 0.0,
    },
    ("cosine", 0.1): {
        0: 0.0,
        2: 0.05,
        4: 0.1,
        6: 0.1 * (0.1 + 0.9 * COS_QUARTER),
        8: 0.055,
        12: 0.01,
        40: 0.01,
    },
}


def hand_lr(schedule: str, t: int, *, warmup=WARMUP, total=TOTAL, final_fraction=0.0) -> float:
    """The documented schedule, in float64: warm-up ``peak·t/W``, then the decay's shape."""
    if t < warmup:
        return PEAK * t / warmup
    if schedule == "constant":
        return PEAK
    progress = min(t - warmup, total - warmup) / (total - warmup)
    shape = 1 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return PEAK * (final_fraction + (1 - final_fraction) * shape)


@pytest.mark.parametrize(("schedule", "final_fraction"), list(EXPECTED))
def test_schedule_values(schedule, final_fraction):
    kwargs = {} if schedule == "constant" else {"total_steps": TOTAL}
    lr = optim.make_schedule(
        PEAK, schedule=schedule, warmup_steps=WARMUP, final_fraction=final_fraction, **kwargs
    )
    for t, want in EXPECTED[schedule, final_fraction].items():
        assert want == pytest.approx(hand_lr(schedule, t, final_fraction=final_fraction))
        # Python ints and the int32 step count optax passes inside a jitted update.
        np.testing.assert_allclose(float(lr(t)), want, rtol=1e-6, atol=1e-9, err_msg=f"t={t}")
        np.testing.assert_allclose(
            float(jax.jit(lr)(jnp.int32(t))), want, rtol=1e-6, atol=1e-9, err_msg=f"t={t}"
        )


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_schedule_without_warmup_starts_at_the_peak(schedule):
    kwargs = {} if schedule == "constant" else {"total_steps": 8}
    lr = optim.make_schedule(PEAK, schedule=schedule, final_fraction=0.25, **kwargs)
    np.testing.assert_allclose(float(lr(0)), PEAK, rtol=1e-6)
    for t in (1, 4, 8, 9):
        want = hand_lr(schedule, t, warmup=0, total=8, final_fraction=0.25)
        np.testing.assert_allclose(float(lr(t)), want, rtol=1e-6, err_msg=f"t={t}")
    if schedule != "constant":
        np.testing.assert_allclose(float(lr(8)), 0.025, rtol=1e-6)


# -- the optimizer steps by the schedule -------------------------------------------------------


def _steps(optimizer, params, grad_fn, steps):
    """``steps`` optax updates; returns the parameters after each (float64), the first included."""
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    out = [np.asarray(params, np.float64)]
    for _ in range(steps):
        updates, state = update(grad_fn(params), state, params)
        params = params + updates
        out.append(np.asarray(params, np.float64))
    return out


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_optimizer_moves_by_the_scheduled_learning_rate(schedule):
    """A constant gradient ``g``: Adam's bias-corrected ``m̂ = g``, ``v̂ = g²`` at every step, so
    step ``t`` moves by exactly ``−lr(t)·g/(|g| + ε)``; after ``k`` steps
    ``p_k = p_0 − Σ_{t<k} lr(t)·g/(|g| + ε)`` (0-based ``t``: the first step uses ``lr(0)``)."""
    eps = 1e-3
    g = np.array([0.5, -2.0, 0.004, -1e-3], np.float32)  # some entries comparable to eps
    p0 = jnp.array([1.0, -1.0, 0.5, 2.0], jnp.float32)
    optimizer = optim.make_optimizer(
        PEAK,
        schedule=schedule,
        warmup_steps=WARMUP,
        total_steps=TOTAL,
        eps=eps,
        max_grad_norm=None,
    )
    trajectory = _steps(optimizer, p0, lambda p: jnp.asarray(g), TOTAL + 2)
    direction = g.astype(np.float64) / (np.abs(g.astype(np.float64)) + eps)
    # rtol 1e-4: optax forms 1 − b2^t in float32 (b2 = 0.999), ~1e-5 off for small t, which
    # shows where |g| ~ eps. A learning rate off by a factor or a step is off by O(1).
    for k in range(1, len(trajectory)):
        step = trajectory[k] - trajectory[k - 1]
        np.testing.assert_allclose(
            step, -hand_lr(schedule, k - 1) * direction, rtol=1e-4, atol=1e-9, err_msg=f"k={k}"
        )
        total_lr = sum(hand_lr(schedule, t) for t in range(k))
        np.testing.assert_allclose(
            trajectory[k] - trajectory[0], -total_lr * direction, rtol=1e-4, err_msg=f"k={k}"
        )


def _reference_adamw(p, grad_fn, steps, *, lr, b1, b2, eps, weight_decay, max_grad_norm):
    """Global-norm clip → Adam with bias correction → decoupled weight decay, float64."""
    p = np.asarray(p, np.float64)
    m, v = np.zeros_like(p), np.zeros_like(p)
    out = [p]
    for t in range(steps):
        g = grad_fn(p)
        norm = np.linalg.norm(g)
        if max_grad_norm is not None and norm >= max_grad_norm:
            g = g * max_grad_norm / norm
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g**2
        m_hat, v_hat = m / (1 - b1 ** (t + 1)), v / (1 - b2 ** (t + 1))
        p = p - lr(t) * (m_hat / (np.sqrt(v_hat) + eps) + weight_decay * p)
        out.append(p)
    return out


A = np.array([4.0, 0.5, 10.0, 1.0, 2.0])
C = np.array([1.0, -2.0, 0.5, 3.0, -1.0])


@pytest.mark.parametrize(
    "kwargs",
    [
        # The defaults: constant lr, no weight decay, clipping at norm 1 (active here: |∇| > 5),
        # b1 0.9, b2 0.999, eps 1e-8.
        {},
        # Everything set: warm-up + cosine, weight decay, a tight clip and an eps comparable to
        # the clipped gradient (so the gradient's scale, not only its sign, shows in the step).
        {
            "schedule": "cosine",
            "warmup_steps": 3,
            "total_steps": 9,
            "weight_decay": 0.3,
            "b1": 0.8,
            "b2": 0.95,
            "eps": 1e-2,
            "max_grad_norm": 0.05,
        },
    ],
    ids=["defaults", "cosine-wd-clip"],
)
def test_adamw_on_a_quadratic_matches_float64_reference(kwargs):
    """``f(p) = ½·Σ a·(p − c)²`` for 11 steps (past the schedule's end)."""
    steps = 11
    settings = {
        "schedule": "constant",
        "warmup_steps": 0,
        "total_steps": None,
        "weight_decay": 0.0,
        "b1": 0.9,
        "b2": 0.999,
        "eps": 1e-8,
        "max_grad_norm": 1.0,
        **kwargs,
    }
    optimizer = optim.make_optimizer(PEAK, **kwargs)
    p0 = np.zeros(5)
    got = _steps(
        optimizer,
        jnp.asarray(p0, jnp.float32),
        lambda p: jnp.asarray(A, jnp.float32) * (p - C),
        steps,
    )
    warmup, total = settings["warmup_steps"], settings["total_steps"] or 1
    want = _reference_adamw(
        p0,
        lambda p: A * (p - C),
        steps,
        lr=lambda t: hand_lr(settings["schedule"], t, warmup=warmup, total=total),
        b1=settings["b1"],
        b2=settings["b2"],
        eps=settings["eps"],
        weight_decay=settings["weight_decay"],
        max_grad_norm=settings["max_grad_norm"],
    )
    # Compared as whole update vectors: near the minimum the float32 gradient ``a·(p − c)`` of
    # the library run loses digits to cancellation, entry by entry.
    for k in range(1, steps + 1):
        step, want_step = got[k] - got[k - 1], want[k] - want[k - 1]
        err = np.linalg.norm(step - want_step)
        assert err <= 1e-4 * np.linalg.norm(want_step), (k, step, want_step)
    # The clip binds on every step of this problem.
    assert all(np.linalg.norm(A * (p - C)) > settings["max_grad_norm"] for p in want[:-1])


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("total_steps", [None, 0, 3, 4])
def test_decaying_schedule_needs_total_steps_past_warmup(schedule, total_steps):
    match = (
        rf"schedule '{schedule}' needs total_steps > warmup_steps, got "
        rf"total_steps={total_steps}, warmup_steps=4"
    )
    with pytest.raises(ValueError, match=match):
        optim.make_schedule(PEAK, schedule=schedule, warmup_steps=4, total_steps=total_steps)
    with pytest.raises(ValueError, match=match):
        optim.make_optimizer(PEAK, schedule=schedule, warmup_steps=4, total_steps=total_steps)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match=r"unknown schedule 'exponential'; expected one of"):
        optim.make_schedule(PEAK, schedule="exponential", total_steps=10)
    with pytest.raises(ValueError, match=r"unknown schedule 'Cosine'"):
        optim.make_optimizer(PEAK, schedule="Cosine", total_steps=10)
    with pytest.raises(ValueError, match="learning_rate must be >= 0, got -0.1"):
        optim.make_schedule(-0.1)
    with pytest.raises(ValueError, match="warmup_steps must be >= 0, got -1"):
        optim.make_schedule(PEAK, warmup_steps=-1)
    with pytest.raises(ValueError, match="max_grad_norm must be > 0, got 0"):
        optim.make_optimizer(PEAK, max_grad_norm=0.0)
    with pytest.raises(ValueError, match=r"final_fraction must be in \[0, 1\], got 1.5"):
        optim.make_optimizer(PEAK, schedule="cosine", total_steps=10, final_fraction=1.5)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_optimizer_decays_to_the_final_fraction(schedule):
    """``make_optimizer(final_fraction=f)``: past ``total_steps`` each step moves by ``f·peak``
    (constant gradient: Adam's normalised step is ``lr·g/(|g| + ε)``)."""
    g = np.array([0.5, -2.0], np.float32)
    optimizer = optim.make_optimizer(
        PEAK, schedule=schedule, total_steps=4, final_fraction=0.1, eps=1e-8, max_grad_norm=None
    )
    trajectory = _steps(optimizer, jnp.zeros(2, jnp.float32), lambda p: jnp.asarray(g), 7)
    np.testing.assert_allclose(trajectory[7] - trajectory[6], -0.1 * PEAK * np.sign(g), rtol=1e-4)


def test_the_configs_final_lr_fraction_reaches_the_optimizer(monkeypatch, tmp_path):
    from jaxrl_llm.train.config_io import load_config  # noqa: PLC0415
    from jaxrl_llm.train.rl import trainer as rl_trainer  # noqa: PLC0415
    from jaxrl_llm.train.rl.config import TrainConfig  # noqa: PLC0415

    seen = {}
    real = optim.make_optimizer

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(optim, "make_optimizer", spy)
    cfg = load_config(
        TrainConfig,
        None,
        [
            f"run_dir={tmp_path}",
            "mesh.fsdp=1",
            "trainer.schedule=cosine",
            "trainer.final_lr_fraction=0.25",
        ],
    )
    rl_trainer.RLTrainer(cfg)
    assert seen["final_fraction"] == 0.25 and seen["schedule"] == "cosine"


def _bf16(x):
    """Rounded to bfloat16 (nearest even), back in float64: what a bf16 store keeps."""
    return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16)).astype(np.float64)


def test_bf16_optimizer_state_stores_rounded_moments_and_updates_in_f32():
    """``state_dtype="bfloat16"``: m and v are kept in bf16 between steps; each step runs Adam
    at full precision from the stored (rounded) moments, float64 reference:
    ``m_t = b1·m̃_{t−1} + (1−b1)·g``, ``v_t = b2·ṽ_{t−1} + (1−b2)·g²``,
    ``Δ = −lr·m̂_t/(√v̂_t + ε)`` (bias-corrected), then ``m̃_t = bf16(m_t)``, ``ṽ_t = bf16(v_t)``."""
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    optimizer = optim.make_optimizer(lr, max_grad_norm=None, state_dtype="bfloat16")
    p = jnp.asarray([1.0, -0.3, 0.77, 2.5, 0.1], jnp.float32)
    state = optimizer.init(p)
    floating = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floating and all(x.dtype == jnp.bfloat16 for x in floating)
    update = jax.jit(optimizer.update)
    m = v = np.zeros(5)
    for t in range(1, 5):
        g = A * (np.asarray(p, np.float64) - C)
        updates, state = update(jnp.asarray(g, jnp.float32), state, p)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g**2
        step = -lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        # rtol 1e-4: optax forms 1 − b2^t in f32 (see above); starting from unrounded moments
        # would be ~2e-3 off.
        np.testing.assert_allclose(np.asarray(updates, np.float64), step, rtol=1e-4)
        stored_m, stored_v = _adam_moments(state)
        np.testing.assert_allclose(stored_m, _bf16(m), rtol=2**-8)
        np.testing.assert_allclose(stored_v, _bf16(v), rtol=2**-8)
        m, v = stored_m, stored_v  # the next step starts from what was stored
        p = p + updates


def test_moments_are_f32_by_default_even_for_bf16_parameters():
    optimizer = optim.make_optimizer(0.01)
    state = optimizer.init({"w": jnp.ones((3, 2), jnp.bfloat16)})
    moments = [x for x in jax.tree.leaves(state) if getattr(x, "shape", ()) == (3, 2)]
    assert len(moments) == 2 and all(x.dtype == jnp.float32 for x in moments)


def _adam_moments(state):
    leaves = [x for x in jax.tree.leaves(state) if getattr(x, "shape", ()) == (5,)]
    assert len(leaves) == 2, leaves
    return [np.asarray(x, np.float64) for x in leaves]
