"""Tests of jaxrl_llm.objectives: presets composed from the loss pieces.

Numbers are compared with tests/reference/objectives.py, a float64 NumPy transcription of
shared/SPEC_LOSSES.md (values, metrics and the analytic gradient with respect to log-probs).
"""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import advantages as adv_lib
from jaxrl_llm import objectives
from jaxrl_llm.objectives import Objective, make
from jaxrl_llm.types import LossOutput, RolloutBatch
from tests.reference import objectives as ref

B, T, G = 6, 7, 3
# Ragged right-padded completions; row 2 is all-masked, row 1 carries a tiny ratio so that
# GSPO's sequence ratio sits inside its 3e-4 / 4e-4 bounds there.
LENGTHS = (7, 3, 0, 5, 1, 6)
TINY_ROW = 1
ROW_ADVANTAGES = (1.3, -0.7, 0.9, -1.5, 0.4, -0.6)
AGGREGATIONS = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
# Log-ratios where some surrogate used below changes branch: PPO 0.8 / 1.2 / 1.28, dual clip 2
# and 3, CISPO 1 + 4 and 1 + 1, CISPO lower 0.7, GMPO ±0.4, GSPO 1 - 3e-4 / 1 + 4e-4.
RATIO_KINKS = np.concatenate(
    [np.log([0.8, 1.2, 1.28, 2.0, 3.0, 5.0, 0.7, 1 - 3e-4, 1 + 4e-4]), [-0.4, 0.4]]
)
# KL kinks in x = ref - lp: abs at 0, k3's value clamp where exp(x) - x - 1 = 10.
KL_KINKS = np.array([0.0, 2.5277])
RTOL, ATOL = 2e-5, 2e-6
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6


def _mask(lengths, width=T) -> np.ndarray:
    return (np.arange(width)[None, :] < np.asarray(lengths)[:, None]).astype(np.float32)


def _push_away(x: np.ndarray, kinks: np.ndarray, gap: float = 0.02) -> np.ndarray:
    # Finite f32 rounding must not flip a branch between the JAX and the float64 computation.
    x = x.copy()
    for _ in range(20):
        close = np.any(np.abs(x[..., None] - kinks) < gap, axis=-1)
        if not close.any():
            return x
        x = np.where(close, x + 2.5 * gap, x)
    raise AssertionError("could not move values away from the kinks")


def _data(rng: np.random.Generator, *, lengths=LENGTHS, width=T) -> dict[str, np.ndarray]:
    """A random rollout batch; masked positions hold finite garbage."""
    rows = len(lengths)
    mask = _mask(lengths, width)
    old = -rng.uniform(0.1, 3.0, (rows, width))
    delta = rng.normal(0.0, 0.5, (rows, width))
    # Ratios far beyond every clip bound, on both sides, for both advantage signs.
    delta[0, 1], delta[0, 4], delta[3, 2], delta[5, 0] = 3.0, -2.5, 2.2, -3.0
    # GSPO's ratio is the row mean: keep the means clear of the kinks as well.
    for _ in range(20):
        delta = _push_away(delta, RATIO_KINKS)
        means = np.sum(delta * mask, axis=1) / np.maximum(mask.sum(axis=1), 1.0)
        shift = np.where(mask.any(axis=1), _push_away(means, RATIO_KINKS) - means, 0.0)
        if not shift.any():
            break
        delta += shift[:, None]
    else:
        raise AssertionError("could not move the row means away from the kinks")
    if rows > TINY_ROW:
        delta[TINY_ROW] = rng.uniform(-1e-4, 1e-4, width)
    old = old.astype(np.float32)
    logprobs = (old + delta).astype(np.float32)
    x = _push_away(rng.normal(0.0, 0.4, (rows, width)), KL_KINKS)
    x[0, 2] = 3.2  # k3 clamped at 10 there
    ref_logprobs = (logprobs + x).astype(np.float32)
    token_adv = rng.normal(0.0, 1.0, (rows, width))
    token_adv[0, 3] = token_adv[4, 0] = 0.0
    token_adv[3, 2] = -abs(token_adv[3, 2]) - 0.5
    return {
        "mask": mask,
        "logprobs": logprobs,
        "old_logprobs": old,
        "ref_logprobs": ref_logprobs,
        "row_advantages": np.resize(np.asarray(ROW_ADVANTAGES, np.float32), rows),
        "token_advantages": token_adv.astype(np.float32),
        "entropy": rng.uniform(0.1, 2.0, (rows, width)).astype(np.float32),
    }


