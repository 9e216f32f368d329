"""Conformance with TRL: TRL's own loss code, run on the same inputs as jaxrl_llm.preference.

Nothing of TRL is transcribed here. Its losses live in trainer methods; each is called unbound
with a minimal stand-in ``self`` (a ``SimpleNamespace`` holding the attributes the method
reads) and a stand-in model that returns fixed tensors (per-token log-probs for the DPO and
KTO trainers, which fuse the LM head; logits for ORPO and CPO; scalar rewards for the reward
model), then ``backward()`` gives TRL's gradients. TRL runs in float64; ours runs its float32
math on the same numbers, so values and gradients agree to float32 precision.

Written against TRL 1.16 (``trl.trainer.dpo_trainer``, ``kto_trainer``, ``reward_trainer``;
``trl.experimental.cpo``, ``trl.experimental.orpo``). Where TRL and jaxrl_llm differ on
purpose, a test pins TRL's behaviour so a TRL change shows up here.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections import defaultdict
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import preference as P

pytest.importorskip("trl")
torch = pytest.importorskip("torch")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # TRLExperimentalWarning: CPO and ORPO live in experimental
    from trl.experimental.cpo.cpo_config import CPOConfig
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer
    from trl.trainer.dpo_config import DPOConfig
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.kto_trainer import KTOTrainer
    from trl.trainer.reward_trainer import RewardTrainer

F64 = torch.float64
VALUE_TOL = {"rtol": 2e-5, "atol": 2e-6}
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}
_ACCELERATOR = SimpleNamespace(
    device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x
)


def _stand_in(**attrs):
    """The attributes every trainer's loss code reads, plus ``attrs``."""
    return SimpleNamespace(
        model=SimpleNamespace(training=False),
        accelerator=_ACCELERATOR,
        aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0,
        _tp_size=1,
        **attrs,
    )


def _trl_dpo_loss_types():
    """TRL's DPO loss types, as its own DPOConfig help text lists them."""
    help_text = DPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    return re.findall(r"`'(\w+)'`", help_text)


def _f32(x):
    return jnp.asarray(x, jnp.float32)


# ------------------------------------------------------------------------------------------
# DPO: DPOTrainer._compute_loss on precomputed reference log-probs.


def _dpo_batch(rng, n=6, t=8, scale=1.0):
    """Per-token log-probs and masks of N pairs (one empty chosen, one empty rejected)."""
    chosen = -rng.uniform(0.05, 3.0, (n, t)) * scale
    rejected = -rng.uniform(0.05, 3.0, (n, t)) * scale
    chosen_mask = np.arange(t)[None] < rng.integers(1, t + 1, n)[:, None]
    rejected_mask = np.arange(t)[None] < rng.integers(1, t + 1, n)[:, None]
    rejected_mask[0] = False
    chosen_mask[1] = False
    ref_chosen = (chosen * chosen_mask).sum(1) + rng.normal(0.0, 2.0 * scale, n)
    ref_rejected = (rejected * rejected_mask).sum(1) + rng.normal(0.0, 2.0 * scale, n)
    return chosen, chosen_mask, rejected, rejected_mask, ref_chosen, ref_rejected


