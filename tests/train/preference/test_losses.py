"""The preference trainer's device side against float64 references, and its config checks.

Per-token log-probs and reward-model scores come from the (separately tested) model, one part
at a time; the references then compute the losses and metrics in float64 NumPy. What is
checked: the one-forward-pass concatenation of chosen and rejected rows, the wiring of the
reference log-probs and of KTO's mismatched pairs, the metric definitions, the Bradley-Terry
loss (``jaxrl_llm.preference.bradley_terry``) and the reward model's loss, and the step with
micro-batches averaged (``train.step.make_step(..., accumulate="mean")``).
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm import data, models
from jaxrl_llm.logprobs import completion_logprobs
from jaxrl_llm.models import heads
from jaxrl_llm.preference import bradley_terry
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.preference.config import PreferenceConfig, check_config
from jaxrl_llm.train.preference.losses import (
    RewardBatch,
    UnpairedBatch,
    make_kto_loss_fn,
    make_loss_fn,
    make_pair_loss_fn,
    make_reward_loss_fn,
)
from jaxrl_llm.train.setup import build_policy
from jaxrl_llm.train.state import TrainState
from jaxrl_llm.train.step import make_step
from jaxrl_llm.types import PreferenceBatch
from tests.reference import preference as ref_pref
from tests.reference import preference_training as ref
from tests.train.preference.preference_helpers import SMALL_MODEL

BETA = 0.5


@pytest.fixture(scope="module")
def model():
    cfg = load_config(PreferenceConfig, None, list(SMALL_MODEL))
    tokenizer, model_config, _ = build_policy(cfg, None)
    params = models.init_params(model_config, jax.random.key(0))
    return tokenizer, model_config, params


@pytest.fixture(scope="module")
def pairs(model):
    tokenizer = model[0]
    records = data.arithmetic_preference_pairs(6, seed=0)
    arrays, _ = data.encode_pairs(
        tokenizer,
        [p.prompt for p in records],
        [p.chosen for p in records],
        [p.rejected + "0" * (i % 3) for i, p in enumerate(records)],  # uneven lengths
        max_prompt_tokens=16,
        max_completion_tokens=16,
        margins=np.linspace(-1.0, 1.0, 6),
    )
    return arrays


def _logps(params, model_config, prompt_tokens, prompt_mask, tokens, mask):
    return np.asarray(
        completion_logprobs(params, model_config, prompt_tokens, prompt_mask, tokens, mask),
        np.float64,
    )


def test_pair_loss_matches_the_reference(model, pairs, rng):
    _, mc, params = model
    a = pairs
    chosen_tok = _logps(params, mc, a.prompt_tokens, a.prompt_mask, a.chosen_tokens, a.chosen_mask)
    rejected_tok = _logps(
        params, mc, a.prompt_tokens, a.prompt_mask, a.rejected_tokens, a.rejected_mask
    )
    chosen = ref_pref.seq_sum(chosen_tok, a.chosen_mask)
    rejected = ref_pref.seq_sum(rejected_tok, a.rejected_mask)
    ref_chosen = chosen + rng.normal(size=6)
    ref_rejected = rejected + rng.normal(size=6)
    batch = PreferenceBatch(
        *(jnp.asarray(x) for x in a[:6]),
        ref_chosen_logps=jnp.asarray(ref_chosen, jnp.float32),
        ref_rejected_logps=jnp.asarray(ref_rejected, jnp.float32),
    )
    loss, metrics = jax.jit(make_pair_loss_fn(mc, "sigmoid", beta=BETA))(params, batch)

    want = ref_pref.dpo(chosen, rejected, ref_chosen, ref_rejected, "sigmoid", beta=BETA)
    np.testing.assert_allclose(loss, want.mean(), rtol=1e-5)
    reward_w, reward_l = BETA * (chosen - ref_chosen), BETA * (rejected - ref_rejected)
    expected = {
        "rewards/chosen": reward_w.mean(),
        "rewards/rejected": reward_l.mean(),
        "rewards/margins": (reward_w - reward_l).mean(),
        "rewards/accuracies": (reward_w > reward_l).mean(),
        "logps/chosen": chosen.mean(),
        "logps/rejected": rejected.mean(),
        "nll": ref.token_mean_nll(chosen_tok, a.chosen_mask),
    }
    for key, value in expected.items():
        np.testing.assert_allclose(metrics[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_reference_free_loss_matches_the_reference(model, pairs):
    _, mc, params = model
    a = pairs
    chosen_tok = _logps(params, mc, a.prompt_tokens, a.prompt_mask, a.chosen_tokens, a.chosen_mask)
    rejected_tok = _logps(
        params, mc, a.prompt_tokens, a.prompt_mask, a.rejected_tokens, a.rejected_mask
    )
    batch = PreferenceBatch(*(jnp.asarray(x) for x in a[:6]))
    loss_fn = make_pair_loss_fn(mc, "simpo", beta=BETA, gamma=0.3)
    loss, metrics = jax.jit(loss_fn)(params, batch)
    lw = ref_pref.seq_avg(chosen_tok, a.chosen_mask)
    ll = ref_pref.seq_avg(rejected_tok, a.rejected_mask)
    want = ref_pref.simpo_cpo(lw, ll, beta=BETA, gamma=0.3)
    np.testing.assert_allclose(loss, want.mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["rewards/chosen"], BETA * lw.mean(), rtol=1e-5)


def _prompt_logps(params, mc, a):
    """``[N, P]`` log-probs of each prompt token after a row's first, from full logits."""
    tokens = jnp.concatenate([jnp.asarray(a.prompt_tokens), jnp.asarray(a.chosen_tokens)], 1)
    mask = jnp.concatenate([jnp.asarray(a.prompt_mask), jnp.asarray(a.chosen_mask)], 1) > 0
    z = np.asarray(models.logits(params, mc, tokens, attention_mask=mask), np.float64)
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    p = a.prompt_tokens.shape[1]
    out, counted = np.zeros(a.prompt_tokens.shape), np.zeros(a.prompt_tokens.shape, bool)
    for row in range(out.shape[0]):
        first = int(np.argmax(np.asarray(a.prompt_mask[row]) > 0))
        for j in range(first + 1, p):
            out[row, j] = logp[row, j - 1, int(a.prompt_tokens[row, j])]
            counted[row, j] = True
    return out, counted


