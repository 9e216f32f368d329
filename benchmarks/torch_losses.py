"""The policy losses of jaxrl_llm's presets written the way PyTorch trainers write them.

The style of verl's ``verl/trainer/ppo/core_algos.py``: eager tensors, ``ratio =
exp(clamp(lp − old))``, ``pg_losses1/2`` and ``torch.maximum``, masked reductions in
``agg_loss``, the ``low_var_kl`` (k3) clamps, and ``loss.backward()`` w.r.t. the log-prob leaf
tensor. The numbers follow shared/SPEC_LOSSES.md, so they equal ``jaxrl_llm.objectives.
policy_loss`` (tests/test_bench.py checks loss and gradient for every preset); where verl's
current code differs from the spec (its ``seq-mean-token-mean`` divides empty rows by 0, its
``seq-mean-token-sum-norm`` sums over rows instead of averaging), the spec is written here.

This file is a benchmark baseline, not part of the package: ``jaxrl_llm.bench`` loads it by
path when PyTorch is installed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

# verl's bounds: the token log ratio before exp, the GSPO log ratio, the k3 log ratio / value.
_SEQ_EPS = 1e-8
_K3_LOG_RATIO_CLAMP = 20.0
_K3_VALUE_CLAMP = 10.0


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.sum(values * mask)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """``[B, T]`` per-token loss -> scalar, as verl's ``agg_loss`` (with the spec's guards)."""
    if loss_agg_mode == "token-mean":
        return masked_sum(loss_mat, loss_mask) / torch.clamp(loss_mask.sum(), min=1.0)
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask)
    seq_tokens = torch.sum(loss_mask, dim=-1)
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
    num_seqs = torch.clamp(torch.sum(seq_tokens > 0), min=1)
    if loss_agg_mode == "seq-mean-token-mean":
        return torch.sum(seq_losses / (seq_tokens + _SEQ_EPS)) / num_seqs
    if loss_agg_mode == "seq-mean-token-sum":
        return torch.sum(seq_losses) / num_seqs
    if loss_agg_mode == "seq-mean-token-sum-norm":
        constant = loss_mask.shape[-1] if norm_constant is None else norm_constant
        return torch.sum(seq_losses) / num_seqs / constant
    raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")


def kl_penalty(
    logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str, straight_through: bool = False
) -> torch.Tensor:
    """verl's ``kl_penalty``: k1 ``"kl"``, k2 ``"mse"``, k3 ``"low_var_kl"``, ``"abs"``."""
    if kind == "k1":
        kl = logprob - ref_logprob
    elif kind == "k2":
        kl = 0.5 * (logprob - ref_logprob).square()
    elif kind == "k3":
        kl = ref_logprob - logprob
        kl = torch.clamp(kl, min=-_K3_LOG_RATIO_CLAMP, max=_K3_LOG_RATIO_CLAMP)
        ratio = torch.exp(kl)
        kld = (ratio - kl - 1).contiguous()
        kl = torch.clamp(kld, min=-_K3_VALUE_CLAMP, max=_K3_VALUE_CLAMP)
    elif kind == "abs":
        kl = (logprob - ref_logprob).abs()
    else:
        raise ValueError(f"unknown kl kind {kind!r}")
    if straight_through and kind != "k2":
        # value of the estimator, gradient of k2 (verl's "+" suffix)
        mse = 0.5 * (logprob - ref_logprob).square()
        kl = mse - mse.detach() + kl.detach()
    return kl


def log_ratio_token(log_prob, old_log_prob, clamp):
    negative_approx_kl = log_prob - old_log_prob
    return torch.clamp(negative_approx_kl, min=-clamp, max=clamp)


def log_ratio_gspo(log_prob, old_log_prob, response_mask, max_log_ratio):
    """verl's ``compute_policy_loss_gspo`` ratio: ``lp − sg(lp) + sg(log s_i)``, capped."""
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = (
        log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    )
    return torch.clamp(log_seq_importance_ratio, max=max_log_ratio)


def pg_losses_vanilla(log_ratio, advantages, clip_low, clip_high, clip_ratio_c=None):
    """verl's ``compute_policy_loss_vanilla`` per-token loss (dual clip when ``clip_ratio_c``)."""
    ratio = torch.exp(log_ratio)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    if clip_ratio_c is None:
        return clip_pg_losses1
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    return torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)


def pg_losses_cispo(log_ratio, log_prob, advantages, clip_low, clip_high):
    """CISPO: ``−sg(clip(r, 1 − ε_low, 1 + ε_high))·A·lp`` (no lower bound when ε_low is None)."""
    ratio = torch.exp(log_ratio)
    lower = None if clip_low is None else 1 - clip_low
    weight = torch.clamp(ratio, min=lower, max=1 + clip_high).detach()
    return -weight * advantages * log_prob


def pg_losses_sapo(log_ratio, advantages, tau_pos, tau_neg):
    """SAPO: ``−σ(τ·(r − 1))·(4/τ)·A``, ``τ = τ_pos`` for ``A > 0`` else ``τ_neg``."""
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    return -torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * advantages


