"""``plan`` for scalar-head models read from a directory: a learned reward model
(``reward_model.path``) and a critic initialised from one (``critic.path``).

Only each directory's ``config.json`` is read (``models.heads``' reader, no weights), as
``plan_model_config`` reads ``model.path``'s. A learned reward model is planned as ``train``
loads and runs it (``train.rl.context.load_reward_model``, ``RunContext.add_learned_reward``):

* loaded once a run, frozen, in the **compute dtype** (bf16 on TPU with ``auto``), its
  parameters sharded by the parameter rules (``heads.scalar_logical_axes``) on the trainer's
  mesh, and kept all run: the ``reward_model`` memory part, resident in every program;
* its scoring forward ``jax.jit(heads.sequence_scores)`` over the rollout batch (``B`` rows of
  ``P + T`` positions, the backbone without an unembedding, the head at each row's last real
  token) once per RL step, under the trainer's mesh (``Trainer.fit`` runs in ``jax.set_mesh``):
  the ``rm_scores`` program. Without reward workers (or with DAPO's dynamic sampling, which
  waits for every draw's rewards) it runs inside the rollout, while the sampler's weights are
  still alive; with ``rollout.reward_workers`` the trainer defers it until the log-prob
  forwards are dispatched, so their outputs and the step's batch are alive instead
  (multi-turn episodes with a learned reward model are refused by ``check_config``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm import models, parallel
from jaxrl_llm.models import heads
from jaxrl_llm.plan import flops as flops_lib
from jaxrl_llm.plan._job import (
    Lowering,
    PlanError,
    Program,
    StepInputs,
    _rows,
    shard_bytes,
    with_shardings,
)
from jaxrl_llm.plan._split import on_trainer_chips
from jaxrl_llm.train import setup
from jaxrl_llm.train.rl.context import reward_model_program
from jaxrl_llm.train.rl.programs import builder_name

PyTree = Any

ASSUMPTIONS = (
    "reward_model.path: the learned reward model is kept all run in the compute dtype "
    "(reward_model part) and scores the rollout batch once a step (rm_scores: its backbone "
    "over P + T positions a row, no unembedding; inside the rollout beside the sampler's "
    "weights, or after the log-prob forwards are dispatched with rollout.reward_workers)",
)


@dataclasses.dataclass(frozen=True)
class RewardModel:
    """A learned reward model as ``train`` holds it.

    Attributes:
      path: ``reward_model.path``.
      config: its ``ModelConfig`` (the causal architecture of its backbone), computing in
        ``model.compute_dtype``.
      params: abstract ``ScalarParams`` in the compute dtype with their shardings.
    """

    path: str
    config: models.ModelConfig
    params: PyTree


def scalar_model_config(
    path: str, key: str, policy_config: models.ModelConfig, model_section
) -> models.ModelConfig:
    """The ``ModelConfig`` of a scalar-head directory's ``config.json`` (a
    ``*ForSequenceClassification`` with one label, or a causal LM), computing in
    ``model.compute_dtype`` on TPU (``setup.load_model``, as ``train`` loads it).

    Raises:
      PlanError: no directory or config.json, an unsupported config, more than one label, or
        a vocabulary other than the policy's (``train`` refuses it: they share the tokenizer).
    """
    try:
        precision = setup.resolve_precision(model_section, backend="tpu")
        config, _ = setup.load_model(
            path, precision, head="scalar", policy=policy_config, key=key, weights=False
        )
    except (FileNotFoundError, ValueError) as err:
        message = str(err)
        raise PlanError(message if message.startswith(key) else f"{key}: {message}") from None
    return config


def scalar_params(config: models.ModelConfig, dtype, mesh, key: str) -> PyTree:
    """Abstract ``ScalarParams`` of ``config`` in ``dtype``, sharded as
    ``heads.load_scalar_model(mesh=mesh)`` places them (the parameter rules)."""
    shapes = heads.scalar_param_shapes(config, dtype)
    try:
        shardings = parallel.logical_to_sharding(
            heads.scalar_logical_axes(config), mesh, parallel.PARAM_RULES, shapes=shapes
        )
    except ValueError as err:
        raise PlanError(f"{key}: parameter layout on mesh {dict(mesh.shape)}: {err}") from None
    return with_shardings(shapes, shardings)


def reward_model_state(cfg, policy_config, mesh) -> RewardModel | None:
    """``reward_model.path``'s model as ``load_reward_model`` loads it (shapes only), or None."""
    path = cfg.reward_model.path
    if path is None:
        return None
    config = scalar_model_config(path, "reward_model.path", policy_config, cfg.model)
    # Frozen: stored in the compute dtype, nothing updates it (``load_reward_model``).
    params = scalar_params(config, jnp.dtype(config.compute_dtype), mesh, "reward_model.path")
    return RewardModel(path, config, params)


