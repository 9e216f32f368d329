"""What a plan compiles: the job's shapes, mesh, abstract state and arguments (see
``jaxrl_llm.plan.programs``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm import models, objectives, parallel
from jaxrl_llm.models import lora
from jaxrl_llm.plan.topology import TopologySpec
from jaxrl_llm.train import setup
from jaxrl_llm.train.rl.config import TrainConfig
from jaxrl_llm.train.rl.spec import JobShape, RunSpec, resolve
from jaxrl_llm.train.rl.updates import batch_corrected
from jaxrl_llm.train.state import (  # noqa: F401 (abstract_train_state re-exported)
    TrainState,
    abstract_train_state,
    with_shardings,
)
from jaxrl_llm.types import RolloutBatch, Sequences

PyTree = Any

PROGRAMS = (
    "update",
    "critic_update",
    "prm_update",
    "logprobs",
    "ref_logprobs",
    "teacher_logprobs",
    "values",
    "prm_logprobs",
    "rm_scores",
    "reshard_base",
    "reshard",
    "serving_reshard",
    "merge",
    "prefill",
    "decode_step",
)
MEMORY_PARTS = (
    "parameters",
    "optimizer_state",
    "reference",
    "frozen_base",
    "aux_model",
    "reward_model",
    "teacher",
    "sampler_weights",
    "kv_cache",
    "inputs",
    "temporaries",
)

ASSUMPTIONS = (
    "overlap: a program takes max(compute, HBM, ICI) (est_step_s, XLA hides collectives behind "
    "compute) or max(compute, HBM) + ICI (est_step_conservative_s, nothing hidden)",
    "every rollout row decodes rollout.max_new_tokens tokens (no early EOS), one decode step "
    "each, and DAPO dynamic sampling draws once",
    "the sampler runs on the layout train picks (rollout.tensor_parallel: a tensor-parallel "
    "serving copy in the compute dtype, resharded on device once per RL step, or the "
    "trainer's FSDP layout, its weights gathered every decode step)",
    "FLOPs are analytic matmul FLOPs with causal attention (a causal-skipping kernel); the "
    "decode step attends to every cache slot; peak is the chip's bf16 matmul rate",
    "HBM bytes and collectives are read from the optimized HLO, weighted by loop trip counts",
    "the once-per-call cast of the weights to the compute dtype before decoding, host work "
    "(tokenising, rewards) and the advantage computation are not counted",
)


class PlanError(ValueError):
    """A configuration ``plan`` cannot plan (bad or unsupported input); the message says why."""


# -- the job's shape -------------------------------------------------------------------------


def job_shape(cfg: TrainConfig, objective: objectives.Objective, mesh=None) -> JobShape:
    """The ``JobShape`` of an RL config (``spec.resolve``'s; ``objective`` is the resolved
    one, kept for callers that pass it).

    With ``mesh``, ``micro_batches`` is what the trainer would run on that mesh's devices
    (``trainer.micro_batch_tokens`` resolved for the planned batch shape); without, the
    configured ``trainer.micro_batches``.
    """
    run = resolve_plan(cfg)
    return run.shape if mesh is None else run.shape_on(mesh)


def resolve_plan(cfg: TrainConfig) -> RunSpec:
    """``spec.resolve(cfg)`` for the TPU backend ``plan`` compiles for: the very checks and
    values of ``jaxrl-llm train``.

    Raises:
      PlanError: a config ``resolve`` refuses (naming the key).
    """
    try:
        # No training warnings: plan only compiles the job (it refuses what train refuses).
        return resolve(cfg, backend="tpu", training=False)
    except ValueError as err:
        raise PlanError(str(err)) from None


def plannable_objective(cfg: TrainConfig) -> objectives.Objective:
    """The objective of a config ``resolve_plan`` accepts.

    Raises:
      PlanError: a config ``spec.resolve`` refuses (the trainer refuses it too).
    """
    return resolve_plan(cfg).objective


def plan_model_config(section) -> models.ModelConfig:
    """The policy's ``ModelConfig`` from ``model.architecture`` or ``model.path``'s config.json
    (no weights read), computing in ``model.compute_dtype`` as on TPU (``auto``: bfloat16),
    with ``model.lora``'s adapters (``setup.lora_spec``) as ``train`` builds it.

    Raises:
      PlanError: neither or both keys set, an unknown architecture, a bad dtype or LoRA
        setting, a PEFT adapter directory as ``model.path``.
      FileNotFoundError: ``model.path`` has no config.json.
    """
    if section.architecture is not None and section.path is not None:
        raise PlanError(
            "set one of model.architecture and model.path, not both (plan reads model.path's "
            "config.json; model.architecture names a config without weights)"
        )
    if lora.is_adapter_dir(section.path):
        raise PlanError(
            f"model.path={section.path!r} is a PEFT adapter directory: plan it as its base "
            "(model.path=<the base checkpoint> or model.architecture) with model.lora.rank, "
            "model.lora.alpha and model.lora.targets set as in its adapter_config.json"
        )
    if section.path is None and section.architecture is None:
        raise PlanError(
            "plan needs a model: set model.architecture (one of "
            f"{', '.join(models.available_architectures())}, or a path to a Hugging Face "
            "config.json) or model.path (a checkpoint directory; only its config.json is read)"
        )
    try:
        precision = setup.resolve_precision(section, backend="tpu")
        spec = setup.lora_spec(section)
    except ValueError as err:
        raise PlanError(str(err)) from None
    if section.path is not None:  # as ``train`` loads it (``setup.load_model``), no weights
        return setup.load_model(section.path, precision, lora=spec, weights=False)[0]
    try:
        config = models.architecture_config(section.architecture)
    except ValueError as err:
        raise PlanError(f"model.architecture: {err}") from None
    return setup.job_model(config, precision, lora=spec)


def plan_mesh(section, devices: Sequence[Any]) -> Mesh:
    """The trainer's ``("data", "fsdp", "tensor")`` mesh over ``devices`` (``make_run_mesh``:
    a ``-1`` fills; without one the first ``data x fsdp x sequence x expert x tensor`` devices
    are used; ``mesh.expert > 1`` adds the ``expert`` axis, ``mesh.sequence > 1`` the
    ``sequence`` one).

    Raises:
      PlanError: sizes that do not fit the slice, or that its torus cannot lay out (each axis
        a product of whole torus axes).
    """
    try:
        return setup.mesh_over(section, devices)
    except ValueError as err:
        raise PlanError(f"mesh: {err}") from None
    except NotImplementedError as err:  # jax.make_mesh on a torus: axes of whole torus axes
        sizes = {a: getattr(section, a, 1) for a in ("data", "fsdp", "sequence", "expert")}
        sizes["tensor"] = section.tensor
        shown = " x ".join(sizes)
        raise PlanError(
            f"mesh: {shown} = {' x '.join(str(n) for n in sizes.values())} does not map onto "
            f"the slice's torus ({str(err).split('. ')[0]}); choose sizes that are products of "
            "its axes"
        ) from None


def mesh_maps(devices: Sequence[Any], data: int, fsdp: int, tensor: int, expert: int = 1) -> bool:
    """Whether ``parallel.make_mesh`` lays these sizes out on ``devices`` (on a TPU torus each
    axis must be a product of whole torus axes: v5p-128's 4x4x4 takes 4, 16 or 64, not 2)."""
    try:
        parallel.make_mesh(data, fsdp, tensor, expert=expert, devices=list(devices))
    except (ValueError, NotImplementedError):
        return False
    return True


# -- abstract arrays and their per-chip bytes -------------------------------------------------


def shard_bytes(tree: PyTree) -> int:
    """Bytes one chip holds of an abstract (or concrete) tree: each leaf's shard shape
    (``sharding.shard_shape``; the whole shape without a sharding) times its item size."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        shape = tuple(leaf.shape) if sharding is None else sharding.shard_shape(tuple(leaf.shape))
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Per-chip bytes of what stays resident all RL step.

    Attributes:
      params: the policy's parameters (``model.param_dtype``).
      optimizer: the optimizer state plus the state's step counter and PRNG key.
      reference: the reference policy's parameters (0 without one; f32 with ``ema``).
      params_compute: the parameters cast to the compute dtype (what the decode loop reads;
        0 when the parameters are stored in it already, so no copy is made).
      aux_params, aux_optimizer: the trained auxiliary model (PPO's critic, PRIME's PRM): its
        parameters and optimizer state (with ``critic.optimizer=joint``, the critic's share
        of the one state: its parameters and their moments; the rest is in ``params`` and
        ``optimizer``).
      base, serving_base: a LoRA run's frozen base (``params`` are its adapters) in the
        compute dtype on the trainer's layout, and its copy on the sampler's serving layout
        (made once a run, kept all run); 0 without LoRA.
      reward_model: a learned reward model's weights (``reward_model.path``, frozen, in the
        compute dtype, kept all run); 0 without one.
      teacher: on-policy distillation's teacher (``teacher.path``, frozen, in the compute
        dtype, kept all run); 0 without one.
    """

    params: int
    optimizer: int
    reference: int
    params_compute: int
    aux_params: int = 0
    aux_optimizer: int = 0
    base: int = 0
    serving_base: int = 0
    reward_model: int = 0
    teacher: int = 0

    @property
    def aux(self) -> int:
        """The trained auxiliary model (PPO's critic, PRIME's implicit PRM): its parameters
        and optimizer state (0 without one)."""
        return self.aux_params + self.aux_optimizer

    @property
    def resident(self) -> int:
        """Alive all step: the train state, the reference, the auxiliary model, a LoRA run's
        frozen base (and its serving copy), a learned reward model and a teacher."""
        frozen = self.base + self.serving_base + self.reward_model + self.teacher
        return self.params + self.optimizer + self.reference + self.aux + frozen


def state_bytes(
    state: TrainState,
    reference: PyTree | None,
    params_compute: PyTree,
    aux: TrainState | None = None,
    base: PyTree | None = None,
) -> StateBytes:
    """``StateBytes`` of an abstract sharded state, reference, compute-dtype weights, the
    auxiliary model's state (PPO's critic, PRIME's PRM) and a LoRA run's frozen base."""
    params = shard_bytes(state.params)
    same = jax.tree.leaves(params_compute)[0].dtype == jax.tree.leaves(state.params)[0].dtype
    return StateBytes(
        params=params,
        optimizer=_optimizer_bytes(state),
        reference=0 if reference is None else shard_bytes(reference),
        params_compute=0 if same else shard_bytes(params_compute),
        aux_params=0 if aux is None else shard_bytes(aux.params),
        aux_optimizer=0 if aux is None else _optimizer_bytes(aux),
        base=0 if base is None else shard_bytes(base),
    )


def _optimizer_bytes(state: TrainState) -> int:
    """The optimizer state plus the state's step counter and PRNG key."""
    return shard_bytes(state.opt_state) + shard_bytes((state.step, state.rng))


# -- the programs ----------------------------------------------------------------------------


@dataclasses.dataclass
class Program:
    """One program of the RL step, lowered with abstract arguments.

    Attributes:
      name: one of ``PROGRAMS``.
      lowered: ``jax.jit(...).lower(...)`` (None when it shares ``same_as``'s compile).
      calls_per_step: how often one RL step runs it.
      flops: analytic FLOPs of one call over all chips.
      model_flops: FLOPs counted for MFU (no rematerialisation).
      tokens: tokens one call trains on, scores or produces (tokens/s).
      argument_parts: per-chip bytes of its arguments that are resident state, by part (the
        rest of its arguments count as ``inputs``).
      resident: per-chip bytes alive during the call that are not its arguments, by part.
      inner_parts: per-chip bytes of its outputs or temporaries counted as a part (the
        prefill's KV cache, the decode loop's compute-dtype copy of the weights).
      same_as: the program whose compile this one reuses (``ref_logprobs`` when the reference
        has the parameters' dtype and layout).
      hbm_bytes: HBM bytes per chip per call from a model (None: read off the optimized HLO).
      per_step_loop: the program is a data-dependent ``while`` loop (the decode loop) and one
        call means one trip of it: collectives (and HLO HBM bytes) are read from its body.
      shared_argument_bytes: argument bytes that are another argument's arrays passed again
        (counted in the compiled arguments, alive once).
      chips: the chips it runs on (its side's, with ``mesh.rollout_devices``; set by
        ``build_job``; None: the whole slice).
      function: the public function that built the jitted function it lowered (the one
        ``train`` calls; ``train.rl.programs``), when it is one of those; else None.
      packing: the packing plan it is lowered with (``plan._packing.PackedForward``: its
        FLOPs and tokens count the packed rows), or None (padded rows).
      routing_bytes: per-chip bytes of the sampler's recorded routing alive during it
        (``model.routing_replay``: the sampler's buffer in its state, the trainer's int32 copy
        of the batch's and a minibatch's; counted in ``inputs``, ``plan._routing``).
    """

    name: str
    lowered: Any
    calls_per_step: int
    flops: float
    model_flops: float
    tokens: float
    argument_parts: dict[str, int]
    resident: dict[str, int]
    inner_parts: dict[str, int] = dataclasses.field(default_factory=dict)
    same_as: str | None = None
    hbm_bytes: float | None = None
    per_step_loop: bool = False
    shared_argument_bytes: int = 0
    chips: int | None = None
    function: str | None = None
    packing: Any = None
    routing_bytes: int = 0


class OfRun:
    """A record built for one resolved job (its ``run``, a ``RunSpec``): the job's config and
    objective by their short names."""

    run: RunSpec

    @property
    def cfg(self) -> TrainConfig:
        """The job's config."""
        return self.run.config

    @property
    def objective(self) -> objectives.Objective:
        """The job's objective, resolved."""
        return self.run.objective


@dataclasses.dataclass(frozen=True)
class Lowering(OfRun):
    """What a plan lowers the step's programs from: the resolved job and what was built for
    it on the plan's mesh (abstract arrays with their shardings).

    Attributes:
      run: the resolved job (``spec.resolve``).
      mesh: the trainer's mesh.
      model_config: the policy's, computing in the job's compute dtype.
      shape: the job's shape on ``mesh`` (``RunSpec.shape_on``).
      optimizer: the policy's optax transformation.
      state, shardings: the policy's abstract train state and its shardings (a joint PPO
        critic's: the policy's view of the joint state).
      sizes: the per-chip bytes resident all step (``StateBytes``).
      reference: the reference policy's abstract parameters (None: none, or a LoRA base).
      aux: PPO's critic or PRIME's PRM (``plan._aux.Aux``), or None.
      layout: the sampler's ``ServingLayout``.
      frozen: a LoRA run's frozen base (``plan._lora.Frozen``), or None.
      reward_model: ``reward_model.path``'s ``plan._frozen_model.FrozenModel``, or None.
      teacher: ``teacher.path``'s ``plan._frozen_model.FrozenModel``, or None.
      split: the sampler's own chips (``plan._split.Split``), or None.
      sampler_free: the chip's usable HBM less the resident state.
      packing: ``trainer.packing`` as planned (``plan._packing.Packing``), or None (padded).
    """

    run: RunSpec
    mesh: Mesh
    model_config: models.ModelConfig
    shape: JobShape
    optimizer: Any
    state: Any
    shardings: Any
    sizes: StateBytes
    reference: Any = None
    aux: Any = None
    layout: Any = None
    frozen: Any = None
    reward_model: Any = None
    teacher: Any = None
    split: Any = None
    sampler_free: int | None = None
    packing: Any = None


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The step's abstract device inputs, as the trainer puts them on device.

    Attributes:
      seqs: the rollout batch's ``Sequences``.
      logprob_out: the log-prob forward's output over it (its shape and dtype).
      minibatch: one update's ``RolloutBatch`` (with its packing plan when packed).
      full_batch: the whole rollout batch's (alive while its minibatches are drawn).
      forward_plan: the frozen log-prob forwards' abstract packing plan (behaviour, reference,
        teacher: ``[K, shards, rows, W]``), or None (padded).
      forward_rows: the rows those forwards compute (packed rows, or ``B``).
      update_rows: the rows one update computes (packed rows, or the minibatch's).
      routing: the sampler's recorded routing of the whole batch on the trainer's mesh
        (``abstract_routing``; ``model.routing_replay`` set), alive from the log-prob
        forwards to the last update; None without.
    """

    seqs: Any
    logprob_out: Any
    minibatch: Any
    full_batch: Any
    forward_plan: Any = None
    forward_rows: int | None = None
    update_rows: int | None = None
    routing: Any = None


@dataclasses.dataclass
class Job(OfRun):
    """Everything built for one plan: the resolved job, topology, mesh, sizes, state bytes,
    programs. ``shape`` is the job's on ``mesh`` (``RunSpec.shape_on``)."""

    run: RunSpec
    spec: TopologySpec
    mesh: Mesh
    model_config: models.ModelConfig
    shape: JobShape
    state: StateBytes
    programs: dict[str, Program]
    serving: Any = None  # sampling.serving.ServingLayout of the rollout
    aux: Any = None  # plan._aux.Aux: PPO's critic or PRIME's PRM, or None
    reward_model: Any = None  # plan._frozen_model.FrozenModel of reward_model.path
    split: Any = None  # plan._split.Split: the sampler's own chips (mesh.rollout_devices)
    teacher: Any = None  # plan._frozen_model.FrozenModel of teacher.path
    packing: Any = None  # plan._packing.Packing: trainer.packing as planned
    train_state: Any = None  # the abstract TrainState (shardings on ``mesh``)
    reference_params: Any = None  # the abstract reference parameters, or None


def _rows(mesh: Mesh, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=setup.row_sharding(mesh))


def _replicated(mesh: Mesh, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))