def pg_losses_geo_mean(log_ratio, advantages, response_mask, clip_low, clip_high):
    """verl's ``compute_policy_loss_geo_mean`` per-sequence loss ``[B]`` (GMPO)."""
    advantages = advantages.expand_as(log_ratio)
    sgn_advantage = torch.sign(advantages)
    negative_approx_kl_clamp = torch.clamp(log_ratio, -clip_low, clip_high)
    negative_approx_kl_min = torch.min(
        sgn_advantage * log_ratio, sgn_advantage * negative_approx_kl_clamp
    )
    negative_approx_kl_min = sgn_advantage * negative_approx_kl_min
    response_mask_sum = response_mask.sum(dim=-1)
    ratio = torch.exp(
        (negative_approx_kl_min * response_mask).sum(dim=-1) / (response_mask_sum + _SEQ_EPS)
    )
    advantage = (advantages * response_mask).sum(dim=-1) / (response_mask_sum + _SEQ_EPS)
    return -advantage * ratio


def pg_losses_gpg(log_prob, advantages):
    """verl's ``compute_policy_loss_gpg`` per-token loss ``−lp·A``."""
    return -log_prob * advantages


def policy_loss(objective: Any, log_prob: torch.Tensor, batch: Any) -> torch.Tensor:
    """The scalar policy loss of a ``jaxrl_llm.objectives.Objective`` on torch tensors.

    Args:
      objective: reads ``ratio``, ``surrogate``, clip bounds, ``kl_*``, ``aggregation``...
      log_prob: ``[B, T]`` leaf tensor (requires grad).
      batch: ``RolloutBatch`` of torch tensors (``completion_mask`` float 0/1).

    Returns:
      The scalar loss ``agg(pg_losses) + kl_coef·agg(kl)`` (KL only when placed in the loss).
    """
    if objective.entropy.coef > 0:
        raise ValueError("the PyTorch baseline has no entropy term (entropy_coef must be 0)")
    mask = batch.completion_mask
    old_log_prob = batch.old_logprobs
    advantages = batch.advantages
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)

    def agg(loss_mat):
        return agg_loss(
            loss_mat, mask, objective.aggregation.mode, objective.aggregation.norm_constant
        )

    if objective.ratio.kind == "gspo_token":
        log_ratio = log_ratio_gspo(log_prob, old_log_prob, mask, objective.ratio.max_log_ratio)
    else:
        log_ratio = log_ratio_token(log_prob, old_log_prob, objective.ratio.clamp)

    if objective.surrogate.name == "ppo_clip":
        pg_losses = pg_losses_vanilla(
            log_ratio,
            advantages,
            objective.surrogate.clip_low,
            objective.surrogate.clip_high,
            objective.surrogate.dual_clip,
        )
    elif objective.surrogate.name == "cispo":
        pg_losses = pg_losses_cispo(
            log_ratio,
            log_prob,
            advantages,
            objective.surrogate.clip_low,
            objective.surrogate.clip_high,
        )
    elif objective.surrogate.name == "sapo":
        pg_losses = pg_losses_sapo(
            log_ratio, advantages, objective.surrogate.tau_pos, objective.surrogate.tau_neg
        )
    elif objective.surrogate.name == "gmpo":
        pg_losses = pg_losses_geo_mean(
            log_ratio, advantages, mask, objective.surrogate.clip_low, objective.surrogate.clip_high
        )
    elif objective.surrogate.name == "reinforce":
        pg_losses = pg_losses_gpg(log_prob, advantages)
    else:
        raise ValueError(f"unknown surrogate {objective.surrogate.name!r}")
    if objective.surrogate.name == "gmpo":
        # verl's torch.mean(pg_losses), over non-empty rows: the loss is already per sequence.
        non_empty = (mask.sum(dim=-1) > 0).to(pg_losses.dtype)
        loss = torch.sum(pg_losses * non_empty) / torch.clamp(non_empty.sum(), min=1.0)
    else:
        loss = agg(pg_losses)

    kl_in_loss = objective.kl.kind is not None and objective.kl.placement == "loss"
    if kl_in_loss and batch.ref_logprobs is not None:
        kld = kl_penalty(
            log_prob, batch.ref_logprobs, objective.kl.kind, objective.kl.straight_through
        )
        loss = loss + objective.kl.coef * agg(kld)
    return loss


def to_torch(
    logprobs: np.ndarray, batch: Any, *, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, Any]:
    """The log-prob leaf tensor (requires grad) and the batch as tensors of ``dtype``."""
    leaf = torch.tensor(np.asarray(logprobs), dtype=dtype, requires_grad=True)
    tensors = batch._replace(
        **{
            field: None if value is None else torch.tensor(np.asarray(value), dtype=dtype)
            for field, value in batch._asdict().items()
        }
    )
    return leaf, tensors


def loss_and_grad(
    objective: Any, logprobs: np.ndarray, batch: Any, *, dtype: torch.dtype = torch.float32
) -> tuple[float, np.ndarray]:
    """``(loss, d loss / d logprobs)`` as NumPy, computed in ``dtype``."""
    leaf, tensors = to_torch(logprobs, batch, dtype=dtype)
    loss = policy_loss(objective, leaf, tensors)
    loss.backward()
    return float(loss.detach()), leaf.grad.numpy()


def make_step(objective: Any, logprobs: np.ndarray, batch: Any) -> Callable[[], None]:
    """One eager training-style step: forward, ``loss.backward()`` into ``logprobs.grad``."""
    leaf, tensors = to_torch(logprobs, batch)

    def step() -> None:
        leaf.grad = None
        policy_loss(objective, leaf, tensors).backward()

    return step