def scores_in_rollout(cfg, objective) -> bool:
    """The learned reward is added as the draw is scored, inside the rollout (no reward
    workers, or dynamic sampling); else once the log-prob forwards are dispatched
    (``RunContext.finish_scoring``)."""
    return cfg.rollout.reward_workers == 0 or objective.dynamic_sampling


def lower_reward_program(programs: dict[str, Program], low: Lowering, inputs: StepInputs) -> None:
    """Adds ``rm_scores`` (after the policy's, auxiliary and sampler programs) and the reward
    model's (``low.reward_model``) weights to every other program's resident bytes."""
    rm, cfg, mesh, objective = low.reward_model, low.cfg, low.mesh, low.objective
    shape, sizes, seqs = low.shape, low.sizes, inputs.seqs
    for name, program in programs.items():  # a fresh dict: programs may share one
        if on_trainer_chips(low.split, name):  # loaded on the trainer's mesh
            program.resident = {**program.resident, "reward_model": sizes.reward_model}
    rows, seq, t_len = shape.rows, shape.seq_len, shape.completion_len

    score_fn = reward_model_program(rm.config)  # the trainer's, as ``load_reward_model`` builds
    with jax.set_mesh(mesh):  # ``Trainer.fit`` runs under the trainer's mesh
        lowered = score_fn.lower(rm.params, seqs)
    around = {
        "parameters": sizes.params,
        "optimizer_state": sizes.optimizer,
        "reference": sizes.reference,
        "frozen_base": sizes.base,
        "aux_model": sizes.aux,
        "teacher": sizes.teacher,
    }
    if scores_in_rollout(cfg, objective):
        # In the rollout: the sampler's weights (its serving copy, a LoRA run's kept base
        # and its adapters) are alive; on the trainer's layout they are the parameters.
        around["sampler_weights"] = programs["prefill"].argument_parts.get("sampler_weights", 0)
    else:
        # Deferred: the step's sequences and the sampler's log-probs are on device, and so
        # are the behaviour, reference and teacher log-probs just dispatched.
        per_token = shard_bytes(_rows(mesh, (rows, t_len), jnp.float32))
        forwards = programs["logprobs"].calls_per_step + ("ref_logprobs" in programs)
        forwards += "teacher_logprobs" in programs
        around["sampler_weights"] = sizes.serving_base
        around["inputs"] = shard_bytes(seqs) + (1 + forwards) * per_token
    forward = flops_lib.forward_flops(rm.config, rows, seq, logits_positions=0)
    programs["rm_scores"] = Program(
        name="rm_scores",
        lowered=lowered,
        calls_per_step=1,
        function=builder_name(reward_model_program),
        flops=forward,
        model_flops=forward,
        tokens=rows * t_len,
        argument_parts={"reward_model": sizes.reward_model},
        resident=around,
    )


def reward_model_report(job) -> dict[str, Any] | None:
    """The report's ``reward_model`` entry: path, architecture, size, dtype, bytes a chip."""
    rm = job.reward_model
    if rm is None:
        return None
    return {
        "path": rm.path,
        "architecture": rm.config.architecture,
        "params": models.param_count(heads.backbone_config(rm.config)) + rm.config.hidden_size,
        "dtype": rm.config.compute_dtype,
        "bytes_per_chip": job.state.reward_model,
        "scores_in_rollout": scores_in_rollout(job.cfg, job.objective),
    }


__all__ = [
    "ASSUMPTIONS",
    "RewardModel",
    "lower_reward_program",
    "reward_model_report",
    "reward_model_state",
    "scalar_model_config",
    "scalar_params",
    "scores_in_rollout",
]