def _batch(data, *, per_token=False, global_norm=False) -> RolloutBatch:
    """``[B]`` or ``[B, T]`` advantages; ``global_norm`` sets the whole-batch normalisers."""
    num_tokens, num_seqs = ref.normalisers(data["mask"]) if global_norm else (None, None)
    return RolloutBatch(
        completion_mask=jnp.asarray(data["mask"]),
        old_logprobs=jnp.asarray(data["old_logprobs"]),
        advantages=jnp.asarray(data["token_advantages" if per_token else "row_advantages"]),
        ref_logprobs=jnp.asarray(data["ref_logprobs"]),
        num_tokens=None if num_tokens is None else jnp.float32(num_tokens),
        num_seqs=None if num_seqs is None else jnp.float32(num_seqs),
    )


def _loss_and_grad(objective, logprobs, batch, entropy):
    """``(loss, metrics, d loss / d logprobs)`` of ``policy_loss``.

    Most tests call it eagerly: each primitive then compiles once per shape and is cached,
    far cheaper than one XLA compile per objective; jit has its dedicated tests.
    """

    def loss_fn(lp):
        out = objectives.policy_loss(objective, lp, batch, entropy=entropy)
        return out.loss, out.metrics

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(logprobs)
    return loss, metrics, grad


@functools.cache
def _every_preset_under_jit():
    """One jitted call evaluating every preset (one compile for all of them)."""
    data = _data(np.random.default_rng(7))

    @jax.jit
    def run(logprobs, batch, entropy):
        return {
            name: _loss_and_grad(make(name), logprobs, batch, entropy)
            for name in objectives.available()
        }

    return data, run(jnp.asarray(data["logprobs"]), _batch(data), jnp.asarray(data["entropy"]))


def _reference(cfg, data, *, per_token=False, global_norm=False):
    num_tokens, num_seqs = ref.normalisers(data["mask"]) if global_norm else (None, None)
    return ref.policy_loss(
        cfg,
        data["logprobs"],
        data["old_logprobs"],
        data["token_advantages" if per_token else "row_advantages"],
        data["mask"],
        ref_logprobs=data["ref_logprobs"],
        entropy=data["entropy"],
        num_tokens=num_tokens,
        num_seqs=num_seqs,
    )


def _assert_matches_reference(objective, cfg, data, **kwargs):
    batch = _batch(data, **kwargs)
    loss, metrics, grad = _loss_and_grad(
        objective, jnp.asarray(data["logprobs"]), batch, jnp.asarray(data["entropy"])
    )
    want_loss, want_metrics, want_grad = _reference(cfg, data, **kwargs)
    chex.assert_shape(loss, ())
    chex.assert_type(loss, jnp.float32)
    np.testing.assert_allclose(float(loss), want_loss, rtol=RTOL, atol=ATOL)
    missing = sorted(set(want_metrics) - set(metrics))
    assert not missing, f"metrics {missing} not reported"
    for key, want in want_metrics.items():
        np.testing.assert_allclose(float(metrics[key]), want, rtol=RTOL, atol=ATOL, err_msg=key)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=GRAD_RTOL, atol=GRAD_ATOL)


# --------------------------------------------------------------------------------------
# Registry and make()
# --------------------------------------------------------------------------------------


def test_available_lists_the_spec_presets_in_order():
    assert objectives.available() == ref.PRESET_NAMES


@pytest.mark.parametrize("name", ref.PRESET_NAMES)
def test_preset_matches_spec_table(name):
    objective = make(name)
    assert isinstance(objective, Objective)
    for field, want in ref.config(name).items():
        got = getattr(objective, field)
        if isinstance(want, float):
            assert got == pytest.approx(want), field
        else:
            assert got == want, field


