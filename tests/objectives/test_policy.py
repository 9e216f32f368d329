"""Tests of jaxrl_llm.objectives.policy: policy_loss against the float64 reference.

Every preset and a set of overridden combinations, then hand cases, identities,
micro-batching, padding, jit / vmap / dtypes and errors.
"""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import objectives
from jaxrl_llm.objectives import make
from jaxrl_llm.types import RolloutBatch
from tests.objectives.helpers import (
    AGGREGATIONS,
    ATOL,
    GRAD_ATOL,
    GRAD_RTOL,
    RTOL,
    B,
    T,
    assert_matches_reference,
    hand_case,
    loss_and_grad,
    policy_data,
    reference_loss,
    rollout_batch,
    single_token,
)
from tests.reference import objectives as ref


@functools.cache
def _every_preset_under_jit():
    """One jitted call evaluating every preset (one compile for all of them)."""
    data = policy_data(np.random.default_rng(7))

    @jax.jit
    def run(logprobs, batch, entropy):
        return {
            name: loss_and_grad(make(name), logprobs, batch, entropy)
            for name in objectives.available()
        }

    return data, run(
        jnp.asarray(data["logprobs"]), rollout_batch(data), jnp.asarray(data["entropy"])
    )


# --------------------------------------------------------------------------------------
# policy_loss against the float64 reference
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", objectives.available())
def test_every_preset_has_finite_loss_and_gradient_under_jit(name):
    data, results = _every_preset_under_jit()
    loss, metrics, grad = results[name]
    chex.assert_tree_all_finite((loss, metrics, grad))
    chex.assert_shape(grad, (B, T))
    # Masked positions (padding and the all-masked row) get exactly zero gradient.
    assert np.all(np.asarray(grad)[data["mask"] == 0] == 0.0)
    # GKD's preset has no advantage: its gradient reaches the student's top-k log-probs only.
    assert np.any(np.asarray(grad) != 0.0) or make(name).advantage.name == "none"


@pytest.mark.parametrize("per_token", [False, True], ids=["adv[B]", "adv[B,T]"])
@pytest.mark.parametrize("name", ref.PRESET_NAMES)
def test_preset_policy_loss_matches_reference(name, per_token, rng):
    # [B, T] advantages also run with explicit global normalisers (the micro-batch path).
    assert_matches_reference(
        make(name), ref.config(name), policy_data(rng), per_token=per_token, global_norm=per_token
    )


CUSTOM = [
    ("grpo", {"kl_straight_through": True, "entropy_coef": 0.01}),
    ("grpo", {"kl_kind": "k2", "aggregation": "token-sum"}),
    ("grpo", {"kl_kind": "abs", "aggregation": "seq-mean-token-sum"}),
    ("ppo", {"kl_placement": "loss", "kl_coef": 0.1}),
    ("dapo", {"dual_clip": 2.0, "entropy_coef": 0.02}),
    ("cispo", {"clip_low": 0.3, "clip_high": 1.0}),
    ("dr_grpo", {"norm_constant": 5.0}),
    ("gspo", {"aggregation": "token-mean"}),
    ("gmpo", {"aggregation": "token-mean"}),
    ("sapo", {"tau_pos": 2.0, "tau_neg": 0.5}),
    ("gpg", {"aggregation": "seq-mean-token-mean", "entropy_coef": 0.05}),
    ("grpo", {"ratio": "gspo_token", "surrogate": "cispo", "clip_low": None, "clip_high": 4.0}),
]


@pytest.mark.parametrize("name, overrides", CUSTOM, ids=[f"{n}-{sorted(o)}" for n, o in CUSTOM])
def test_overridden_combination_matches_reference(name, overrides, rng):
    assert_matches_reference(
        make(name, **overrides), ref.config(name, **overrides), policy_data(rng), per_token=True
    )


# Configurations whose gradient is the gradient of their value (no stop-gradient weight, no
# straight-through estimator), so the analytic reference gradient must match finite differences.
FD_CASES = [
    (name, overrides, per_token)
    for name, overrides in [
        ("grpo", {}),
        ("ppo", {"kl_placement": "loss"}),
        ("dapo", {"dual_clip": 2.0}),
        ("sapo", {}),
        ("gmpo", {}),
        ("gmpo", {"aggregation": "token-sum"}),
        ("gpg", {}),
        ("dr_grpo", {}),
        ("grpo", {"kl_kind": "k2"}),
        ("grpo", {"kl_kind": "abs"}),
    ]
    for per_token in (False, True)
]
# With [B] advantages and seq-mean-token-mean, GSPO-token's per-token gradient is the gradient
# of the sequence-level objective (not so with [B, T] advantages).
FD_CASES.append(("gspo", {}, False))


