"""The device side of preference training: losses of a model's log-probs or scores, and the
frozen reference pass.

Everything here is pure and jit-able; configs are resolved into these functions' arguments
before anything is traced. Each loss function has the ``train.step`` signature
``(params, batch, totals) -> (loss, metrics)`` (``totals`` unused: the step averages
micro-batches, ``accumulate="mean"``). Pairs travel as ``types.PreferenceBatch``
(chosen and rejected completions scored in one forward pass over ``2N`` rows), KTO's
labelled completions as :class:`UnpairedBatch`, a reward model's pairs as
:class:`RewardBatch`; any of them as a ``packing.PackedBatch`` (with ``trainer.packing``) runs
its ``2N`` forward rows packed (``jaxrl_llm.packing``), the same losses to rounding.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm._checks import f32
from jaxrl_llm.logprobs import completion_logprobs, packed_completion_logprobs
from jaxrl_llm.models import heads
from jaxrl_llm.preference import (
    bradley_terry,
    kto,
    kto_reference_point,
    preference_loss,
    sequence_logps,
)
from jaxrl_llm.train.packing import micro_plan
from jaxrl_llm.train.preference.config import PreferenceConfig, dpo_loss_types
from jaxrl_llm.train.preference.packing import unwrap
from jaxrl_llm.types import PreferenceBatch, Sequences

Array = jax.Array


class UnpairedBatch(NamedTuple):
    """KTO's batch: labelled completions and the mismatched completions of its KL estimate.

    Attributes:
      prompt_tokens: ``[N, P]`` int32, left-padded.
      prompt_mask: ``[N, P]``.
      completion_tokens: ``[N, T]`` int32, right-padded.
      completion_mask: ``[N, T]``.
      labels: ``[N]`` bool, true for desirable completions.
      kl_completion_tokens: ``[N, T]`` the completion of another example, paired with row
        ``i``'s prompt (``data.mismatched_partners``).
      kl_completion_mask: ``[N, T]``.
      ref_logps: ``[N]`` summed reference log-probs of the completions.
      ref_kl_logps: ``[N]`` summed reference log-probs of the mismatched completions.
    """

    prompt_tokens: Array
    prompt_mask: Array
    completion_tokens: Array
    completion_mask: Array
    labels: Array
    kl_completion_tokens: Array
    kl_completion_mask: Array
    ref_logps: Array | None = None
    ref_kl_logps: Array | None = None


class RewardBatch(NamedTuple):
    """A reward model's batch: the pairs and their Bradley-Terry margins ``[N]``."""

    pairs: PreferenceBatch
    margins: Array


def _masked_mean(x: Array, weights: Array) -> Array:
    return jnp.sum(jnp.where(weights > 0, x, 0.0)) / jnp.maximum(jnp.sum(weights), 1.0)


def _token_nll(token_logps: Array, mask: Array) -> Array:
    """``−Σ m·lp / max(Σ m, 1)``: the token-mean NLL over every row (a metric)."""
    mask = mask.astype(jnp.float32)
    return -jnp.sum(jnp.where(mask > 0, f32(token_logps), 0.0)) / jnp.maximum(jnp.sum(mask), 1.0)


def _both(prompt_tokens, prompt_mask, first_tokens, first_mask, second_tokens, second_mask):
    """``[2N, ...]`` rows ``[prompt; prompt]`` with ``[first; second]``: one forward pass."""
    cat = lambda a, b: jnp.concatenate([a, b], axis=0)  # noqa: E731
    return (
        cat(prompt_tokens, prompt_tokens),
        cat(prompt_mask, prompt_mask),
        cat(first_tokens, second_tokens),
        cat(first_mask, second_mask),
    )


def _pair_rows(batch: PreferenceBatch):
    """The ``[2N, ...]`` rows ``[prompt; prompt]`` with ``[chosen; rejected]``."""
    return _both(
        batch.prompt_tokens,
        batch.prompt_mask,
        batch.chosen_tokens,
        batch.chosen_mask,
        batch.rejected_tokens,
        batch.rejected_mask,
    )


def _row_logprobs(params, model_config, rows, packing=None, **kwargs):
    """``completion_logprobs`` of the ``[2N, ...]`` forward rows, or with a ``packing`` plan of
    them (leaves ``[shards, rows, W]``) ``packed_completion_logprobs``: the same values."""
    if packing is None:
        return completion_logprobs(params, model_config, *rows, **kwargs)
    return packed_completion_logprobs(params, model_config, Sequences(*rows), packing, **kwargs)