def test_make_applies_overrides_without_touching_the_preset():
    objective = make("grpo", kl_coef=0.1, clip_high=0.28, entropy_coef=0.01)
    assert (objective.kl_coef, objective.clip_high, objective.entropy_coef) == (0.1, 0.28, 0.01)
    assert objective.kl_kind == "k3"
    assert objective.aggregation == "seq-mean-token-mean"
    assert make("grpo").kl_coef == pytest.approx(0.04)
    assert make("grpo") == objectives.PRESETS["grpo"]


@pytest.mark.parametrize(
    "name, overrides, match",
    [
        ("no_such_preset", {}, "no_such_preset"),
        ("grpo", {"kl_cof": 0.1}, "kl_cof"),
        ("ppo", {"dual_clip": 1.0}, "dual_clip"),
        ("ppo", {"dual_clip": 0.5}, "dual_clip"),
        ("grpo", {"clip_low": None}, "clip_low"),
        ("grpo", {"clip_low": 1.0}, "clip_low"),
        ("grpo", {"aggregation": "token-avg"}, "aggregation"),
        ("grpo", {"surrogate": "trpo"}, "surrogate"),
        ("grpo", {"kl_kind": "k4"}, "kl_kind"),
        ("grpo", {"kl_placement": "advantage"}, "kl_placement"),
        ("grpo", {"advantage": "vtrace"}, "advantage"),
        ("grpo", {"ratio": "sequence"}, "ratio"),
        ("grpo", {"kl_coef": -0.1}, "kl_coef"),
        ("dr_grpo", {"norm_constant": 0.0}, "norm_constant"),
        ("gmpo", {"ratio": "gspo_token"}, "gmpo"),
    ],
)
def test_make_rejects_bad_input(name, overrides, match):
    with pytest.raises(ValueError, match=match):
        make(name, **overrides)


def test_presets_are_hashable_jit_static_arguments():
    assert hash(make("grpo")) == hash(make("grpo"))
    assert make("grpo") != make("grpo", kl_coef=0.0)
    assert len({make(name) for name in objectives.available()}) == len(objectives.available())
    traces = []

    @functools.partial(jax.jit, static_argnums=0)
    def loss(objective, lp, batch):
        traces.append(objective)
        return objectives.policy_loss(objective, lp, batch).loss

    data = _data(np.random.default_rng(1))
    batch = _batch(data)
    lp = jnp.asarray(data["logprobs"])
    first = loss(make("dapo"), lp, batch)
    second = loss(make("dapo"), lp, batch)  # an equal, distinct instance: cache hit
    assert len(traces) == 1
    loss(make("dapo", clip_high=0.3), lp, batch)
    assert len(traces) == 2
    assert float(first) == float(second)


# --------------------------------------------------------------------------------------
# policy_loss against the float64 reference
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ref.PRESET_NAMES)
def test_every_preset_has_finite_loss_and_gradient_under_jit(name):
    data, results = _every_preset_under_jit()
    loss, metrics, grad = results[name]
    chex.assert_tree_all_finite((loss, metrics, grad))
    chex.assert_shape(grad, (B, T))
    # Masked positions (padding and the all-masked row) get exactly zero gradient.
    assert np.all(np.asarray(grad)[data["mask"] == 0] == 0.0)
    assert np.any(np.asarray(grad) != 0.0)