@pytest.mark.parametrize(
    "name, overrides, per_token",
    FD_CASES,
    ids=[f"{n}-{sorted(o)}-{'adv[B,T]' if p else 'adv[B]'}" for n, o, p in FD_CASES],
)
def test_reference_gradient_matches_finite_differences(name, overrides, per_token, rng):
    cfg = ref.config(name, **overrides)
    data = policy_data(rng)
    _, _, grad = reference_loss(cfg, data, per_token=per_token)
    lp = data["logprobs"].astype(np.float64)
    step = 1e-6
    numeric = np.zeros_like(lp)
    for idx in np.ndindex(*lp.shape):
        if data["mask"][idx] == 0:
            continue
        values = []
        for sign in (1.0, -1.0):
            shifted = lp.copy()
            shifted[idx] += sign * step
            values.append(
                reference_loss(cfg, {**data, "logprobs": shifted}, per_token=per_token)[0]
            )
        numeric[idx] = (values[0] - values[1]) / (2 * step)
    np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------------
# Hand-checked edge cases
# --------------------------------------------------------------------------------------


def test_ppo_clip_hand_cases():
    dapo = make("dapo")  # clip 0.2 / 0.28, no dual clip
    loss, metrics, grad = single_token(dapo, math.log(1.5), 1.0)
    assert loss == pytest.approx(-1.28) and grad == 0.0
    assert metrics["clip_frac"] == 1.0 and metrics["clip_frac_lower"] == 0.0
    assert metrics["ratio_mean"] == pytest.approx(1.5)
    assert metrics["approx_kl"] == pytest.approx(-math.log(1.5))
    # Inside the bounds: -A r, gradient -A r.
    loss, metrics, grad = single_token(dapo, math.log(1.1), -2.0)
    assert loss == pytest.approx(2.2) and grad == pytest.approx(2.2)
    assert metrics["clip_frac"] == 0.0
    # A < 0, ratio below 1 - clip_low: the clipped term wins, no gradient.
    loss, metrics, grad = single_token(dapo, math.log(0.5), -1.0)
    assert loss == pytest.approx(0.8) and grad == 0.0 and metrics["clip_frac"] == 1.0


def test_dual_clip_applies_to_negative_advantages_only():
    ppo = make("ppo")  # dual clip 3
    loss, metrics, grad = single_token(ppo, math.log(4.0), -1.0)
    assert loss == pytest.approx(3.0) and grad == 0.0
    assert metrics["clip_frac_lower"] == 1.0 and metrics["clip_frac"] == 0.0
    # Under the dual bound the ordinary PPO loss -A r stands.
    loss, metrics, grad = single_token(ppo, math.log(2.0), -1.0)
    assert loss == pytest.approx(2.0) and grad == pytest.approx(2.0)
    assert metrics["clip_frac_lower"] == 0.0
    # A > 0 with a huge ratio: plain upper clip, the dual bound never applies.
    loss, metrics, grad = single_token(ppo, math.log(4.0), 1.0)
    assert loss == pytest.approx(-1.2) and metrics["clip_frac_lower"] == 0.0


def test_ratio_beyond_the_clamp_stays_finite():
    loss, metrics, grad = single_token(make("dapo"), 50.0, 1.0)
    assert loss == pytest.approx(-1.28) and grad == 0.0
    assert metrics["ratio_max"] == pytest.approx(math.exp(20.0), rel=1e-5)


def test_cispo_hand_case():
    # r = 10 is capped at 1 + 4 = 5; the weight is detached, so d/dlp = -5 A.
    loss, metrics, grad = single_token(make("cispo"), math.log(10.0), 0.5, lp=-2.0)
    assert loss == pytest.approx(-5.0 * 0.5 * -2.0) and grad == pytest.approx(-2.5)
    assert metrics["clip_frac"] == 1.0
    # No lower bound: r = 0.01 keeps its weight.
    loss, _, grad = single_token(make("cispo"), math.log(0.01), 1.0, lp=-2.0)
    assert loss == pytest.approx(0.02, rel=1e-5) and grad == pytest.approx(-0.01, rel=1e-5)