def _logps_of_both(
    params, model_config, prompt_tokens, prompt_mask, *completions, packing=None, **kwargs
):
    """Per-token log-probs of two ``[N, T]`` completion sets for the same prompts, one pass
    (over packed rows with a ``packing`` plan of the ``2N`` rows)."""
    n = completions[0].shape[0]
    rows = _both(prompt_tokens, prompt_mask, *completions)
    token_logps = _row_logprobs(params, model_config, rows, packing, **kwargs)
    return token_logps[:n], token_logps[n:]


def pair_token_logps(
    params,
    model_config,
    batch: PreferenceBatch,
    *,
    chunk_size=None,
    remat="none",
    return_prompt_logprobs=False,
    dropout_key=None,
    packing=None,
):
    """Per-token log-probs ``([N, T], [N, T])`` of the chosen and rejected completions.

    With ``return_prompt_logprobs``, also ``[N, P]`` log-probs of the (chosen rows') prompt
    tokens the model predicts, from the same pass (ORPO's TRL-style NLL). ``packing``: a plan
    of the ``2N`` rows ``[chosen ; rejected]`` (leaves ``[shards, rows, W]``), or None.
    """
    if return_prompt_logprobs:
        n = batch.chosen_tokens.shape[0]
        completion, prompt = _row_logprobs(
            params,
            model_config,
            _pair_rows(batch),
            packing,
            chunk_size=chunk_size,
            remat=remat,
            return_prompt_logprobs=True,
            dropout_key=dropout_key,
        )
        return completion[:n], completion[n:], prompt[:n]
    return _logps_of_both(
        params,
        model_config,
        batch.prompt_tokens,
        batch.prompt_mask,
        batch.chosen_tokens,
        batch.chosen_mask,
        batch.rejected_tokens,
        batch.rejected_mask,
        packing=packing,
        chunk_size=chunk_size,
        remat=remat,
        dropout_key=dropout_key,
    )


def unpaired_token_logps(
    params,
    model_config,
    batch: UnpairedBatch,
    *,
    chunk_size=None,
    remat="none",
    dropout_key=None,
    packing=None,
):
    """Per-token log-probs ``([N, T], [N, T])`` of the completions and the mismatched ones
    (``packing``: a plan of the ``2N`` rows ``[completions ; mismatched]``, or None)."""
    return _logps_of_both(
        params,
        model_config,
        batch.prompt_tokens,
        batch.prompt_mask,
        batch.completion_tokens,
        batch.completion_mask,
        batch.kl_completion_tokens,
        batch.kl_completion_mask,
        packing=packing,
        chunk_size=chunk_size,
        remat=remat,
        dropout_key=dropout_key,
    )


def make_pair_loss_fn(
    model_config, loss_name, *, beta, chunk_size=None, remat="none", **loss_kwargs
):
    """``L(θ) = mean_i ℓ(lp_θ(y_w^i), lp_θ(y_l^i))``: a pair loss of a model, with metrics.

    ``ℓ`` is ``jaxrl_llm.preference.preference_loss``'s: a DPO loss type or a tuple of them
    (Rafailov et al. 2023 and its variants; they read ``batch.ref_chosen_logps`` /
    ``ref_rejected_logps``, ``[N]``), or the reference-free ``orpo`` (Hong et al. 2024),
    ``simpo`` (Meng et al. 2024), ``cpo`` (Xu et al. 2024). The ``N`` chosen and ``N``
    rejected completions (``[N, T]``, prompts ``[N, P]``) are scored in one forward pass over
    ``2N`` rows. Metrics are ``preference_loss``'s plus ``nll``, the token-mean NLL of the
    chosen completions. Hyper-parameters are bound here, before ``jax.jit``. ORPO's
    ``nll="prompt_and_completion"`` (TRL's) scores the chosen prompts in the same pass.
    """
    with_prompt = loss_kwargs.get("nll") == "prompt_and_completion"

    def loss_fn(params, batch: PreferenceBatch, totals=None, key=None):
        batch, plan = unwrap(batch)
        out = pair_token_logps(
            params,
            model_config,
            batch,
            chunk_size=chunk_size,
            remat=remat,
            return_prompt_logprobs=with_prompt,
            dropout_key=key,
            packing=plan,
        )
        chosen, rejected = out[:2]
        extra = {}
        if with_prompt:
            extra["prompt_logps"] = out[2]
            real = batch.prompt_mask.astype(bool)
            # The tokens the model predicts: real, after a real token (not a row's first).
            extra["prompt_mask"] = jnp.pad(real[:, 1:] & real[:, :-1], [(0, 0), (1, 0)])
        out = preference_loss(
            loss_name,
            chosen,
            batch.chosen_mask,
            rejected,
            batch.rejected_mask,
            batch.ref_chosen_logps,
            batch.ref_rejected_logps,
            beta=beta,
            **loss_kwargs,
            **extra,
        )
        metrics = dict(out.metrics)
        metrics["nll"] = jax.lax.stop_gradient(_token_nll(chosen, batch.chosen_mask))
        return out.loss, metrics

    return loss_fn