@pytest.mark.parametrize("per_token", [False, True], ids=["adv[B]", "adv[B,T]"])
@pytest.mark.parametrize("name", ref.PRESET_NAMES)
def test_preset_policy_loss_matches_reference(name, per_token, rng):
    # [B, T] advantages also run with explicit global normalisers (the micro-batch path).
    _assert_matches_reference(
        make(name), ref.config(name), _data(rng), per_token=per_token, global_norm=per_token
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
    _assert_matches_reference(
        make(name, **overrides), ref.config(name, **overrides), _data(rng), per_token=True
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
    data = _data(rng)
    _, _, grad = _reference(cfg, data, per_token=per_token)
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
            values.append(_reference(cfg, {**data, "logprobs": shifted}, per_token=per_token)[0])
        numeric[idx] = (values[0] - values[1]) / (2 * step)
    np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------------
# Hand-checked edge cases
# --------------------------------------------------------------------------------------


def _embed(values, fill: float) -> jax.Array:
    """A small hand case in the corner of a ``[B, T]`` (or ``[B]``) array of masked garbage.

    Every test shares the ``[B, T]`` shape so that eager primitives compile once.
    """
    values = np.asarray(values, np.float32)
    out = np.full((B, T)[: values.ndim], fill, np.float32)
    out[tuple(slice(0, n) for n in values.shape)] = values
    return jnp.asarray(out)


def _hand_case(objective, logprobs, deltas, mask, advantages):
    """Loss, metrics and gradient of a hand case; the rest of the batch is masked garbage."""
    lp = _embed(logprobs, -0.5)
    batch = RolloutBatch(
        completion_mask=_embed(mask, 0.0),
        old_logprobs=lp - _embed(deltas, 2.5),
        advantages=_embed(advantages, 4.0),
    )
    loss, metrics, grad = _loss_and_grad(objective, lp, batch, None)
    return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)


def _single(objective, delta, advantage, *, lp=-1.0):
    """Loss, metrics and gradient of one valid token with log-ratio ``delta``."""
    loss, metrics, grad = _hand_case(objective, [[lp]], [[delta]], [[1.0]], [advantage])
    assert not np.any(grad[1:]) and not np.any(grad[:, 1:])
    return loss, metrics, float(grad[0, 0])


def test_ppo_clip_hand_cases():
    dapo = make("dapo")  # clip 0.2 / 0.28, no dual clip
    loss, metrics, grad = _single(dapo, math.log(1.5), 1.0)
    assert loss == pytest.approx(-1.28) and grad == 0.0
    assert metrics["clip_frac"] == 1.0 and metrics["clip_frac_lower"] == 0.0
    assert metrics["ratio_mean"] == pytest.approx(1.5)
    assert metrics["approx_kl"] == pytest.approx(-math.log(1.5))
    # Inside the bounds: -A r, gradient -A r.
    loss, metrics, grad = _single(dapo, math.log(1.1), -2.0)
    assert loss == pytest.approx(2.2) and grad == pytest.approx(2.2)
    assert metrics["clip_frac"] == 0.0
    # A < 0, ratio below 1 - clip_low: the clipped term wins, no gradient.
    loss, metrics, grad = _single(dapo, math.log(0.5), -1.0)
    assert loss == pytest.approx(0.8) and grad == 0.0 and metrics["clip_frac"] == 1.0


def test_dual_clip_applies_to_negative_advantages_only():
    ppo = make("ppo")  # dual clip 3
    loss, metrics, grad = _single(ppo, math.log(4.0), -1.0)
    assert loss == pytest.approx(3.0) and grad == 0.0
    assert metrics["clip_frac_lower"] == 1.0 and metrics["clip_frac"] == 0.0
    # Under the dual bound the ordinary PPO loss -A r stands.
    loss, metrics, grad = _single(ppo, math.log(2.0), -1.0)
    assert loss == pytest.approx(2.0) and grad == pytest.approx(2.0)
    assert metrics["clip_frac_lower"] == 0.0
    # A > 0 with a huge ratio: plain upper clip, the dual bound never applies.
    loss, metrics, grad = _single(ppo, math.log(4.0), 1.0)
    assert loss == pytest.approx(-1.2) and metrics["clip_frac_lower"] == 0.0


def test_ratio_beyond_the_clamp_stays_finite():
    loss, metrics, grad = _single(make("dapo"), 50.0, 1.0)
    assert loss == pytest.approx(-1.28) and grad == 0.0
    assert metrics["ratio_max"] == pytest.approx(math.exp(20.0), rel=1e-5)


def test_cispo_hand_case():
    # r = 10 is capped at 1 + 4 = 5; the weight is detached, so d/dlp = -5 A.
    loss, metrics, grad = _single(make("cispo"), math.log(10.0), 0.5, lp=-2.0)
    assert loss == pytest.approx(-5.0 * 0.5 * -2.0) and grad == pytest.approx(-2.5)
    assert metrics["clip_frac"] == 1.0
    # No lower bound: r = 0.01 keeps its weight.
    loss, _, grad = _single(make("cispo"), math.log(0.01), 1.0, lp=-2.0)
    assert loss == pytest.approx(0.02, rel=1e-5) and grad == pytest.approx(-0.01, rel=1e-5)


def test_gspo_uses_the_length_normalised_sequence_ratio():
    # One row, two tokens, log-ratios 1e-4 and 3e-4: s = exp(2e-4) is inside (1-3e-4, 1+4e-4).
    lp = np.asarray([[-1.0, -2.0, -7.0]], np.float32)
    deltas = np.asarray([[1e-4, 3e-4, 5.0]], np.float32)
    loss, metrics, grad = _hand_case(make("gspo"), lp, deltas, [[1.0, 1.0, 0.0]], [2.0])
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
    loss, _, _ = _hand_case(make("gmpo"), lp, delta, mask, [1.0, 5.0, -2.0])
    # Row 0 (A > 0): the 0.9 log-ratio is clipped to 0.4 -> exp((0.1 + 0.4) / 2).
    # Row 2 (A < 0): -0.2 is inside the bounds -> exp(-0.2). Row 1 is empty.
    want = (-1.0 * math.exp(0.25) + 2.0 * math.exp(-0.2)) / 2
    assert loss == pytest.approx(want, rel=1e-5)


def test_all_masked_batch_gives_zero_loss_and_finite_metrics(rng):
    data = _data(rng)
    data["mask"] = np.zeros_like(data["mask"])
    for name in ("grpo", "gmpo", "cispo"):
        loss, metrics, grad = _loss_and_grad(
            make(name), jnp.asarray(data["logprobs"]), _batch(data), jnp.asarray(data["entropy"])
        )
        assert float(loss) == 0.0
        chex.assert_tree_all_finite(metrics)
        assert not np.any(np.asarray(grad))


# --------------------------------------------------------------------------------------
# Identities
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_token", [False, True], ids=["adv[B]", "adv[B,T]"])
def test_dapo_without_its_changes_is_grpo_without_kl(per_token, rng):
    data = _data(rng)
    args = (jnp.asarray(data["logprobs"]), _batch(data, per_token=per_token), None)
    dapo = make("dapo", clip_high=0.2, aggregation="seq-mean-token-mean", dynamic_sampling=False)
    loss_a, _, grad_a = _loss_and_grad(dapo, *args)
    loss_b, _, grad_b = _loss_and_grad(make("grpo", kl_coef=0.0), *args)
    np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad_a), np.asarray(grad_b), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_on_policy_ppo_gradient_is_the_reinforce_gradient(aggregation, rng):
    data = _data(rng)
    batch = _batch(data, per_token=True)

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
    full = _loss_and_grad(objective, logprobs, batch, entropy)

    def split(x):
        return x.reshape(MICRO_K, -1, *x.shape[1:])

    micro_batch = batch._replace(**{f: split(getattr(batch, f)) for f in _ROW_FIELDS})
    axes = RolloutBatch(*(0 if f in _ROW_FIELDS else None for f in RolloutBatch._fields))
    micro = jax.vmap(functools.partial(_loss_and_grad, objective), in_axes=(0, axes, 0))(
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
    data = _data(rng, lengths=MICRO_LENGTHS)
    batch = _batch(data, per_token=True, global_norm=True)
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
        return _loss_and_grad(
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
    data = {k: jnp.asarray(v) for k, v in _data(rng).items()}
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
    data = {k: jnp.asarray(v) for k, v in _data(rng).items()}
    base, padded = _padded_variants(make("dr_grpo"), data)
    np.testing.assert_allclose(float(padded[0]), float(base[0]) * T / (T + 3), rtol=1e-6)


# --------------------------------------------------------------------------------------
# jit / vmap / recompilation / dtypes
# --------------------------------------------------------------------------------------


def test_vmap_over_a_stack_of_batches(rng):
    objective = make("grpo", entropy_coef=0.01)
    stack = [_data(rng) for _ in range(3)]
    lp = jnp.stack([jnp.asarray(d["logprobs"]) for d in stack])
    batches = jax.tree.map(lambda *xs: jnp.stack(xs), *[_batch(d, per_token=True) for d in stack])
    entropy = jnp.stack([jnp.asarray(d["entropy"]) for d in stack])
    losses, _, grads = jax.jit(
        jax.vmap(functools.partial(_loss_and_grad, objective), in_axes=(0, 0, 0))
    )(lp, batches, entropy)
    chex.assert_shape(losses, (3,))
    chex.assert_shape(grads, (3, B, T))
    for i, d in enumerate(stack):
        want_loss, _, want_grad = _reference(
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

    first, second = _data(rng), _data(rng)
    step(jnp.asarray(first["logprobs"]), _batch(first))
    step(jnp.asarray(second["logprobs"]), _batch(second))
    assert len(traces) == 1
    assert step._cache_size() == 1


def test_bf16_logprobs_give_an_f32_loss(rng):
    data = _data(rng)
    batch = _batch(data)
    objective = make("grpo")
    lp16 = jnp.asarray(data["logprobs"], jnp.bfloat16)
    loss16, metrics16, grad16 = _loss_and_grad(objective, lp16, batch, None)
    assert loss16.dtype == jnp.float32
    assert all(v.dtype == jnp.float32 for v in metrics16.values())
    assert grad16.dtype == jnp.bfloat16
    chex.assert_tree_all_finite(grad16)
    # The math is f32 on the upcast values: equal to the f32 loss of the rounded inputs ...
    rounded, _, _ = _loss_and_grad(objective, lp16.astype(jnp.float32), batch, None)
    np.testing.assert_allclose(float(loss16), float(rounded), rtol=1e-6)
    # ... and close to the loss of the unrounded f32 inputs.
    full, _, _ = _loss_and_grad(objective, jnp.asarray(data["logprobs"]), batch, None)
    np.testing.assert_allclose(float(loss16), float(full), rtol=0.05, atol=0.02)


# --------------------------------------------------------------------------------------
# policy_loss errors
# --------------------------------------------------------------------------------------


def test_policy_loss_errors(rng):
    data = _data(rng)
    lp = jnp.asarray(data["logprobs"])
    batch = _batch(data)
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


# --------------------------------------------------------------------------------------
# combine / sft_loss
# --------------------------------------------------------------------------------------


def test_sft_loss_is_the_token_mean_nll(rng):
    data = _data(rng)
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
    data = _data(rng)
    batch = _batch(data)
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
# Advantages from an objective
# --------------------------------------------------------------------------------------


def _rollout(rng, lengths=LENGTHS):
    mask = _mask(lengths)
    return {
        "mask": mask,
        # Group 0 has distinct rewards; group 1 ties two rows.
        "rewards": np.asarray([1.0, 0.0, 0.5, 2.0, 2.0, -1.0], np.float32),
        "old": (-rng.uniform(0.1, 3.0, mask.shape)).astype(np.float32),
        "ref": (-rng.uniform(0.1, 3.0, mask.shape)).astype(np.float32),
        "values": rng.normal(0.0, 1.0, mask.shape).astype(np.float32),
        "process": rng.normal(0.0, 0.1, mask.shape).astype(np.float32),
        "baseline": np.asarray([0.5, 0.5, 0.5, 1.0, 1.0, 1.0], np.float32),
    }


def _compute(objective, roll, **kwargs):
    defaults = {
        "old_logprobs": roll["old"],
        "ref_logprobs": roll["ref"],
        "values": roll["values"],
        "baseline_rewards": roll["baseline"],
        "process_rewards": roll["process"],
    }
    return objectives.compute_advantages(
        objective, roll["rewards"], roll["mask"], group_size=G, **{**defaults, **kwargs}
    )


SEQUENCE_ESTIMATORS = {
    "grpo": lambda r, m: adv_lib.grpo(r, group_size=G),
    "rloo": lambda r, m: adv_lib.rloo(r, group_size=G),
    "gpg": lambda r, m: adv_lib.gpg(r, group_size=G),
    "pass_at_k": lambda r, m: adv_lib.pass_at_k(r, group_size=G),
    "opo": lambda r, m: adv_lib.opo(r, m, group_size=G),
    "reinforce_pp_baseline": lambda r, m: adv_lib.reinforce_pp_baseline(r, m, group_size=G),
    "remax": lambda r, m: adv_lib.remax(r, jnp.asarray([0.5, 0.5, 0.5, 1.0, 1.0, 1.0])),
}


@pytest.mark.parametrize("estimator", list(SEQUENCE_ESTIMATORS))
def test_compute_advantages_calls_the_estimator(estimator, rng):
    roll = _rollout(rng)
    got, returns = _compute(make("dapo", advantage=estimator), roll)
    want = SEQUENCE_ESTIMATORS[estimator](jnp.asarray(roll["rewards"]), jnp.asarray(roll["mask"]))
    assert returns is None
    chex.assert_shape(got, want.shape)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)


def test_compute_advantages_forwards_hyper_parameters(rng):
    roll = _rollout(rng)
    rewards = jnp.asarray(roll["rewards"])
    got, _ = _compute(make("dr_grpo"), roll)
    np.testing.assert_allclose(got, adv_lib.grpo(rewards, group_size=G, scale="none"), atol=1e-7)
    got, _ = _compute(make("grpo", std_ddof=0, advantage_scale="batch"), roll)
    want = adv_lib.grpo(rewards, group_size=G, scale="batch", std_ddof=0)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_outcome_token_rewards_puts_the_reward_on_the_last_valid_token():
    mask = np.asarray([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0]], bool)
    rewards = np.asarray([0.5, 5.0, -1.25, 2.0], np.float32)
    got = objectives.outcome_token_rewards(jnp.asarray(rewards), jnp.asarray(mask))
    chex.assert_type(got, jnp.float32)
    want = np.asarray([[0, 0.5, 0, 0], [0, 0, 0, 0], [0, 0, 0, -1.25], [0, 0, 2.0, 0]])
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(want, ref.outcome_token_rewards(rewards, mask))
    # Integer rewards are not truncated into an integer array.
    got = objectives.outcome_token_rewards(jnp.asarray([3, 1, 2, 7]), jnp.asarray(mask))
    assert got.dtype == jnp.float32 and float(got[0, 1]) == 3.0
    with pytest.raises(ValueError, match="rewards"):
        objectives.outcome_token_rewards(jnp.zeros((3,)), jnp.asarray(mask))


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_token_level_estimators_without_kl(gamma, rng):
    roll = _rollout(rng)
    mask = jnp.asarray(roll["mask"])
    outcome = jnp.asarray(ref.outcome_token_rewards(roll["rewards"], roll["mask"]), jnp.float32)
    got, returns = _compute(make("reinforce_pp", kl_coef=0.0, gamma=gamma), roll)
    assert returns is None
    np.testing.assert_allclose(got, adv_lib.reinforce_pp(outcome, mask, gamma=gamma), atol=1e-6)
    got, returns = _compute(make("ppo", kl_coef=0.0, gamma=gamma, lam=0.95), roll)
    want, want_returns = adv_lib.gae(outcome, roll["values"], mask, gamma=gamma, lam=0.95)
    np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(returns, want_returns, atol=1e-6)


@pytest.mark.parametrize("name", ["reinforce_pp", "ppo"])
def test_kl_in_reward_subtracts_beta_k1_of_old_and_ref(name, rng):
    roll = _rollout(rng)
    objective = make(name)
    beta = ref.config(name)["kl_coef"]
    token_rewards = (
        ref.outcome_token_rewards(roll["rewards"], roll["mask"])
        - beta * (roll["old"].astype(np.float64) - roll["ref"]) * roll["mask"]
    ).astype(np.float32)
    mask = jnp.asarray(roll["mask"])
    got, returns = _compute(objective, roll)
    if name == "reinforce_pp":
        want, want_returns = adv_lib.reinforce_pp(token_rewards, mask), None
    else:
        want, want_returns = adv_lib.gae(token_rewards, roll["values"], mask)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if want_returns is not None:
        np.testing.assert_allclose(returns, want_returns, rtol=1e-5, atol=1e-6)
    # The penalty matters: without it the advantages differ.
    no_kl, _ = _compute(make(name, kl_coef=0.0), roll)
    assert not np.allclose(np.asarray(no_kl), np.asarray(got), atol=1e-4)


def test_kl_in_reward_for_a_sequence_estimator_uses_the_row_sum(rng):
    roll = _rollout(rng)
    objective = make("grpo", kl_kind="k1", kl_coef=0.1, kl_placement="reward")
    penalised = roll["rewards"] - 0.1 * np.sum((roll["old"] - roll["ref"]) * roll["mask"], axis=1)
    got, _ = _compute(objective, roll)
    want = adv_lib.grpo(jnp.asarray(penalised, jnp.float32), group_size=G)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_prime_matches_reference(rng):
    roll = _rollout(rng)
    got, returns = _compute(make("prime"), roll)
    chex.assert_shape((got, returns), (B, T))
    want, want_returns = ref.prime_advantages(
        roll["rewards"], roll["process"], roll["mask"], group_size=G
    )
    np.testing.assert_allclose(returns, want_returns, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got)[roll["mask"] == 0])