def test_orpo_with_trl_nll_counts_the_prompt_tokens(model, pairs):
    """``loss.orpo_nll=prompt_and_completion``: TRL ORPOTrainer's NLL over the whole sequence."""
    _, mc, params = model
    a = pairs
    chosen_tok = _logps(params, mc, a.prompt_tokens, a.prompt_mask, a.chosen_tokens, a.chosen_mask)
    rejected_tok = _logps(
        params, mc, a.prompt_tokens, a.prompt_mask, a.rejected_tokens, a.rejected_mask
    )
    prompt_tok, counted = _prompt_logps(params, mc, a)
    assert counted.sum() > a.prompt_tokens.shape[0]
    lw = ref_pref.seq_avg(chosen_tok, a.chosen_mask)
    ll = ref_pref.seq_avg(rejected_tok, a.rejected_mask)
    batch = PreferenceBatch(*(jnp.asarray(x) for x in a[:6]))
    for mode, nll in (
        ("completion", ref_pref.batch_token_mean_nll(chosen_tok, a.chosen_mask)),
        (
            "prompt_and_completion",
            ref_pref.batch_token_mean_nll(chosen_tok, a.chosen_mask, prompt_tok, counted),
        ),
    ):
        cfg = load_config(
            PreferenceConfig,
            None,
            [*SMALL_MODEL, "loss.name=orpo", f"loss.beta={BETA}", f"loss.orpo_nll={mode}"],
        )
        check_config(cfg)
        loss, metrics = jax.jit(make_loss_fn(cfg, mc))(params, batch)
        want, _ = ref_pref.orpo(lw, ll, beta=BETA, nll=nll)
        np.testing.assert_allclose(loss, want.mean(), rtol=1e-5, err_msg=mode)
        np.testing.assert_allclose(metrics["nll_loss"], np.mean(nll), rtol=1e-5, err_msg=mode)