def _trl_dpo(batch, loss_types, *, beta, label_smoothing=0.0, weights=None, discopop_tau=0.05):
    """TRL's DPO loss and its gradients with respect to the per-token log-probs."""
    chosen, chosen_mask, rejected, rejected_mask, ref_chosen, ref_rejected = batch
    n = chosen.shape[0]
    token_logps = torch.tensor(np.concatenate([chosen, rejected]), dtype=F64, requires_grad=True)
    mask = torch.tensor(np.concatenate([chosen_mask, rejected_mask]))
    rows, width = mask.shape
    # Column 0 stands for the prompt: the completion mask is shifted by one in TRL.
    completion_mask = torch.cat([torch.zeros(rows, 1, dtype=torch.long), mask.long()], dim=1)

    def model(**_):
        zeros = torch.zeros(rows, width, dtype=F64)
        return SimpleNamespace(
            log_probs=torch.where(mask, token_logps, 0.0),
            entropy=zeros,
            mean_logits=zeros,
            is_top1=torch.zeros(rows, width, dtype=torch.bool),
        )

    self = _stand_in(
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=list(loss_types),
        loss_weights=list(weights or [1.0] * len(loss_types)),
        beta=beta,
        label_smoothing=label_smoothing,
        use_weighting=False,
        args=SimpleNamespace(discopop_tau=discopop_tau),
    )
    inputs = {
        "input_ids": torch.zeros_like(completion_mask),
        "attention_mask": torch.ones_like(completion_mask),
        "completion_mask": completion_mask,
        "ref_chosen_logps": torch.tensor(ref_chosen, dtype=F64),
        "ref_rejected_logps": torch.tensor(ref_rejected, dtype=F64),
    }
    loss = DPOTrainer._compute_loss(self, model, inputs, return_outputs=False)
    loss.backward()
    grad = token_logps.grad.numpy()
    return loss.item(), grad[:n], grad[n:]


def _ours_dpo(batch, loss_name, *, beta, **kwargs):
    chosen, chosen_mask, rejected, rejected_mask, ref_chosen, ref_rejected = batch

    def loss(c, r):
        return P.preference_loss(
            loss_name,
            c,
            chosen_mask,
            r,
            rejected_mask,
            _f32(ref_chosen),
            _f32(ref_rejected),
            beta=beta,
            **kwargs,
        ).loss

    value, (g_chosen, g_rejected) = jax.value_and_grad(loss, (0, 1))(_f32(chosen), _f32(rejected))
    return float(value), np.asarray(g_chosen), np.asarray(g_rejected)


def _assert_same(ours, trl):
    np.testing.assert_allclose(ours[0], trl[0], **VALUE_TOL, err_msg="loss")
    for i, (a, b) in enumerate(zip(ours[1:], trl[1:])):
        np.testing.assert_allclose(a, b, **GRAD_TOL, err_msg=f"gradient {i}")


# TRL 1.16 smooths robust, exo_pair (ε > 0 required), aot and aot_unpaired.
_DPO_SMOOTHING = {"robust": 0.2, "exo_pair": 1e-3, "aot": 0.15, "aot_unpaired": 0.15}


def test_every_trl_dpo_loss_type_is_implemented():
    assert set(_trl_dpo_loss_types()) == set(P.LOSS_TYPES)


@pytest.mark.parametrize("loss_type", P.LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.1, 0.7])
def test_dpo_loss_types_match_trl(rng, loss_type, beta):
    batch = _dpo_batch(rng)
    eps = _DPO_SMOOTHING.get(loss_type, 0.0)
    trl = _trl_dpo(batch, [loss_type], beta=beta, label_smoothing=eps)
    kwargs = {"label_smoothing": eps} if eps else {}
    _assert_same(_ours_dpo(batch, loss_type, beta=beta, **kwargs), trl)


@pytest.mark.parametrize("loss_type", ["robust", "exo_pair", "aot", "aot_unpaired"])
def test_dpo_label_smoothing_matches_trl(rng, loss_type):
    batch = _dpo_batch(rng)
    trl = _trl_dpo(batch, [loss_type], beta=0.3, label_smoothing=0.4)
    _assert_same(_ours_dpo(batch, loss_type, beta=0.3, label_smoothing=0.4), trl)


