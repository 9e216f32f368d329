"""``plan``'s auxiliary trained models: PPO's critic and PRIME's implicit PRM.

Each is built as its trainer builds it (``PPOTrainer``, ``PRIMETrainer``): an abstract state
resident all step (the ``aux_model`` memory part) and the programs that read or train it.

PPO's critic (``PPOTrainer.setup_extra_networks``) is the policy's architecture with a scalar
head, or with ``critic.init=reward_model`` the architecture of the scalar-head model at
``critic.path`` (its ``config.json``, ``plan._reward.scalar_model_config``), in
``model.param_dtype``. With ``critic.optimizer=separate`` it has its own state and AdamW
(``values``, ``critic_update``); with ``joint`` one state holds ``{"policy", "value"}`` under
the trainer's optimizer, and the update program is the joint step (``make_joint_step``: policy
loss + ``value_coef`` x value loss), no ``critic_update``. The joint state is split for the
memory parts, each byte counted once: the policy's parameters, their moments and the state's
counters (``parameters``, ``optimizer_state``), the critic's parameters and moments
(``aux_model``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl_llm import models, parallel
from jaxrl_llm.models import heads
from jaxrl_llm.plan import flops as flops_lib
from jaxrl_llm.plan._job import (
    PlanError,
    Program,
    StateBytes,
    _abstract_state,
    _optimizer_bytes,
    _rows,
    abstract_train_state,
    shard_bytes,
)
from jaxrl_llm.plan._reward import scalar_model_config
from jaxrl_llm.train import setup
from jaxrl_llm.train.optim import make_optimizer
from jaxrl_llm.train.rl.config import micro_batching
from jaxrl_llm.train.rl.ppo import make_joint_step, make_value_fn, make_value_step
from jaxrl_llm.train.rl.prime import make_prm_loss_fn
from jaxrl_llm.train.rl.updates import update_objective
from jaxrl_llm.train.state import TrainState
from jaxrl_llm.train.step import jit_step, make_step
from jaxrl_llm.types import RolloutBatch

ASSUMPTIONS = (
    "critic.optimizer=joint: one AdamW (trainer.*) over the policy and the critic, the update "
    "being the joint step; the critic's warm-up steps (critic.warmup_steps: the value loss "
    "alone) are not planned, only the steady state",
)


@dataclasses.dataclass(frozen=True)
class Aux:
    """The auxiliary model's abstract state (PPO's critic, PRIME's PRM).

    Attributes:
      optimizer: its optimizer (the trainer's with ``joint``).
      state, shardings: its ``TrainState`` and ``NamedSharding``s; with ``joint`` the one
        state over ``{"policy": ..., "value": ...}``.
      config: its ``ModelConfig`` (the critic's: the policy's or ``critic.path``'s).
      joint: ``critic.optimizer=joint``.
      source: ``critic.path`` when the critic starts from a reward model, else None.
    """

    optimizer: Any
    state: TrainState
    shardings: TrainState
    config: models.ModelConfig
    joint: bool = False
    source: str | None = None

    @property
    def params(self) -> Any:
        """The auxiliary model's parameters (the critic's share of a joint state)."""
        return self.state.params["value"] if self.joint else self.state.params

    @property
    def param_shardings(self) -> Any:
        return self.shardings.params["value"] if self.joint else self.shardings.params


def abstract_critic_state(
    model_config: models.ModelConfig, optimizer, mesh: Mesh, param_dtype
) -> tuple[TrainState, TrainState]:
    """PPO's critic state (``PPOTrainer``: ``model_config``'s backbone with a scalar head, its
    own optimizer), shapes only, with its shardings."""
    return _abstract_state(
        lambda key: heads.init_scalar_params(model_config, key, dtype=param_dtype),
        optimizer,
        model_config,
        mesh,
        params_axes=heads.scalar_logical_axes(model_config),
    )


def abstract_joint_state(
    model_config: models.ModelConfig,
    value_config: models.ModelConfig,
    optimizer,
    mesh: Mesh,
    param_dtype,
) -> tuple[TrainState, TrainState]:
    """``critic.optimizer=joint``: one state over ``{"policy", "value"}`` with the trainer's
    optimizer, its parameter axes those ``PPOTrainer.setup_extra_networks`` gives it."""

    def init(key):
        return {
            "policy": models.init_params(model_config, key, dtype=param_dtype),
            "value": heads.init_scalar_params(value_config, key, dtype=param_dtype),
        }

    axes = {
        "policy": models.logical_axes(model_config),
        "value": heads.scalar_logical_axes(value_config),
    }
    return _abstract_state(init, optimizer, model_config, mesh, params_axes=axes)


def policy_view(tree: TrainState) -> TrainState:
    """The policy's share of a joint state (or of its shardings): its parameters, the state's
    step and key; the optimizer state, over both models, is left out (``with_aux_bytes``)."""
    return TrainState(step=tree.step, params=tree.params["policy"], opt_state=None, rng=tree.rng)


def critic_config(cfg, model_config: models.ModelConfig) -> models.ModelConfig:
    """The critic's architecture: the policy's, or ``critic.path``'s with
    ``critic.init=reward_model`` (``PPOTrainer._initial_value_params``)."""
    if cfg.critic.init != "reward_model":
        return model_config
    return scalar_model_config(cfg.critic.path, "critic.path", model_config, cfg.model)


def aux_state(cfg, objective, model_config, mesh, optimizer=None) -> Aux | None:
    """The job's auxiliary model (``optimizer``: the trainer's, for a joint critic), or None.

    Raises:
      PlanError: a ``critic.path`` plan cannot read or the trainer refuses, or a weight the
        mesh does not divide.
    """
    dtype = setup.param_dtype(cfg.model)
    try:
        if objective.needs_critic:  # PPO
            critic = cfg.critic
            config = critic_config(cfg, model_config)
            source = critic.path if critic.init == "reward_model" else None
            if critic.optimizer == "joint":
                joint = abstract_joint_state(model_config, config, optimizer, mesh, dtype)
                return Aux(optimizer, *joint, config, joint=True, source=source)
            own = make_optimizer(critic.learning_rate, max_grad_norm=critic.max_grad_norm)
            return Aux(own, *abstract_critic_state(config, own, mesh, dtype), config, False, source)
        if objective.needs_process_rewards:  # PRIME: a trainable copy of the policy
            prime = cfg.prime
            own = make_optimizer(prime.learning_rate, max_grad_norm=prime.max_grad_norm)
            return Aux(own, *abstract_train_state(model_config, own, mesh, dtype), model_config)
    except PlanError:
        raise
    except ValueError as err:  # a weight dimension the mesh does not divide
        what = "the critic's" if objective.needs_critic else "the PRM's"
        raise PlanError(f"{what} parameter layout on mesh {dict(mesh.shape)}: {err}") from None
    return None


def _is_value(path) -> bool:
    return any(getattr(key, "key", None) == "value" for key in path)


def with_aux_bytes(sizes: StateBytes, aux: Aux | None) -> StateBytes:
    """``sizes`` with the auxiliary model's bytes; a joint state's optimizer state split by
    model: the critic's moments to ``aux_optimizer``, the rest (the policy's moments and the
    optimizer's counters) to ``optimizer``, beside the state's step and key."""
    if aux is None:
        return sizes
    if not aux.joint:
        return dataclasses.replace(
            sizes,
            aux_params=shard_bytes(aux.state.params),
            aux_optimizer=_optimizer_bytes(aux.state),
        )
    leaves = jax.tree_util.tree_flatten_with_path(aux.state.opt_state)[0]
    value_moments = shard_bytes([leaf for path, leaf in leaves if _is_value(path)])
    return dataclasses.replace(
        sizes,
        optimizer=_optimizer_bytes(aux.state) - value_moments,
        aux_params=shard_bytes(aux.params),
        aux_optimizer=value_moments,
    )


def joint_update_program(
    aux: Aux, cfg, model_config, objective, shape, sizes, minibatch, full_batch
) -> Program:
    """``critic.optimizer=joint``: the update is ``PPOTrainer``'s ``joint_fn``
    (``jit_step(make_joint_step(...))`` on the joint state), both models' forward and backward
    on one minibatch; it takes the whole state, the critic's share included."""
    step = jit_step(
        make_joint_step(
            model_config,
            update_objective(objective),
            aux.optimizer,
            micro_batches=shape.micro_batches,
            temperature=cfg.rollout.temperature,
            chunk_size=cfg.model.chunk_size,
            remat=shape.remat,
            param_shardings=aux.shardings.params,
            value_config=aux.config,
        ),
        aux.shardings,
    )
    m_rows, seq, t_len = shape.minibatch_rows, shape.seq_len, shape.completion_len

    def flops(remat: str) -> int:
        policy = flops_lib.train_flops(
            model_config, m_rows, seq, remat=remat, logits_positions=t_len
        )
        value = flops_lib.train_flops(aux.config, m_rows, seq, remat=remat, logits_positions=0)
        return policy + value

    return Program(
        name="update",
        lowered=step.lower(aux.state, minibatch),
        calls_per_step=shape.updates_per_step,
        flops=flops(shape.remat),
        model_flops=flops("none"),
        tokens=m_rows * t_len,
        argument_parts={
            "parameters": sizes.params,
            "optimizer_state": sizes.optimizer,
            "aux_model": sizes.aux,
        },
        resident={"reference": sizes.reference, "inputs": shard_bytes(full_batch)},
    )