def test_alphapo_from_the_config(model, pairs):
    _, mc, params = model
    a = pairs
    chosen_tok = _logps(params, mc, a.prompt_tokens, a.prompt_mask, a.chosen_tokens, a.chosen_mask)
    rejected_tok = _logps(
        params, mc, a.prompt_tokens, a.prompt_mask, a.rejected_tokens, a.rejected_mask
    )
    lw = ref_pref.seq_avg(chosen_tok, a.chosen_mask)
    ll = ref_pref.seq_avg(rejected_tok, a.rejected_mask)
    cfg = load_config(
        PreferenceConfig,
        None,
        [
            *SMALL_MODEL,
            "loss.name=alphapo",
            "loss.alpha=0.25",
            "loss.gamma=0.2",
            f"loss.beta={BETA}",
        ],
    )
    check_config(cfg)
    loss, metrics = jax.jit(make_loss_fn(cfg, mc))(
        params, PreferenceBatch(*(jnp.asarray(x) for x in a[:6]))
    )
    rw, rl = ref_pref.alphapo_reward(lw, 0.25), ref_pref.alphapo_reward(ll, 0.25)
    want = -np.log(1.0 / (1.0 + np.exp(-(BETA * (rw - rl) - 0.2))))
    np.testing.assert_allclose(loss, want.mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["rewards/chosen"], BETA * rw.mean(), rtol=1e-5)


def test_kto_loss_uses_the_mismatched_pairs(model, pairs, rng):
    tokenizer, mc, params = model
    records = data.pairs_to_unpaired(data.arithmetic_preference_pairs(3, seed=1))
    arrays, _ = data.encode_unpaired(
        tokenizer,
        [r.prompt for r in records],
        [r.completion for r in records],
        [r.label for r in records],
        max_prompt_tokens=16,
        max_completion_tokens=16,
    )
    partners = data.mismatched_partners(6)
    a = arrays
    tok = _logps(params, mc, a.prompt_tokens, a.prompt_mask, a.completion_tokens, a.completion_mask)
    kl_tokens, kl_mask = a.completion_tokens[partners], a.completion_mask[partners]
    kl_tok = _logps(params, mc, a.prompt_tokens, a.prompt_mask, kl_tokens, kl_mask)
    policy = ref_pref.seq_sum(tok, a.completion_mask)
    kl_policy = ref_pref.seq_sum(kl_tok, kl_mask)
    # A reference below the policy on the mismatched pairs: z0 = mean KL > 0 is exercised.
    ref_logps = policy + rng.normal(size=6)
    ref_kl = kl_policy - np.abs(rng.normal(size=6))
    batch = UnpairedBatch(
        *(jnp.asarray(x) for x in a),
        jnp.asarray(kl_tokens),
        jnp.asarray(kl_mask),
        jnp.asarray(ref_logps, jnp.float32),
        jnp.asarray(ref_kl, jnp.float32),
    )
    loss_fn = make_kto_loss_fn(mc, beta=BETA, desirable_weight=1.0, undesirable_weight=1.5)
    loss, metrics = jax.jit(loss_fn)(params, batch)

    labels = a.labels
    want = ref_pref.kto(policy, ref_logps, labels, kl_policy, ref_kl, beta=BETA, w_u=1.5)
    # The loss and rewards (~0.01) are β x differences of f32 sequence log-probs (sums of ~16
    # tokens), whose rounding, which the CPU's vector width reorders, is up to ~1e-6 absolute
    # (measured 2.5e-7 on an AVX-512 Xeon).
    tol = dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, want.mean(), **tol)
    z0 = max(np.mean(kl_policy - ref_kl), 0.0)
    assert z0 > 0
    np.testing.assert_allclose(metrics["kl"], z0, **tol)
    reward = BETA * (policy - ref_logps)
    np.testing.assert_allclose(metrics["rewards/chosen"], ref.masked_mean(reward, labels), **tol)
    np.testing.assert_allclose(metrics["rewards/rejected"], ref.masked_mean(reward, ~labels), **tol)
    desirable_mask = a.completion_mask & labels[:, None]
    np.testing.assert_allclose(metrics["nll"], ref.token_mean_nll(tok, desirable_mask), rtol=1e-5)
    log_ratio = policy - ref_logps
    on_side = np.where(labels, log_ratio > z0, log_ratio < z0)
    np.testing.assert_allclose(metrics["rewards/accuracies"], on_side.mean(), rtol=1e-6)


