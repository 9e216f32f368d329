"""The policy update of every RL objective: log-probs → ``objectives.policy_loss`` → step.

Everything here is pure and jit-able; the objective and the model settings are bound before
``jax.jit``. The step's batch is a :class:`~jaxrl_llm.types.RolloutBatch` whose token fields are
set; the whole batch's token and row counts reach every micro-batch (``train.step``), so the
accumulated gradient equals the full-batch gradient for every aggregation mode.

A mixture-of-experts policy adds its router losses (``RouterLoss``) to the objective's loss,
from the router logits of the forward that gives the log-probs. An objective with a
distillation loss (``Objective.distill_loss``, GKD's JSD) has the same forward gather the
policy's log-probs of the teacher's top-k tokens (``batch.teacher_top_ids``), chunk by chunk.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxrl_llm import objectives
from jaxrl_llm import packing as packing_lib
from jaxrl_llm.losses import masked
from jaxrl_llm.models import moe
from jaxrl_llm.train.adapters import has_dropout
from jaxrl_llm.train.forward import routed_sequence_logprobs, sequence_logprobs
from jaxrl_llm.train.step import LossFn, Step, Totals, make_step
from jaxrl_llm.types import RolloutBatch, sequences_of

PyTree = Any


def with_totals(batch: RolloutBatch, totals: Totals | None) -> RolloutBatch:
    """The batch carrying the whole batch's normalisers (``num_tokens`` / ``num_seqs``)."""
    if totals is None:
        return batch
    return batch._replace(num_tokens=totals.num_tokens, num_seqs=totals.num_seqs)


# Bound on |log pi_train - log pi_rollout| inside exp (k3): finite however far apart they are.
_MAX_LOG_RATIO = 20.0


def sampler_mismatch(
    train_logprobs: jax.Array, rollout_logprobs: jax.Array, mask: jax.Array, num_tokens
) -> dict[str, jax.Array]:
    """How far the sampler's log-probs are from the trainer's, on the valid tokens.

    With ``d = log pi_train(y) - log pi_rollout(y)`` (``y`` sampled by the rollout policy):
    ``rollout/logprob_diff_mean = Σ|d|·m / N``, ``rollout/logprob_diff_max = max |d|`` and
    ``rollout/k3 = Σ (e^d - 1 - d)·m / N``, the k3 estimate (Schulman, 2020) of
    ``KL(pi_rollout || pi_train)`` (``d`` clipped to ±20 inside the exponential). ``N`` is the
    whole batch's token count (micro-batch sums then add up). Zero in exact arithmetic when
    both sides run the same policy: what is left is the numerics (bf16 matmuls, kernels,
    batch shapes).
    """
    mask = mask.astype(jnp.float32)
    diff = jax.lax.stop_gradient(train_logprobs).astype(jnp.float32) - rollout_logprobs
    clipped = jnp.clip(diff, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    denom = jnp.maximum(jnp.asarray(num_tokens, jnp.float32), 1.0)
    return {
        "rollout/logprob_diff_mean": jnp.sum(jnp.abs(diff) * mask) / denom,
        "rollout/logprob_diff_max": masked.extreme(jnp.abs(diff), mask, jnp.max, 0.0),
        "rollout/k3": jnp.sum((jnp.expm1(clipped) - clipped) * mask) / denom,
    }


class RouterLoss(NamedTuple):
    """Coefficients of a mixture-of-experts policy's router losses in the update.

    ``loss += aux_coef · load_balancing_loss + z_coef · router_z_loss`` (``models.moe``), both
    over the real tokens (prompt and completion) of every layer, in f32.
    """

    aux_coef: float
    z_coef: float = 0.0


def router_loss(
    model_config, aux_coef: float | None = None, z_coef: float = 0.0
) -> RouterLoss | None:
    """The ``RouterLoss`` of ``model.router_aux_loss_coef`` / ``model.router_z_loss_coef``.

    ``aux_coef`` None takes the checkpoint's ``router_aux_loss_coef`` (``ModelConfig``; HF's
    weight of the load-balancing loss in training). None for a dense model, which must leave
    both unset (None / 0).

    Raises:
      ValueError: a coefficient that is not a finite number >= 0, or one set non-zero for a
        dense model.
    """
    for key, value in (("router_aux_loss_coef", aux_coef), ("router_z_loss_coef", z_coef)):
        if value is None and key == "router_aux_loss_coef":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"model.{key} must be a number >= 0, got {value!r}")
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"model.{key} must be a finite number >= 0, got {value!r}")
    if not model_config.is_moe:
        if aux_coef or z_coef:
            raise ValueError(
                f"model.router_aux_loss_coef / model.router_z_loss_coef apply to mixture-of-"
                f"experts models; {model_config.architecture} here is dense: leave them unset, got "
                f"{aux_coef!r} / {z_coef!r}"
            )
        return None
    aux = model_config.router_aux_loss_coef if aux_coef is None else aux_coef
    return RouterLoss(float(aux), float(z_coef))


