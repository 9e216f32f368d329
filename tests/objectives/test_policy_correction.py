"""policy_loss with rollout correction against float64 NumPy transcriptions of verl.

verl's ``compute_policy_loss_vanilla`` (PPO clip, dual clip ``c = 3``, ``pg_losses *
rollout_is_weights``, token-mean over the rejection-masked response mask), its
``compute_policy_loss_bypass_mode`` (``ppo_clip``: the ratio against the rollout log-probs and
no weights; ``reinforce``: ``-w·A·log π`` with ``w`` detached) and the IS weights / rejection
masks of ``rollout_corr_helper``; values and gradients with respect to the current log-probs.
"""

from __future__ import annotations

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
    GRAD_ATOL,
    GRAD_RTOL,
    RATIO_KINKS,
    RTOL,
    B,
    T,
    loss_and_grad,
    policy_data,
    push_away,
    rollout_batch,
)

ATOL = 2e-6
BOUND = 20.0
# log-ratios where an IS bound or a token rejection bound of the cases below sits
CORRECTION_KINKS = np.log([2.0, 0.5, 1.5, 0.7, 0.6, 1.8])
CORRECTION_KINKS = np.concatenate([CORRECTION_KINKS, [-(0.2**0.5), 0.2**0.5]])  # k2 <= 0.1


# -- float64 reference -----------------------------------------------------------------------------


def msum(v, m, axis=None):
    return np.sum(np.where(m > 0, v, 0.0) * m, axis=axis)


def mmean(v, m, axis=None):
    return msum(v, m, axis) / (np.sum(m, axis=axis) + 1e-8)


def verl_weights(log_ratio, m, *, level="token", upper=2.0, lower=None, normalize=False):
    """compute_rollout_correction_weights: TIS ``min(ρ, C)`` or IcePop's band, detached."""
    if level == "token":
        raw = np.exp(np.clip(log_ratio, -BOUND, BOUND))
    else:
        raw = np.broadcast_to(
            np.exp(np.clip(msum(log_ratio, m, -1), -BOUND, BOUND))[:, None], m.shape
        )
    raw = raw * m
    w = (
        np.minimum(raw, upper)
        if lower is None
        else np.where((raw >= lower) & (raw <= upper), raw, 0.0)
    )
    if normalize:
        if level == "token":
            mean = mmean(w, m)
        else:
            rows = (m.sum(-1) > 0) * 1.0
            mean = np.sum(mmean(w, m, -1) * rows) / max(rows.sum(), 1e-8)
        w = w / mean if mean > 1e-8 else w
    return w


def verl_reject(log_ratio, m, criteria):
    """compute_rollout_rejection_mask: every criterion must pass."""
    r = np.clip(log_ratio, -BOUND, BOUND)
    per_token = {"k1": -r, "k2": 0.5 * r**2, "k3": np.exp(r) - 1.0 - r}
    keep = np.ones_like(m)
    for name, spec in criteria.items():
        stat = per_token[name[-2:]]
        if name.startswith("seq_sum"):
            stat = msum(stat, m, -1)[:, None]
        elif name.startswith("seq_mean"):
            stat = mmean(stat, m, -1)[:, None]
        elif name.startswith("seq_max"):
            top = np.where(m > 0, stat, -np.inf).max(-1)
            stat = np.where(np.isneginf(top), 0.0, top)[:, None]
        if name.endswith("k1"):
            lo, up = (1.0 / spec, spec) if isinstance(spec, float) else spec
            lo, hi = math.log(lo), math.log(up)
            ok = (stat >= lo) & (stat <= hi)
            bounds = (lo, hi)
        else:
            ok, bounds = stat <= spec, (spec,)
        for bound in bounds:  # f32 rounding must not flip a decision
            near = np.abs(stat - bound) < 1e-4 * max(1.0, abs(bound))
            assert not np.any(np.broadcast_to(near, m.shape) & (m > 0)), (name, bound)
        keep = keep * np.broadcast_to(ok, m.shape)
    return m * keep