def test_bradley_terry_matches_the_reference(rng):
    chosen, rejected, margins = rng.normal(size=(3, 7)) * 3.0
    for center in (0.0, 0.01):
        got = bradley_terry(
            jnp.asarray(chosen, jnp.float32),
            jnp.asarray(rejected, jnp.bfloat16),
            margins=jnp.asarray(margins, jnp.float32),
            center_rewards_coefficient=center,
        )
        rejected_bf16 = np.asarray(jnp.asarray(rejected, jnp.bfloat16), np.float64)
        want = ref.bradley_terry(chosen, rejected_bf16, margins, center)
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(
        bradley_terry(jnp.asarray(chosen), jnp.asarray(rejected)),
        ref.bradley_terry(chosen, rejected),
        rtol=1e-5,
    )


def test_bradley_terry_edge_cases():
    # Equal rewards: log 2. Huge gaps: finite values and gradients (0 and −1 in the tails).
    np.testing.assert_allclose(bradley_terry(jnp.zeros(2), jnp.zeros(2)), np.log(2.0), rtol=1e-6)
    chosen, rejected = jnp.array([1e4, -1e4]), jnp.zeros(2)
    values = bradley_terry(chosen, rejected)
    grads = jax.grad(lambda c: jnp.sum(bradley_terry(c, rejected)))(chosen)
    np.testing.assert_allclose(values, [0.0, 1e4], rtol=1e-6)
    np.testing.assert_allclose(grads, [0.0, -1.0], atol=1e-6)
    with pytest.raises(ValueError, match="center_rewards_coefficient"):
        bradley_terry(chosen, rejected, center_rewards_coefficient=-1.0)
    with pytest.raises(ValueError, match=r"\(2,\)"):
        bradley_terry(chosen, jnp.zeros(3))


def test_reward_loss_matches_the_reference(model, pairs):
    _, mc, params = model
    scalar = heads.init_scalar_params(mc, jax.random.key(1), backbone=params, score_std=1.0)
    a = pairs
    score = jax.jit(lambda p, *x: heads.sequence_scores(p, mc, *x))
    rw = np.asarray(score(scalar, a.prompt_tokens, a.prompt_mask, a.chosen_tokens, a.chosen_mask))
    rl = np.asarray(
        score(scalar, a.prompt_tokens, a.prompt_mask, a.rejected_tokens, a.rejected_mask)
    )
    batch = RewardBatch(PreferenceBatch(*(jnp.asarray(x) for x in a[:6])), jnp.asarray(a.margins))
    loss_fn = make_reward_loss_fn(mc, center_rewards_coefficient=0.05)
    loss, metrics = jax.jit(loss_fn)(scalar, batch)
    want = ref.bradley_terry(rw, rl, a.margins, 0.05)
    np.testing.assert_allclose(loss, want.mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["rewards/accuracies"], np.mean(rw > rl), atol=1e-7)
    np.testing.assert_allclose(metrics["rewards/margins"], np.mean(rw - rl), rtol=1e-5, atol=1e-6)


def test_micro_batches_average_to_the_full_batch_step(model, pairs):
    _, mc, params = model
    a = pairs
    batch = PreferenceBatch(
        *(jnp.asarray(x) for x in a[:6]),
        ref_chosen_logps=jnp.linspace(-20.0, -10.0, 6),
        ref_rejected_logps=jnp.linspace(-12.0, -18.0, 6),
    )
    loss_fn = make_pair_loss_fn(mc, "sigmoid", beta=BETA)
    optimizer = optax.sgd(1.0)
    state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), jax.random.key(0))
    outputs = {}
    for k in (1, 2):
        step = jax.jit(make_step(loss_fn, optimizer, micro_batches=k, accumulate="mean"))
        outputs[k] = jax.device_get(step(state, batch))
    (full_state, full_metrics) = outputs[1]
    # The DPO loss is a mean over pairs, so averaging equal micro-batches is exact.
    micro_state, micro_metrics = outputs[2]
    chex.assert_trees_all_close(micro_state.params, full_state.params, atol=1e-5)
    np.testing.assert_allclose(micro_metrics["loss"], full_metrics["loss"], rtol=1e-5)
    np.testing.assert_allclose(micro_metrics["grad_norm"], full_metrics["grad_norm"], rtol=1e-4)
    assert int(full_state.step) == 1
    with pytest.raises(ValueError, match="micro_batches=4 does not divide the batch size B=6"):
        jax.jit(make_step(loss_fn, optimizer, micro_batches=4, accumulate="mean"))(state, batch)