def test_cdpo_matches_trl_conservative_sigmoid(rng):
    # TRL 1.16's DPOTrainer sigmoid ignores label_smoothing (next test); cDPO's smoothed
    # sigmoid lives in its CPOTrainer, −(1−ε)·logσ(β·x) − ε·logσ(−β·x) on x = chosen − rejected.
    # With x = c − ρ that is cDPO, our sigmoid with ε > 0.
    c, rho = rng.normal(0.0, 5.0, 16), rng.normal(0.0, 5.0, 16)
    self = _stand_in(alpha=0.0, beta=0.3, label_smoothing=0.2, loss_type="sigmoid")
    c_t = torch.tensor(c, dtype=F64, requires_grad=True)
    rho_t = torch.tensor(rho, dtype=F64, requires_grad=True)
    losses, _, _ = CPOTrainer.cpo_loss(self, c_t, rho_t)
    losses.sum().backward()
    zeros = jnp.zeros(16)
    ours = functools.partial(P.dpo, beta=0.3, label_smoothing=0.2)
    np.testing.assert_allclose(ours(_f32(c), _f32(rho), zeros, zeros), losses.detach(), **VALUE_TOL)
    grads = jax.grad(lambda a, b: ours(a, b, zeros, zeros).sum(), (0, 1))(_f32(c), _f32(rho))
    np.testing.assert_allclose(grads[0], c_t.grad, **GRAD_TOL)
    np.testing.assert_allclose(grads[1], rho_t.grad, **GRAD_TOL)


def test_trl_dpo_sigmoid_ignores_label_smoothing(rng):
    # Pins the TRL 1.16 behaviour our dpo docstring states: ε > 0 is cDPO here, a no-op there.
    batch = _dpo_batch(rng)
    smoothed = _trl_dpo(batch, ["sigmoid"], beta=0.1, label_smoothing=0.3)
    plain = _trl_dpo(batch, ["sigmoid"], beta=0.1)
    assert smoothed[0] == plain[0]
    ours = _ours_dpo(batch, "sigmoid", beta=0.1, label_smoothing=0.3)[0]
    assert abs(ours - plain[0]) > 1e-3


def test_dpo_mixtures_match_trl(rng):
    batch = _dpo_batch(rng)
    # MPO (Wang et al. 2024) as TRL documents it, and RPO-like DPO + NLL.
    for types, weights in [
        (("sigmoid", "bco_pair", "sft"), (0.8, 0.2, 1.0)),
        (("sigmoid", "sft"), (1.0, 0.5)),
        (("aot", "apo_zero", "ipo"), (0.3, 1.0, 0.1)),
    ]:
        trl = _trl_dpo(batch, types, beta=0.2, weights=weights)
        _assert_same(_ours_dpo(batch, types, beta=0.2, loss_weights=weights), trl)


def test_dpo_discopop_tau_matches_trl(rng):
    batch = _dpo_batch(rng)
    trl = _trl_dpo(batch, ["discopop"], beta=0.5, discopop_tau=0.3)
    _assert_same(_ours_dpo(batch, "discopop", beta=0.5, discopop_tau=0.3), trl)


@pytest.mark.parametrize("loss_type", P.LOSS_TYPES)
def test_dpo_edge_cases_match_trl(rng, loss_type):
    eps = _DPO_SMOOTHING.get(loss_type, 0.0)
    kwargs = {"label_smoothing": eps} if eps else {}
    chosen, chosen_mask, rejected, rejected_mask, _, _ = _dpo_batch(rng)
    # Policy = reference and chosen = rejected: every margin 0 (AOT: all sorted values tie).
    same = (chosen, chosen_mask, chosen, chosen_mask)
    sums = (chosen * chosen_mask).sum(1)
    tied = (*same, sums, sums)
    _assert_same(
        _ours_dpo(tied, loss_type, beta=0.1, **kwargs),
        _trl_dpo(tied, [loss_type], beta=0.1, label_smoothing=eps),
    )
    # Large margins of both signs (|βΔ| up to ~40; TRL's discopop overflows beyond ~700).
    large = (chosen * 10, chosen_mask, rejected * 10, rejected_mask, np.zeros(6), np.zeros(6))
    _assert_same(
        _ours_dpo(large, loss_type, beta=0.5, **kwargs),
        _trl_dpo(large, [loss_type], beta=0.5, label_smoothing=eps),
    )


# ------------------------------------------------------------------------------------------
# KTO: KTOTrainer._compute_loss on precomputed reference log-probs.


