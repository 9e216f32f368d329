"""``plan`` for on-policy distillation's teacher (``teacher.path``: the ``distill`` and
``grpo_distill`` advantages, e.g. ``objective.name=distill``).

Only the directory's ``config.json`` is read (``setup.load_model(..., weights=False)``), as
``plan`` reads ``model.path``'s and ``reward_model.path``'s. The teacher is planned as ``train``
loads and runs it (``train.rl.context.load_teacher``, ``RLTrainer``):

* loaded once a run, frozen, in the **compute dtype** (bf16 on TPU with ``auto``, whatever
  ``model.param_dtype``), its parameters sharded by the parameter rules
  (``models.logical_axes``, ``parallel.PARAM_RULES``) on the trainer's mesh, and kept all run:
  the ``teacher`` memory part, resident in every program on the trainer's chips;
* its log-probs of the rollout batch once a step, by the program the trainer calls
  (``train.rl.programs.teacher_program``: the policy's log-prob forward, ``make_logprob_fn``,
  on the teacher's config and shardings): ``teacher_logprobs``, dispatched after the behaviour
  and reference forwards, whose outputs (and the sampler's log-probs) are then on device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jaxrl_llm import models, parallel
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
from jaxrl_llm.train.rl.programs import teacher_program

PyTree = Any

ASSUMPTIONS = (
    "teacher.path: the distillation teacher is kept all run in the compute dtype (teacher "
    "part) and scores the rollout batch once a step (teacher_logprobs: the policy's log-prob "
    "forward on the teacher, after the behaviour and reference forwards)",
)


@dataclasses.dataclass(frozen=True)
class Teacher:
    """On-policy distillation's teacher as ``train`` holds it.

    Attributes:
      path: ``teacher.path``.
      config: its ``ModelConfig``, computing in ``model.compute_dtype``.
      params: abstract parameters in the compute dtype with their shardings.
      shardings: their ``NamedSharding``s (what ``teacher_program`` places them by).
    """

    path: str
    config: models.ModelConfig
    params: PyTree
    shardings: PyTree


def teacher_state(cfg, policy_config: models.ModelConfig, mesh) -> Teacher | None:
    """``teacher.path``'s model as ``load_teacher`` loads it (shapes only), or None.

    Raises:
      PlanError: no directory or config.json, an unsupported config, a vocabulary other than
        the policy's (``train`` refuses it: they share the tokenizer), or a weight the mesh
        does not divide; each naming ``teacher.path``.
    """
    path, key = cfg.teacher.path, "teacher.path"
    if path is None:
        return None
    try:
        precision = setup.resolve_precision(cfg.model, backend="tpu")
        config, _ = setup.load_model(
            path, precision, frozen=True, policy=policy_config, key=key, weights=False
        )
    except (FileNotFoundError, ValueError) as err:
        message = str(err)
        raise PlanError(message if message.startswith(key) else f"{key}: {message}") from None
    # Frozen: stored in the compute dtype, nothing updates it (``setup.load_model(frozen=True)``).
    shapes = models.param_shapes(config, jnp.dtype(config.compute_dtype))
    try:
        shardings = parallel.logical_to_sharding(
            models.logical_axes(config), mesh, parallel.PARAM_RULES, shapes=shapes
        )
    except ValueError as err:
        raise PlanError(f"{key}: parameter layout on mesh {dict(mesh.shape)}: {err}") from None
    return Teacher(path, config, with_shardings(shapes, shardings), shardings)


def lower_teacher_program(programs: dict[str, Program], low: Lowering, inputs: StepInputs) -> None:
    """Adds ``teacher_logprobs`` (after the policy's, auxiliary and sampler programs) and the
    teacher's (``low.teacher``) weights to every other program on the trainer's chips."""
    teacher, mesh, sizes, shape = low.teacher, low.mesh, low.sizes, low.shape
    for name, program in programs.items():  # a fresh dict: programs may share one
        if on_trainer_chips(low.split, name):
            program.resident = {**program.resident, "teacher": sizes.teacher}
    rows, seq, t_len = shape.rows, shape.seq_len, shape.completion_len
    built = teacher_program(low.run, teacher.config, teacher.shardings)
    # Dispatched last of the step's forwards: the sampler's log-probs (put on device for
    # every step) and the behaviour and reference log-probs just dispatched are alive.
    per_token = shard_bytes(_rows(mesh, (rows, t_len), jnp.float32))
    forwards = programs["logprobs"].calls_per_step + ("ref_logprobs" in programs)
    forward = flops_lib.forward_flops(teacher.config, rows, seq, logits_positions=t_len)
    programs["teacher_logprobs"] = Program(
        name="teacher_logprobs",
        lowered=built.fn.lower(teacher.params, inputs.seqs),
        calls_per_step=built.calls_per_step,
        function=built.builder,
        flops=forward,
        model_flops=forward,
        tokens=rows * t_len,
        argument_parts={"teacher": sizes.teacher},
        resident={
            "parameters": sizes.params,
            "optimizer_state": sizes.optimizer,
            "reference": sizes.reference,
            "frozen_base": sizes.base,
            "aux_model": sizes.aux,
            # A LoRA run's serving copy of its base is kept all run.
            "sampler_weights": sizes.serving_base,
            "inputs": (1 + forwards) * per_token,
        },
    )


def teacher_report(job) -> dict[str, Any] | None:
    """The report's ``teacher`` entry: path, architecture, size, dtype, bytes a chip."""
    teacher = job.teacher
    if teacher is None:
        return None
    return {
        "path": teacher.path,
        "architecture": teacher.config.architecture,
        "params": models.param_count(teacher.config),
        "dtype": teacher.config.compute_dtype,
        "bytes_per_chip": job.state.teacher,
    }


__all__ = [
    "ASSUMPTIONS",
    "Teacher",
    "lower_teacher_program",
    "teacher_report",
    "teacher_state",
]
