"""``plan``'s auxiliary trained models: PPO's critic and PRIME's implicit PRM.

Each is built as its trainer builds it (``PPOTrainer`` with ``critic.optimizer: separate``,
``PRIMETrainer``): an abstract state with its own optimizer, resident all step (the
``aux_model`` memory part), and the programs that read or train it.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl_llm import models, parallel
from jaxrl_llm.models import heads
from jaxrl_llm.plan import flops as flops_lib
from jaxrl_llm.plan._job import (
    Program,
    _abstract_state,
    _rows,
    abstract_train_state,
    shard_bytes,
)
from jaxrl_llm.train import setup
from jaxrl_llm.train.optim import make_optimizer
from jaxrl_llm.train.rl.config import micro_batching
from jaxrl_llm.train.rl.ppo import make_value_fn, make_value_step
from jaxrl_llm.train.rl.prime import make_prm_loss_fn
from jaxrl_llm.train.state import TrainState
from jaxrl_llm.train.step import jit_step, make_step
from jaxrl_llm.types import RolloutBatch


def abstract_critic_state(
    model_config: models.ModelConfig, optimizer, mesh: Mesh, param_dtype
) -> tuple[TrainState, TrainState]:
    """PPO's critic state (``PPOTrainer``: the policy's architecture with a scalar head, its
    own optimizer), shapes only, with its shardings."""
    return _abstract_state(
        lambda key: heads.init_scalar_params(model_config, key, dtype=param_dtype),
        optimizer,
        model_config,
        mesh,
        params_axes=heads.scalar_logical_axes(model_config),
    )


def aux_state(cfg, objective, model_config, mesh) -> tuple[Any, Any, Any] | None:
    """``(optimizer, abstract state, shardings)`` of the job's auxiliary model, or None."""
    dtype = setup.param_dtype(cfg.model)
    if objective.needs_critic:  # PPO: the critic's own state and optimizer
        optimizer = make_optimizer(cfg.critic.learning_rate, max_grad_norm=cfg.critic.max_grad_norm)
        return (optimizer, *abstract_critic_state(model_config, optimizer, mesh, dtype))
    if objective.needs_process_rewards:  # PRIME: a trainable copy of the policy
        optimizer = make_optimizer(cfg.prime.learning_rate, max_grad_norm=cfg.prime.max_grad_norm)
        return (optimizer, *abstract_train_state(model_config, optimizer, mesh, dtype))
    return None


def _policy_resident(sizes) -> dict[str, int]:
    """The policy's state and reference: alive around every auxiliary program."""
    return {
        "parameters": sizes.params,
        "optimizer_state": sizes.optimizer,
        "reference": sizes.reference,
    }


def lower_aux_programs(
    programs,
    aux,
    cfg,
    mesh,
    model_config,
    objective,
    shape,
    sizes,
    seqs,
    logprob_out,
    minibatch,
    full_batch,
) -> None:
    """Adds the auxiliary model's programs to ``programs``."""
    if objective.needs_process_rewards:
        _lower_prm_programs(
            programs, aux, cfg, mesh, model_config, objective, shape, sizes, seqs, logprob_out
        )
    else:
        _lower_critic_programs(
            programs,
            aux,
            cfg,
            mesh,
            model_config,
            objective,
            shape,
            sizes,
            seqs,
            minibatch,
            full_batch,
        )


def _lower_critic_programs(
    programs, critic, cfg, mesh, model_config, objective, shape, sizes, seqs, minibatch, full_batch
) -> None:
    """PPO's rollout-time ``values`` forward and its ``critic_update`` (``PPOTrainer``)."""
    optimizer, state, shardings = critic
    policy = _policy_resident(sizes)
    rows, seq, t_len = shape.rows, shape.seq_len, shape.completion_len
    # The scalar head's 2·D FLOPs a position are left out (under 0.01% of the backbone's).
    forward = flops_lib.forward_flops(model_config, rows, seq, logits_positions=0)
    values_fn = make_value_fn(model_config, param_shardings=shardings.params)
    programs["values"] = Program(
        name="values",
        lowered=values_fn.lower(state.params, seqs),
        calls_per_step=1,
        flops=forward,
        model_flops=forward,
        tokens=rows * t_len,
        argument_parts={"aux_model": sizes.aux_params},
        resident={**policy, "aux_model": sizes.aux_optimizer},
    )
    step = jit_step(
        make_value_step(
            model_config,
            objective,
            optimizer,
            micro_batches=shape.micro_batches,
            remat=shape.remat,
            param_shardings=shardings.params,
        ),
        shardings,
    )
    m_rows = shape.minibatch_rows
    programs["critic_update"] = Program(
        name="critic_update",
        lowered=step.lower(state, minibatch),
        calls_per_step=shape.updates_per_step,
        flops=flops_lib.train_flops(
            model_config, m_rows, seq, remat=shape.remat, logits_positions=0
        ),
        model_flops=flops_lib.train_flops(model_config, m_rows, seq, logits_positions=0),
        tokens=m_rows * t_len,
        argument_parts={"aux_model": sizes.aux},
        resident={**policy, "inputs": shard_bytes(full_batch)},
    )


def _lower_prm_programs(
    programs, prm, cfg, mesh, model_config, objective, shape, sizes, seqs, logprob_out
) -> None:
    """PRIME's implicit-PRM update on the whole rollout batch and its log-probs forward
    (``PRIMETrainer.score``: ``make_prm_loss_fn`` through ``make_step``, then the same
    log-prob program as the policy's on the PRM's parameters)."""
    optimizer, state, shardings = prm
    policy = _policy_resident(sizes)
    rows, seq, t_len = shape.rows, shape.seq_len, shape.completion_len
    per_token = _rows(mesh, (rows, t_len), logprob_out.dtype)
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
    )
    step = jit_step(
        make_step(
            make_prm_loss_fn(
                model_config,
                beta=objective.prime_beta,
                temperature=cfg.rollout.temperature,
                chunk_size=cfg.model.chunk_size,
                remat=shape.remat,
            ),
            optimizer,
            micro_batches=micro_batching(cfg.trainer, parallel.current_platform(mesh)[0]),
            param_shardings=shardings.params,
        ),
        shardings,
    )
    programs["prm_update"] = Program(
        name="prm_update",
        lowered=step.lower(state, batch),
        calls_per_step=1,
        flops=flops_lib.train_flops(
            model_config, rows, seq, remat=shape.remat, logits_positions=t_len
        ),
        model_flops=flops_lib.train_flops(model_config, rows, seq, logits_positions=t_len),
        tokens=rows * t_len,
        argument_parts={"aux_model": sizes.aux},
        resident=dict(policy),
    )
    forward = flops_lib.forward_flops(model_config, rows, seq, logits_positions=t_len)
    programs["prm_logprobs"] = Program(
        name="prm_logprobs",
        lowered=None,  # the policy's log-prob program, on the PRM's parameters
        calls_per_step=1,
        flops=forward,
        model_flops=forward,
        tokens=rows * t_len,
        argument_parts={"aux_model": sizes.aux_params},
        resident={
            **policy,
            "aux_model": sizes.aux_optimizer,
            "inputs": shard_bytes(logprob_out),  # the reference log-probs, on device
        },
        same_as="logprobs",
    )


__all__ = ["aux_state", "lower_aux_programs"]