def verl_vanilla(lp, old, adv, m, w=None, *, clip=0.2, clip_c=3.0, num_tokens=None):
    """compute_policy_loss_vanilla (token-mean) and its gradient with respect to ``lp``."""
    adv = adv[:, None] if adv.ndim == 1 else adv
    log_ratio = np.clip(lp - old, -BOUND, BOUND)
    ratio = np.exp(log_ratio)
    l1 = -adv * ratio
    l2 = -adv * np.clip(ratio, 1 - clip, 1 + clip)
    c1 = np.maximum(l1, l2)
    l3 = -adv * clip_c
    c2 = np.minimum(l3, c1)
    pg = np.where(adv < 0, c2, c1)
    d1 = -adv * ratio * (np.abs(lp - old) < BOUND)
    d_c1 = np.where(l2 > l1, 0.0, d1)  # the clipped branch is constant
    d = np.where(adv < 0, np.where(l3 < c1, 0.0, d_c1), d_c1)
    return _token_mean(pg, d, m, w, num_tokens)


def verl_reinforce(lp, adv, m, w=None, *, num_tokens=None):
    """compute_policy_loss_reinforce: ``-A·log π·w``, ``w`` detached."""
    adv = adv[:, None] if adv.ndim == 1 else adv
    return _token_mean(-adv * lp, -adv * np.ones_like(lp), m, w, num_tokens)


def _token_mean(pg, d, m, w, num_tokens):
    w = np.ones_like(pg) if w is None else w
    n = m.sum() + 1e-8 if num_tokens is None else num_tokens
    return msum(pg * w, m) / n, np.where(m > 0, d * w, 0.0) / n


# -- data ------------------------------------------------------------------------------------------


def data(seed=0):
    """helpers.policy_data plus rollout log-probs for either mode.

    ``old - rollout_decoupled`` and ``logprobs - rollout_bypass`` are the correction log-ratios
    (outside [-3, 3] on some tokens); the bypass one is also PPO's log-ratio, so it keeps clear
    of the clip kinks too.
    """
    rng = np.random.default_rng(seed)
    d = policy_data(rng)
    kinks = np.concatenate([CORRECTION_KINKS, RATIO_KINKS])
    for key, base in (("decoupled", "old_logprobs"), ("bypass", "logprobs")):
        u = push_away(rng.normal(0.0, 0.4, (B, T)), kinks)
        u[0, 2], u[3, 1], u[5, 3] = 2.5, -3.5, 1.3
        d[f"rollout_{key}"] = (d[base].astype(np.float64) - u).astype(np.float32)
    return d


def batch_of(d, mode, *, per_token=False, global_norm=False, rows=slice(None)):
    full = rollout_batch(d, per_token=per_token, global_norm=global_norm)
    part = RolloutBatch(*(None if x is None or x.ndim == 0 else x[rows] for x in full))._replace(
        num_tokens=full.num_tokens, num_seqs=full.num_seqs
    )
    return part._replace(rollout_logprobs=jnp.asarray(d[f"rollout_{mode}"][rows]))


def f64(*xs):
    return [np.asarray(x, np.float64) for x in xs]


def ppo(**correction):
    """verl's vanilla PPO as an objective: clip 0.2, dual clip 3, token-mean, no KL."""
    return make(
        "grpo",
        kl_kind=None,
        dual_clip=3.0,
        aggregation="token-mean",
        rollout_correction=correction or None,
    )


def run(objective, d, batch):
    loss, metrics, grad = loss_and_grad(objective, jnp.asarray(d["logprobs"]), batch, None)
    chex.assert_shape(grad, (B, T))
    return float(loss), metrics, np.asarray(grad)


def assert_close(loss, grad, want_loss, want_grad):
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad, want_grad, rtol=GRAD_RTOL, atol=GRAD_ATOL)


# -- against verl ----------------------------------------------------------------------------------

