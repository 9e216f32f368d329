"""The 2025-26 stabilisers through ``policy_loss`` / ``compute_advantages``: DPPO, KL-Cov,
Clip-Cov, the top-entropy, off-policy and M2PO token masks (M2PO in detail:
tests/objectives/test_m2po.py), the importance-weighted KL and GDPO, against the float64
references of tests/reference/stabilisers.py, on every preset."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from jaxrl_llm import objectives
from jaxrl_llm.losses import advantages
from jaxrl_llm.objectives import make
from tests.objectives.helpers import (
    AGGREGATIONS,
    GRAD_ATOL,
    GRAD_RTOL,
    RTOL,
    compute,
    loss_and_grad,
    policy_data,
    rollout_batch,
    rollout_data,
)
from tests.reference import objectives as ref
from tests.reference import stabilisers as stab

ATOL = 1e-5


def _weights(mask, mode, batch):
    return ref.aggregation_weights(
        mask,
        mode,
        num_tokens=None if batch.num_tokens is None else float(batch.num_tokens),
        num_seqs=None if batch.num_seqs is None else float(batch.num_seqs),
    )


def _run(objective, data, *, per_token=False, entropy=True, **batch_fields):
    batch = rollout_batch(data, per_token=per_token)._replace(**batch_fields)
    h = jnp.asarray(data["entropy"]) if entropy else None
    loss, metrics, grad = loss_and_grad(objective, jnp.asarray(data["logprobs"]), batch, h)
    return float(loss), metrics, np.asarray(grad), batch


def _close(got, want, msg=""):
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=msg)


def _close_grad(got, want, msg=""):
    np.testing.assert_allclose(got, want, rtol=GRAD_RTOL, atol=GRAD_ATOL, err_msg=msg)


# ----------------------------------------------------------------------------- surrogates


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("divergence", ["tv", "kl"])
def test_dppo_policy_loss_matches_reference(rng, divergence, mode):
    data = policy_data(rng)
    data["logprobs"] = np.minimum(data["logprobs"], -0.01)  # probabilities, on every token
    delta = 0.15 if divergence == "tv" else 0.05
    objective = make(
        "dr_grpo",
        surrogate=f"dppo_{divergence}",
        clip_low=delta,
        clip_high=delta,
        ratio_cap=1.5,
        aggregation=mode,
    )
    loss, metrics, grad, batch = _run(objective, data, per_token=True)
    lp, old, adv, mask = (data[k] for k in ("logprobs", "old_logprobs", "token_advantages", "mask"))
    per_token, d_per_token = stab.dppo(lp, old, adv, divergence, delta, delta, 1.5)
    w = _weights(mask, mode, batch)
    _close(loss, np.sum(w * per_token))
    _close_grad(grad, w * d_per_token)
    inside = stab.dppo_inside(lp, old, adv, divergence, delta, delta)
    _close(float(metrics["clip_frac"]), ref.masked_mean(1.0 - inside, mask))
    assert 0 < float(metrics["clip_frac"]) < 1


def test_kl_cov_policy_loss_matches_reference(rng):
    data = policy_data(rng)
    objective = make("dapo", surrogate="kl_cov", cov_fraction=0.2, kl_cov_coef=0.5)
    loss, metrics, grad, batch = _run(objective, data)
    lp, old, adv, mask = (data[k] for k in ("logprobs", "old_logprobs", "row_advantages", "mask"))
    per_token, d_per_token = stab.kl_cov(lp - old, lp, adv, mask, 0.2, 0.5)
    w = _weights(mask, "token-mean", batch)
    _close(loss, np.sum(w * np.where(mask > 0, per_token, 0.0)))
    _close_grad(grad, w * d_per_token)
    _close(float(metrics["cov_frac"]), int(0.2 * mask.sum()) / mask.sum())


def test_clip_cov_policy_loss_is_ppo_clip_without_the_drawn_tokens(rng):
    data = policy_data(rng)
    lp, old, adv, mask = (data[k] for k in ("logprobs", "old_logprobs", "token_advantages", "mask"))
    cov = stab.covariance(lp, adv, mask)
    bounds = tuple(float(b) for b in np.quantile(cov[mask > 0], [0.3, 0.95]))
    base = make("dapo", clip_high=0.28)
    objective = base.replace(surrogate="clip_cov", cov_fraction=0.1, cov_bounds=bounds)
    loss, metrics, grad, _ = _run(objective, data, per_token=True)
    plain_loss, _, plain_grad, _ = _run(base, data, per_token=True)
    dropped = (grad == 0) & (plain_grad != 0)
    candidates = stab.clip_cov_candidates(lp - old, lp, adv, mask, *bounds, 0.2, 0.28)
    assert dropped.sum() == min(stab.clip_count(mask, 0.1), candidates.sum()) > 0
    assert np.all(candidates[dropped])
    _close_grad(np.where(dropped, 0.0, grad), np.where(dropped, 0.0, plain_grad))
    _close(float(metrics["cov_frac"]), dropped.sum() / mask.sum())
    # The draw is a pure function of the batch: a second call repeats it exactly.
    again = _run(objective, data, per_token=True)
    assert again[0] == loss and np.array_equal(again[2], grad)
    assert loss != plain_loss


def test_new_surrogates_refuse_a_dual_clip(rng):
    data = policy_data(rng)
    for surrogate in ("dppo_tv", "clip_cov"):
        with pytest.raises(ValueError, match="dual_clip"):
            _run(make("ppo", surrogate=surrogate), data)
    with pytest.raises(ValueError, match="ratio"):
        make("gspo", surrogate="dppo_kl")


# ----------------------------------------------------------------------------- token masks


def test_top_entropy_quantile_trains_only_the_forking_tokens(rng):
    data = policy_data(rng)
    for name in ("grpo", "dapo", "cispo"):
        plain = make(name)
        objective = plain.replace(top_entropy_quantile=0.3)
        loss, metrics, grad, _ = _run(objective, data)
        _, _, plain_grad, _ = _run(plain, data)
        keep = stab.top_entropy_mask(data["entropy"], data["mask"], 0.3)
        # With zero advantages only the KL term is left, and it keeps every token.
        no_pg = dict(data, row_advantages=np.zeros_like(data["row_advantages"]))
        kl_grad = _run(plain, no_pg)[2]
        _close_grad(grad - kl_grad, (plain_grad - kl_grad) * keep, msg=name)
        _close(float(metrics["top_entropy_frac"]), ref.masked_mean(keep, data["mask"]))
        assert 0 < keep.sum() < data["mask"].sum()


def test_entropy_bonus_acts_on_the_selected_tokens(rng):
    data = policy_data(rng)
    objective = make("dapo", entropy_coef=0.1, top_entropy_quantile=0.5)
    batch = rollout_batch(data)
    keep = stab.top_entropy_mask(data["entropy"], data["mask"], 0.5)

    def bonus(h):
        return objectives.policy_loss(objective, jnp.asarray(data["logprobs"]), batch, entropy=h)

    d_entropy = jax.grad(lambda h: bonus(h).loss)(jnp.asarray(data["entropy"]))
    w = ref.aggregation_weights(data["mask"], "token-mean")
    _close_grad(np.asarray(d_entropy), -0.1 * w * keep)
    _close(
        float(bonus(jnp.asarray(data["entropy"])).metrics["entropy_loss"]),
        np.sum(w * keep * data["entropy"]),
    )


@pytest.mark.parametrize("use_rollout", [False, True])
def test_off_policy_mask_drops_drifted_negative_rows(rng, use_rollout):
    data = policy_data(rng)
    plain = make("dapo")
    objective = plain.replace(off_policy_mask_threshold=0.05)
    lp, old, mask = data["logprobs"], data["old_logprobs"], data["mask"]
    sampling = old + 0.2 * (np.arange(lp.shape[0]) % 2)[:, None].astype(np.float32)
    fields = {"rollout_logprobs": jnp.asarray(sampling)} if use_rollout else {}
    loss, metrics, grad, _ = _run(objective, data, **fields)
    _, _, plain_grad, _ = _run(plain, data)
    keep = stab.off_policy_sequence_mask(
        lp, sampling if use_rollout else old, data["row_advantages"], mask, 0.05
    )
    assert 0 < keep.sum() < mask.sum()
    _close_grad(grad, plain_grad * keep)
    _close(float(metrics["off_policy_masked_frac"]), ref.masked_mean(1.0 - keep, mask))


def test_kl_bias_correction_weights_the_kl_by_the_ratio(rng):
    data = policy_data(rng)
    plain = make("grpo")
    objective = plain.replace(kl_bias_correction=True)
    loss, metrics, grad, batch = _run(objective, data)
    no_kl = plain.replace(kl_kind=None, kl_coef=0.0)
    pg_loss, _, pg_grad, _ = _run(no_kl, data)
    lp, ref_lp, old, mask = (data[k] for k in ("logprobs", "ref_logprobs", "old_logprobs", "mask"))
    value, d_value = stab.importance_weighted_k3(lp, ref_lp, old)
    clamped = np.abs(ref_lp - lp) > 2.5  # k3's value clamp at 10 (one token of policy_data)
    value = np.where(clamped, 10.0 * np.exp(lp - old), value)
    d_value = np.where(clamped, 10.0 * np.exp(lp - old), d_value)
    w = _weights(mask, "seq-mean-token-mean", batch)
    _close(loss, pg_loss + 0.04 * np.sum(w * np.where(mask > 0, value, 0.0)))
    _close_grad(grad, pg_grad + 0.04 * w * d_value)
    _close(float(metrics["kl"]), ref.masked_mean(value, mask))


# ----------------------------------------------------------------------------- every preset


STABILISERS = {
    "top_entropy": {"top_entropy_quantile": 0.4},
    "off_policy": {"off_policy_mask_threshold": 0.05},
    "kl_bias_correction": {"kl_bias_correction": True},
    "m2po": {"m2_threshold": 0.04},
    "all": {
        "top_entropy_quantile": 0.4,
        "off_policy_mask_threshold": 0.05,
        "kl_bias_correction": True,
        "m2_threshold": 0.04,
    },
}


@pytest.mark.parametrize("which", list(STABILISERS))
def test_every_preset_composes_with_the_stabilisers(rng, which):
    """Finite losses and gradients, 0 on padding, for every preset; a threshold nobody
    exceeds and ``ρ = 1`` give the preset's numbers exactly."""
    data = policy_data(rng)
    mask = data["mask"]
    sampling = jnp.asarray(data["old_logprobs"] + 0.3)
    for name in objectives.available():
        objective = make(name, **STABILISERS[which])
        loss, _, grad, _ = _run(objective, data, rollout_logprobs=sampling)
        assert np.isfinite(loss) and np.all(np.isfinite(grad)), name
        assert not np.any(grad[mask == 0]), name
        inert = make(
            name, top_entropy_quantile=1.0, off_policy_mask_threshold=1e9, m2_threshold=1e9
        )
        assert _run(inert, data)[0] == _run(make(name), data)[0], name