def _kto_batch(rng, n=8, t=6, kl_shift=-0.4):
    policy = -rng.uniform(0.05, 3.0, (n, t))
    mask = np.arange(t)[None] < rng.integers(1, t + 1, n)[:, None]
    labels = rng.random(n) < 0.5
    labels[:2] = [True, False]
    ref_logps = (policy * mask).sum(1) + rng.normal(0.0, 2.0, n)
    kl_policy = -rng.uniform(0.05, 3.0, (n, t + 2))  # the KL completions have their own width
    kl_mask = np.arange(t + 2)[None] < rng.integers(1, t + 3, n)[:, None]
    ref_kl = (kl_policy * kl_mask).sum(1) + rng.normal(kl_shift, 0.5, n)
    return policy, mask, labels, ref_logps, kl_policy, kl_mask, ref_kl


def _trl_kto(batch, *, beta, desirable_weight=1.0, undesirable_weight=1.0, calculate_kl=True):
    policy, mask, labels, ref_logps, kl_policy, kl_mask, ref_kl = batch
    token_logps = torch.tensor(policy, dtype=F64, requires_grad=True)
    mask_t, kl_mask_t = torch.tensor(mask), torch.tensor(kl_mask)
    kl_logps = torch.tensor(kl_policy, dtype=F64)

    def prepend_prompt(m):
        return torch.cat([torch.zeros(m.shape[0], 1, dtype=torch.long), m.long()], dim=1)

    completion_mask, kl_completion_mask = prepend_prompt(mask_t), prepend_prompt(kl_mask_t)

    def model(**kwargs):
        if kwargs["input_ids"].shape == kl_completion_mask.shape:
            return SimpleNamespace(log_probs=torch.where(kl_mask_t, kl_logps, 0.0))
        zeros = torch.zeros(mask_t.shape, dtype=F64)
        return SimpleNamespace(
            log_probs=torch.where(mask_t, token_logps, 0.0), entropy=zeros, mean_logits=zeros
        )

    self = _stand_in(
        calculate_KL=calculate_kl,
        precompute_ref_logps=True,
        loss_type="kto",
        beta=beta,
        desirable_weight=desirable_weight,
        undesirable_weight=undesirable_weight,
    )
    self._compute_kl_logps = functools.partial(KTOTrainer._compute_kl_logps, self)
    inputs = {
        "label": torch.tensor(labels),
        "input_ids": torch.zeros_like(completion_mask),
        "attention_mask": torch.ones_like(completion_mask),
        "completion_mask": completion_mask,
        "ref_logps": torch.tensor(ref_logps, dtype=F64),
    }
    if calculate_kl:
        inputs |= {
            "KL_input_ids": torch.zeros_like(kl_completion_mask),
            "KL_attention_mask": torch.ones_like(kl_completion_mask),
            "KL_completion_mask": kl_completion_mask,
            "ref_KL_logps": torch.tensor(ref_kl, dtype=F64),
        }
    loss = KTOTrainer._compute_loss(self, model, inputs, return_outputs=False)
    loss.backward()
    return loss.item(), token_logps.grad.numpy(), self._metrics["eval"]["kl"][-1]


def _ours_kto(batch, *, beta, calculate_kl=True, **kwargs):
    policy, mask, labels, ref_logps, kl_policy, kl_mask, ref_kl = batch
    kl = (
        (P.sequence_logps(_f32(kl_policy), kl_mask), _f32(ref_kl)) if calculate_kl else (None, None)
    )

    def loss(tokens):
        policy_logps = P.sequence_logps(tokens, mask)
        return P.kto(policy_logps, _f32(ref_logps), labels, *kl, beta=beta, **kwargs).mean()

    value, grad = jax.value_and_grad(loss)(_f32(policy))
    z0 = 0.0 if kl[0] is None else float(P.kto_reference_point(*kl))
    return float(value), np.asarray(grad), z0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"beta": 0.1},
        {"beta": 0.5, "desirable_weight": 1.33, "undesirable_weight": 0.7},
        {"beta": 0.3, "calculate_kl": False},
    ],
)
@pytest.mark.parametrize("kl_shift", [-0.4, 2.0])  # z0 > 0, and a negative mean clamped to 0
def test_kto_matches_trl(rng, kwargs, kl_shift):
    batch = _kto_batch(rng, kl_shift=kl_shift)
    trl = _trl_kto(batch, **kwargs)
    ours = _ours_kto(batch, **kwargs)
    _assert_same(ours[:2], trl[:2])
    np.testing.assert_allclose(ours[2], trl[2], **VALUE_TOL, err_msg="z0")


