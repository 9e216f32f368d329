"""``plan``'s programs of the auxiliary trained models (``plan._aux``'s states): PPO's
``values`` forward, its ``critic_update`` or the joint ``update``, PRIME's ``prm_update`` and
``prm_logprobs``, each as its trainer runs it, with the memory parts alive around it."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jaxrl_llm.plan import flops as flops_lib
from jaxrl_llm.plan._aux import Aux
from jaxrl_llm.plan._job import Lowering, Program, StepInputs, _rows, shard_bytes
from jaxrl_llm.train.rl.ppo import critic_programs, joint_update
from jaxrl_llm.train.rl.prime import prm_programs
from jaxrl_llm.types import RolloutBatch


def _base_share(aux: Aux, sizes) -> tuple[dict[str, int], dict[str, int]]:
    """``(argument part, resident part)`` of a LoRA policy's frozen base around a program of
    the auxiliary model alone: the share of the base it takes as its frozen half (the critic's
    backbone view, the PRM's whole base) and the rest, alive beside it."""
    if not sizes.base:
        return {}, {}
    frozen = aux.model_frozen[0]
    taken = 0 if aux.own_frozen or frozen is None else shard_bytes(frozen)
    return {"frozen_base": taken}, {"frozen_base": sizes.base - taken}


def joint_update_program(low: Lowering, inputs: StepInputs) -> Program:
    """``critic.optimizer=joint``: the update is ``PPOTrainer``'s ``joint_fn``
    (``ppo.joint_update``: ``jit_step(make_joint_step(...))`` on the joint state), both models'
    forward and backward on one minibatch; it takes the whole state, the critic's share
    included. Packed (``inputs.minibatch.packing``): FLOPs and tokens over the packed rows."""
    aux, run, model_config, shape, sizes = low.aux, low.run, low.model_config, low.shape, low.sizes
    built = joint_update(
        run,
        model_config,
        aux.config,
        aux.optimizer,
        aux.shardings,
        frozen=aux.frozen,
        frozen_shardings=aux.frozen_shardings,
    )
    m_rows, seq, t_len = _update_rows(low, inputs), shape.seq_len, shape.completion_len

    def flops(remat: str) -> int:
        policy = flops_lib.train_flops(
            model_config, m_rows, seq, remat=remat, logits_positions=t_len
        )
        value = flops_lib.train_flops(aux.config, m_rows, seq, remat=remat, logits_positions=0)
        return policy + value

    return Program(
        name="update",
        lowered=built.fn.lower(aux.state, inputs.minibatch),
        calls_per_step=built.calls_per_step,
        function=built.builder,
        flops=flops(shape.remat),
        model_flops=flops("none"),
        tokens=m_rows * t_len,
        argument_parts={
            "parameters": sizes.params,
            "optimizer_state": sizes.optimizer,
            "aux_model": sizes.aux,
            **({"frozen_base": sizes.base} if sizes.base else {}),
        },
        resident={
            "reference": sizes.reference,
            **({"sampler_weights": sizes.serving_base} if sizes.serving_base else {}),
            "inputs": shard_bytes(inputs.full_batch),
        },
        # A LoRA critic over the policy's base takes the base's arrays a second time.
        shared_argument_bytes=_base_share(aux, sizes)[0].get("frozen_base", 0),
        packing=_update_packing(low, inputs),
    )


def _update_rows(low: Lowering, inputs: StepInputs) -> int:
    """The rows one minibatch update computes: its packed rows, or the minibatch's."""
    return inputs.update_rows or low.shape.minibatch_rows


def _update_packing(low: Lowering, inputs: StepInputs) -> Any:
    """The update's ``plan._packing.PackedForward`` when the minibatch is packed, else None."""
    return low.packing.update if inputs.minibatch.packing is not None else None


def _policy_resident(sizes) -> dict[str, int]:
    """The policy's state and reference (and a LoRA run's sampler copy of its base): alive
    around every auxiliary program."""
    alive = {
        "parameters": sizes.params,
        "optimizer_state": sizes.optimizer,
        "reference": sizes.reference,
    }
    if sizes.serving_base:
        alive["sampler_weights"] = sizes.serving_base
    return alive


def lower_aux_programs(
    programs: dict[str, Program], low: Lowering, inputs: StepInputs, logprobs: Any
) -> None:
    """Adds the auxiliary model's (``low.aux``) programs to ``programs`` (``logprobs``: the
    policy's log-prob program, ``train.rl.programs``)."""
    if low.objective.needs_process_rewards:
        _lower_prm_programs(programs, low, inputs, logprobs)
    else:
        _lower_critic_programs(programs, low, inputs)


def _lower_critic_programs(programs: dict[str, Program], low: Lowering, inputs: StepInputs) -> None:
    """PPO's rollout-time ``values`` forward and, with its own optimizer, its
    ``critic_update`` (``PPOTrainer``; a joint critic trains in the ``update``)."""
    critic, run, shape, sizes = low.aux, low.run, low.shape, low.sizes
    base_args, base_rest = _base_share(critic, sizes)
    policy = {**_policy_resident(sizes), **base_rest}
    rows, seq, t_len = shape.rows, shape.seq_len, shape.completion_len
    value_config = critic.config
    # The scalar head's 2·D FLOPs a position are left out (under 0.01% of the backbone's).
    forward = flops_lib.forward_flops(value_config, rows, seq, logits_positions=0)
    built = critic_programs(
        run,
        value_config,
        critic.optimizer,
        critic.shardings,
        value_param_shardings=critic.full(critic.param_shardings, shardings=True),
        frozen=critic.frozen,
        frozen_shardings=critic.frozen_shardings,
        joint=critic.joint,
    )
    programs["values"] = Program(
        name="values",
        lowered=built["values"].fn.lower(critic.full(critic.params), inputs.seqs),
        calls_per_step=built["values"].calls_per_step,
        function=built["values"].builder,
        flops=forward,
        model_flops=forward,
        tokens=rows * t_len,
        argument_parts={"aux_model": sizes.aux_params, **base_args},
        resident={**policy, "aux_model": sizes.aux_optimizer},
    )
    if critic.joint:
        return
    step = built["critic_update"]
    m_rows = _update_rows(low, inputs)  # the policy's plans serve the critic's step
    programs["critic_update"] = Program(
        name="critic_update",
        lowered=step.fn.lower(critic.state, inputs.minibatch),
        calls_per_step=step.calls_per_step,
        function=step.builder,
        flops=flops_lib.train_flops(
            value_config, m_rows, seq, remat=shape.remat, logits_positions=0
        ),
        model_flops=flops_lib.train_flops(value_config, m_rows, seq, logits_positions=0),
        tokens=m_rows * t_len,
        argument_parts={"aux_model": sizes.aux, **base_args},
        resident={**policy, "inputs": shard_bytes(inputs.full_batch)},
        packing=_update_packing(low, inputs),
    )


def _lower_prm_programs(
    programs: dict[str, Program], low: Lowering, inputs: StepInputs, logprobs: Any
) -> None:
    """PRIME's implicit-PRM update on the whole rollout batch and its log-probs forward
    (``PRIMETrainer.score``: ``make_prm_loss_fn`` through ``make_step``, then the same
    log-prob program as the policy's on the PRM's parameters)."""
    prm, run, mesh, model_config = low.aux, low.run, low.mesh, low.model_config
    shape, sizes, seqs, logprob_out = low.shape, low.sizes, inputs.seqs, inputs.logprob_out
    optimizer, state, shardings = prm.optimizer, prm.state, prm.shardings
    base_args, base_rest = _base_share(prm, sizes)
    policy = {**_policy_resident(sizes), **base_rest}
    rows, seq, t_len = shape.rows, shape.seq_len, shape.completion_len
    per_token = _rows(mesh, (rows, t_len), logprob_out.dtype)
    # Packed: the PRM's update over the whole batch with its own plan, its log-probs with the
    # policy's forwards' (``PRIMETrainer.prm_packing_plans``).
    update_packed = None if low.packing is None else low.packing.prm_update
    update_plan = None if low.packing is None else low.packing.plan_of(update_packed, mesh)
    update_packed = update_packed if update_plan is not None else None
    update_rows = rows if update_packed is None else update_packed.packed_rows
    forward_rows = inputs.forward_rows or rows
    labels = _rows(mesh, (rows,), jnp.float32)  # the outcome labels, correct in {0, 1}
    batch = RolloutBatch(
        completion_mask=seqs.completion_mask,
        old_logprobs=None,
        advantages=None,
        ref_logprobs=per_token,
        prompt_tokens=seqs.prompt_tokens,
        prompt_mask=seqs.prompt_mask,
        completion_tokens=seqs.completion_tokens,
        rewards=labels,
        packing=update_plan,
    )
    built = prm_programs(
        run,
        model_config,
        optimizer,
        shardings,
        logprobs=logprobs,
        frozen=prm.frozen,
        frozen_shardings=prm.frozen_shardings,
    )
    step = built["prm_update"]
    programs["prm_update"] = Program(
        name="prm_update",
        lowered=step.fn.lower(state, batch),
        calls_per_step=step.calls_per_step,
        function=step.builder,
        flops=flops_lib.train_flops(
            model_config, update_rows, seq, remat=shape.remat, logits_positions=t_len
        ),
        model_flops=flops_lib.train_flops(model_config, update_rows, seq, logits_positions=t_len),
        tokens=update_rows * t_len,
        argument_parts={"aux_model": sizes.aux, **base_args},
        resident=dict(policy),
        packing=update_packed,
    )
    forward = flops_lib.forward_flops(model_config, forward_rows, seq, logits_positions=t_len)
    programs["prm_logprobs"] = Program(
        name="prm_logprobs",
        lowered=None,  # the policy's log-prob program, on the PRM's parameters
        calls_per_step=built["prm_logprobs"].calls_per_step,
        function=built["prm_logprobs"].builder,
        flops=forward,
        model_flops=forward,
        tokens=forward_rows * t_len,
        argument_parts={"aux_model": sizes.aux_params, **base_args},
        resident={
            **policy,
            "aux_model": sizes.aux_optimizer,
            "inputs": shard_bytes(logprob_out),  # the reference log-probs, on device
        },
        same_as="logprobs",
        packing=None if inputs.forward_plan is None else low.packing.forwards,
    )


__all__ = ["joint_update_program", "lower_aux_programs"]
