"""``plan`` for the frozen side models a job loads from a directory and runs once a step: a
learned reward model (``reward_model.path``) and on-policy distillation's teacher
(``teacher.path``: the ``distill`` and ``grpo_distill`` advantages).

Only each directory's ``config.json`` is read (``setup.load_model(..., weights=False)``), as
``plan_model_config`` reads ``model.path``'s. Both are planned as ``train`` loads and runs them
(``train.rl.context.load_reward_model`` / ``load_teacher``):

* loaded once a run, frozen, in the **compute dtype** (bf16 on TPU with ``auto``, whatever
  ``model.param_dtype``), their parameters sharded by the parameter rules on the trainer's
  mesh, and kept all run: a memory part of their own (``reward_model``, ``teacher``),
  resident in every program on the trainer's chips;
* one program a step over the rollout batch (``B`` rows of ``P + T`` positions), lowered
  under the trainer's mesh (``Trainer.fit`` runs in ``jax.set_mesh``), after the policy's,
  auxiliary and sampler programs.

What differs is data (``FrozenKind``):

* the reward model (``REWARD_MODEL``) has a scalar head (``heads.scalar_param_shapes``,
  ``heads.scalar_logical_axes``); its ``rm_scores`` (``train.rl.context.reward_model_program``:
  ``heads.sequence_scores``, the backbone without an unembedding, the head at each row's last
  real token) runs inside the rollout beside the sampler's weights without reward workers
  (or with DAPO's dynamic sampling, which waits for every draw's rewards); with
  ``rollout.reward_workers`` the trainer defers it until the log-prob forwards are
  dispatched, so their outputs and the step's sequences are alive instead (multi-turn
  episodes with a learned reward model are refused by ``check_config``);
* the teacher (``TEACHER``) is a causal LM (``models.param_shapes``, ``models.logical_axes``);
  its ``teacher_logprobs`` (``train.rl.programs.teacher_program``: the policy's log-prob
  forward, ``make_logprob_fn``, on the teacher's config and shardings, the unembedding at the
  ``T`` completion positions) is dispatched after the behaviour and reference forwards, whose
  outputs (and the sampler's log-probs) are then on device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl_llm import models, parallel
from jaxrl_llm.models import heads
from jaxrl_llm.plan import flops as flops_lib
from jaxrl_llm.plan._job import (
    Lowering,
    PlanError,
    Program,
    StepInputs,
    _rows,
    abstract_sequences,
    shard_bytes,
    with_shardings,
)
from jaxrl_llm.plan._packing import job_packing
from jaxrl_llm.plan._split import on_trainer_chips
from jaxrl_llm.train import setup
from jaxrl_llm.train.rl.context import reward_model_program
from jaxrl_llm.train.rl.programs import ProgramSpec, builder_name, teacher_program

PyTree = Any


def scores_in_rollout(cfg, objective) -> bool:
    """The learned reward is added as the draw is scored, inside the rollout (no reward
    workers, or dynamic sampling); else once the log-prob forwards are dispatched
    (``RunContext.finish_scoring``)."""
    return cfg.rollout.reward_workers == 0 or objective.advantage.dynamic_sampling


def _reward_model_spec(run, config: models.ModelConfig, shardings: PyTree) -> ProgramSpec:
    """``rm_scores`` as ``load_reward_model`` builds it (its shardings are its arguments')."""
    del run, shardings
    fn = reward_model_program(config)
    return ProgramSpec("rm_scores", fn, 1, builder_name(reward_model_program), config)


@dataclasses.dataclass(frozen=True)
class FrozenKind:
    """What one kind of frozen side model differs by (see the module).

    Attributes:
      part: its config section, memory part (``MEMORY_PARTS``) and ``StateBytes`` field.
      program: the program it runs once a step (``PROGRAMS``).
      head: ``setup.load_model``'s ``head`` (``scalar``: a one-label scalar head).
      unembeds: its forward computes the unembedding at the ``T`` completion positions
        (log-probs); else none (a scalar head at one position).
      build: ``(run, config, shardings) -> ProgramSpec`` of the program ``train`` calls.
      in_rollout: ``(cfg, objective) -> bool``: it runs inside the rollout, beside the
        sampler's weights (else after the log-prob forwards are dispatched); None: never,
        and the report does not say.
      counts_sequences: when it runs after the log-prob forwards, the step's sequences are
        counted alive beside its own arguments.
      assumption: its line in the report's assumptions.
      packs: ``train`` passes it the log-prob forwards' packing plan (``trainer.packing``):
        lowered with that plan, its FLOPs over the packed rows.
    """

    part: str
    program: str
    head: str
    unembeds: bool
    build: Callable[..., ProgramSpec]
    in_rollout: Callable[..., bool] | None
    counts_sequences: bool
    assumption: str
    packs: bool = False

    @property
    def key(self) -> str:
        """The config key naming its directory (``reward_model.path``, ``teacher.path``)."""
        return f"{self.part}.path"


TEACHER = FrozenKind(
    part="teacher",
    program="teacher_logprobs",
    head="causal",
    unembeds=True,
    build=teacher_program,
    in_rollout=None,
    counts_sequences=False,
    assumption=(
        "teacher.path: the distillation teacher is kept all run in the compute dtype (teacher "
        "part) and scores the rollout batch once a step (teacher_logprobs: the policy's "
        "log-prob forward on the teacher, after the behaviour and reference forwards)"
    ),
    packs=True,
)
REWARD_MODEL = FrozenKind(
    part="reward_model",
    program="rm_scores",
    head="scalar",
    unembeds=False,
    build=_reward_model_spec,
    in_rollout=scores_in_rollout,
    counts_sequences=True,
    assumption=(
        "reward_model.path: the learned reward model is kept all run in the compute dtype "
        "(reward_model part) and scores the rollout batch once a step (rm_scores: its backbone "
        "over P + T positions a row, no unembedding; inside the rollout beside the sampler's "
        "weights, or after the log-prob forwards are dispatched with rollout.reward_workers)"
    ),
)
OWN_CHIPS_ASSUMPTION = (
    "teacher.devices: the teacher and its teacher_logprobs live on the last chips of the slice "
    "(the trainer's mesh is over the rest), which hold nothing else; the step's sequences are "
    "put there and its outputs put back on the trainer's mesh (transfers not counted), and "
    "the RL step counts its forward in full, though it runs beside the behaviour and "
    "reference forwards (an upper bound)"
)
# In the order their programs are lowered (a step dispatches the teacher's forward first).
FROZEN_KINDS = (TEACHER, REWARD_MODEL)


@dataclasses.dataclass(frozen=True)
class FrozenModel:
    """A frozen side model as ``train`` holds it.

    Attributes:
      kind: what kind (``REWARD_MODEL``, ``TEACHER``).
      path: its directory (``kind.key``).
      config: its ``ModelConfig``, computing in ``model.compute_dtype``.
      params: abstract parameters in the compute dtype with their shardings.
      shardings: their ``NamedSharding``s (what its program places them by).
      own_mesh: the fsdp mesh of its chips of its own (``teacher.devices``:
        ``setup.reserved_mesh``), or None: it lives on the trainer's mesh.
      top_k: ``k`` of the teacher's top-k a JSD distillation loss reads
        (``train.rl.programs.distill_top_k``), or None.
    """

    kind: FrozenKind
    path: str
    config: models.ModelConfig
    params: PyTree
    shardings: PyTree
    own_mesh: Any = None
    top_k: int | None = None

    @property
    def param_count(self) -> int:
        """Its parameters (a scalar head: the backbone's and the head's ``D``)."""
        if self.kind.head == "scalar":
            return models.param_count(heads.backbone_config(self.config)) + self.config.hidden_size
        return models.param_count(self.config)


def side_model_config(
    path: str, key: str, policy_config: models.ModelConfig, model_section, head: str = "scalar"
) -> models.ModelConfig:
    """The ``ModelConfig`` of a side model's directory (its ``config.json``: with ``head``
    ``scalar`` a ``*ForSequenceClassification`` with one label or a causal LM's backbone;
    ``causal`` a causal LM), computing in ``model.compute_dtype`` on TPU
    (``setup.load_model``, as ``train`` loads it).

    Raises:
      PlanError: no directory or config.json, an unsupported config, more than one label, or
        a vocabulary other than the policy's (``train`` refuses it: they share the tokenizer),
        each naming ``key``.
    """
    try:
        precision = setup.resolve_precision(model_section, backend="tpu")
        config, _ = setup.load_model(
            path, precision, head=head, frozen=True, policy=policy_config, key=key, weights=False
        )
    except (FileNotFoundError, ValueError) as err:
        message = str(err)
        raise PlanError(message if message.startswith(key) else f"{key}: {message}") from None
    return config


def reserved_devices(cfg, devices: Sequence[Any]) -> tuple[list, list]:
    """``(trainer's devices, the teacher's own)`` of ``devices`` (those after
    ``mesh.rollout_devices``'s), as ``setup.trainer_devices`` / ``setup.reserved_mesh`` split
    them for ``teacher.devices = N``: the last ``N`` are the teacher's (none with 0).

    Raises:
      PlanError: ``N`` leaves the trainer no chip (``setup.trainer_devices``' message).
    """
    try:
        return setup.split_reserved(devices, cfg.teacher.devices)
    except ValueError as err:
        raise PlanError(str(err)) from None


def reserved_mesh(devices: Sequence[Any], rows: int) -> Mesh:
    """The teacher's own mesh (``setup.reserved_mesh``: ``fsdp`` over ``devices``), after the
    trainer's check that its batch shards divide the rollout batch.

    Raises:
      PlanError: a layout the torus cannot take, or rows its shards do not divide.
    """
    try:
        mesh = setup.own_mesh(devices)
        setup.check_batch_sizes({"rollout batch on teacher.devices": rows}, mesh)
    except (ValueError, NotImplementedError) as err:
        raise PlanError(f"teacher.devices={len(devices)}: {str(err).split('. ')[0]}") from None
    return mesh


def frozen_model_state(
    kind: FrozenKind, cfg, policy_config: models.ModelConfig, mesh, *, own_mesh=None
) -> FrozenModel | None:
    """``kind``'s model as ``train`` loads it (shapes only), or None without its path.

    Frozen: stored in the compute dtype (nothing updates it), sharded by the parameter rules
    on ``mesh`` (the trainer's) or ``own_mesh`` (chips of its own: ``teacher.devices``).

    Raises:
      PlanError: see ``side_model_config``; or a weight the mesh does not divide (naming the
        key).
    """
    path = getattr(cfg, kind.part).path
    if path is None:
        return None
    config = side_model_config(path, kind.key, policy_config, cfg.model, kind.head)
    mesh = mesh if own_mesh is None else own_mesh
    dtype = jnp.dtype(config.compute_dtype)
    if kind.head == "scalar":
        shapes, axes = heads.scalar_param_shapes(config, dtype), heads.scalar_logical_axes(config)
    else:
        shapes, axes = models.param_shapes(config, dtype), models.logical_axes(config)
    try:
        shardings = parallel.logical_to_sharding(axes, mesh, parallel.PARAM_RULES, shapes=shapes)
    except ValueError as err:
        raise PlanError(f"{kind.key}: parameter layout on mesh {dict(mesh.shape)}: {err}") from None
    return FrozenModel(
        kind, path, config, with_shardings(shapes, shardings), shardings, own_mesh=own_mesh
    )


def lower_frozen_program(
    programs: dict[str, Program], low: Lowering, inputs: StepInputs, model: FrozenModel
) -> None:
    """Adds ``model``'s program (``kind.program``) and its weights to every other program on
    the trainer's chips, with what the trainer keeps alive while it runs."""
    kind, cfg, mesh, sizes, shape = model.kind, low.cfg, low.mesh, low.sizes, low.shape
    if model.own_mesh is not None:  # on chips of its own (``teacher.devices``)
        _lower_on_own_chips(programs, low, model)
        return
    routing = 0
    weights = getattr(sizes, kind.part)
    for name, program in programs.items():  # a fresh dict: programs may share one
        if on_trainer_chips(low.split, name):  # loaded on the trainer's mesh
            program.resident = {**program.resident, kind.part: weights}
    rows, seq, t_len = shape.rows, shape.seq_len, shape.completion_len
    others = {k.part: getattr(sizes, k.part) for k in FROZEN_KINDS if k is not kind}
    around = {
        "parameters": sizes.params,
        "optimizer_state": sizes.optimizer,
        "reference": sizes.reference,
        "frozen_base": sizes.base,
        "aux_model": sizes.aux,
        **others,
    }
    if kind.in_rollout is not None and kind.in_rollout(cfg, low.objective):
        # In the rollout: the sampler's weights (its serving copy, a LoRA run's kept base
        # and its adapters) are alive; on the trainer's layout they are the parameters.
        around["sampler_weights"] = programs["prefill"].argument_parts.get("sampler_weights", 0)
    else:
        # After the log-prob forwards are dispatched: the sampler's log-probs (put on device
        # every step) and the behaviour, reference (and teacher) log-probs are alive; a LoRA
        # run's serving copy of its base is kept all run.
        per_token = shard_bytes(_rows(mesh, (rows, t_len), jnp.float32))
        forwards = programs["logprobs"].calls_per_step
        forwards += sum(name in programs for name in ("ref_logprobs", "teacher_logprobs"))
        around["sampler_weights"] = sizes.serving_base
        sequences = shard_bytes(inputs.seqs) if kind.counts_sequences else 0
        # The recorded routing (``model.routing_replay``) is on device until the last update.
        routing = 0 if inputs.routing is None else shard_bytes(inputs.routing)
        around["inputs"] = sequences + (1 + forwards) * per_token + routing
    built = kind.build(low.run, model.config, model.shardings)
    plan = inputs.forward_plan if kind.packs else None  # packed: the forwards' plan
    with jax.set_mesh(mesh):  # ``Trainer.fit`` runs under the trainer's mesh
        if plan is None:
            lowered = built.fn.lower(model.params, inputs.seqs)
        else:
            lowered = built.fn.lower(model.params, inputs.seqs, plan)
            rows = inputs.forward_rows
    forward = flops_lib.forward_flops(
        model.config, rows, seq, logits_positions=t_len if kind.unembeds else 0
    )
    programs[kind.program] = Program(
        name=kind.program,
        lowered=lowered,
        calls_per_step=built.calls_per_step,
        function=built.builder,
        flops=forward,
        model_flops=forward,
        tokens=rows * t_len,
        argument_parts={kind.part: weights},
        resident=around,
        packing=None if plan is None else low.packing.forwards,
        routing_bytes=routing,
    )


def _lower_on_own_chips(programs: dict[str, Program], low: Lowering, model: FrozenModel) -> None:
    """``model``'s program on its own chips (``RLTrainer.teacher_logprobs`` with a
    ``teacher_mesh``): the step's sequences put there, its own packing plan for its batch
    shards (when the trainer's forwards run packed), lowered under its mesh; the chips hold its
    weights and this program only (its output is put back on the trainer's mesh)."""
    kind, cfg, shape, mesh = model.kind, low.cfg, low.shape, model.own_mesh
    rows, seq, t_len = shape.rows, shape.seq_len, shape.completion_len
    seqs = abstract_sequences(mesh, rows, shape.prompt_len, t_len)
    packed = None
    if kind.packs and low.packing is not None and low.packing.plan_of(low.packing.forwards, mesh):
        # ``packing_plan(..., self.teacher_mesh)``: planned again for its own shards.
        prompt_tokens = min(cfg.data.max_prompt_tokens, shape.prompt_len)
        own = job_packing(cfg, shape, mesh, prompt_tokens, parallel.current_platform(mesh)[0])
        packed = None if own is None else own.forwards
    plan = None if packed is None or not packed.packed else packed.abstract(mesh)
    built = kind.build(low.run, model.config, model.shardings)
    with jax.set_mesh(mesh):  # not the trainer's mesh
        lowered = built.fn.lower(model.params, seqs, plan)
    if plan is not None:
        rows = packed.packed_rows
    forward = flops_lib.forward_flops(
        model.config, rows, seq, logits_positions=t_len if kind.unembeds else 0
    )
    programs[kind.program] = Program(
        name=kind.program,
        lowered=lowered,
        calls_per_step=built.calls_per_step,
        function=built.builder,
        flops=forward,
        model_flops=forward,
        tokens=rows * t_len,
        argument_parts={kind.part: shard_bytes(model.params)},
        resident={},
        packing=None if plan is None else packed,
    )


def frozen_model_report(job, model: FrozenModel | None) -> dict[str, Any] | None:
    """The report's entry for ``model``: path, architecture, size, dtype, bytes a chip (and
    whether it scores inside the rollout, for a kind that may)."""
    if model is None:
        return None
    out = {
        "path": model.path,
        "architecture": model.config.architecture,
        "params": model.param_count,
        "dtype": model.config.compute_dtype,
        # On chips of its own its bytes are not in the trainer's resident state.
        "bytes_per_chip": shard_bytes(model.params),
    }
    if model.kind is TEACHER:
        own = model.own_mesh
        out["devices"] = 0 if own is None else own.size  # teacher.devices (0: the trainer's)
        out["top_k"] = model.top_k
    if model.kind.in_rollout is not None:
        out["scores_in_rollout"] = model.kind.in_rollout(job.cfg, job.objective)
    return out


__all__ = [
    "FROZEN_KINDS",
    "OWN_CHIPS_ASSUMPTION",
    "REWARD_MODEL",
    "TEACHER",
    "FrozenKind",
    "FrozenModel",
    "frozen_model_report",
    "frozen_model_state",
    "lower_frozen_program",
    "reserved_devices",
    "reserved_mesh",
    "scores_in_rollout",
    "side_model_config",
]