def critic_report(job) -> dict[str, Any] | None:
    """The report's ``critic`` entry (PPO): its optimizer, where it starts, its size."""
    aux = job.aux
    if aux is None or not job.objective.needs_critic:
        return None
    config = aux.config
    return {
        "optimizer": "joint" if aux.joint else "separate",
        "init": job.cfg.critic.init,
        "path": aux.source,
        "architecture": config.architecture,
        "params": models.param_count(heads.backbone_config(config)) + config.hidden_size,
        "aux_params_bytes": job.state.aux_params,
        "aux_optimizer_bytes": job.state.aux_optimizer,
    }


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
    """PPO's rollout-time ``values`` forward and, with its own optimizer, its
    ``critic_update`` (``PPOTrainer``; a joint critic trains in the ``update``)."""
    policy = _policy_resident(sizes)
    rows, seq, t_len = shape.rows, shape.seq_len, shape.completion_len
    value_config = critic.config
    # The scalar head's 2·D FLOPs a position are left out (under 0.01% of the backbone's).
    forward = flops_lib.forward_flops(value_config, rows, seq, logits_positions=0)
    values_fn = make_value_fn(value_config, param_shardings=critic.param_shardings)
    programs["values"] = Program(
        name="values",
        lowered=values_fn.lower(critic.params, seqs),
        calls_per_step=1,
        flops=forward,
        model_flops=forward,
        tokens=rows * t_len,
        argument_parts={"aux_model": sizes.aux_params},
        resident={**policy, "aux_model": sizes.aux_optimizer},
    )
    if critic.joint:
        return
    step = jit_step(
        make_value_step(
            value_config,
            objective,
            critic.optimizer,
            micro_batches=shape.micro_batches,
            remat=shape.remat,
            param_shardings=critic.param_shardings,
        ),
        critic.shardings,
    )
    m_rows = shape.minibatch_rows
    programs["critic_update"] = Program(
        name="critic_update",
        lowered=step.lower(critic.state, minibatch),
        calls_per_step=shape.updates_per_step,
        flops=flops_lib.train_flops(
            value_config, m_rows, seq, remat=shape.remat, logits_positions=0
        ),
        model_flops=flops_lib.train_flops(value_config, m_rows, seq, logits_positions=0),
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
    optimizer, state, shardings = prm.optimizer, prm.state, prm.shardings
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


__all__ = [
    "ASSUMPTIONS",
    "Aux",
    "aux_state",
    "critic_report",
    "joint_update_program",
    "lower_aux_programs",
    "policy_view",
    "with_aux_bytes",
]
