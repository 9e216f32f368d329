"""A plan's report: per-program figures, the summary and what to change (see
``jaxrl_llm.plan.programs``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from jaxrl_llm import models, parallel
from jaxrl_llm.plan import estimate as est
from jaxrl_llm.plan import flops as flops_lib
from jaxrl_llm.plan._analysis import (
    _hlo_estimate,
    build_job,
    decode_hbm_bytes_per_chip,
    memory_parts,
)
from jaxrl_llm.plan._aux import ASSUMPTIONS as JOINT_ASSUMPTIONS
from jaxrl_llm.plan._aux import critic_report
from jaxrl_llm.plan._engine import engine_shape
from jaxrl_llm.plan._frozen_model import OWN_CHIPS_ASSUMPTION, frozen_model_report
from jaxrl_llm.plan._job import (
    ASSUMPTIONS,
    Job,
    Program,
    mesh_maps,
)
from jaxrl_llm.plan._lora import ASSUMPTIONS as LORA_ASSUMPTIONS
from jaxrl_llm.plan._lora import lora_report
from jaxrl_llm.plan._moe import moe_hints, moe_report, moe_suggestions, replication
from jaxrl_llm.plan._routing import ASSUMPTIONS as ROUTING_ASSUMPTIONS
from jaxrl_llm.plan._routing import records_routing, routing_report
from jaxrl_llm.plan._serving import roofline_mesh
from jaxrl_llm.plan._split import ASSUMPTIONS as SPLIT_ASSUMPTIONS
from jaxrl_llm.plan._split import split_report
from jaxrl_llm.plan.goodput import (
    expected_seconds,
    goodput_report,
    matmul_efficiency,
    step_tokens,
)
from jaxrl_llm.plan.topology import CompileOutcome, GiB, TopologySpec, try_compile

# The jitted sampler programs ``sampling.generate`` calls (its module name is shadowed by the
# function ``sampling.generate``, hence the direct import).
from jaxrl_llm.sampling import serving
from jaxrl_llm.train.rl.config import TrainConfig

PyTree = Any


# -- planning --------------------------------------------------------------------------------


def compile_job(job: Job, *, stream: TextIO | None = None) -> dict[str, CompileOutcome]:
    """``try_compile`` of each lowered program (a program sharing another's compile reuses it).

    A progress bar over the programs compiled (done, total, time left, the one compiling)
    draws on ``stream`` (None: stderr) when it is a terminal, and is erased when done (tqdm's
    ``disable=None``: nothing on a pipe or a file).
    """
    from tqdm.auto import tqdm  # noqa: PLC0415

    compiled = [name for name, program in job.programs.items() if program.same_as is None]
    outcomes: dict[str, CompileOutcome] = {}
    with tqdm(
        total=len(compiled),
        desc="compiling",
        unit="program",
        file=stream,
        disable=None,
        leave=False,
        dynamic_ncols=True,
    ) as bar:
        for name, program in job.programs.items():
            if program.same_as is not None:
                outcomes[name] = outcomes[program.same_as]
                continue
            bar.set_postfix_str(name)
            outcomes[name] = try_compile(program.lowered)
            bar.update(1)
    return outcomes


def host_bytes(memory: est.MemoryBreakdown) -> int:
    """Host memory a compiled program holds at its peak: its host arguments and outputs (less
    the donated ones) and host temporaries, e.g. the layer inputs ``model.remat=offload``
    keeps there between the forward and the backward."""
    return (
        memory.host_argument_bytes
        + memory.host_output_bytes
        - memory.host_alias_bytes
        + memory.host_temp_bytes
    )


def _gib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / GiB


def _program_report(job: Job, program: Program, outcome: CompileOutcome | None) -> dict[str, Any]:
    spec = job.spec
    compiled = None if outcome is None else outcome.compiled
    memory = None if compiled is None else est.memory_breakdown(compiled, spec)
    required = None if outcome is None else outcome.required_bytes
    parts = memory_parts(program, memory, required)
    total = sum(parts.values())
    out: dict[str, Any] = {
        "calls_per_step": program.calls_per_step,
        "function": program.function,
        "compiled": compiled is not None,
        "compile_s": None if outcome is None else outcome.seconds,
        "shares_compile_of": program.same_as,
        "error": None if outcome is None else outcome.error,
        "memory_bytes": parts,
        "program_memory": None if memory is None else dataclasses.asdict(memory),
        # Pinned host memory at the program's peak (``model.remat=offload``'s layer inputs),
        # beside the HBM total; None when not compiled.
        "host_bytes": None if memory is None else host_bytes(memory),
        "total_bytes": total,
        "total_gib": total / GiB,
        "fits": compiled is not None and total <= spec.usable_hbm_bytes_per_chip,
        "flops": program.flops,
        "model_flops": program.model_flops,
        "tokens": program.tokens,
        # Lowered over packed rows (trainer.packing): the plan's sizes, else None (padded).
        "packing": None if program.packing is None else program.packing.report(),
    }
    if compiled is not None:
        out.update(_hlo_estimate(compiled, spec, program, job.model_config, dict(job.mesh.shape)))
        times = out.pop("times")
        if out["moe"] is not None:  # a mixture of experts: the expert matmuls as compiled
            rep = out["moe"]["replication"] = replication(job, program.name, out["moe"])
            if rep is not None and rep["extra_flops"]:  # chips doing other chips' tokens
                times = est.roofline(
                    spec,
                    flops=program.flops + rep["extra_flops"],
                    hbm_bytes=out["hbm_bytes"],
                    ici_s=times["ici_s"],
                    model_flops=program.model_flops,
                    tokens=program.tokens,
                    chips=program.chips,
                )
    else:
        # No HLO: the compute time only, a lower bound (HBM and ICI unknown).
        compute = est.roofline(spec, flops=program.flops, hbm_bytes=0.0, chips=program.chips)[
            "compute_s"
        ]
        times = {
            "compute_s": compute,
            "hbm_s": None,
            "ici_s": None,
            "step_s": compute,
            "step_conservative_s": compute,
            "bound": None,
            "roofline_mfu_bound": None,
            "roofline_mfu_bound_conservative": None,
            "tokens_per_s": None,
            "tokens_per_s_conservative": None,
        }
        out.update(
            hbm_bytes=None,
            hbm_bytes_hlo=None,
            hlo_of_one_loop_trip=None,
            collective_bytes=None,
            collective_bytes_as_parsed=None,
            trip_counts_known=None,
            xla_optimal_seconds=None,
            collectives=[],
            moe=None,
        )
    # Expected: the compute time at the chip generation's measured matmul efficiency.
    efficiency = matmul_efficiency(spec.generation).value
    expected = expected_seconds(times, efficiency) if compiled is not None else None
    times["expected_s"] = expected
    times["expected_mfu"] = (
        program.model_flops
        / (spec.peak_bf16_flops_per_chip * (program.chips or spec.chips) * expected)
        if expected
        else None
    )
    out["times"] = times
    if program.name == "decode_step":
        # The floor: one decode step's unavoidable HBM traffic on the serving layout (weights
        # read in place once, cache and logits), against which the estimate is judged.
        rows, kv_len = job.shape.rows, job.shape.seq_len
        if job.cfg.rollout.engine == "continuous":
            engine = engine_shape(job.cfg, job.shape, job.serving.mesh)
            rows, kv_len = engine.slots, engine.width
            if engine.paged is not None:  # a pool smaller than every slot's longest row
                kv_len = min(kv_len, engine.paged[0] * engine.paged[1] // engine.slots)
        floor = decode_hbm_bytes_per_chip(job.model_config, roofline_mesh(job), rows, kv_len)
        out["hbm_roofline_bytes"] = floor
        out["hbm_roofline_s"] = floor / job.spec.hbm_bandwidth_bytes_per_s
    return out


def plan_job(
    cfg: TrainConfig,
    spec: TopologySpec,
    *,
    devices: Sequence[Any] | None = None,
    compile_anyway: bool = False,
    length_source: str | None = None,
) -> dict[str, Any]:
    """The plan of an RL job on a topology: per-chip memory by part and program, roofline
    times, the estimated RL step, MFU and decode tokens/s, and what to change if it does not
    fit. JSON-ready.

    When the resident state alone (parameters, optimizer state, reference) exceeds the chip's
    usable HBM nothing is compiled (the answer is known) unless ``compile_anyway``.
    ``length_source`` says where ``rollout.expected_length_fraction`` came from (default: the
    config key; ``goodput``'s length model).

    Raises:
      PlanError: see ``build_job``.
    """
    job = build_job(cfg, spec, devices)
    skip = job.state.resident > spec.usable_hbm_bytes_per_chip and not compile_anyway
    outcomes = {} if skip else compile_job(job)
    programs = {
        name: _program_report(job, program, outcomes.get(name))
        for name, program in job.programs.items()
    }
    return summarise(job, programs, skipped_compile=skip, length_source=length_source)


def summarise(
    job: Job,
    programs: Mapping[str, dict],
    *,
    skipped_compile: bool,
    length_source: str | None = None,
) -> dict[str, Any]:
    """The top-level report from the per-program ones (see ``plan_job``)."""
    spec, shape, state = job.spec, job.shape, job.state
    largest = max(programs, key=lambda n: programs[n]["total_bytes"])
    peak = programs[largest]["total_bytes"]
    fits = (not skipped_compile) and all(p["fits"] for p in programs.values())
    contribution = {n: p["calls_per_step"] * p["times"]["step_s"] for n, p in programs.items()}
    conservative = {
        n: p["calls_per_step"] * p["times"]["step_conservative_s"] for n, p in programs.items()
    }
    step_s = sum(contribution.values())
    step_cons = sum(conservative.values())
    split = None
    if job.split is not None:  # the sampler's own chips: the phases overlap or wait
        split = split_report(job, programs)
        step_s = split["step_s"]
        step_cons = split_report(job, programs, "step_conservative_s")["step_s"]
    model_flops = sum(p["calls_per_step"] * p["model_flops"] for p in programs.values())
    peak_flops = spec.chips * spec.peak_bf16_flops_per_chip
    update, decode = programs["update"]["times"], programs["decode_step"]["times"]
    config = job.model_config
    all_compiled = all(p["compiled"] for p in programs.values())
    expected_step = None
    if all_compiled and all(p["times"]["expected_s"] is not None for p in programs.values()):
        expected_step = sum(
            p["calls_per_step"] * p["times"]["expected_s"] for p in programs.values()
        )
        if job.split is not None:
            expected_step = split_report(job, programs, "expected_s")["step_s"]
    tokens = step_tokens(
        shape.rows,
        shape.prompt_len,
        shape.completion_len,
        min(job.cfg.data.max_prompt_tokens, shape.prompt_len),
        job.cfg.rollout.expected_length_fraction,
        length_source,
    )
    goodput = goodput_report(
        programs,
        tokens,
        matmul_efficiency(spec.generation),
        peak_flops,
        step_s if all_compiled else None,
        expected_step,
    )
    report: dict[str, Any] = {
        "fits": fits,
        "topology": spec.cloud_name,
        "jax_topology": spec.jax_topology_name,
        "chips": spec.chips,
        "mesh": dict(job.mesh.shape),
        "hbm_capacity_gib": spec.hbm_bytes_per_chip / GiB,
        "hbm_usable_gib": spec.usable_hbm_bytes_per_chip / GiB,
        "hbm_per_chip_gib": peak / GiB,
        "headroom_gib": (spec.usable_hbm_bytes_per_chip - peak) / GiB,
        "largest_program": largest,
        # The most pinned host memory a chip any program holds (model.remat=offload), GiB.
        "host_per_chip_gib": max((p["host_bytes"] or 0) for p in programs.values()) / GiB,
        "est_step_s": step_s,
        "est_step_conservative_s": step_cons,
        # A program that did not compile counts its compute time only: a lower bound.
        "est_step_is_lower_bound": not all(p["compiled"] for p in programs.values()),
        # Over the roofline times: upper bounds, not expected utilisations.
        "roofline_mfu_bound": update["roofline_mfu_bound"],
        "roofline_mfu_bound_conservative": update["roofline_mfu_bound_conservative"],
        "roofline_step_mfu_bound": (
            model_flops / (peak_flops * step_s) if step_s > 0 and all_compiled else None
        ),
        "est_mfu": update["roofline_mfu_bound"],  # the old name (benchmarks/pod_plans.py)
        # At the chip generation's measured matmul efficiency (goodput.MATMUL_EFFICIENCY).
        "expected_step_s": expected_step,
        "expected_mfu": update["expected_mfu"],
        **goodput,
        "est_decode_tokens_per_s": decode["tokens_per_s"],
        "est_decode_tokens_per_s_conservative": decode["tokens_per_s_conservative"],
        "est_decode_roofline_tokens_per_s": job.programs["decode_step"].tokens
        / programs["decode_step"]["hbm_roofline_s"],
        "est_decode_fraction_of_roofline": (
            None
            if decode["step_s"] is None or not programs["decode_step"]["compiled"]
            else programs["decode_step"]["hbm_roofline_s"] / decode["step_s"]
        ),
        # trainer.packing as lowered: whether the forwards run packed, their rows (plan._packing).
        "packing": None if job.packing is None else job.packing.report(),
        "sampler_layout": {
            "mesh": dict(job.serving.mesh.shape),
            "tensor": job.serving.tensor,
            "is_trainer_layout": job.serving.is_trainer_layout,
            "reshard_s": programs["reshard"]["times"]["step_s"] if "reshard" in programs else 0.0,
            "reshard_collective_bytes": (
                programs["reshard"]["collective_bytes"] if "reshard" in programs else None
            ),
            # What the per-step reshard moves: a LoRA run's adapters (the base once a run).
            "reshard_moves": "adapters" if config.lora is not None else "parameters",
            "base_reshard_once_s": (
                programs["reshard_base"]["times"]["step_s"] if "reshard_base" in programs else None
            ),
            # A LoRA run's sampler: adapters applied on the fly, or merged once a step.
            "lora_weights": None
            if config.lora is None
            else ("merged" if "merge" in programs else "adapters"),
            "merge_s": programs["merge"]["times"]["step_s"] if "merge" in programs else None,
            # The decode loop's weights and cache (rollout.decode_layers; auto: stacked).
            "decode_layers": (
                "per_layer" if job.cfg.rollout.decode_layers == "per_layer" else "stacked"
            ),
        },
        "split": split,
        "step_breakdown_s": contribution,
        "dominant_program": max(contribution, key=contribution.get),
        "compile_skipped": skipped_compile,
        "compile_s": sum(
            p["compile_s"] or 0.0 for p in programs.values() if not p["shares_compile_of"]
        ),
        "model": {
            "name": job.cfg.model.architecture or job.cfg.model.path,
            "architecture": config.architecture,
            "params": models.param_count(config),
            # What one token uses (a mixture of experts: its k routed experts of E); FLOPs,
            # MFU and goodput count these.
            "active_params": flops_lib.active_param_count(config),
            "matmul_params": flops_lib.matmul_params(config),
            "param_dtype": job.cfg.model.param_dtype,
            "compute_dtype": config.compute_dtype,
            "optimizer_state_dtype": job.cfg.trainer.optimizer_state_dtype,
            "lora": lora_report(config),
        },
        "objective": job.objective.name,
        "moe": moe_report(job, programs),
        "critic": critic_report(job),
        "reward_model": frozen_model_report(job, job.reward_model),
        "teacher": frozen_model_report(job, job.teacher),
        "routing_replay": routing_report(job, programs),
        "job": {**dataclasses.asdict(shape), "seq_len": shape.seq_len},
        "resident_bytes": dataclasses.asdict(state),
        "programs": dict(programs),
        "assumptions": [
            *ASSUMPTIONS,
            *(LORA_ASSUMPTIONS if config.lora is not None else ()),
            *(JOINT_ASSUMPTIONS if job.aux is not None and job.aux.joint else ()),
            *(m.kind.assumption for m in (job.reward_model, job.teacher) if m is not None),
            *((OWN_CHIPS_ASSUMPTION,) if job.teacher and job.teacher.own_mesh else ()),
            *(SPLIT_ASSUMPTIONS if job.split is not None else ()),
            *(ROUTING_ASSUMPTIONS if records_routing(job.cfg) else ()),
        ],
    }
    report["suggestions"] = [] if fits else suggestions(job, programs, skipped_compile)
    report["hints"] = (
        [*moe_hints(job, programs), *decode_hints(job, programs, spec.usable_hbm_bytes_per_chip)]
        if fits
        else []
    )
    return report


def decode_hints(job: Job, programs: Mapping[str, dict], usable: float) -> list[str]:
    """Speed-ups a fitting job could take (``report["hints"]``): per-layer decoding where the
    stacked decode loop (``rollout.decode_layers`` auto or stacked, the static sampler) runs
    under ``DECODE_HINT_BELOW`` of its HBM roofline and its program still fits with a second
    copy of the sampler's weights (what per layer costs; at most, since only the layer weights
    are copied). XLA:TPU copies a stacked cache's layer slices every step; in every plan
    measured per-layer decoding was as fast or 2.2-3.3x faster (benchmarks/RESULTS.md)."""
    r, decode = job.cfg.rollout, programs.get("decode_step")
    if r.decode_layers == "per_layer" or r.engine == "continuous" or decode is None:
        return []
    step, weights = decode["times"]["step_s"], decode["memory_bytes"].get("sampler_weights", 0)
    if not (decode["compiled"] and step and weights):
        return []
    fraction = decode["hbm_roofline_s"] / step
    with_copy = decode["total_bytes"] + weights
    if fraction >= DECODE_HINT_BELOW or with_copy > usable:
        return []
    return [
        f"rollout.decode_layers=per_layer: the stacked decode loop runs at {fraction:.0%} of "
        "its HBM roofline (XLA copies each layer's KV-cache slice every step); per layer it "
        f"reads them in place, for a copy of the layer weights (up to {weights / GiB:.2f} GiB "
        f"a chip: decode_step at most {with_copy / GiB:.2f} of {usable / GiB:.2f} GiB). Plan "
        "it to see its estimate."
    ]


# Below this share of its HBM roofline a stacked decode loop is worth planning per layer.
DECODE_HINT_BELOW = 0.6


# -- what to change --------------------------------------------------------------------------


def bigger_topology(spec: TopologySpec, factor: int = 2) -> str | None:
    """The Cloud name of a slice of the same generation with ``factor`` x the chips, or None."""
    from jaxrl_llm.plan.topology import resolve_topology  # noqa: PLC0415

    count = spec.chips * factor * (spec.cores_per_chip if len(spec.shape) == 3 else 1)
    name = f"{spec.cloud_name.rsplit('-', 1)[0]}-{count}"
    try:
        return resolve_topology(name).cloud_name
    except ValueError:
        return None


def _chips_for(nbytes_all_chips: float, usable: int, fraction: float = 0.7) -> int:
    """Chips whose usable HBM holds ``nbytes`` at ``fraction`` full."""
    return max(1, math.ceil(nbytes_all_chips / (usable * fraction)))


def suggestions(job: Job, programs: Mapping[str, dict], skipped_compile: bool = False) -> list[str]:
    """What to change so the job fits, most certain first.

    Changes to the resident state (AdamW's moments or the master weights in bf16, more chips)
    shrink every program by an amount known here, quoted against the overflow; the others
    (remat, micro-batches, a tensor axis, shorter rollouts) act on a program's temporaries or
    KV cache by an amount only another plan can tell.
    """
    spec, shape, state, cfg = job.spec, job.shape, job.state, job.cfg
    usable = spec.usable_hbm_bytes_per_chip
    chips = job.mesh.size
    resident = state.resident
    worst = max(programs, key=lambda n: programs[n]["total_bytes"])
    overflow = max(programs[worst]["total_bytes"], resident) - usable

    def saves(nbytes: float) -> str:
        enough = "; enough on its own" if nbytes >= overflow > 0 else ""
        return f"saves {_fmt(nbytes)} a chip of the {_fmt(max(overflow, 0))} over{enough}"

    out: list[str] = []
    if skipped_compile or resident > 0.8 * usable:
        need = _chips_for(resident * chips, usable)
        example = bigger_topology(spec, _pow2_at_least(need / chips)) if need > chips else None
        base = f", frozen base {_fmt(state.base + state.serving_base)}" if state.base else ""
        base += f", critic/PRM {_fmt(state.aux)}" if state.aux else ""
        base += f", reward model {_fmt(state.reward_model)}" if state.reward_model else ""
        base += f", teacher {_fmt(state.teacher)}" if state.teacher else ""
        out.append(
            f"the resident state alone (parameters {_fmt(state.params)}, optimizer state "
            f"{_fmt(state.optimizer)}, reference {_fmt(state.reference)}{base}) takes "
            f"{_fmt(resident)} of {_fmt(usable)} a chip: a bigger topology (about {need} "
            f"chips or more" + (f", e.g. {example}" if example else "") + ")"
        )
    lora = job.model_config.lora is not None  # the adapters' state is small: no halving
    if state.serving_base:
        out.append(
            "rollout.tensor_parallel=trainer: the sampler decodes on the trainer's layout, so "
            f"no serving copy of the frozen base ({_fmt(state.serving_base)} a chip) is kept "
            "all run; the decode step then gathers the base every token, with temporaries of "
            "its own (plan it to see)"
        )
    joint = job.aux is not None and job.aux.joint  # the trainer's AdamW has the critic's too
    if cfg.trainer.optimizer_state_dtype == "float32" and not lora:
        moments = state.optimizer + (state.aux_optimizer if joint else 0)
        out.append(
            "trainer.optimizer_state_dtype=bfloat16: AdamW's moments in bf16 (the update is "
            f"still computed in f32{'; the critic on the joint optimizer too' * joint}); "
            f"{saves(moments / 2)}"
        )
    if cfg.model.param_dtype == "float32" and not lora:
        # The critic's or PRM's masters are in model.param_dtype too.
        halved = (state.params + state.aux_params) / 2
        halved += state.reference / 2 if cfg.reference.mode != "ema" else 0
        out.append(
            "model.param_dtype=bfloat16: master weights (and the reference"
            f"{', the critic/PRM' if state.aux_params else ''}) in bf16, but small "
            "updates round away (benchmarks/RESULTS.md, mixed precision); at least "
            f"{saves(halved)}"
        )
    over = {n for n, p in programs.items() if p["total_bytes"] > usable or not p["compiled"]}
    if not skipped_compile and "update" in over:
        micro = shape.micro_batches
        if shape.remat == "none":
            out.append("model.remat=layer: keep only each layer's input for the backward pass")
        double, shards = micro * 2, parallel.batch_shards(job.mesh)
        rows = shape.minibatch_rows // double if shape.minibatch_rows % double == 0 else 0
        if rows and rows % shards == 0:
            out.append(
                f"trainer.micro_batches={double} (now {micro}): halves the activations kept "
                "per micro-batch (not the gradients or the optimizer's intermediates: see the "
                "update's temporaries)"
            )
        else:
            out.append(
                f"more micro-batches do not divide: {shape.minibatch_rows // micro} rows per "
                f"micro-batch already, and the batch axes need a multiple of {shards}; "
                "more trainer.minibatches instead"
            )
    if not skipped_compile:  # a mixture of experts: where mesh.expert shrinks what is over
        out += moe_suggestions(job, programs)
    if not skipped_compile and over & {"update", "logprobs", "ref_logprobs", "teacher_logprobs"}:
        sizes = dict(job.mesh.shape)
        tensor, devices = sizes["tensor"], list(job.mesh.devices.flat)
        expert = sizes.get("expert", 1)
        others = sizes["data"] * expert
        # The next size the model's heads, widths and vocabulary divide and the slice's torus
        # lays out (v5p-128's 4x4x4 takes 4 and 16, not 2 or 8); none: no such suggestion.
        bigger = next(
            (
                t
                for t in serving.tensor_sizes(job.model_config, chips)
                if t > tensor
                and chips % (t * others) == 0
                and mesh_maps(devices, sizes["data"], chips // (t * others), t, expert)
            ),
            None,
        )
        if bigger is not None:
            out.append(
                f"a tensor axis (mesh.tensor={bigger} with mesh.fsdp=-1): splits heads, MLP "
                "width and vocabulary, their weights gathered per layer and their activations"
            )
    if not skipped_compile and over & {"logprobs", "ref_logprobs"}:
        out.append(
            "the log-prob forwards run over the whole rollout batch at once: fewer rollout "
            "rows (rollout.prompts_per_step) or a smaller model.chunk_size"
        )
    if not skipped_compile and "teacher_logprobs" in over:
        out.append(
            "the teacher scores the whole rollout batch at once (teacher_logprobs): fewer "
            "rollout rows (rollout.prompts_per_step), a smaller model.chunk_size, a smaller "
            "teacher (teacher.path)"
            + (
                ", more chips of its own (teacher.devices)"
                if job.teacher is not None and job.teacher.own_mesh is not None
                else ", or chips of its own (teacher.devices)"
            )
        )
    if not skipped_compile and "rm_scores" in over:
        out.append(
            "the reward model scores the whole rollout batch at once (rm_scores): fewer "
            "rollout rows (rollout.prompts_per_step), a shorter rollout.max_new_tokens or a "
            "smaller reward model (reward_model.path)"
        )
    sampler = over & {"serving_reshard", "prefill", "decode_step"}
    if job.split is not None and not skipped_compile and over and (sampler == over or not sampler):
        n = len(job.split.sampler_devices)
        out.append(
            f"{'more' if sampler else 'fewer'} sampler chips (mesh.rollout_devices={n} now): "
            f"the {'sampler' if sampler else 'trainer'}'s side is over"
        )
    if not skipped_compile and over & {"prefill", "decode_step"}:
        kv = programs["decode_step"]["memory_bytes"]["kv_cache"]
        if job.cfg.rollout.engine == "continuous":
            engine = engine_shape(job.cfg, shape, job.serving.mesh)
            out.append(
                f"the engine's KV cache ({_fmt(kv)} a chip for {engine.slots} slots x "
                f"{engine.width} cache slots): fewer rollout.slots, a paged pool of fewer blocks "
                "(rollout.kv_block_size, rollout.kv_blocks: requests wait or are preempted "
                "when it is full), or a tensor axis (mesh.tensor) to split it by kv-head"
            )
        else:
            out.append(
                f"the KV cache ({_fmt(kv)} a chip for {shape.rows} rows x {shape.seq_len} "
                "slots): fewer rollout rows (rollout.prompts_per_step x rollout.group_size), "
                "shorter rollout.max_new_tokens, or a tensor axis (mesh.tensor) to split it by "
                "kv-head"
            )
    bigger = bigger_topology(spec)
    if bigger is not None and not any("bigger topology" in line for line in out):
        out.append(
            f"a bigger topology, e.g. {bigger} (twice the chips): the sharded state halves, "
            f"{saves(resident / 2)}"
        )
    return out


def _pow2_at_least(x: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(x, 1.0))))


def _fmt(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB"