def test_selection_keeps_micro_batches_additive(rng):
    data = policy_data(rng)
    objective = make(
        "dr_grpo",
        surrogate="dppo_tv",
        clip_low=0.15,
        clip_high=0.15,
        off_policy_mask_threshold=0.0,
        aggregation="seq-mean-token-mean",
    )
    full = rollout_batch(data, global_norm=True)
    lp = jnp.asarray(data["logprobs"])
    whole = objectives.policy_loss(objective, lp, full).loss
    halves = 0.0
    for rows in (slice(0, 3), slice(3, 6)):
        part = jax.tree.map(lambda x, r=rows: x if jnp.ndim(x) == 0 else x[r], full)
        halves += objectives.policy_loss(objective, lp[rows], part).loss
    _close(float(halves), float(whole))


def test_gmpo_takes_the_selection_through_its_mask(rng):
    data = policy_data(rng)
    plain = make("gmpo")
    objective = plain.replace(off_policy_mask_threshold=0.0)
    sampling = data["old_logprobs"] + 1.0  # every negative-advantage row drifted
    _, _, grad, _ = _run(objective, data, rollout_logprobs=jnp.asarray(sampling))
    negative = np.asarray(data["row_advantages"]) < 0
    assert not np.any(grad[negative]) and np.any(grad[~negative])