def make_kto_loss_fn(model_config, *, beta, chunk_size=None, remat="none", **kto_kwargs):
    """``L(θ) = mean_i λ_i·(1 − σ(±β·(r_i − z0)))``: KTO over ``N`` labelled completions.

    Ethayarajh et al. 2024: ``r_i = lp_θ(y_i) − lp_ref(y_i)``, ``+`` and ``λ_D`` for desirable
    completions, ``−`` and ``λ_U`` for undesirable ones (``jaxrl_llm.preference.kto``). The
    reference point ``z0 = max(mean_i(lp_θ(y'_i) − lp_ref(y'_i)), 0)`` (detached) comes from
    the batch's mismatched pairs: prompt ``i`` with another example's completion ``y'_i``,
    scored in the same forward pass over ``2N`` rows. Metrics: ``rewards/chosen`` /
    ``rewards/rejected`` (mean ``β·r`` over desirable / undesirable examples, as TRL reports),
    ``rewards/margins``, ``rewards/accuracies`` (the fraction of examples on their label's side
    of the reference point: ``r > z0`` when desirable, ``r < z0`` when not, i.e. whose KTO term
    is below 1/2; unpaired data has no chosen-vs-rejected comparison), ``logps/chosen`` /
    ``logps/rejected``, ``kl`` (``z0``) and ``nll`` (token-mean NLL of the desirable
    completions).
    """

    def loss_fn(params, batch: UnpairedBatch, totals=None, key=None):
        batch, plan = unwrap(batch)
        token_logps, kl_token_logps = unpaired_token_logps(
            params,
            model_config,
            batch,
            chunk_size=chunk_size,
            remat=remat,
            dropout_key=key,
            packing=plan,
        )
        policy = sequence_logps(token_logps, batch.completion_mask)
        kl_policy = sequence_logps(kl_token_logps, batch.kl_completion_mask)
        per_example = kto(
            policy,
            batch.ref_logps,
            batch.labels,
            kl_policy,
            batch.ref_kl_logps,
            beta=beta,
            **kto_kwargs,
        )
        loss = jnp.mean(per_example)
        sg = jax.lax.stop_gradient
        desirable = batch.labels.astype(jnp.float32)
        undesirable = 1.0 - desirable
        reward = sg(beta * (policy - f32(batch.ref_logps)))
        chosen, rejected = _masked_mean(reward, desirable), _masked_mean(reward, undesirable)
        token_weights = batch.completion_mask * desirable[:, None]
        z0 = kto_reference_point(sg(kl_policy), f32(batch.ref_kl_logps))
        log_ratio = sg(policy - f32(batch.ref_logps))
        on_side = jnp.where(desirable > 0, log_ratio > z0, log_ratio < z0)
        metrics = {
            "loss": sg(loss),
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
            "rewards/margins": chosen - rejected,
            "rewards/accuracies": jnp.mean(on_side.astype(jnp.float32)),
            "logps/chosen": _masked_mean(sg(policy), desirable),
            "logps/rejected": _masked_mean(sg(policy), undesirable),
            "kl": z0,
            "nll": sg(_token_nll(token_logps, token_weights)),
        }
        return loss, metrics

    return loss_fn


