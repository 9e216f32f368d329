"""The adaptive entropy coefficient (``jaxrl_llm.objectives.entropy_control`` and
``policy_loss(entropy_coef=...)``) against the float64 transcription of TRL's controller in
tests/reference/m2po.py, and the bonus against tests/reference/objectives.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from jaxrl_llm import objectives
from jaxrl_llm.objectives import EntropyControl, entropy_control, make
from tests.jit_traces import count_traces
from tests.objectives.helpers import (
    GRAD_ATOL,
    GRAD_RTOL,
    RTOL,
    distill_inputs,
    loss_and_grad,
    policy_data,
    rollout_batch,
)
from tests.reference import m2po as m2ref
from tests.reference import objectives as ref
from tests.reference import stabilisers as stab

ATOL = 1e-6
TARGET = 0.5


def _objective(**overrides):
    fields = {
        "entropy_target": TARGET,
        "entropy_coef": 0.01,
        "entropy_coef_delta": 0.02,
        "entropy_coef_bounds": (0.0, 0.05),
        **overrides,
    }
    return make("dapo", **fields)


def _run(objective, entropies):
    """The controller over a run under one ``lax.scan``: ``(applied, coefs)`` per step."""

    def step(control, entropy):
        applied = entropy_control.applied_coef(objective, control)
        metrics = {"entropy": entropy}
        return entropy_control.update_control(objective, control, metrics), (
            applied,
            control.coef,
        )

    control = entropy_control.init_control(objective)
    final, (applied, before) = jax.jit(lambda c, h: jax.lax.scan(step, c, h))(
        control, jnp.asarray(entropies, jnp.float32)
    )
    coefs = np.append(np.asarray(before)[1:], float(final.coef))
    return np.asarray(applied), coefs, final


def test_controller_matches_trl_over_a_run():
    # Up to the upper bound, at the target exactly (≤: up), down to the lower bound, back up.
    entropies = [0.3, 0.4, 0.5, 0.45, 0.2, 0.9, 0.8, 0.7, 0.6, 0.55, 0.1, 0.5]
    objective = _objective()
    applied, coefs, final = _run(objective, entropies)
    want_applied, want_coefs = m2ref.adaptive_entropy(
        0.01, entropies, target=TARGET, delta=0.02, low=0.0, high=0.05
    )
    np.testing.assert_allclose(applied, want_applied, rtol=1e-6, atol=ATOL)
    np.testing.assert_allclose(coefs, want_coefs, rtol=1e-6, atol=ATOL)
    # Hand-checked: nothing before the first measurement; clipped at 0.05 and at 0.
    assert applied[0] == 0.0 and applied[1] == pytest.approx(0.03)
    assert coefs.max() == pytest.approx(0.05) and coefs.min() == 0.0
    assert float(final.entropy) == pytest.approx(0.5)


def test_controller_state_resumes_bit_exactly():
    """A run cut in two, its state through host NumPy (a checkpoint's round trip), repeats
    the uncut run to the bit."""
    objective = _objective()
    entropies = np.linspace(0.2, 0.9, 10).astype(np.float32)
    _, _, final = _run(objective, entropies)

    def scan(control, h):
        def step(c, e):
            return entropy_control.update_control(objective, c, {"entropy": e}), c.coef

        return jax.lax.scan(step, control, jnp.asarray(h))

    half, _ = scan(entropy_control.init_control(objective), entropies[:5])
    saved = EntropyControl(*(np.asarray(x) for x in jax.device_get(half)))
    restored = EntropyControl(*(jnp.asarray(x) for x in saved))
    resumed, _ = scan(restored, entropies[5:])
    assert np.asarray(resumed.coef).tobytes() == np.asarray(final.coef).tobytes()
    assert np.asarray(resumed.entropy).tobytes() == np.asarray(final.entropy).tobytes()
    assert [leaf.dtype for leaf in jax.tree.leaves(final)] == [jnp.float32] * 2


def test_pure_update_rule_hand_checked():
    up = entropy_control.adaptive_entropy_coef(0.1, 0.2, target=0.3, delta=0.05, bounds=(0, 1))
    down = entropy_control.adaptive_entropy_coef(0.1, 0.4, target=0.3, delta=0.05, bounds=(0, 1))
    capped = entropy_control.adaptive_entropy_coef(0.98, 0.0, target=0.3, delta=0.05, bounds=(0, 1))
    floored = entropy_control.adaptive_entropy_coef(
        0.02, 9.0, target=0.3, delta=0.05, bounds=(0.01, 1)
    )
    np.testing.assert_allclose([up, down, capped, floored], [0.15, 0.05, 1.0, 0.01], rtol=1e-6)
    assert float(entropy_control.gated_coef(0.2, jnp.inf, target=0.3)) == 0.0
    assert float(entropy_control.gated_coef(0.2, 0.3, target=0.3)) == pytest.approx(0.2)
    assert float(entropy_control.gated_coef(0.2, 0.31, target=0.3)) == 0.0
    grad = jax.grad(
        lambda c: entropy_control.adaptive_entropy_coef(
            c, 0.2, target=0.3, delta=0.1, bounds=(0, 1)
        )
    )(0.5)
    assert float(grad) == 0.0


def test_policy_loss_applies_the_given_coefficient(rng):
    data = policy_data(rng)
    objective = _objective(entropy_coef=0.0)
    batch = rollout_batch(data)
    lp, h = jnp.asarray(data["logprobs"]), jnp.asarray(data["entropy"])

    @jax.jit
    def run(lp, h, coef):
        out = objectives.policy_loss(objective, lp, batch, entropy=h, entropy_coef=coef)
        return out.loss, out.metrics

    with count_traces("run") as traced:
        first = run(lp, h, jnp.float32(0.0))
    for coef in (0.0, 0.03):  # one compile: the coefficient is traced
        loss, metrics = first if coef == 0.0 else run(lp, h, jnp.float32(coef))
        cfg = ref.config("dapo", entropy_coef=coef)
        want_loss, want_metrics, _ = ref.policy_loss(
            cfg,
            data["logprobs"],
            data["old_logprobs"],
            data["row_advantages"],
            data["mask"],
            entropy=data["entropy"],
        )
        np.testing.assert_allclose(float(loss), want_loss, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(float(metrics["entropy_coef"]), coef, rtol=1e-6)
        np.testing.assert_allclose(
            float(metrics["entropy_loss"]),
            np.sum(ref.aggregation_weights(data["mask"], "token-mean") * data["entropy"]),
            rtol=RTOL,
        )
    with count_traces("run") as retraced:
        run(lp, h, jnp.float32(0.5))
    assert traced == ["run"] and retraced == []
    d_entropy = jax.grad(
        lambda x: (
            objectives.policy_loss(
                objective, lp, batch, entropy=x, entropy_coef=jnp.float32(0.03)
            ).loss
        )
    )(h)
    w = ref.aggregation_weights(data["mask"], "token-mean")
    np.testing.assert_allclose(np.asarray(d_entropy), -0.03 * w, rtol=GRAD_RTOL, atol=GRAD_ATOL)


def test_measured_entropy_is_the_bonus_tokens_mean_over_micro_batches(rng):
    data = policy_data(rng)
    mask, h = data["mask"], data["entropy"]
    for quantile in (1.0, 0.4):
        objective = _objective(top_entropy_quantile=quantile)
        full = rollout_batch(data, global_norm=True)
        summed: dict[str, float] = {}
        for rows in (slice(0, 3), slice(3, 6)):
            part = jax.tree.map(lambda x, r=rows: x if jnp.ndim(x) == 0 else x[r], full)
            out = objectives.policy_loss(
                objective,
                jnp.asarray(data["logprobs"][rows]),
                part,
                entropy=jnp.asarray(h[rows]),
                entropy_coef=jnp.float32(0.02),
            )
            for key, value in out.metrics.items():
                summed[key] = summed.get(key, 0.0) + float(value)
        # TRL: the token mean over the whole window of the tokens the bonus acts on.
        keep = (
            mask
            if quantile == 1.0
            else np.concatenate(
                [stab.top_entropy_mask(h[r], mask[r], quantile) for r in (slice(0, 3), slice(3, 6))]
            )
        )
        want = np.sum(h * keep) / np.sum(keep)
        got = entropy_control.measured_entropy(objective, summed)
        np.testing.assert_allclose(float(got), want, rtol=RTOL)
        np.testing.assert_allclose(summed["entropy_coef"], 0.02, rtol=1e-6)


def test_measured_entropy_without_tokens_is_zero():
    objective = _objective(top_entropy_quantile=0.5)
    metrics = {"entropy": 0.0, "entropy_top": 0.0, "top_entropy_frac": 0.0}
    assert float(entropy_control.measured_entropy(objective, metrics)) == 0.0
    with pytest.raises(ValueError, match="entropy_top"):
        entropy_control.measured_entropy(objective, {"entropy": 0.1})


def test_policy_loss_asks_for_the_coefficient_exactly_when_adaptive(rng):
    data = policy_data(rng)
    batch = rollout_batch(data)
    lp, h = jnp.asarray(data["logprobs"]), jnp.asarray(data["entropy"])
    with pytest.raises(ValueError, match="entropy_target"):
        objectives.policy_loss(_objective(), lp, batch, entropy=h)
    with pytest.raises(ValueError, match="entropy_target"):
        objectives.policy_loss(make("dapo"), lp, batch, entropy=h, entropy_coef=0.1)
    with pytest.raises(ValueError, match="entropy"):
        objectives.policy_loss(_objective(), lp, batch, entropy_coef=0.1)
    with pytest.raises(ValueError, match="entropy_coef"):
        objectives.policy_loss(_objective(), lp, batch, entropy=h, entropy_coef=jnp.ones(2))
    with pytest.raises(ValueError, match="entropy_target"):
        entropy_control.init_control(make("dapo"))


def test_every_preset_takes_the_adaptive_coefficient(rng):
    """Finite losses and gradients, 0 on padding; coefficient 0: the preset's loss exactly."""
    data = policy_data(rng)
    batch = rollout_batch(data)
    lp, h = jnp.asarray(data["logprobs"]), jnp.asarray(data["entropy"])
    for name in objectives.available():
        objective = make(name, entropy_target=0.5)
        inputs, extra = distill_inputs(objective, batch, lp.shape)

        def loss_fn(x, objective=objective, inputs=inputs, extra=extra):
            return objectives.policy_loss(
                objective, x, inputs, entropy=h, entropy_coef=0.05, **extra
            ).loss

        loss, grad = jax.value_and_grad(loss_fn)(lp)
        assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grad))), name
        assert not np.any(np.asarray(grad)[data["mask"] == 0]), name
        off = objectives.policy_loss(
            objective, lp, inputs, entropy=h, entropy_coef=0.0, **extra
        ).loss
        assert float(off) == float(loss_and_grad(make(name), lp, batch, h)[0]), name


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"entropy_target": -0.1}, "entropy_target"),
        ({"entropy_target": 0.2, "entropy_coef_delta": 0.0}, "entropy_coef_delta"),
        ({"entropy_target": 0.2, "entropy_coef_bounds": (0.5, 0.1)}, "entropy_coef_bounds"),
        ({"entropy_target": 0.2, "entropy_coef_bounds": (-0.1, 0.1)}, "entropy_coef_bounds"),
        ({"entropy_target": 0.2, "entropy_coef": 2.0}, "entropy_coef_bounds"),
    ],
)
def test_adaptive_entropy_settings_are_validated(overrides, match):
    with pytest.raises(ValueError, match=match):
        make("grpo", **overrides)


def test_adaptive_entropy_is_configured_from_yaml():
    from jaxrl_llm.train.rl.config import ObjectiveSection, make_objective  # noqa: PLC0415

    text = """
    name: grpo
    overrides:
      entropy_coef: 0.001
      entropy_target: 0.3
      entropy_coef_delta: 0.0005
      entropy_coef_bounds: [0.0, 0.01]
    """
    objective = make_objective(ObjectiveSection(**yaml.safe_load(text)))
    assert objective.entropy.coef_bounds == (0.0, 0.01) and objective.entropy.adaptive
    assert objective.needs_entropy and not make("grpo").entropy.adaptive
    hash(objective)