DECOUPLED = [
    {"is_level": "token", "is_upper": 2.0},
    {"is_level": "sequence", "is_upper": 2.0},
    {"is_level": "token", "is_upper": 1.5, "is_lower": 0.7, "rejection": {"token_k1": (0.6, 1.8)}},
    {"is_level": "sequence", "is_upper": 5.0, "is_lower": 0.2, "rejection": {"seq_max_k2": 0.6}},
    {"is_level": "token", "batch_normalize": True, "rejection": {"seq_mean_k3": 0.15}},
    {"is_level": None, "rejection": {"token_k2": 0.1, "seq_sum_k1": 3.0}},
]


@pytest.mark.parametrize("per_token", [False, True], ids=["adv[B]", "adv[B,T]"])
@pytest.mark.parametrize("spec", DECOUPLED, ids=lambda s: "-".join(map(str, s.values()))[:40])
def test_decoupled_matches_verl_vanilla_with_rollout_is_weights(spec, per_token):
    d = data()
    lp, old, roll, m = f64(d["logprobs"], d["old_logprobs"], d["rollout_decoupled"], d["mask"])
    adv = np.asarray(d["token_advantages" if per_token else "row_advantages"], np.float64)
    u = old - roll
    w = None
    if spec.get("is_level"):
        w = verl_weights(
            u,
            m,
            level=spec["is_level"],
            upper=spec.get("is_upper", 2.0),
            lower=spec.get("is_lower"),
            normalize=spec.get("batch_normalize", False),
        )
    kept = verl_reject(u, m, spec["rejection"]) if "rejection" in spec else m
    assert "rejection" not in spec or 0 < kept.sum() < m.sum()
    want_loss, want_grad = verl_vanilla(lp, old, adv, kept, w)
    loss, metrics, grad = run(ppo(**spec), d, batch_of(d, "decoupled", per_token=per_token))
    assert_close(loss, grad, want_loss, want_grad)
    assert np.all(grad[kept == 0] == 0.0)
    np.testing.assert_allclose(
        float(metrics["rollout_corr/rejected_frac"]), 1.0 - kept.sum() / m.sum(), rtol=1e-6
    )
    if w is not None:
        np.testing.assert_allclose(
            float(metrics["rollout_corr/is_weight_mean"]), msum(w, kept) / kept.sum(), rtol=RTOL
        )
    else:
        assert "rollout_corr/is_weight_mean" not in metrics


@pytest.mark.parametrize(
    "rejection", [None, {"token_k1": 2.0}, {"seq_sum_k1": (0.25, 2.0), "token_k3": 0.5}]
)
def test_bypass_ppo_clip_is_vanilla_against_the_rollout_without_weights(rejection):
    d = data()
    lp, roll, m = f64(d["logprobs"], d["rollout_bypass"], d["mask"])
    adv = np.asarray(d["row_advantages"], np.float64)
    kept = verl_reject(lp - roll, m, rejection) if rejection else m  # the current policy's
    want_loss, want_grad = verl_vanilla(lp, roll, adv, kept)
    batch = batch_of(d, "bypass")
    for level in (None, "token", "sequence"):  # IS weights never multiply a ratio surrogate
        spec = {"mode": "bypass", "is_level": level, "is_upper": 1.5, "rejection": rejection or {}}
        loss, metrics, grad = run(ppo(**spec), d, batch)
        assert_close(loss, grad, want_loss, want_grad)
        assert "rollout_corr/is_weight_mean" not in metrics
    # verl's bypass mode with the global batch info: rejected tokens stay in the token count
    global_batch = batch_of(d, "bypass", global_norm=True)
    loss, _, grad = run(ppo(**spec), d, global_batch)
    assert_close(loss, grad, *verl_vanilla(lp, roll, adv, kept, num_tokens=m.sum()))
    # old_logprobs play no part: the rollout is the old policy
    moved = batch._replace(old_logprobs=batch.old_logprobs + 0.7)
    np.testing.assert_allclose(run(ppo(**spec), d, moved)[0], want_loss, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    "spec",
    [
        {"is_level": "token", "is_upper": 2.0},
        {"is_level": "sequence", "is_upper": 5.0, "is_lower": 0.2},
        {"is_level": "token", "is_upper": 1.5, "rejection": {"token_k2": 0.1, "seq_max_k3": 2.0}},
        {"is_level": "token", "batch_normalize": True},
        {"is_level": None, "rejection": {"seq_mean_k1": 1.5}},
    ],
    ids=["tis", "seq_icepop", "tis_rs", "batch_norm", "rs_only"],
)
def test_bypass_reinforce_matches_verl_reinforce_with_detached_weights(spec):
    d = data()
    lp, roll, m = f64(d["logprobs"], d["rollout_bypass"], d["mask"])
    adv = np.asarray(d["token_advantages"], np.float64)
    w = None
    if spec["is_level"]:
        w = verl_weights(
            lp - roll,
            m,
            level=spec["is_level"],
            upper=spec.get("is_upper", 2.0),
            lower=spec.get("is_lower"),
            normalize=spec.get("batch_normalize", False),
        )
        assert np.any((w != 1.0) & (m > 0))
    kept = verl_reject(lp - roll, m, spec["rejection"]) if "rejection" in spec else m
    want_loss, want_grad = verl_reinforce(lp, adv, kept, w)
    objective = make("gpg", rollout_correction={"mode": "bypass", **spec})
    loss, _, grad = run(objective, d, batch_of(d, "bypass", per_token=True))
    assert_close(loss, grad, want_loss, want_grad)
    loss, _, grad = run(objective, d, batch_of(d, "bypass", per_token=True, global_norm=True))
    assert_close(loss, grad, *verl_reinforce(lp, adv, kept, w, num_tokens=m.sum()))