def make_reward_loss_fn(model_config, *, center_rewards_coefficient=0.0, remat="none"):
    """``L(φ) = mean_i ℓ_BT(r_φ(x_i, y_w^i), r_φ(x_i, y_l^i), m_i)``: a reward model's loss.

    ``jaxrl_llm.preference.bradley_terry`` on the scalar-head model's rewards ``r_φ``
    (``heads.sequence_scores``, the head at the last real token; Ouyang et al. 2022), chosen
    and rejected rows in one forward pass over ``2N`` rows. Metrics: ``loss``,
    ``rewards/chosen``, ``rewards/rejected`` (mean rewards), ``rewards/margins`` and
    ``rewards/accuracies`` (pair accuracy, the fraction with ``r_w > r_l``).
    """

    def loss_fn(params, batch: RewardBatch, totals=None, key=None):
        batch, plan = unwrap(batch)
        n = batch.pairs.chosen_tokens.shape[0]
        scores = heads.sequence_scores(
            params,
            model_config,
            *_pair_rows(batch.pairs),
            remat=remat,
            dropout_key=key,
            packing=plan,
        )
        rw, rl = scores[:n], scores[n:]
        loss = jnp.mean(
            bradley_terry(
                rw,
                rl,
                margins=batch.margins,
                center_rewards_coefficient=center_rewards_coefficient,
            )
        )
        rw, rl = jax.lax.stop_gradient(rw), jax.lax.stop_gradient(rl)
        return loss, {
            "loss": jax.lax.stop_gradient(loss),
            "rewards/chosen": jnp.mean(rw),
            "rewards/rejected": jnp.mean(rl),
            "rewards/margins": jnp.mean(rw - rl),
            "rewards/accuracies": jnp.mean((rw > rl).astype(jnp.float32)),
        }

    return loss_fn


def make_reference_fn(
    model_config, *, unpaired: bool, chunk_size=None, param_shardings=None, row_sharding=None
):
    """A jitted ``(ref_params, batch) -> ([N], [N])`` of ``lp_ref(y) = Σ_t m_t·log π_ref(y_t)``.

    For pairs (``PreferenceBatch``): the chosen and the rejected completions; for KTO
    (``UnpairedBatch``): the completions and the mismatched ones. No gradient flows into
    ``ref_params``; ``param_shardings`` are their ``NamedSharding``s, ``row_sharding`` that of
    the ``[N]`` outputs (give the batch's, so they can join it without a reshard). A
    ``packing.PackedBatch`` (a one-micro-batch plan: leaves ``[1, shards, rows, W]``) runs the
    ``2N`` rows packed.
    """

    def fn(params, batch):
        params = jax.lax.stop_gradient(params)
        batch, plan = unwrap(batch)
        plan = None if plan is None else micro_plan(plan, 0)
        if unpaired:
            first, second = unpaired_token_logps(
                params, model_config, batch, chunk_size=chunk_size, packing=plan
            )
            masks = batch.completion_mask, batch.kl_completion_mask
        else:
            first, second = pair_token_logps(
                params, model_config, batch, chunk_size=chunk_size, packing=plan
            )
            masks = batch.chosen_mask, batch.rejected_mask
        return sequence_logps(first, masks[0]), sequence_logps(second, masks[1])

    out_shardings = None if row_sharding is None else (row_sharding, row_sharding)
    return jax.jit(fn, in_shardings=(param_shardings, None), out_shardings=out_shardings)


def make_loss_fn(cfg: PreferenceConfig, model_config):
    """The loss function the config names, with its hyper-parameters bound."""
    loss, chunk, remat = cfg.loss, cfg.model.chunk_size, cfg.model.remat
    if loss.name == "bradley_terry":
        return make_reward_loss_fn(
            model_config,
            center_rewards_coefficient=loss.center_rewards_coefficient,
            remat=remat,
        )
    if loss.name == "kto":
        return make_kto_loss_fn(
            model_config,
            beta=loss.beta,
            chunk_size=chunk,
            remat=remat,
            desirable_weight=loss.desirable_weight,
            undesirable_weight=loss.undesirable_weight,
        )
    kwargs: dict[str, Any] = {}
    if loss.label_smoothing:
        kwargs["label_smoothing"] = loss.label_smoothing
    if loss.name == "dpo":
        types, weights = dpo_loss_types(loss)
        name = types[0] if len(types) == 1 else types
        if len(types) > 1:
            kwargs["loss_weights"] = weights
        if loss.discopop_tau is not None:
            kwargs["discopop_tau"] = loss.discopop_tau
    else:
        name = loss.name
        if loss.gamma is not None:
            kwargs["gamma"] = loss.gamma
        if loss.cpo_alpha is not None:
            kwargs["cpo_alpha"] = loss.cpo_alpha
        if loss.alpha is not None:
            kwargs["alpha"] = loss.alpha
        if loss.name == "orpo" and loss.orpo_nll != "completion":
            kwargs["nll"] = loss.orpo_nll
    return make_pair_loss_fn(
        model_config, name, beta=loss.beta, chunk_size=chunk, remat=remat, **kwargs
    )
