"""Lowering a job's programs and reading them: memory by part, collectives, HLO estimates
(see ``jaxrl_llm.plan.programs``)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl_llm import models, parallel
from jaxrl_llm.plan import estimate as est
from jaxrl_llm.plan import flops as flops_lib
from jaxrl_llm.plan import hlo as hlo_lib
from jaxrl_llm.plan._aux import aux_state, policy_view, with_aux_bytes
from jaxrl_llm.plan._aux_programs import joint_update_program, lower_aux_programs
from jaxrl_llm.plan._collectives import _optimal_seconds, loop_body_module, unique_collectives
from jaxrl_llm.plan._frozen_model import (
    REWARD_MODEL,
    TEACHER,
    frozen_model_state,
    lower_frozen_program,
    reserved_devices,
    reserved_mesh,
)
from jaxrl_llm.plan._job import (
    MEMORY_PARTS,
    PROGRAMS,
    Job,
    Lowering,
    PlanError,
    Program,
    StepInputs,
    abstract_rollout_batch,
    abstract_routing,
    abstract_sequences,
    abstract_train_state,
    plan_mesh,
    plan_model_config,
    resolve_plan,
    shard_bytes,
    state_bytes,
)
from jaxrl_llm.plan._lora import (
    abstract_lora_state,
    policy,
    serving_trees,
)
from jaxrl_llm.plan._moe import WEIGHT_PROGRAMS as MOE_WEIGHT_PROGRAMS
from jaxrl_llm.plan._moe import is_expert_exchange, is_moe, program_moe
from jaxrl_llm.plan._packing import job_packing
from jaxrl_llm.plan._routing import records_routing, replays_routing
from jaxrl_llm.plan._serving import choose_layout, lower_sampler_programs
from jaxrl_llm.plan._split import (
    SAMPLER_PROGRAMS,
    check_trainer_mesh,
    compute_weight_bytes,
    sampler_layout,
    split_job,
    weight_sync,
)
from jaxrl_llm.plan.topology import TopologySpec, get_devices

# The jitted sampler programs ``sampling.generate`` calls (its module name is shadowed by the
# function ``sampling.generate``, hence the direct import).
from jaxrl_llm.train import setup
from jaxrl_llm.train.optim import make_trainer_optimizer
from jaxrl_llm.train.rl.config import TrainConfig
from jaxrl_llm.train.rl.programs import (
    check_replay_model,
    distill_top_k,
    policy_programs,
    takes_own_logprobs,
)

PyTree = Any


def build_job(cfg: TrainConfig, spec: TopologySpec, devices: Sequence[Any] | None = None) -> Job:
    """Lowers the RL step's programs for ``spec`` (compile-only devices unless ``devices``).

    Args:
      cfg: the RL job (``load_config(TrainConfig, ...)``).
      spec: the topology (``resolve_topology``).
      devices: devices to build the mesh over (default ``get_devices(spec)``; tests pass CPU
        devices to check the accounting without libtpu).

    Raises:
      PlanError: what ``plannable_objective`` / ``plan_model_config`` / ``plan_mesh`` refuse,
        or sizes the mesh does not divide (naming the config key).
    """
    run = resolve_plan(cfg)
    objective = run.objective
    model_config = plan_model_config(cfg.model)
    try:  # model.routing_replay on a dense model, refused as ``train`` refuses it
        check_replay_model(cfg.model.replay_mode, model_config)
    except ValueError as err:
        raise PlanError(str(err)) from None
    devices = get_devices(spec) if devices is None else list(devices)
    split = split_job(cfg, devices)
    # ``teacher.devices``: the last chips after the sampler's are the teacher's own
    # (``setup.make_run_mesh(..., reserve=)``, ``setup.reserved_mesh``).
    trainer_devices, teacher_devices = reserved_devices(
        cfg, devices if split is None else split.trainer_devices
    )
    mesh = plan_mesh(cfg.mesh, trainer_devices)
    if split is not None:
        check_trainer_mesh(cfg, split, mesh)
    shape = run.shape_on(mesh)
    try:
        setup.check_batch_sizes(
            {
                "rollout batch (prompts_per_step x group_size)": shape.rows,
                "minibatch": shape.minibatch_rows,
                "micro-batch (minibatch / trainer.micro_batches)": shape.minibatch_rows
                // shape.micro_batches,
                "rollout.prompts_per_step (the prefill's rows)": shape.prompts,
            },
            mesh,
        )
    except ValueError as err:
        raise PlanError(str(err)) from None
    t = cfg.trainer
    optimizer = make_trainer_optimizer(t, total_steps=t.max_steps * t.epochs * t.minibatches)
    param_dtype = setup.param_dtype(cfg.model)
    frozen = None
    try:
        if model_config.lora is None:
            state, shardings = abstract_train_state(
                model_config, optimizer, mesh=mesh, param_dtype=param_dtype
            )
        else:  # LoRA: the adapters' state; the base frozen beside it
            state, shardings, frozen = abstract_lora_state(
                model_config, optimizer, mesh, param_dtype
            )
    except ValueError as err:  # a weight dimension the mesh does not divide
        raise PlanError(f"parameter layout on mesh {dict(mesh.shape)}: {err}") from None
    critic = aux_state(cfg, objective, model_config, mesh, optimizer, frozen)
    if critic is not None and critic.joint:  # one state over policy and critic (PPOTrainer)
        state, shardings = policy_view(critic.state), policy_view(critic.shardings)
    params = state.params
    reference = None
    if shape.needs_reference and frozen is None:  # a LoRA run's reference is its base
        ref_dtype = jnp.float32 if cfg.reference.mode == "ema" else None
        reference = jax.tree.map(
            lambda p: jax.ShapeDtypeStruct(p.shape, ref_dtype or p.dtype, sharding=p.sharding),
            params,
        )
    compute = jnp.dtype(model_config.compute_dtype)
    params_compute = jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(
            p.shape,
            compute if jnp.issubdtype(p.dtype, jnp.floating) else p.dtype,
            sharding=p.sharding,
        ),
        params,
    )
    rm = frozen_model_state(REWARD_MODEL, cfg, model_config, mesh)
    own = reserved_mesh(teacher_devices, shape.rows) if teacher_devices else None
    teacher = frozen_model_state(TEACHER, cfg, model_config, mesh, own_mesh=own)
    if teacher is not None:
        try:  # the JSD loss's k (``teacher.top_k``), refused as ``RLTrainer`` refuses it
            teacher = dataclasses.replace(teacher, top_k=distill_top_k(run, teacher.config))
        except ValueError as err:
            raise PlanError(str(err)) from None
    sizes = with_aux_bytes(
        state_bytes(state, reference, params_compute, None, frozen and frozen.base), critic
    )
    if rm is not None:
        sizes = dataclasses.replace(sizes, reward_model=shard_bytes(rm.params))
    if teacher is not None and teacher.own_mesh is None:  # else not on the trainer's chips
        sizes = dataclasses.replace(sizes, teacher=shard_bytes(teacher.params))
    if split is not None:  # the sampler's own chips
        layout = sampler_layout(cfg, model_config, split, spec)
        weights = compute_weight_bytes(state.params, model_config)
        split = dataclasses.replace(split, sync=weight_sync(spec, split, weights, layout.tensor))
    else:
        try:
            layout = choose_layout(cfg, model_config, mesh, shape, spec, sizes)
        except ValueError as err:
            raise PlanError(f"the sampler's layout: {err}") from None
    # trainer.packing: the packed rows of the update and the log-prob forwards (length model).
    prompt_tokens = min(cfg.data.max_prompt_tokens, shape.prompt_len)
    platform = parallel.current_platform(mesh)[0]
    packing = job_packing(
        cfg, shape, mesh, prompt_tokens, platform, prm=objective.needs_process_rewards
    )
    if frozen is not None and not layout.is_trainer_layout:  # kept all run (serving_base)
        served_base = shard_bytes(serving_trees(model_config, layout)[0])
        sizes = dataclasses.replace(sizes, serving_base=served_base)
    programs = _lower_programs(
        Lowering(
            run,
            mesh,
            model_config,
            shape,
            optimizer,
            state,
            shardings,
            sizes,
            reference=reference,
            aux=critic,
            layout=layout,
            frozen=frozen,
            reward_model=rm,
            teacher=teacher,
            split=split,
            sampler_free=spec.usable_hbm_bytes_per_chip - sizes.resident,
            packing=packing,
        )
    )
    for name, program in programs.items():  # the chips each program runs on
        on_sampler = split is not None and name in SAMPLER_PROGRAMS
        program.chips = len(split.sampler_devices) if on_sampler else mesh.size
        if teacher is not None and teacher.own_mesh is not None and name == TEACHER.program:
            program.chips = teacher.own_mesh.size
    return Job(
        run,
        spec,
        mesh,
        model_config,
        shape,
        sizes,
        programs,
        layout,
        critic,
        rm,
        split,
        teacher,
        packing,
        train_state=state,
        reference_params=reference,
    )


def _lower_programs(low: Lowering) -> dict[str, Program]:
    """The step's programs: the policy's (``train.rl.programs``), the auxiliary model's, the
    sampler's and a learned reward model's, lowered from ``low``."""
    run, mesh, model_config, objective = low.run, low.mesh, low.model_config, low.objective
    shape, state, sizes, frozen, critic = low.shape, low.state, low.sizes, low.frozen, low.aux
    reference = low.reference
    rows, seq, p_len, t_len = shape.rows, shape.seq_len, shape.prompt_len, shape.completion_len
    # What stays on device all step beside a program's own arguments: the reference and, for
    # PPO, the critic's state; for LoRA the serving copy of the base (the base itself is an
    # argument of the log-prob forwards and the update).
    ref_bytes = {"reference": sizes.reference, "aux_model": sizes.aux}
    if frozen is not None:
        ref_bytes["sampler_weights"] = sizes.serving_base
    weights = {"parameters": sizes.params}
    if frozen is not None:
        weights["frozen_base"] = sizes.base
    programs: dict[str, Program] = {}

    # The very programs the trainer calls (``train.rl.programs``), lowered with abstract
    # arguments: a LoRA run's base passed as frozen parameters.
    built = policy_programs(
        run,
        model_config,
        low.optimizer,
        low.shardings,
        frozen=frozen and frozen.base,
        frozen_shardings=frozen and frozen.shardings,
    )
    # (b) the behaviour (and reference) log-probs over the whole rollout batch; with one
    # update per rollout batch the trainer skips the behaviour forward (the update uses its own).
    # Packed (``trainer.packing``): lowered with the stacked plan ``train`` passes as a third
    # argument, FLOPs and tokens over the packed rows (``plan._packing``).
    on_policy = takes_own_logprobs(run)
    logprob_fn = built["logprobs"].fn
    policy_params = policy(state.params, frozen)
    seqs = abstract_sequences(mesh, rows, p_len, t_len)
    packing, f_rows, m_rows = low.packing, rows, shape.minibatch_rows
    f_plan = u_plan = f_packed = u_packed = None
    if packing is not None:
        f_plan, u_plan = (
            packing.plan_of(packing.forwards, mesh),
            packing.plan_of(packing.update, mesh),
        )
        f_packed = packing.forwards if f_plan is not None else None
        u_packed = packing.update if u_plan is not None else None
        f_rows = rows if f_packed is None else f_packed.packed_rows
        m_rows = m_rows if u_packed is None else u_packed.packed_rows
    # Routing replay (``model.routing_replay``): the sampler's recorded routing of the whole
    # batch, on device from the log-prob forwards to the last update; with ``rollout`` the
    # policy's (and the reference's) forwards replay it (``RLTrainer.train_step``).
    records = records_routing(run.config)
    routing = abstract_routing(mesh, model_config, rows, seq) if records else None
    replay = routing if replays_routing(run.config) else None
    routing_bytes = 0 if routing is None else shard_bytes(routing)
    routing_alive = {} if routing is None else {"inputs": routing_bytes}
    logprob_out = jax.eval_shape(logprob_fn, policy_params, seqs, f_plan, replay)
    forward = flops_lib.forward_flops(model_config, f_rows, seq, logits_positions=t_len)
    programs["logprobs"] = Program(
        name="logprobs",
        lowered=logprob_fn.lower(policy_params, seqs, f_plan, replay),
        calls_per_step=built["logprobs"].calls_per_step,
        function=built["logprobs"].builder,
        flops=forward,
        model_flops=forward,
        tokens=f_rows * t_len,
        argument_parts=dict(weights),
        # A recorded routing it does not replay (``measure``) is on device beside it.
        resident={
            "optimizer_state": sizes.optimizer,
            **ref_bytes,
            **(routing_alive if replay is None else {}),
        },
        packing=f_packed,
        routing_bytes=routing_bytes,
    )
    if shape.needs_reference:
        # The old log-probs computed just before stay on device.
        around = {
            "parameters": sizes.params,
            "optimizer_state": sizes.optimizer,
            "aux_model": sizes.aux,
            "inputs": shard_bytes(logprob_out)
            + (routing_alive.get("inputs", 0) if replay is None else 0),
        }
        ref = built["ref_logprobs"]
        if frozen is not None:  # the base itself, adapters off (lora.base_config)
            base_config = ref.config
            ref_forward = flops_lib.forward_flops(base_config, f_rows, seq, logits_positions=t_len)
            programs["ref_logprobs"] = Program(
                name="ref_logprobs",
                lowered=ref.fn.lower(frozen.base, seqs, f_plan, replay),
                calls_per_step=ref.calls_per_step,
                function=ref.builder,
                flops=ref_forward,
                model_flops=ref_forward,
                tokens=f_rows * t_len,
                argument_parts={"frozen_base": sizes.base},
                resident={**around, "sampler_weights": sizes.serving_base},
                packing=f_packed,
                routing_bytes=routing_bytes,
            )
        else:
            same = jax.tree.leaves(reference)[0].dtype == jax.tree.leaves(state.params)[0].dtype
            programs["ref_logprobs"] = Program(
                name="ref_logprobs",
                lowered=None if same else ref.fn.lower(reference, seqs, f_plan, replay),
                calls_per_step=ref.calls_per_step,
                function=ref.builder,
                flops=forward,
                model_flops=forward,
                tokens=f_rows * t_len,
                argument_parts={"reference": sizes.reference},
                resident=around,
                same_as="logprobs" if same else None,
                packing=f_packed,
                routing_bytes=routing_bytes,
            )

    # (a) the policy update on one minibatch (a LoRA run's base passed as frozen parameters;
    # PPO's joint optimizer: the joint step on the whole state).
    # Packed: each minibatch's ``RolloutBatch`` carries its stacked plan (``packing``).
    # The batch carries the recorded routing (``model.routing_replay``) and a JSD loss's
    # teacher top-k (``teacher_program``'s ``[B, T, k]``) as ``RLTrainer.train_step`` puts them.
    batch_fields = dict(
        on_policy=on_policy,
        routed=model_config if records else None,
        teacher_top_k=None if low.teacher is None else low.teacher.top_k,
    )
    minibatch = abstract_rollout_batch(
        mesh, objective, shape, shape.minibatch_rows, logprob_out.dtype, **batch_fields
    )._replace(packing=u_plan)
    full_batch = abstract_rollout_batch(
        mesh, objective, shape, rows, logprob_out.dtype, **batch_fields
    )
    inputs = StepInputs(
        seqs, logprob_out, minibatch, full_batch, f_plan, f_rows, m_rows, routing=routing
    )
    if critic is not None and critic.joint:
        programs["update"] = joint_update_program(low, inputs)
    else:
        update_fn = built["update"].fn
        programs["update"] = Program(
            name="update",
            lowered=update_fn.lower(state, minibatch),
            calls_per_step=built["update"].calls_per_step,
            function=built["update"].builder,
            flops=flops_lib.train_flops(
                model_config, m_rows, seq, remat=shape.remat, logits_positions=t_len
            ),
            model_flops=flops_lib.train_flops(model_config, m_rows, seq, logits_positions=t_len),
            tokens=m_rows * t_len,
            argument_parts={**weights, "optimizer_state": sizes.optimizer},
            # The whole rollout batch stays on device while its minibatches are drawn.
            resident={**ref_bytes, "inputs": shard_bytes(full_batch)},
            packing=u_packed,
            # The minibatch's routing (an argument) beside the whole batch's.
            routing_bytes=0 if routing is None else routing_bytes + shard_bytes(minibatch.routing),
        )
    if critic is not None:
        lower_aux_programs(programs, low, inputs, built["logprobs"])

    # (c) the reshard into the sampler's layout, the rollout's prefill and (d) one decode step.
    lower_sampler_programs(
        programs,
        low,
        {"reference": sizes.reference, "aux_model": sizes.aux},
        functools.partial(decode_hbm_bytes_per_chip, model_config),
    )
    # (e) on-policy distillation's teacher and (f) a learned reward model, scoring each rollout.
    for model in (low.teacher, low.reward_model):
        if model is not None:
            lower_frozen_program(programs, low, inputs, model)
    return {name: programs[name] for name in PROGRAMS if name in programs}


# -- memory accounting -----------------------------------------------------------------------


def memory_parts(
    program: Program, memory: est.MemoryBreakdown | None, required_bytes: int | None = None
) -> dict[str, int]:
    """Per-chip bytes alive during ``program`` by part (``MEMORY_PARTS``), summing to the total.

    With the compiled program's ``memory`` (``estimate.memory_breakdown``), whose total is
    ``arguments + outputs - aliased + temporaries + code``: its arguments split into the
    resident parts of ``program.argument_parts`` and ``inputs`` (the rest), its inner parts
    (``program.inner_parts``) are taken out of the remainder, which is ``temporaries``; the
    ``program.resident`` bytes (alive, not arguments) are added. Without ``memory`` (the
    compiler ran out of HBM), ``required_bytes`` (its message's figure, else the arguments)
    stands for the program's total.
    """
    parts = dict.fromkeys(MEMORY_PARTS, 0)
    known_args = sum(program.argument_parts.values())
    if memory is not None:
        shared = program.shared_argument_bytes  # the same arrays as another argument
        program_total, arguments = memory.total_bytes - shared, memory.argument_bytes - shared
    else:
        program_total = max(required_bytes or 0, known_args)
        arguments = known_args
    for name, nbytes in program.argument_parts.items():
        parts[name] += nbytes
    parts["inputs"] += max(arguments - known_args, 0)
    rest = program_total - max(arguments, known_args)
    for name, nbytes in program.inner_parts.items():
        taken = min(nbytes, max(rest, 0))
        parts[name] += taken
        rest -= taken
    parts["temporaries"] += max(rest, 0)
    for name, nbytes in program.resident.items():
        parts[name] += nbytes
    return parts


def decode_hbm_bytes_per_chip(
    config: models.ModelConfig, mesh: Mesh, rows: int, kv_len: int
) -> float:
    """HBM bytes one chip moves in one decode step on the trainer's (FSDP) layout.

    With ``c`` bytes of the compute dtype, ``W = (matmul_params + adapter_params) x c``
    (``flops.matmul_params``, and a LoRA model's adapters, ``flops.adapter_params``),
    ``E = V D c`` (the embedding table), ``f`` / ``t`` the fsdp / tensor axes, ``s`` the batch
    shards (``data x fsdp``):

    * weights: each step all-gathers them over fsdp: the gather reads the chip's shard
      (``W / t f``) and writes the gathered weights into HBM (``W / t``), the matmuls read them
      back (``W / t``): ``W / t (2 + 1 / f)``; ``W / t`` when ``f = 1`` (read in place). An
      untied embedding table is gathered too (``E / t (1 + 1 / f)``; the lookup then reads
      ``rows x D x c / s``);
    * a mixture of experts: the matmuls read the experts the step's tokens reach, not only
      ``k`` (``flops.decode_weight_params``: ``E (1 - (1 - k / E)^n)`` a layer for the ``n``
      tokens routed to a chip's experts, ``rows / s`` times the expert axis ``P``), and the
      gather moves all of a chip's ``E / P`` experts: ``W_all / t (1 + 1 / f) + W_read / t``
      with the experts ``/ P`` in both;
    * cache: ``estimate.decode_hbm_bytes`` without weights (every slot's keys and values read,
      this step's written) over ``s x t`` chips (rows over the batch axes, kv-heads over
      tensor);
    * logits: the ``[rows, V]`` f32 logits written and read back by the sampler, over ``s x t``.
    """
    c = jnp.dtype(config.compute_dtype).itemsize
    sizes = dict(mesh.shape)
    fsdp, tensor, expert = sizes["fsdp"], sizes["tensor"], sizes.get("expert", 1)
    shards = parallel.batch_shards(mesh)
    adapters = flops_lib.adapter_params(config)
    read = flops_lib.decode_weight_params(config, rows * expert / shards) + adapters
    gathered = float(flops_lib.matmul_params(config) + adapters)
    if config.num_experts:  # a chip's E / P experts, all gathered; the touched ones read
        per_layer = 3 * config.hidden_size * config.moe_intermediate_size
        active = config.num_hidden_layers * config.num_experts_per_tok * per_layer
        dense = gathered - active
        gathered = dense + (config.num_hidden_layers * config.num_experts * per_layer) / expert
        read = dense + (read - dense) / expert
    weights = read * c / tensor
    table = config.vocab_size * config.hidden_size * c / tensor
    if fsdp > 1:
        weights += gathered * c / tensor * (1 + 1 / fsdp)
        table = 0.0 if config.tie_word_embeddings else table * (1 + 1 / fsdp)
    else:
        table = 0.0
    lookup = rows * config.hidden_size * c / shards
    split = shards * (tensor if config.num_key_value_heads % tensor == 0 else 1)
    cache = est.decode_hbm_bytes(config, rows, kv_len, param_bytes=0, cache_bytes=c) / split
    logits = 2 * rows * config.vocab_size * 4 / (shards * tensor)
    return weights + table + lookup + cache + logits


def _hlo_estimate(
    compiled: Any,
    spec: TopologySpec,
    program: Program,
    model_config: models.ModelConfig | None = None,
    mesh_sizes: dict[str, int] | None = None,
) -> dict[str, Any]:
    """HBM bytes, de-duplicated trip-weighted collectives and roofline times of a compiled
    program (``estimate.estimate_program`` with ``unique_collectives`` applied; one trip of
    the decode loop for ``per_step_loop`` programs; ``program.hbm_bytes`` when modelled).

    For a mixture-of-experts ``model_config`` on the trainer's mesh (``mesh_sizes``) also
    ``moe``: the program's expert all-to-all and whole-expert gathers (``plan._moe``); each
    collective says whether it is the experts' exchange (``expert_exchange``)."""
    module = hlo_lib.parse_hlo_module(compiled.as_text())
    one_trip = False
    if program.per_step_loop:
        try:
            module, one_trip = loop_body_module(module), True
        except ValueError:  # no single data-dependent loop: the whole call, loop counted once
            pass
    parsed = hlo_lib.collective_ops(module)
    ops = unique_collectives(module, parsed)
    link = spec.ici_bandwidth_bytes_per_s_per_link

    def by_kind(items):
        totals = dict.fromkeys(hlo_lib.COLLECTIVE_KINDS, 0)
        for op in items:
            totals[op.kind] += op.total_bytes
        return totals

    hbm_hlo = est.hlo_hbm_bytes(module)
    hbm = hbm_hlo if program.hbm_bytes is None else program.hbm_bytes
    times = est.roofline(
        spec,
        flops=program.flops,
        hbm_bytes=hbm,
        ici_s=est.collectives_ici_time_s(ops, link),
        model_flops=program.model_flops,
        tokens=program.tokens,
        chips=program.chips,
    )
    return {
        "hbm_bytes": float(hbm),
        "hbm_bytes_hlo": float(hbm_hlo),
        "hlo_of_one_loop_trip": one_trip,
        "collective_bytes": by_kind(ops),
        "collective_bytes_as_parsed": by_kind(parsed),
        "trip_counts_known": all(
            loop.trip_count is not None for loop in hlo_lib.while_loops(module)
        ),
        "xla_optimal_seconds": _optimal_seconds(compiled),
        "collectives": [
            {
                "kind": op.kind,
                "bytes": op.bytes,
                "group_size": op.group_size,
                "multiplier": op.multiplier,
                "ici_s": op.multiplier * est.ici_time_s(op.kind, op.bytes, op.group_size, link),
                "expert_exchange": is_expert_exchange(op),
            }
            for op in ops
        ],
        "times": times,
        "moe": (
            program_moe(
                module,
                ops,
                model_config,
                mesh_sizes or {},
                link,
                check_gathers=program.name not in MOE_WEIGHT_PROGRAMS,
            )
            if model_config is not None and is_moe(model_config)
            else None
        ),
    }