def test_prime_sign_on_a_constructed_case():
    # Groups of two equal-length rows; in each, the first row has the better outcome and the
    # better process rewards. Copies of one symmetric group keep the batch mean at 0.
    mask = np.ones((B, T), np.float32)
    better = np.linspace(0.05, 0.3, T, dtype=np.float32)
    process = np.tile(np.stack([better, -better]), (B // 2, 1))
    rewards = jnp.asarray(np.tile([1.0, 0.0], B // 2))
    got, returns = objectives.compute_advantages(
        make("prime"), rewards, mask, group_size=2, process_rewards=process
    )
    chex.assert_shape((got, returns), (B, T))
    assert np.all(np.asarray(returns)[0::2] > 0) and np.all(np.asarray(returns)[1::2] < 0)
    assert np.all(np.asarray(got)[0::2] > 0) and np.all(np.asarray(got)[1::2] < 0)


def test_compute_advantages_errors(rng):
    roll = _rollout(rng)
    with pytest.raises(ValueError, match="values"):
        _compute(make("ppo"), roll, values=None)
    with pytest.raises(ValueError, match="process_rewards"):
        _compute(make("prime"), roll, process_rewards=None)
    with pytest.raises(ValueError, match="baseline_rewards"):
        _compute(make("dapo", advantage="remax"), roll, baseline_rewards=None)
    for missing in ("old_logprobs", "ref_logprobs"):
        with pytest.raises(ValueError, match="old_logprobs and ref_logprobs"):
            _compute(make("reinforce_pp"), roll, **{missing: None})
    with pytest.raises(ValueError, match="group_size"):
        objectives.compute_advantages(make("grpo"), roll["rewards"], roll["mask"], group_size=4)
    with pytest.raises(ValueError, match="rewards"):
        objectives.compute_advantages(make("grpo"), np.zeros(5), roll["mask"], group_size=1)
    with pytest.raises(ValueError, match="group_size"):
        objectives.compute_advantages(
            make("prime"),
            roll["rewards"],
            roll["mask"],
            group_size=1,
            process_rewards=roll["process"],
        )


# --------------------------------------------------------------------------------------
# value_loss
# --------------------------------------------------------------------------------------


def _value_data(rng):
    mask = _mask(LENGTHS)
    old_values = rng.normal(0.0, 1.0, mask.shape)
    values = old_values + _push_away(rng.normal(0.0, 0.7, mask.shape), np.array([-0.5, 0.5]))
    returns = old_values + rng.normal(0.0, 1.0, mask.shape)
    return mask, *(x.astype(np.float32) for x in (values, old_values, returns))


@pytest.mark.parametrize(
    "overrides, global_norm",
    [({}, False), ({"aggregation": "seq-mean-token-mean", "value_clip": 0.3}, True)],
)
def test_value_loss_matches_reference(overrides, global_norm, rng):
    mask, values, old_values, returns = _value_data(rng)
    if overrides.get("value_clip") == 0.3:
        values = (old_values + _push_away(values - old_values, np.array([-0.3, 0.3]))).astype(
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
        completion_mask=_embed([[1.0, 1.0, 0.0]], 0.0),
        old_logprobs=jnp.zeros((B, T)),
        advantages=jnp.zeros((B,)),
        old_values=_embed([[0.0, 0.0, 0.0]], 3.0),
        returns=_embed([[2.0, 0.0, 9.0]], -4.0),
    )
    # Second token: v = 2, R = 0: max(4, 0.25) / 2 = 2, unclipped.
    values = _embed([[1.0, 2.0, 5.0]], 1.0)
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