def test_batch_is_weights_multiply_the_surrogate_without_gradient():
    d = data()
    lp, old, roll, m = f64(d["logprobs"], d["old_logprobs"], d["rollout_decoupled"], d["mask"])
    adv = np.asarray(d["row_advantages"], np.float64)
    given = np.random.default_rng(3).uniform(0.2, 1.8, (B, T)).astype(np.float32)
    batch = batch_of(d, "decoupled")._replace(is_weights=jnp.asarray(given))
    # alone
    loss, metrics, grad = run(ppo(), d, batch)
    assert_close(loss, grad, *verl_vanilla(lp, old, adv, m, np.float64(given)))
    np.testing.assert_allclose(float(metrics["pg_loss"]), loss, rtol=1e-6)
    # times the objective's own weights
    w = verl_weights(old - roll, m)
    loss, _, grad = run(ppo(is_level="token"), d, batch)
    assert_close(loss, grad, *verl_vanilla(lp, old, adv, m, given * w))

    def loss_of_weights(x):
        return objectives.policy_loss(ppo(), batch.old_logprobs, batch._replace(is_weights=x)).loss

    assert not np.any(np.asarray(jax.grad(loss_of_weights)(jnp.asarray(given))))


# -- scalar surrogates, errors, jit ----------------------------------------------------------------


