"""Tests for jaxrl_llm.preference.preference_loss against tests/reference/preference.py."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import preference as P
from tests.reference import preference as ref

# ------------------------------------------------------------------------------------------
# preference_loss.


def _token_batch(rng, n=6, t=9, t_rej=7, empty_rejected=True):
    chosen_tok = rng.normal(-1.5, 0.8, (n, t)).astype(np.float32)
    rejected_tok = rng.normal(-1.8, 0.8, (n, t_rej)).astype(np.float32)
    chosen_mask = np.arange(t)[None] < rng.integers(1, t + 1, n)[:, None]
    rejected_mask = np.arange(t_rej)[None] < rng.integers(0, t_rej + 1, n)[:, None]
    rejected_mask[:, 0] = True
    if empty_rejected:
        rejected_mask[0] = False
    ref_chosen_tok = (chosen_tok + rng.normal(0, 0.3, (n, t))).astype(np.float32)
    ref_rejected_tok = (rejected_tok + rng.normal(0, 0.3, (n, t_rej))).astype(np.float32)
    return chosen_tok, chosen_mask, rejected_tok, rejected_mask, ref_chosen_tok, ref_rejected_tok


def _expected_metrics(rw, rl, lw, ll):
    return {
        "rewards/chosen": rw.mean(),
        "rewards/rejected": rl.mean(),
        "rewards/accuracies": (rw > rl).mean(),
        "rewards/margins": (rw - rl).mean(),
        "logps/chosen": lw.mean(),
        "logps/rejected": ll.mean(),
    }


def _assert_metrics(out, expected):
    for key, value in expected.items():
        np.testing.assert_allclose(out.metrics[key], value, rtol=1e-5, atol=1e-5, err_msg=key)
        chex.assert_shape(out.metrics[key], ())
    np.testing.assert_allclose(out.metrics["loss"], out.loss, rtol=1e-7)


@pytest.mark.parametrize("loss_name", ["sigmoid", "ipo", "sigmoid_norm", ("sigmoid", "bco_pair")])
@pytest.mark.parametrize("ref_per_token", [False, True])
def test_preference_loss_dpo(rng, loss_name, ref_per_token):
    ct, cm, rt, rm, rct, rrt = _token_batch(rng)
    lw, ll = ref.seq_sum(ct, cm), ref.seq_sum(rt, rm)
    rw_ref, rl_ref = ref.seq_sum(rct, cm), ref.seq_sum(rrt, rm)
    refs = (rct, rrt) if ref_per_token else (rw_ref.astype(np.float32), rl_ref.astype(np.float32))
    kwargs = {"loss_weights": (0.8, 0.2)} if isinstance(loss_name, tuple) else {}
    out = P.preference_loss(loss_name, ct, cm, rt, rm, *refs, beta=0.2, **kwargs)
    weights = kwargs.get("loss_weights")
    want = ref.dpo(
        lw,
        ll,
        rw_ref,
        rl_ref,
        loss_name,
        weights=weights,
        beta=0.2,
        n_w=ref.seq_len(cm),
        n_l=ref.seq_len(rm),
    ).mean()
    chex.assert_shape(out.loss, ())
    chex.assert_type(out.loss, jnp.float32)
    np.testing.assert_allclose(out.loss, want, rtol=1e-5)
    _assert_metrics(out, _expected_metrics(0.2 * (lw - rw_ref), 0.2 * (ll - rl_ref), lw, ll))


def test_preference_loss_dpo_gradient_only_on_valid_tokens(rng):
    ct, cm, rt, rm, rct, rrt = _token_batch(rng)
    grads = jax.jit(
        jax.grad(lambda c, r: P.preference_loss("sigmoid", c, cm, r, rm, rct, rrt).loss, (0, 1))
    )(ct, rt)
    np.testing.assert_array_equal(np.asarray(grads[0])[~cm], 0.0)
    np.testing.assert_array_equal(np.asarray(grads[1])[~rm], 0.0)
    assert np.all(np.asarray(grads[0])[cm] < 0)


@pytest.mark.parametrize("per_token_kl", [False, True])
def test_preference_loss_kto(rng, per_token_kl):
    ct, cm, rt, rm, rct, rrt = _token_batch(rng)
    kl_pol_tok = rng.normal(-2.0, 0.5, (4, 9)).astype(np.float32)
    kl_ref_tok = (kl_pol_tok - 0.3).astype(np.float32)
    kl_mask = np.ones((4, 9), bool)
    kl_mask[1, 5:] = False
    kl_pol, kl_ref = ref.seq_sum(kl_pol_tok, kl_mask), ref.seq_sum(kl_ref_tok, kl_mask)
    if per_token_kl:
        kl_kwargs = {"kl_policy_logps": kl_pol_tok, "kl_ref_logps": kl_ref_tok, "kl_mask": kl_mask}
    else:
        kl_kwargs = {
            "kl_policy_logps": kl_pol.astype(np.float32),
            "kl_ref_logps": kl_ref.astype(np.float32),
        }
    out = P.preference_loss(
        "kto", ct, cm, rt, rm, rct, rrt, beta=0.3, desirable_weight=1.2, **kl_kwargs
    )
    lw, ll = ref.seq_sum(ct, cm), ref.seq_sum(rt, rm)
    rw_ref, rl_ref = ref.seq_sum(rct, cm), ref.seq_sum(rrt, rm)
    labels = np.array([True] * 6 + [False] * 6)
    want = ref.kto(
        np.concatenate([lw, ll]),
        np.concatenate([rw_ref, rl_ref]),
        labels,
        kl_pol,
        kl_ref,
        beta=0.3,
        w_d=1.2,
    ).mean()
    np.testing.assert_allclose(out.loss, want, rtol=1e-5)
    expected = _expected_metrics(0.3 * (lw - rw_ref), 0.3 * (ll - rl_ref), lw, ll)
    expected["kl"] = max((kl_pol - kl_ref).mean(), 0.0)
    _assert_metrics(out, expected)


@pytest.mark.parametrize("loss_name", ["orpo", "simpo", "cpo"])
def test_preference_loss_reference_free(rng, loss_name):
    # Non-empty completions: an empty one averages to log-prob 0, where ORPO's odds are inf.
    ct, cm, rt, rm, _, _ = _token_batch(rng, empty_rejected=False)
    beta = 0.5
    lw, ll = ref.seq_avg(ct, cm), ref.seq_avg(rt, rm)
    nll = ref.batch_token_mean_nll(ct, cm)
    kwargs = {"gamma": 0.2, "cpo_alpha": 0.3} if loss_name == "simpo" else {}
    out = P.preference_loss(loss_name, ct, cm, rt, rm, beta=beta, **kwargs)
    if loss_name == "orpo":
        per_pair, log_odds = ref.orpo(lw, ll, beta=beta, nll=0.0)
        want = per_pair.mean() + nll
    elif loss_name == "simpo":
        want = ref.simpo_cpo(lw, ll, beta=beta, gamma=0.2, nll=0.0).mean() + 0.3 * nll
    else:
        want = ref.simpo_cpo(lw, ll, beta=beta, gamma=0.0, nll=0.0).mean() + 1.0 * nll
    np.testing.assert_allclose(out.loss, want, rtol=1e-5)
    expected = _expected_metrics(beta * lw, beta * ll, lw, ll)
    expected["nll_loss"] = nll
    if loss_name == "orpo":
        expected["log_odds_chosen"] = log_odds.mean()
        expected["log_odds_ratio"] = ref.log_sigmoid(log_odds).mean()
    _assert_metrics(out, expected)


def test_preference_loss_bf16_and_no_recompile(rng):
    ct, cm, rt, rm, rct, rrt = _token_batch(rng)
    traces = []

    def loss(c, r):
        return P.preference_loss("simpo", c, cm, r, rm).loss

    def fn(c, r):
        traces.append(1)
        return loss(c, r)

    step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
    loss_bf16, grads = step(jnp.asarray(ct, jnp.bfloat16), jnp.asarray(rt, jnp.bfloat16))
    chex.assert_type(loss_bf16, jnp.float32)
    chex.assert_type(grads, jnp.bfloat16)
    rounded = [np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (ct, rt)]
    loss_f32 = jax.jit(loss)
    np.testing.assert_allclose(loss_bf16, loss_f32(*rounded), rtol=1e-6)
    np.testing.assert_allclose(loss_bf16, loss_f32(ct, rt), rtol=1e-2)
    step(jnp.asarray(ct + 0.1, jnp.bfloat16), jnp.asarray(rt - 0.1, jnp.bfloat16))
    assert len(traces) == 1


def test_preference_loss_errors(rng):
    ct, cm, rt, rm, rct, rrt = _token_batch(rng)
    with pytest.raises(ValueError, match="ref_chosen_logps is required"):
        P.preference_loss("sigmoid", ct, cm, rt, rm)
    with pytest.raises(ValueError, match="reference-free"):
        P.preference_loss("simpo", ct, cm, rt, rm, rct, rrt)
    with pytest.raises(ValueError, match="unknown loss_name"):
        P.preference_loss("dpo", ct, cm, rt, rm, rct, rrt)
    with pytest.raises(ValueError, match="number of pairs"):
        P.preference_loss("sigmoid", ct, cm, rt[:3], rm[:3], rct, rrt[:3])
    with pytest.raises(ValueError, match="does not match mask"):
        P.preference_loss("sigmoid", ct[:, :4], cm, rt, rm, rct, rrt)
    with pytest.raises(ValueError, match="ref_rejected_logps must have shape"):
        P.preference_loss("sigmoid", ct, cm, rt, rm, rct, np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="unknown keyword"):
        P.preference_loss("orpo", ct, cm, rt, rm, label_smoothing=0.1)
    with pytest.raises(ValueError, match="unknown keyword"):
        P.preference_loss("sigmoid", ct, cm, rt, rm, rct, rrt, chosen_len=np.ones(6))
    with pytest.raises(ValueError, match="unknown keyword"):
        P.preference_loss("kto", ct, cm, rt, rm, rct, rrt, gamma=1.0)


def test_exported_names():
    assert len(P.LOSS_TYPES) == 15 and len(set(P.LOSS_TYPES)) == 15
    assert set(P.PREFERENCE_LOSSES) == set(P.LOSS_TYPES) | {
        "kto",
        "orpo",
        "simpo",
        "cpo",
        "alphapo",
    }
    assert set(P.BATCH_COUPLED) <= set(P.LOSS_TYPES)
    assert P.ORPO_NLL_MODES == ("completion", "prompt_and_completion")


@pytest.mark.parametrize("loss_name", ["orpo", "simpo", "cpo", "ipo", "kto"])
def test_preference_loss_empty_completion_is_finite(rng, loss_name):
    ct, cm, rt, rm, rct, rrt = _token_batch(rng)
    cm[1] = False
    refs = () if loss_name in ("orpo", "simpo", "cpo") else (rct, rrt)
    value, grads = jax.jit(
        jax.value_and_grad(
            lambda c, r: P.preference_loss(loss_name, c, cm, r, rm, *refs).loss, argnums=(0, 1)
        )
    )(ct, rt)
    assert np.isfinite(value) and all(np.all(np.isfinite(g)) for g in grads)


@pytest.mark.parametrize(
    "loss_name", ["aot", "aot_unpaired", "sft", ("sigmoid", "bco_pair", "sft")]
)
def test_preference_loss_batch_coupled_dpo_types(rng, loss_name):
    ct, cm, rt, rm, rct, rrt = _token_batch(rng)
    lw, ll = ref.seq_sum(ct, cm), ref.seq_sum(rt, rm)
    rw_ref, rl_ref = ref.seq_sum(rct, cm), ref.seq_sum(rrt, rm)
    kwargs = {"loss_weights": (0.8, 0.2, 1.0)} if isinstance(loss_name, tuple) else {}
    out = P.preference_loss(loss_name, ct, cm, rt, rm, rct, rrt, beta=0.2, **kwargs)
    want = ref.dpo(
        lw,
        ll,
        rw_ref,
        rl_ref,
        loss_name,
        weights=kwargs.get("loss_weights"),
        beta=0.2,
        n_w=ref.seq_len(cm),
        n_l=ref.seq_len(rm),
    ).mean()
    np.testing.assert_allclose(out.loss, want, rtol=1e-5)


def _prompt_batch(rng, n=6, p=5):
    prompt_tok = rng.normal(-2.5, 0.8, (n, p)).astype(np.float32)
    # Left-padded prompts of 2..p tokens; the first real token is not predicted.
    prompt_len = rng.integers(2, p + 1, n)
    prompt_mask = np.arange(p)[None] >= (p - prompt_len + 1)[:, None]
    return prompt_tok, prompt_mask


def test_preference_loss_orpo_prompt_and_completion_nll(rng):
    ct, cm, rt, rm, _, _ = _token_batch(rng, empty_rejected=False)
    pt, pm = _prompt_batch(rng)
    beta = 0.5
    out = P.preference_loss(
        "orpo",
        ct,
        cm,
        rt,
        rm,
        beta=beta,
        nll="prompt_and_completion",
        prompt_logps=pt,
        prompt_mask=pm,
    )
    lw, ll = ref.seq_avg(ct, cm), ref.seq_avg(rt, rm)
    nll = ref.batch_token_mean_nll(ct, cm, pt, pm)
    per_pair, _ = ref.orpo(lw, ll, beta=beta, nll=0.0)
    np.testing.assert_allclose(out.loss, per_pair.mean() + nll, rtol=1e-5)
    np.testing.assert_allclose(out.metrics["nll_loss"], nll, rtol=1e-5)
    # The prompt terms change the NLL (and only it): the default mode leaves them out.
    default = P.preference_loss("orpo", ct, cm, rt, rm, beta=beta)
    np.testing.assert_allclose(
        default.loss - out.loss, ref.batch_token_mean_nll(ct, cm) - nll, rtol=1e-4
    )
    # Padded prompt positions carry no gradient; predicted ones −1/(total token count).
    grad = jax.grad(
        lambda p: (
            P.preference_loss(
                "orpo",
                ct,
                cm,
                rt,
                rm,
                beta=beta,
                nll="prompt_and_completion",
                prompt_logps=p,
                prompt_mask=pm,
            ).loss
        )
    )(pt)
    np.testing.assert_array_equal(np.asarray(grad)[~pm], 0.0)
    np.testing.assert_allclose(np.asarray(grad)[pm], -1.0 / (cm.sum() + pm.sum()), rtol=1e-6)


@pytest.mark.parametrize("alpha", [0.0, 0.3, -0.2])
def test_preference_loss_alphapo(rng, alpha):
    ct, cm, rt, rm, _, _ = _token_batch(rng, empty_rejected=False)
    beta = 2.0
    out = P.preference_loss("alphapo", ct, cm, rt, rm, beta=beta, alpha=alpha, gamma=0.4)
    lw, ll = ref.seq_avg(ct, cm), ref.seq_avg(rt, rm)
    want = ref.simpo_cpo(lw, ll, beta=beta, gamma=0.4, shape=alpha).mean()
    np.testing.assert_allclose(out.loss, want, rtol=1e-5)
    rw, rl = beta * ref.alphapo_reward(lw, alpha), beta * ref.alphapo_reward(ll, alpha)
    expected = _expected_metrics(rw, rl, lw, ll)
    expected["nll_loss"] = ref.batch_token_mean_nll(ct, cm)
    _assert_metrics(out, expected)
    # SimPO with the same reward shape and no NLL term is the same loss.
    simpo = P.preference_loss("simpo", ct, cm, rt, rm, beta=beta, alpha=alpha, gamma=0.4)
    np.testing.assert_allclose(simpo.loss, out.loss, rtol=1e-6)


@pytest.mark.parametrize(
    "loss_name,kwargs,match",
    [
        ("alphapo", {}, "needs alpha"),
        ("alphapo", {"cpo_alpha": 1.0}, "unknown keyword"),
        ("orpo", {"nll": "prompt"}, "nll"),
        ("orpo", {"nll": "prompt_and_completion"}, "needs prompt_logps"),
        ("orpo", {"prompt_logps": np.zeros((6, 5), np.float32)}, "used by nll="),
        ("simpo", {"nll": "completion"}, "unknown keyword"),
    ],
)
def test_preference_loss_new_option_errors(rng, loss_name, kwargs, match):
    ct, cm, rt, rm, _, _ = _token_batch(rng)
    with pytest.raises(ValueError, match=match):
        P.preference_loss(loss_name, ct, cm, rt, rm, **kwargs)


def test_preference_loss_orpo_prompt_shape_errors(rng):
    ct, cm, rt, rm, _, _ = _token_batch(rng)
    pt, pm = _prompt_batch(rng)
    with pytest.raises(ValueError, match="does not match mask"):
        P.preference_loss(
            "orpo",
            ct,
            cm,
            rt,
            rm,
            nll="prompt_and_completion",
            prompt_logps=pt[:, :3],
            prompt_mask=pm,
        )
    with pytest.raises(ValueError, match="N=6 rows"):
        P.preference_loss(
            "orpo",
            ct,
            cm,
            rt,
            rm,
            nll="prompt_and_completion",
            prompt_logps=pt[:3],
            prompt_mask=pm[:3],
        )


@pytest.mark.parametrize("loss_name", ["aot", "sft", "alphapo", "orpo"])
def test_preference_loss_new_losses_jit_like_eager(rng, loss_name):
    ct, cm, rt, rm, rct, rrt = _token_batch(rng, empty_rejected=False)
    pt, pm = _prompt_batch(rng)
    refs, kwargs = (rct, rrt), {}
    if loss_name == "alphapo":
        refs, kwargs = (), {"alpha": 0.3}
    elif loss_name == "orpo":
        refs = ()
        kwargs = {"nll": "prompt_and_completion", "prompt_logps": pt, "prompt_mask": pm}

    def fn(c, r):
        return P.preference_loss(loss_name, c, cm, r, rm, *refs, **kwargs).loss

    eager = jax.value_and_grad(fn, (0, 1))(ct, rt)
    jitted = jax.jit(jax.value_and_grad(fn, (0, 1)))(ct, rt)
    for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