def test_gspo_uses_the_length_normalised_sequence_ratio():
    # One row, two tokens, log-ratios 1e-4 and 3e-4: s = exp(2e-4) is inside (1-3e-4, 1+4e-4).
    lp = np.asarray([[-1.0, -2.0, -7.0]], np.float32)
    deltas = np.asarray([[1e-4, 3e-4, 5.0]], np.float32)
    loss, metrics, grad = hand_case(make("gspo"), lp, deltas, [[1.0, 1.0, 0.0]], [2.0])
    s = math.exp(float(np.mean((lp - (lp - deltas))[0, :2])))
    assert loss == pytest.approx(-2.0 * s, rel=1e-6)
    # d/dlp_t of -A s over the seq-mean-token-mean: -A s / |y| on each valid token.
    want = np.zeros((B, T))
    want[0, :2] = -s
    np.testing.assert_allclose(grad, want, rtol=1e-5)
    assert metrics["ratio_min"] == pytest.approx(s) == metrics["ratio_max"]
    assert metrics["clip_frac"] == 0.0


def test_gmpo_preset_is_the_mean_over_non_empty_sequences():
    lp = [[-1.0, -2.0], [-1.0, -1.0], [-3.0, -1.0]]
    delta = [[0.1, 0.9], [0.0, 0.0], [-0.2, 0.0]]
    mask = [[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]]
    loss, _, _ = hand_case(make("gmpo"), lp, delta, mask, [1.0, 5.0, -2.0])
    # Row 0 (A > 0): the 0.9 log-ratio is clipped to 0.4 -> exp((0.1 + 0.4) / 2).
    # Row 2 (A < 0): -0.2 is inside the bounds -> exp(-0.2). Row 1 is empty.
    want = (-1.0 * math.exp(0.25) + 2.0 * math.exp(-0.2)) / 2
    assert loss == pytest.approx(want, rel=1e-5)


def test_all_masked_batch_gives_zero_loss_and_finite_metrics(rng):
    data = policy_data(rng)
    data["mask"] = np.zeros_like(data["mask"])
    for name in ("grpo", "gmpo", "cispo"):
        loss, metrics, grad = loss_and_grad(
            make(name),
            jnp.asarray(data["logprobs"]),
            rollout_batch(data),
            jnp.asarray(data["entropy"]),
        )
        assert float(loss) == 0.0
        chex.assert_tree_all_finite(metrics)
        assert not np.any(np.asarray(grad))


# --------------------------------------------------------------------------------------
# Identities
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_token", [False, True], ids=["adv[B]", "adv[B,T]"])
def test_dapo_without_its_changes_is_grpo_without_kl(per_token, rng):
    data = policy_data(rng)
    args = (jnp.asarray(data["logprobs"]), rollout_batch(data, per_token=per_token), None)
    dapo = make("dapo", clip_high=0.2, aggregation="seq-mean-token-mean", dynamic_sampling=False)
    loss_a, _, grad_a = loss_and_grad(dapo, *args)
    loss_b, _, grad_b = loss_and_grad(make("grpo", kl_coef=0.0), *args)
    np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad_a), np.asarray(grad_b), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_on_policy_ppo_gradient_is_the_reinforce_gradient(aggregation, rng):
    data = policy_data(rng)
    batch = rollout_batch(data, per_token=True)

    def grad_of(objective):
        def loss_fn(lp):
            on_policy = batch._replace(old_logprobs=jax.lax.stop_gradient(lp))
            return objectives.policy_loss(objective, lp, on_policy).loss

        return jax.grad(loss_fn)(jnp.asarray(data["logprobs"]))

    ppo = grad_of(make("grpo", kl_coef=0.0, aggregation=aggregation))
    pg = grad_of(make("gpg", aggregation=aggregation))
    np.testing.assert_allclose(np.asarray(ppo), np.asarray(pg), rtol=1e-6, atol=1e-9)
    assert np.any(np.asarray(pg) != 0.0)


# --------------------------------------------------------------------------------------
# Micro-batching and padding invariances
# --------------------------------------------------------------------------------------

# Equal splits keep one extra shape; the middle micro-batch holds only all-masked rows.
MICRO_LENGTHS = (7, 3, 0, 0, 5, 1)
MICRO_K = 3  # rows 2-3 (the second micro-batch) are all-masked
SURROGATE_CASES = {
    "ppo_clip": {"dual_clip": 3.0},
    "cispo": {"surrogate": "cispo", "clip_low": None, "clip_high": 4.0},
    "sapo": {"surrogate": "sapo"},
    "gmpo": {"surrogate": "gmpo", "clip_low": 0.4, "clip_high": 0.4},
    "reinforce": {"surrogate": "reinforce"},
    "gspo_token": {"ratio": "gspo_token", "clip_low": 3e-4, "clip_high": 4e-4},
}


_ROW_FIELDS = ("completion_mask", "old_logprobs", "advantages", "ref_logprobs")