def test_jit_with_the_stabilisers(rng):
    data = policy_data(rng)
    objective = make(
        "dapo", surrogate="clip_cov", cov_bounds=(-10.0, 10.0), top_entropy_quantile=0.5
    )
    batch = rollout_batch(data)

    @jax.jit
    def run(lp, batch, h):
        return objectives.policy_loss(objective, lp, batch, entropy=h).loss

    eager = objectives.policy_loss(
        objective, jnp.asarray(data["logprobs"]), batch, entropy=jnp.asarray(data["entropy"])
    ).loss
    _close(
        float(run(jnp.asarray(data["logprobs"]), batch, jnp.asarray(data["entropy"]))), float(eager)
    )


# ----------------------------------------------------------------------------- configuration


def test_stabilisers_are_configured_from_yaml_overrides():
    from jaxrl_llm.train.rl.config import ObjectiveSection, make_objective  # noqa: PLC0415

    text = """
    name: dr_grpo
    overrides:
      surrogate: clip_cov
      cov_bounds: [0.5, 4.0]
      cov_fraction: 0.001
      top_entropy_quantile: 0.2
      off_policy_mask_threshold: 0.5
      kl_bias_correction: true
    """
    objective = make_objective(ObjectiveSection(**yaml.safe_load(text)))
    assert objective.surrogate.cov_bounds == (0.5, 4.0) and objective.surrogate.name == "clip_cov"
    assert objective.needs_entropy and not make("dr_grpo").needs_entropy
    hash(objective)
    gdpo = make_objective(
        ObjectiveSection(name="grpo", overrides={"advantage": "gdpo", "reward_weights": [1, 2]})
    )
    assert gdpo.advantage.reward_weights == (1.0, 2.0) and gdpo.needs_reward_columns


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"top_entropy_quantile": 1.5}, "top_entropy_quantile"),
        ({"off_policy_mask_threshold": -0.1}, "off_policy_mask_threshold"),
        ({"cov_fraction": 0.0}, "cov_fraction"),
        ({"cov_bounds": (2.0, 1.0)}, "cov_bounds"),
        ({"ratio_cap": 0.0}, "ratio_cap"),
        ({"kl_cov_coef": -1.0}, "kl_cov_coef"),
        ({"advantage": "gdpo", "kl_placement": "reward", "kl_kind": "k1"}, "kl_placement"),
    ],
)
def test_stabiliser_settings_are_validated(overrides, match):
    with pytest.raises(ValueError, match=match):
        make("grpo", **overrides)


def test_policy_loss_asks_for_the_entropy(rng):
    data = policy_data(rng)
    with pytest.raises(ValueError, match="entropy"):
        _run(make("grpo", top_entropy_quantile=0.2), data, entropy=False)


# ----------------------------------------------------------------------------- GDPO


def test_gdpo_estimator_normalises_each_reward_column(rng):
    roll = rollout_data(rng)
    columns = np.stack([roll["rewards"], rng.normal(0.0, 5.0, 6)], axis=1).astype(np.float32)
    objective = make("grpo", advantage="gdpo", reward_weights=(1.0, 0.5))
    adv, returns = compute(objective, roll, reward_columns=columns)
    assert returns is None
    want = stab.gdpo_trl(columns, 3, (1.0, 0.5), eps=1e-6)
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        adv, advantages.gdpo(columns, group_size=3, weights=(1.0, 0.5)), rtol=1e-6
    )
    with pytest.raises(ValueError, match="reward_columns"):
        compute(objective, roll)
    with pytest.raises(ValueError, match="weights"):
        compute(make("grpo", advantage="gdpo", reward_weights=(1.0,)), roll, reward_columns=columns)