def router_loss_terms(
    router_logits: jax.Array,
    token_mask: jax.Array,
    *,
    top_k: int,
    coefs: RouterLoss,
    weight: jax.Array | float = 1.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(w · (aux_coef · LB + z_coef · Z), {"moe/load_balancing_loss": w · LB,
    "moe/router_z_loss": w · Z})`` for one micro-batch.

    ``LB = models.moe.load_balancing_loss`` and ``Z = models.moe.router_z_loss`` of the
    ``[L, N, S, E]`` router logits over the ``[N, S]`` real tokens, in f32. ``w`` is the
    micro-batch's share of the whole batch's completion tokens (``n_k / N``, 1 for the whole
    batch), so the values summed over the K micro-batches are the token-weighted mean
    ``sum_k (n_k / N) · L_k`` of the micro-batches' losses: each ``L_k``'s statistics (the
    experts' load ``f`` and mean probability ``P``) are those of its own tokens, as in Megatron's
    per-micro-batch auxiliary loss; with one micro-batch, exactly the full-batch value. A zero
    coefficient adds nothing to the loss (its value is still reported).
    """
    lb = moe.load_balancing_loss(router_logits, token_mask, top_k=top_k)
    z = moe.router_z_loss(router_logits, token_mask)
    weight = jnp.asarray(weight, jnp.float32)
    total = jnp.zeros((), jnp.float32)
    if coefs.aux_coef:
        total = total + coefs.aux_coef * lb
    if coefs.z_coef:
        total = total + coefs.z_coef * z
    metrics = {"moe/load_balancing_loss": weight * lb, "moe/router_z_loss": weight * z}
    return weight * total, metrics


def routing_mismatch(router_logits: jax.Array, recorded: jax.Array, scored: jax.Array) -> jax.Array:
    """How many scored tokens the trainer's own router sends to another top-k set than the
    sampler recorded, in any mixture-of-experts layer (f32 scalar count).

    Token ``(n, s)`` counts when ``scored[n, s]`` and, for some layer ``l`` whose recorded
    ids are all ``>= 0``, ``sort(top_k(router_logits[l, n, s])) != sort(recorded[l, n, s])``.

    Args:
      router_logits: ``[L, N, S, E]`` the forward's router logits.
      recorded: ``[L, N, S, k]`` int, the sampler's ids in the same row layout (-1: none).
      scored: ``[N, S]`` bool, the tokens to count (real completion tokens).
    """
    k = recorded.shape[-1]
    _, free = jax.lax.top_k(router_logits, k)
    valid = jnp.all(recorded >= 0, axis=-1)
    differs = jnp.any(jnp.sort(free, axis=-1) != jnp.sort(recorded, axis=-1), axis=-1)
    token = jnp.any(differs & valid, axis=0) & scored.astype(bool)
    return jnp.sum(token.astype(jnp.float32))


def batch_routing_mismatch(
    router_logits: jax.Array, batch: RolloutBatch, *, num_tokens: jax.Array | float
) -> jax.Array:
    """``moe/routing_mismatch``: the share of the batch's real completion tokens whose
    ``routing_mismatch`` count is 1, for one micro-batch (``num_tokens``: the whole batch's
    completion tokens, so the micro-batches' values add up). ``router_logits`` are over the
    batch's padded ``[B, P + T]`` rows or its packed ones (``batch.packing``)."""
    routing = batch.routing.astype(jnp.int32)
    prompt = jnp.zeros(batch.prompt_mask.shape, bool)
    scored = jnp.concatenate([prompt, batch.completion_mask.astype(bool)], axis=1)
    if batch.packing is not None:
        routing = packing_lib.pack(routing + 1, batch.packing) - 1
        scored = packing_lib.pack(scored, batch.packing)
    count = routing_mismatch(router_logits, jnp.moveaxis(routing, 2, 0), scored)
    return count / jnp.maximum(jnp.asarray(num_tokens, jnp.float32), 1.0)


def make_policy_loss_fn(
    model_config,
    objective: objectives.Objective,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    remat: str = "none",
    compute_entropy: bool = True,
    router: RouterLoss | None = None,
    replay_routing: bool = False,
) -> LossFn:
    """``(params, batch, totals) -> (loss, metrics)``: log-probs → ``objectives.policy_loss``
    (plus the router losses of a mixture-of-experts model, ``router_loss_terms``; with a
    recorded ``batch.routing``, ``moe/routing_mismatch``, and the forward replays it when
    ``replay_routing``).

    See :func:`make_policy_step` for the arguments.
    """
    need_entropy = compute_entropy or objective.needs_entropy
    if router is not None and not model_config.is_moe:
        raise ValueError(
            f"router losses apply to mixture-of-experts models; {model_config.architecture} "
            "is dense: pass router=None"
        )
    if router is None and model_config.is_moe:  # the checkpoint's aux weight, no z-loss
        router = RouterLoss(float(model_config.router_aux_loss_coef))

    distills = objective.distill.loss is not None

    def loss_fn(params, batch: RolloutBatch, totals: Totals | None, key=None):
        kwargs = dict(
            packing=batch.packing,  # this micro-batch's plan, or None (padded)
            temperature=temperature,
            chunk_size=chunk_size,
            remat=remat,
            return_entropy=need_entropy,
            dropout_key=key,
        )
        if replay_routing:
            if batch.routing is None:
                raise ValueError(
                    "model.routing_replay=rollout: the update's batch carries no routing "
                    "(RolloutBatch.routing, the sampler's recorded expert ids)"
                )
            kwargs["routing"] = batch.routing
        if distills:  # the policy's log-probs of the teacher's top-k, from the same forward
            if batch.teacher_top_ids is None:
                raise ValueError(
                    f"objective {objective.name!r} adds the {objective.distill.loss} "
                    "distillation loss: the batch carries no teacher_top_ids / "
                    "teacher_top_logprobs (the teacher's top-k, train.rl.programs.teacher_program)"
                )
            kwargs["gather_ids"] = batch.teacher_top_ids
        routed = None
        if router is None:
            out = sequence_logprobs(params, model_config, sequences_of(batch), **kwargs)
        else:  # one forward: the log-probs and the router logits they were computed with
            routed = routed_sequence_logprobs(params, model_config, sequences_of(batch), **kwargs)
            out = routed.logprobs
        student_top = None
        if distills:  # a LogprobOutputs
            token_logprobs, entropy, student_top = out.logprobs, out.entropy, out.gathered
        else:
            token_logprobs, entropy = out if need_entropy else (out, None)
        if batch.old_logprobs is None:  # on-policy: this forward's own log-probs, held fixed
            batch = batch._replace(old_logprobs=jax.lax.stop_gradient(token_logprobs))
        result = objectives.policy_loss(
            objective,
            token_logprobs,
            with_totals(batch, totals),
            entropy=entropy,
            entropy_coef=None if totals is None else totals.entropy_coef,
            student_top_logprobs=student_top,
        )
        loss, metrics = result.loss, result.metrics
        if routed is not None:
            share = 1.0
            if totals is not None:  # this micro-batch's share of the batch's tokens
                count = jnp.sum(batch.completion_mask.astype(jnp.float32))
                share = count / jnp.maximum(totals.num_tokens, 1.0)
            extra, router_metrics = router_loss_terms(
                routed.router_logits,
                routed.token_mask,
                top_k=model_config.num_experts_per_tok,
                coefs=router,
                weight=share,
            )
            metrics = {**metrics, **router_metrics}
            if batch.routing is not None:
                tokens = jnp.sum(batch.completion_mask.astype(jnp.float32))
                tokens = tokens if totals is None else totals.num_tokens
                metrics["moe/routing_mismatch"] = jax.lax.stop_gradient(
                    batch_routing_mismatch(routed.router_logits, batch, num_tokens=tokens)
                )
            if router.aux_coef or router.z_coef:  # coefficients 0: the loss left as it was
                loss = loss + extra
                metrics["loss"] = loss  # what the step minimises, router losses included
        if batch.rollout_logprobs is not None:
            # Against this step's own forward: exact while the parameters are the rollout's
            # (every step on-policy; a batch's first optimizer step otherwise).
            count = jnp.sum(batch.completion_mask) if totals is None else totals.num_tokens
            metrics = {
                **metrics,
                **sampler_mismatch(
                    token_logprobs, batch.rollout_logprobs, batch.completion_mask, count
                ),
            }
        return loss, metrics

    return loss_fn


def make_policy_step(
    model_config,
    objective: objectives.Objective,
    optimizer: optax.GradientTransformation,
    *,
    micro_batches: int = 1,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    remat: str = "none",
    compute_entropy: bool = True,
    param_shardings: PyTree | None = None,
    router: RouterLoss | None = None,
    replay_routing: bool = False,
) -> Step:
    """A pure policy-update step: log-probs → ``objectives.policy_loss`` → gradient → optax.

    Args:
      model_config: the policy's ``ModelConfig`` (static).
      objective: the ``Objective`` (static).
      optimizer: the optax transformation whose state is in ``TrainState.opt_state``.
      micro_batches: gradient-accumulation micro-batches (``train.step.make_step``).
      temperature: sampling temperature, applied to the recomputed log-probs (so the ratio
        starts at 1 when the policy has not moved).
      chunk_size: sequence chunk of the log-prob computation (memory ``O(B·chunk·V)``).
      remat: ``"none"``, ``"layer"`` (recompute each layer in the backward pass) or
        ``"offload"`` (``models.REMAT_POLICIES``).
      compute_entropy: also compute the per-token entropy (metric; needed for a bonus).
      param_shardings: the parameters' shardings (``train.step.make_step``).
      router: a mixture-of-experts policy's router-loss coefficients (``router_loss``, from
        ``model.router_aux_loss_coef`` / ``model.router_z_loss_coef``); None takes the
        checkpoint's ``router_aux_loss_coef`` and no z-loss. Must be None for a dense model.
        The update then adds ``moe/load_balancing_loss`` and ``moe/router_z_loss`` to its
        metrics, and its ``loss`` metric includes the weighted router losses.
      replay_routing: routing replay (``model.routing_replay=rollout``): the forward routes
        each token to the experts the sampler recorded (``batch.routing`` ``[B, P + T, L,
        k]``, required). A batch with ``routing`` also reports ``moe/routing_mismatch``
        (``batch_routing_mismatch``: the share of completion tokens whose top-k under the
        trainer's own router differs from the recorded set), replayed or not.

    Returns:
      ``step(state, batch) -> (state, metrics)``; ``batch`` is a ``RolloutBatch`` with prompt and
      completion tokens, masks, ``old_logprobs``, ``advantages`` and, when the objective needs
      them, ``ref_logprobs`` and (``objective.distill.loss``) the teacher's
      ``teacher_top_logprobs`` / ``teacher_top_ids`` ``[B, T, k]``. ``old_logprobs=None``
      means on-policy: the behaviour log-probs are this step's own,
      ``stop_gradient(logprobs)`` (ratio exactly 1, as in TRL's ``GRPOTrainer`` with one
      update per generation batch), which saves the separate forward pass; valid only while
      the parameters have not moved since the rollout (one epoch, one minibatch;
      ``train.rl.trainer.on_policy_update``).
    """
    loss_fn = make_policy_loss_fn(
        model_config,
        objective,
        temperature=temperature,
        chunk_size=chunk_size,
        remat=remat,
        compute_entropy=compute_entropy,
        router=router,
        replay_routing=replay_routing,
    )
    return make_step(
        loss_fn,
        optimizer,
        micro_batches=micro_batches,
        param_shardings=param_shardings,
        loss_takes_key=has_dropout(model_config),  # LoRA dropout in the update
        adaptive_entropy=objective if objective.entropy.adaptive else None,
    )