def _full_and_micro(objective, logprobs, batch, entropy):
    """The full-batch result, and the stacked results of K equal row micro-batches.

    The micro-batches keep the full batch's ``num_tokens`` / ``num_seqs``; they are evaluated
    under ``vmap`` (one eager dispatch for all K; vmap itself is tested separately).
    """
    full = loss_and_grad(objective, logprobs, batch, entropy)

    def split(x):
        return x.reshape(MICRO_K, -1, *x.shape[1:])

    micro_batch = batch._replace(**{f: split(getattr(batch, f)) for f in _ROW_FIELDS})
    axes = RolloutBatch(*(0 if f in _ROW_FIELDS else None for f in RolloutBatch._fields))
    micro = jax.vmap(functools.partial(loss_and_grad, objective), in_axes=(0, axes, 0))(
        split(logprobs), micro_batch, split(entropy)
    )
    return full, micro


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("surrogate", list(SURROGATE_CASES))
def test_micro_batches_sum_to_the_full_batch(surrogate, aggregation, rng):
    objective = make(
        "grpo",
        aggregation=aggregation,
        kl_coef=0.04,
        entropy_coef=0.01,
        **SURROGATE_CASES[surrogate],
    )
    data = policy_data(rng, lengths=MICRO_LENGTHS)
    batch = rollout_batch(data, per_token=True, global_norm=True)
    (loss, metrics, grad), micro = _full_and_micro(
        objective, jnp.asarray(data["logprobs"]), batch, jnp.asarray(data["entropy"])
    )
    micro_loss, micro_metrics, micro_grad = jax.tree.map(np.asarray, micro)
    np.testing.assert_allclose(micro_loss.sum(), float(loss), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(micro_grad.reshape(B, T), np.asarray(grad), rtol=1e-5, atol=1e-7)
    non_empty = data["mask"].reshape(MICRO_K, -1).any(axis=1)
    assert not non_empty.all()
    for key, value in metrics.items():
        parts = micro_metrics[key]
        if key.endswith("_min"):
            # An empty micro-batch reports 0 for its extremes; the others carry the minimum.
            want = parts[non_empty].min()
        elif key.endswith("_max"):
            want = parts.max()
        else:
            want = parts.sum()
        np.testing.assert_allclose(want, float(value), rtol=1e-5, atol=1e-6, err_msg=key)


def _padded_variants(objective, data):
    """Base loss/grad, and with 3 extra padded columns and 2 extra all-masked rows."""

    def run(extra_rows, extra_cols):
        def pad(x, value):
            return jnp.pad(x, ((0, extra_rows), (0, extra_cols)), constant_values=value)

        # Garbage (not zeros) where the mask is 0.
        garbage = jnp.linspace(-4.0, 1.0, (B + extra_rows) * (T + extra_cols)).reshape(
            B + extra_rows, T + extra_cols
        )
        mask = pad(data["mask"], 0.0)
        fill = mask == 0

        def with_garbage(x, scale):
            return jnp.where(fill, scale * garbage, pad(x, 0.0))

        batch = RolloutBatch(
            completion_mask=mask,
            old_logprobs=with_garbage(data["old_logprobs"], 1.0),
            advantages=with_garbage(data["token_advantages"], 3.0),
            ref_logprobs=with_garbage(data["ref_logprobs"], -2.0),
        )
        return loss_and_grad(
            objective,
            with_garbage(data["logprobs"], 0.5),
            batch,
            with_garbage(data["entropy"], 7.0),
        )

    return run(0, 0), run(2, 3)


@pytest.mark.parametrize("name", ref.PRESET_NAMES)
def test_padding_columns_and_empty_rows_change_nothing(name, rng):
    # Dr.GRPO's default constant is the width T; pin it so extra columns are neutral.
    objective = make(name, norm_constant=4.0) if name == "dr_grpo" else make(name)
    data = {k: jnp.asarray(v) for k, v in policy_data(rng).items()}
    base, padded = _padded_variants(objective, data)
    np.testing.assert_allclose(float(padded[0]), float(base[0]), rtol=1e-6, atol=1e-7)
    assert set(padded[1]) == set(base[1])
    for key, value in base[1].items():
        np.testing.assert_allclose(
            float(padded[1][key]), float(value), rtol=1e-6, atol=1e-7, err_msg=key
        )
    grad = np.asarray(padded[2])
    np.testing.assert_allclose(grad[:B, :T], np.asarray(base[2]), rtol=1e-6, atol=1e-9)
    assert not np.any(grad[B:]) and not np.any(grad[:, T:])


def test_dr_grpo_default_constant_is_the_completion_width(rng):
    data = {k: jnp.asarray(v) for k, v in policy_data(rng).items()}
    base, padded = _padded_variants(make("dr_grpo"), data)
    np.testing.assert_allclose(float(padded[0]), float(base[0]) * T / (T + 3), rtol=1e-6)


# --------------------------------------------------------------------------------------
# jit / vmap / recompilation / dtypes
# --------------------------------------------------------------------------------------


def test_vmap_over_a_stack_of_batches(rng):
    objective = make("grpo", entropy_coef=0.01)
    stack = [policy_data(rng) for _ in range(3)]
    lp = jnp.stack([jnp.asarray(d["logprobs"]) for d in stack])
    batches = jax.tree.map(
        lambda *xs: jnp.stack(xs), *[rollout_batch(d, per_token=True) for d in stack]
    )
    entropy = jnp.stack([jnp.asarray(d["entropy"]) for d in stack])
    losses, _, grads = jax.jit(
        jax.vmap(functools.partial(loss_and_grad, objective), in_axes=(0, 0, 0))
    )(lp, batches, entropy)
    chex.assert_shape(losses, (3,))
    chex.assert_shape(grads, (3, B, T))
    for i, d in enumerate(stack):
        want_loss, _, want_grad = reference_loss(
            ref.config("grpo", entropy_coef=0.01), d, per_token=True
        )
        np.testing.assert_allclose(float(losses[i]), want_loss, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(np.asarray(grads[i]), want_grad, rtol=GRAD_RTOL, atol=GRAD_ATOL)


def test_second_call_with_same_shapes_does_not_recompile(rng):
    traces = []

    @jax.jit
    def step(lp, batch):
        traces.append(None)
        return jax.value_and_grad(lambda x: objectives.policy_loss(make("grpo"), x, batch).loss)(lp)

    first, second = policy_data(rng), policy_data(rng)
    step(jnp.asarray(first["logprobs"]), rollout_batch(first))
    step(jnp.asarray(second["logprobs"]), rollout_batch(second))
    assert len(traces) == 1


def test_bf16_logprobs_give_an_f32_loss(rng):
    data = policy_data(rng)
    batch = rollout_batch(data)
    objective = make("grpo")
    lp16 = jnp.asarray(data["logprobs"], jnp.bfloat16)
    loss16, metrics16, grad16 = loss_and_grad(objective, lp16, batch, None)
    assert loss16.dtype == jnp.float32
    assert all(v.dtype == jnp.float32 for v in metrics16.values())
    assert grad16.dtype == jnp.bfloat16
    chex.assert_tree_all_finite(grad16)
    # The math is f32 on the upcast values: equal to the f32 loss of the rounded inputs ...
    rounded, _, _ = loss_and_grad(objective, lp16.astype(jnp.float32), batch, None)
    np.testing.assert_allclose(float(loss16), float(rounded), rtol=1e-6)
    # ... and close to the loss of the unrounded f32 inputs.
    full, _, _ = loss_and_grad(objective, jnp.asarray(data["logprobs"]), batch, None)
    np.testing.assert_allclose(float(loss16), float(full), rtol=0.05, atol=0.02)


# --------------------------------------------------------------------------------------
# policy_loss errors
# --------------------------------------------------------------------------------------


def test_policy_loss_errors(rng):
    data = policy_data(rng)
    lp = jnp.asarray(data["logprobs"])
    batch = rollout_batch(data)
    with pytest.raises(ValueError, match="ref_logprobs"):
        objectives.policy_loss(make("grpo"), lp, batch._replace(ref_logprobs=None))
    # No KL in the loss: no reference needed.
    objectives.policy_loss(make("dapo"), lp, batch._replace(ref_logprobs=None))
    for bad in (jnp.zeros((B + 1,)), jnp.zeros((B, T + 1)), jnp.zeros((B, T, 1))):
        with pytest.raises(ValueError, match="advantages"):
            objectives.policy_loss(make("dapo"), lp, batch._replace(advantages=bad))
    with pytest.raises(ValueError, match=r"logprobs.*\(6, 8\)"):
        objectives.policy_loss(make("dapo"), jnp.zeros((B, T + 1)), batch)
    with pytest.raises(ValueError, match=r"old_logprobs.*\(6, 6\)"):
        objectives.policy_loss(make("dapo"), lp, batch._replace(old_logprobs=jnp.zeros((B, T - 1))))
    with pytest.raises(ValueError, match="ref_logprobs"):
        objectives.policy_loss(make("grpo"), lp, batch._replace(ref_logprobs=jnp.zeros((B, 2))))
    with pytest.raises(ValueError, match="entropy"):
        objectives.policy_loss(make("dapo", entropy_coef=0.1), lp, batch)