# --------------------------------------------------------------------------------------------
# Config checks (no JAX work)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["job=sft"], r"job must be one of \('preference', 'reward_model'\)"),
        (["loss.name=ppo"], r"loss.name must be one of"),
        (["job=reward_model"], r"job 'reward_model' trains with loss.name=bradley_terry"),
        (["loss.name=bradley_terry"], r"set job=reward_model"),
        (["loss.loss_type=sigmod"], r"loss.loss_type must be one of"),
        (["loss.name=kto", "loss.loss_type=hinge"], r"loss.loss_type selects a DPO variant"),
        (["loss.reference=lazy"], r"loss.reference must be one of"),
        (["loss.beta=0"], r"loss.beta must be > 0"),
        (["loss.name=orpo", "loss.label_smoothing=0.1"], r"label_smoothing applies to dpo"),
        (["loss.gamma=0.5"], r"loss.gamma applies to simpo, cpo and alphapo only"),
        (["loss.name=alphapo", "loss.cpo_alpha=1"], r"loss.cpo_alpha applies to simpo and cpo"),
        (["loss.alpha=0.5"], r"loss.alpha .* applies to simpo, cpo and alphapo"),
        (["loss.name=alphapo"], r"loss.name=alphapo needs loss.alpha"),
        (["loss.name=cpo", "loss.alpha=.inf"], r"loss.alpha must be finite"),
        (["loss.name=orpo", "loss.orpo_nll=prompt"], r"loss.orpo_nll must be one of"),
        (["loss.orpo_nll=prompt_and_completion"], r"loss.orpo_nll .* applies to orpo only"),
        (["data.task=jsonl"], r"data.task=jsonl needs data.train_path"),
        (["data.task=csv"], r"data.task must be one of"),
        (["data.unpaired=true"], r"only loss.name=kto"),
        (["loss.center_rewards_coefficient=0.1"], r"applies to bradley_terry only"),
        (["trainer.batch_size=6", "trainer.micro_batches=4"], r"micro_batches=4 must divide"),
        (["trainer.max_steps=0"], r"trainer.max_steps must be > 0"),
        (["loss.loss_type=[{type: sigmoid, weight: -1}]"], r"weights must be >= 0"),
        # Refused before any model is built, not at the first traced step.
        (["loss.loss_type=exo_pair"], r"loss.label_smoothing .*exo_pair.* must be > 0"),
        (
            ["loss.loss_type=robust", "loss.label_smoothing=0.5"],
            r"loss.label_smoothing .*robust.* must be < 0.5",
        ),
        (["loss.loss_type=hinge", "loss.label_smoothing=0.1"], r"has no effect on loss_type"),
        (["loss.discopop_tau=0.1"], r"discopop_tau has no effect"),
        (["loss.name=simpo", "loss.label_smoothing=0.6"], r"label_smoothing must be in \[0, 0.5\]"),
    ],
)
def test_bad_configs_are_refused_by_name(overrides, message):
    cfg = load_config(PreferenceConfig, None, overrides)
    with pytest.raises(ValueError, match=message):
        check_config(cfg)


def test_make_loss_fn_passes_each_setting_to_its_loss(model):
    _, mc, _ = model
    # A mixture, discopop's tau and label smoothing reach dpo (bad values are refused by the
    # config check, and again by dpo itself).
    cfg = load_config(
        PreferenceConfig,
        None,
        ["loss.loss_type=[{type: discopop, weight: 1.0}, {type: exo_pair, weight: 0.5}]"],
    )
    with pytest.raises(ValueError, match="exo_pair' takes log"):
        check_config(cfg)
    with pytest.raises(ValueError, match="exo_pair' takes log"):
        jax.eval_shape(make_loss_fn(cfg, mc), *_abstract_pair_inputs(mc))
    cfg = dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, label_smoothing=0.01))
    check_config(cfg)
    jax.eval_shape(make_loss_fn(cfg, mc), *_abstract_pair_inputs(mc))


def _abstract_pair_inputs(mc):
    params = models.param_shapes(mc)
    tokens = jax.ShapeDtypeStruct((2, 3), jnp.int32)
    mask = jax.ShapeDtypeStruct((2, 3), jnp.bool_)
    ref = jax.ShapeDtypeStruct((2,), jnp.float32)
    return params, PreferenceBatch(tokens, mask, tokens, mask, tokens, mask, ref, ref)