def test_kto_paired_preference_loss_matches_trl(rng):
    # preference_loss("kto") on N pairs is TRL's KTO on 2N examples, chosen desirable.
    chosen, chosen_mask, rejected, rejected_mask, ref_c, ref_r = _dpo_batch(rng, t=6)
    n = chosen.shape[0]
    _, _, _, _, kl_policy, kl_mask, ref_kl = _kto_batch(rng, n=2 * n)
    batch = (
        np.concatenate([chosen, rejected]),
        np.concatenate([chosen_mask, rejected_mask]),
        np.array([True] * n + [False] * n),
        np.concatenate([ref_c, ref_r]),
        kl_policy,
        kl_mask,
        ref_kl,
    )
    trl = _trl_kto(batch, beta=0.2, desirable_weight=1.2)

    def loss(c, r):
        return P.preference_loss(
            "kto",
            c,
            chosen_mask,
            r,
            rejected_mask,
            _f32(ref_c),
            _f32(ref_r),
            beta=0.2,
            desirable_weight=1.2,
            kl_policy_logps=P.sequence_logps(_f32(kl_policy), kl_mask),
            kl_ref_logps=_f32(ref_kl),
        ).loss

    value, grads = jax.value_and_grad(loss, (0, 1))(_f32(chosen), _f32(rejected))
    np.testing.assert_allclose(float(value), trl[0], **VALUE_TOL)
    np.testing.assert_allclose(np.concatenate(grads), trl[1], **GRAD_TOL)


# ------------------------------------------------------------------------------------------
# ORPO and CPO: the trainers' concatenated forward on a stand-in model's logits.


def _sequence_batch(rng, n=5, width=10, vocab=7):
    """Right-padded prompt + completion rows as TRL's ORPO/CPO collators build them."""
    batch, masks = {}, {}
    prompt_len = rng.integers(2, 4, n)
    for side in ("chosen", "rejected"):
        completion_len = rng.integers(1, width - 3, n)
        ids = rng.integers(0, vocab, (n, width))
        positions = np.arange(width)[None]
        attention = positions < (prompt_len + completion_len)[:, None]
        completion = attention & (positions >= prompt_len[:, None])
        labels = np.where(completion, ids, -100)
        batch[f"{side}_input_ids"] = torch.tensor(np.where(attention, ids, 0))
        batch[f"{side}_attention_mask"] = torch.tensor(attention.astype(np.int64))
        batch[f"{side}_labels"] = torch.tensor(labels)
        masks[side] = (ids, attention, completion)
    logits = rng.normal(0.0, 1.5, (2 * n, width, vocab))
    return batch, masks, logits


def _token_logps(logits, masks):
    """Our per-token log-probs of the next tokens, with completion and (predicted) prompt masks."""
    n = logits.shape[0] // 2
    out = {}
    for k, side in enumerate(("chosen", "rejected")):
        ids, attention, completion = masks[side]
        logps = jax.nn.log_softmax(logits[k * n : (k + 1) * n, :-1], axis=-1)
        token = jnp.take_along_axis(logps, jnp.asarray(ids[:, 1:, None]), axis=-1)[..., 0]
        prompt = attention[:, 1:] & ~completion[:, 1:]
        out[side] = (token, completion[:, 1:], prompt)
    return out


def _logits_model(logits_t):
    return lambda *args, **kwargs: SimpleNamespace(logits=logits_t)