def abstract_sequences(mesh: Mesh, rows: int, prompt_len: int, completion_len: int) -> Sequences:
    """The ``Sequences`` the trainer puts on device: rows split over the batch axes."""
    return Sequences(
        prompt_tokens=_rows(mesh, (rows, prompt_len), jnp.int32),
        prompt_mask=_rows(mesh, (rows, prompt_len), bool),
        completion_tokens=_rows(mesh, (rows, completion_len), jnp.int32),
        completion_mask=_rows(mesh, (rows, completion_len), bool),
    )


def abstract_routing(
    mesh: Mesh, model_config: models.ModelConfig, rows: int, seq_len: int
) -> jax.ShapeDtypeStruct:
    """The sampler's recorded routing as ``RLTrainer.batch_routing`` puts it on the trainer's
    mesh (``model.routing_replay``): ``[rows, P + T, L, k]`` int32 (the ``k`` experts each of
    the ``L`` layers chose for every prompt and completion token), rows split over the batch
    axes; ``rows x (P + T) x L x k x 4`` bytes over the batch shards."""
    width = (model_config.num_hidden_layers, model_config.num_experts_per_tok)
    return _rows(mesh, (rows, seq_len, *width), jnp.int32)


def abstract_teacher_top(mesh: Mesh, rows: int, completion_len: int, k: int) -> tuple:
    """A JSD distillation loss's teacher top-k as the trainer puts them in the batch
    (``RolloutBatch.teacher_top_logprobs`` / ``teacher_top_ids``): ``[rows, T, k]`` f32 and
    int32, rows split over the batch axes."""
    return (
        _rows(mesh, (rows, completion_len, k), jnp.float32),
        _rows(mesh, (rows, completion_len, k), jnp.int32),
    )