def test_gmpo_rejects_is_weights_but_takes_rejection():
    d = data()
    batch = batch_of(d, "decoupled")
    with pytest.raises(ValueError, match="returns one loss for the batch"):
        run(make("gmpo", rollout_correction={"is_level": "token"}), d, batch)
    with pytest.raises(ValueError, match="returns one loss for the batch"):
        run(make("gmpo"), d, batch._replace(is_weights=jnp.ones((B, T))))
    rejection = {"token_k1": 2.0, "seq_mean_k2": 0.5}
    old, roll, m = f64(d["old_logprobs"], d["rollout_decoupled"], d["mask"])
    kept = verl_reject(old - roll, m, rejection)
    assert 0 < kept.sum() < m.sum()
    got = run(make("gmpo", rollout_correction={"is_level": None, "rejection": rejection}), d, batch)
    plain = run(make("gmpo"), d, batch._replace(completion_mask=jnp.asarray(kept, jnp.float32)))
    np.testing.assert_allclose(got[0], plain[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got[2], plain[2], rtol=1e-6, atol=1e-7)
    # bypass: GMPO has a ratio, so no weights and no error; its old policy is the rollout
    bypass = batch_of(d, "bypass")
    got = run(make("gmpo", rollout_correction={"mode": "bypass"}), d, bypass)
    plain = run(make("gmpo"), d, bypass._replace(old_logprobs=bypass.rollout_logprobs))
    np.testing.assert_allclose(got[0], plain[0], rtol=1e-6, atol=1e-7)


def test_missing_or_misshapen_inputs_raise():
    d = data()
    batch = batch_of(d, "decoupled")
    for mode in ("decoupled", "bypass"):
        objective = ppo(mode=mode, is_level="token")
        with pytest.raises(ValueError, match="batch.rollout_logprobs .* is None"):
            run(objective, d, batch._replace(rollout_logprobs=None))
        with pytest.raises(ValueError, match="rollout_logprobs shape"):
            run(objective, d, batch._replace(rollout_logprobs=batch.rollout_logprobs[:, :3]))
    with pytest.raises(ValueError, match="is_weights shape"):
        run(ppo(), d, batch._replace(is_weights=jnp.ones((B, T - 1))))


def test_policy_loss_with_correction_under_jit_matches_eager():
    d = data()
    objective = make(
        "grpo",
        rollout_correction={
            "mode": "decoupled",
            "is_level": "sequence",
            "rejection": {"token_k1": 2.0},
        },
    )
    batch = batch_of(d, "decoupled")
    lp = jnp.asarray(d["logprobs"])
    jitted = jax.jit(loss_and_grad, static_argnums=0)(objective, lp, batch, None)
    eager = loss_and_grad(objective, lp, batch, None)
    chex.assert_trees_all_close(jitted, eager, rtol=1e-5, atol=1e-6)


# -- micro-batches: with the batch's totals, two row halves sum to the full batch ------------------


@pytest.mark.parametrize(
    ("preset", "spec"),
    [
        ("grpo", {"is_level": "token", "rejection": {"token_k1": (0.6, 1.8)}}),
        (
            "grpo",
            {
                "is_level": "sequence",
                "is_upper": 5.0,
                "is_lower": 0.2,
                "rejection": {"seq_mean_k3": 0.15, "seq_sum_k1": 3.0},
            },
        ),
        ("dapo", {"mode": "bypass", "rejection": {"token_k2": 0.1}}),
        ("dapo", {"mode": "bypass", "is_level": None, "rejection": {"seq_max_k2": 0.6}}),
        ("gpg", {"mode": "bypass", "is_level": "token", "rejection": {"token_k3": 0.1}}),
        ("gpg", {"mode": "bypass", "is_level": "sequence", "rejection": {"seq_mean_k1": 1.15}}),
    ],
    ids=[
        "decoupled_token",
        "decoupled_seq",
        "bypass_ppo_token_rs",
        "bypass_ppo_seq_rs",
        "bypass_reinforce_token",
        "bypass_reinforce_seq",
    ],
)
def test_micro_batches_sum_to_the_full_batch(preset, spec):
    d = data()
    mode = spec.get("mode", "decoupled")
    objective = make(preset, rollout_correction=spec)
    lp = jnp.asarray(d["logprobs"])
    entropy = jnp.asarray(d["entropy"])

    def step(rows):
        batch = batch_of(d, mode, per_token=True, global_norm=True, rows=rows)
        loss, metrics, grad = loss_and_grad(objective, lp[rows], batch, entropy[rows])
        return float(loss), float(metrics["rollout_corr/rejected_frac"]), np.asarray(grad)

    full = step(slice(None))
    halves = [step(slice(0, B // 2)), step(slice(B // 2, B))]
    np.testing.assert_allclose(halves[0][0] + halves[1][0], full[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(halves[0][1] + halves[1][1], full[1], rtol=1e-5, atol=1e-7)
    assert 0 < halves[0][1] and 0 < halves[1][1] and full[1] < 1  # both halves reject tokens
    np.testing.assert_allclose(
        np.concatenate([halves[0][2], halves[1][2]]), full[2], rtol=1e-5, atol=1e-7
    )