def _orpo_self(beta):
    self = _stand_in(is_encoder_decoder=False, padding_value=0, beta=beta)
    self.concatenated_inputs = ORPOTrainer.concatenated_inputs
    self.get_batch_logps = ORPOTrainer.get_batch_logps
    self.concatenated_forward = functools.partial(ORPOTrainer.concatenated_forward, self)
    self.odds_ratio_loss = functools.partial(ORPOTrainer.odds_ratio_loss, self)
    return self


def _cpo_self(config):
    self = _stand_in(
        is_encoder_decoder=False,
        pad_token_id=0,
        beta=config.beta,
        label_smoothing=config.label_smoothing,
        loss_type=config.loss_type,
        cpo_alpha=config.cpo_alpha,
        simpo_gamma=config.simpo_gamma,
        alpha=config.alpha,
    )
    self.concatenated_inputs = CPOTrainer.concatenated_inputs
    self.get_batch_logps = CPOTrainer.get_batch_logps
    self.concatenated_forward = functools.partial(CPOTrainer.concatenated_forward, self)
    self.cpo_loss = functools.partial(CPOTrainer.cpo_loss, self)
    return self


def _cpo_config(tmp_path, **kwargs):
    """TRL's CPOConfig, for its own defaults and its ``alphapo`` shorthand."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **kwargs)


def _ours_from_logits(logits, masks, loss_of_tokens):
    value, grad = jax.value_and_grad(lambda x: loss_of_tokens(_token_logps(x, masks)))(_f32(logits))
    return float(value), np.asarray(grad)


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_orpo_prompt_and_completion_nll_matches_trl(rng, beta):
    batch, masks, logits = _sequence_batch(rng)
    logits_t = torch.tensor(logits, dtype=F64, requires_grad=True)
    loss, _ = ORPOTrainer.get_batch_loss_metrics(_orpo_self(beta), _logits_model(logits_t), batch)
    loss.backward()

    def ours(tokens):
        (c, cm, cp), (r, rm, _) = tokens["chosen"], tokens["rejected"]
        return P.preference_loss(
            "orpo",
            c,
            cm,
            r,
            rm,
            beta=beta,
            nll="prompt_and_completion",
            prompt_logps=c,
            prompt_mask=cp,
        ).loss

    _assert_same(_ours_from_logits(logits, masks, ours), (loss.item(), logits_t.grad.numpy()))


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_orpo_completion_nll_matches_trl_pieces(rng, beta, tmp_path):
    # The paper's completion-only NLL has no TRL ORPO switch. TRL's pieces: the odds-ratio term
    # of ORPOTrainer.odds_ratio_loss on TRL's averaged log-probs, and TRL's completion-only NLL
    # (CPOTrainer's cross-entropy with the prompt labels masked); joined as ORPOTrainer joins them,
    # ``nll − losses.mean()``.
    batch, masks, logits = _sequence_batch(rng)
    logits_t = torch.tensor(logits, dtype=F64, requires_grad=True)
    cpo_self = _cpo_self(_cpo_config(tmp_path, loss_type="simpo", cpo_alpha=1.0))
    chosen, rejected, _, _, nll = cpo_self.concatenated_forward(_logits_model(logits_t), batch)
    losses, *_ = ORPOTrainer.odds_ratio_loss(_orpo_self(beta), chosen, rejected)
    loss = nll - losses.mean()
    loss.backward()

    def ours(tokens):
        (c, cm, _), (r, rm, _) = tokens["chosen"], tokens["rejected"]
        return P.preference_loss("orpo", c, cm, r, rm, beta=beta).loss

    _assert_same(_ours_from_logits(logits, masks, ours), (loss.item(), logits_t.grad.numpy()))


def _cpo_ours(config):
    """Our CPOTrainer counterpart: summed log-probs for sigmoid / hinge, averaged otherwise."""
    averaged = config.loss_type in ("ipo", "simpo")

    def loss(tokens):
        (c, cm, _), (r, rm, _) = tokens["chosen"], tokens["rejected"]
        if config.loss_type == "simpo":
            name = "alphapo" if config.cpo_alpha == 0 and config.alpha else "simpo"
            kwargs = {"alpha": config.alpha, "gamma": config.simpo_gamma}
            if name == "simpo":
                kwargs["cpo_alpha"] = config.cpo_alpha
            if config.label_smoothing:
                kwargs["label_smoothing"] = config.label_smoothing
            return P.preference_loss(name, c, cm, r, rm, beta=config.beta, **kwargs).loss
        pick = P.average_logps if averaged else P.sequence_logps
        chosen_sum, chosen_len = P.sequence_logps(c, cm), P.sequence_lengths(cm)
        per_pair = P.cpo(
            pick(c, cm),
            pick(r, rm),
            beta=config.beta,
            loss_type=config.loss_type,
            label_smoothing=config.label_smoothing if config.loss_type == "sigmoid" else 0.0,
            cpo_alpha=config.cpo_alpha,
            chosen_nll=P.token_mean_nll(chosen_sum, chosen_len),
            alpha=config.alpha,
        )
        return per_pair.mean()

    return loss


@pytest.mark.parametrize(
    "kwargs",
    [
        {"loss_type": "sigmoid"},
        {"loss_type": "sigmoid", "label_smoothing": 0.1, "beta": 0.3, "cpo_alpha": 0.5},
        {"loss_type": "sigmoid", "alpha": 0.2},
        {"loss_type": "hinge", "beta": 0.2},
        {"loss_type": "ipo", "beta": 0.5, "alpha": -0.3},
        {"loss_type": "simpo", "cpo_alpha": 0.0, "beta": 2.0},
        {"loss_type": "simpo", "cpo_alpha": 0.5, "simpo_gamma": 1.0, "label_smoothing": 0.2},
        {"loss_type": "alphapo", "alpha": 0.25, "beta": 2.5},
        {"loss_type": "alphapo", "alpha": -0.5, "simpo_gamma": 0.8},
    ],
)
def test_cpo_loss_types_match_trl(rng, kwargs, tmp_path):
    config = _cpo_config(tmp_path, **kwargs)
    batch, masks, logits = _sequence_batch(rng)
    logits_t = torch.tensor(logits, dtype=F64, requires_grad=True)
    loss, _ = CPOTrainer.get_batch_loss_metrics(_cpo_self(config), _logits_model(logits_t), batch)
    loss.backward()
    ours = _ours_from_logits(logits, masks, _cpo_ours(config))
    _assert_same(ours, (loss.item(), logits_t.grad.numpy()))


# ------------------------------------------------------------------------------------------
# Reward model: RewardTrainer.compute_loss on a stand-in model's scalar rewards.


def _trl_reward(chosen, rejected, margins=None, center=None):
    rewards = torch.tensor(np.concatenate([chosen, rejected])[:, None], dtype=F64)
    rewards.requires_grad_(True)
    self = _stand_in(args=SimpleNamespace(center_rewards_coefficient=center))
    inputs = {} if margins is None else {"margin": torch.tensor(margins, dtype=F64)}
    loss = RewardTrainer.compute_loss(self, lambda **_: SimpleNamespace(logits=rewards), inputs)
    loss.backward()
    n = chosen.shape[0]
    return loss.item(), rewards.grad[:n, 0].numpy(), rewards.grad[n:, 0].numpy()


@pytest.mark.parametrize("use_margin", [False, True])
@pytest.mark.parametrize("center", [None, 0.01])
@pytest.mark.parametrize("scale", [2.0, 30.0])
def test_bradley_terry_matches_trl(rng, use_margin, center, scale):
    chosen, rejected = rng.normal(0.5, scale, 12), rng.normal(-0.5, scale, 12)
    margins = rng.uniform(0.0, 2.0, 12) if use_margin else None
    trl = _trl_reward(chosen, rejected, margins, center)

    def loss(rw, rl):
        return P.bradley_terry(
            rw,
            rl,
            margins=None if margins is None else _f32(margins),
            center_rewards_coefficient=center or 0.0,
        ).mean()

    value, grads = jax.value_and_grad(loss, (0, 1))(_f32(chosen), _f32(rejected))
    _assert_same((float(value), *map(np.asarray, grads)), trl)