def abstract_rollout_batch(
    mesh: Mesh,
    objective: objectives.Objective,
    shape: JobShape,
    rows: int,
    logprob_dtype,
    *,
    on_policy: bool = False,
    routed: models.ModelConfig | None = None,
    teacher_top_k: int | None = None,
) -> RolloutBatch:
    """The update's ``RolloutBatch`` of ``rows`` rows, as ``RLTrainer.score`` builds it (the
    advantages' shape from ``objectives.advantage_fn`` itself; no ``old_logprobs`` when
    ``on_policy``: the update takes its own).

    ``routed``: the mixture-of-experts policy's config when the batch carries the sampler's
    routing (``model.routing_replay`` set; ``abstract_routing``). ``teacher_top_k``: ``k`` of a
    JSD distillation loss's teacher top-k (``abstract_teacher_top``), or None.
    """
    seqs = abstract_sequences(mesh, rows, shape.prompt_len, shape.completion_len)
    per_token = _rows(mesh, (rows, shape.completion_len), logprob_dtype)
    rewards = _rows(mesh, (rows,), jnp.float32)
    ref = per_token if objective.needs_reference else None
    advantage_fn = objectives.advantage_fn(objective, group_size=shape.group_size)
    # Shapes only; group_size divides the full batch (the advantages are computed on it).
    full = _rows(mesh, (shape.rows, shape.completion_len), logprob_dtype)
    values = _rows(mesh, (shape.rows, shape.completion_len), jnp.float32)
    critic = {"values": values} if objective.needs_critic else {}
    if objective.needs_process_rewards:  # PRIME: dense rewards from the implicit PRM
        critic = {"process_rewards": full}
    if "teacher_logprobs" in objective.estimator_requires:  # on-policy distillation
        critic = {**critic, "teacher_logprobs": full}
    adv, _ = jax.eval_shape(
        lambda r, m, o, f, c: advantage_fn(r, m, old_logprobs=o, ref_logprobs=f, **c),
        jax.ShapeDtypeStruct((shape.rows,), jnp.float32),
        jax.ShapeDtypeStruct((shape.rows, shape.completion_len), bool),
        full,
        None if ref is None else full,
        critic,
    )
    # PPO: the critic's rollout-time values and its targets (``PPOTrainer.score``).
    per_value = _rows(mesh, (rows, shape.completion_len), jnp.float32)
    value_fields = {"old_values": per_value, "returns": per_value} if objective.needs_critic else {}
    extra = {}
    if routed is not None:
        extra["routing"] = abstract_routing(mesh, routed, rows, shape.seq_len)
    if teacher_top_k is not None:
        top = abstract_teacher_top(mesh, rows, shape.completion_len, teacher_top_k)
        extra["teacher_top_logprobs"], extra["teacher_top_ids"] = top
    return RolloutBatch(
        completion_mask=seqs.completion_mask,
        old_logprobs=None if on_policy else per_token,
        advantages=_rows(mesh, (rows, *adv.shape[1:]), adv.dtype),
        ref_logprobs=ref,
        prompt_tokens=seqs.prompt_tokens,
        prompt_mask=seqs.prompt_mask,
        completion_tokens=seqs.completion_tokens,
        rewards=rewards,
        # The sampler's log-probs (``RLTrainer.train_step`` always passes them) and, with a
        # decoupled rollout correction, its IS weights (``updates.correct_batch``).
        rollout_logprobs=_rows(mesh, (rows, shape.completion_len), jnp.float32),
        is_weights=_rows(mesh, (rows, shape.completion_len), jnp.float32)
        if batch_corrected(objective)
        else None,
        **value_fields,
        **extra,
    )
