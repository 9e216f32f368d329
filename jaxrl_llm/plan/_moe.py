"""A mixture-of-experts job in a plan: the experts' share of a chip's memory, the expert
all-to-all's bytes and ICI time per program, the check that no program gathers every expert on
a chip, and where ``mesh.expert`` is the fix (see docs/plan.md, "Mixture-of-experts jobs").

Shapes: ``E`` experts a layer of width ``F`` (``moe_intermediate_size``), ``k`` a token, ``D``
hidden, ``L`` layers, ``c`` bytes of the compute dtype; on the trainer's mesh ``P`` the
``expert`` axis, ``f`` fsdp, ``t`` tensor, ``s = chips / t`` the batch shards (data x fsdp x
expert: the expert axis is one more data axis for every layer but the experts).

**The exchange** (``models.moe.expert_parallel_mlp``). Each chip routes its own ``T_l`` tokens
(``rows x seq / s`` a forward, a micro-batch's in the update) and sends every destination a
dense buffer of ``C = T_l k`` rows (dropless without a capacity factor: all of its
assignments could go to one shard), so one exchange of rows moves a ``[P, C, D]`` buffer:

    R = P T_l k D c          bytes a chip, the all-to-all's result (``P x`` the real rows)
    R_ids = P T_l k 4        the rows' expert ids (int32)

A forward exchanges rows twice (to the experts and back) and ids once; the update's backward
exchanges the rows' cotangents twice more, and ``model.remat=layer`` runs the forward's three
again: per layer and micro-batch ``4 + 2 r`` exchanges of ``R`` and ``1 + r`` of ``R_ids``
(``r`` = 1 with layer remat). They sit in the scanned layer stack (and the micro-batch loop),
so the HLO's one copy of each is weighted by those trip counts (``hlo.collective_ops``). Which
all-to-alls are the experts' is read from the HLO's ``op_name`` metadata (the ``all_to_all``
JAX primitive; an XLA resharding all-to-all is named for the op it serves).

**The experts' weights** ``[E, D, F]`` are stored split over ``expert`` (``E / P`` whole experts
a chip), ``fsdp`` (``D``) and ``tensor`` (``F``) and gathered over fsdp alone where used, so a
layer's gathered experts are ``3 (E / P) D (F / t) c`` on a chip. A program that gathers all
``E`` experts on a chip (an all-gather whose result is shaped ``[..., E, D, F]``, ``D`` and
``F`` whole or split by the mesh: ``whole_expert_gathers``) is flagged: with ``P = 1`` (no
expert axis) that is plain FSDP, with ``P > 1`` it means the experts' layout was lost.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm import models, parallel
from jaxrl_llm.parallel import vocab as vocab_parallel
from jaxrl_llm.plan import estimate as est
from jaxrl_llm.plan import flops as flops_lib
from jaxrl_llm.plan import hlo as hlo_lib
from jaxrl_llm.plan._job import mesh_maps
from jaxrl_llm.plan.topology import GiB
from jaxrl_llm.train.rl.config import forward_micro_batching

# JAX primitives of the experts' token exchange (the op_name's last component).
EXCHANGE_PRIMITIVES = ("all_to_all", "ragged_all_to_all")
# Programs whose job is to move the weights (no expert gathers are checked there: the sampler's
# serving copy holds every expert by design).
WEIGHT_PROGRAMS = ("reshard_base", "reshard", "serving_reshard", "merge")
# Programs over the rollout batch that run the policy on the trainer's mesh.
_FORWARDS = ("logprobs", "ref_logprobs")


def is_moe(config: models.ModelConfig) -> bool:
    """A mixture-of-experts model (``num_experts > 0``)."""
    return bool(getattr(config, "num_experts", 0))


def is_expert_exchange(op: hlo_lib.CollectiveOp) -> bool:
    """An all-to-all that ``models.moe`` issued (its ``op_name`` ends in ``all_to_all``), not
    one of the vocabulary-parallel tables' (under ``vocab_parallel.SCOPE``)."""
    return (
        op.kind == "all-to-all"
        and op.op_name.rsplit("/", 1)[-1] in EXCHANGE_PRIMITIVES
        and not vocab_parallel.in_scope(op.op_name)
    )


def exchange_summary(ops: Iterable[hlo_lib.CollectiveOp], link_bandwidth: float) -> dict:
    """The expert all-to-alls among ``ops`` over one call: ``bytes`` (trip weighted),
    ``ici_s`` (``estimate.ici_time_s`` x trips), ``exchanges`` (executions) and ``ops``
    (distinct HLO ops)."""
    mine = [op for op in ops if is_expert_exchange(op)]
    return {
        "bytes": sum(op.total_bytes for op in mine),
        "ici_s": est.collectives_ici_time_s(mine, link_bandwidth),
        "exchanges": sum(op.multiplier for op in mine),
        "ops": len(mine),
    }


# -- the analytic exchange -----------------------------------------------------------------


def exchange_bytes(
    config: models.ModelConfig, tokens_per_chip: float, expert: int, itemsize: int
) -> tuple[float, float]:
    """``(R, R_ids)``: bytes of one exchange of rows ``P T_l k D c`` and of their expert ids
    ``P T_l k 4`` on one chip (0, 0 without an expert axis, ``P = 1``)."""
    if expert <= 1:
        return 0.0, 0.0
    slots = expert * tokens_per_chip * config.num_experts_per_tok
    return slots * config.hidden_size * itemsize, slots * 4.0


def exchanges_per_layer(*, training: bool, remat: str) -> tuple[int, int]:
    """``(row exchanges, id exchanges)`` a layer runs per forward or update micro-batch:
    ``(2, 1)`` a forward; ``(4 + 2 r, 1 + r)`` an update (``r = 1`` with ``remat=layer``)."""
    if not training:
        return 2, 1
    r = 1 if remat != "none" else 0  # layer and offload recompute alike
    return 4 + 2 * r, 1 + r


def expected_exchange(
    config: models.ModelConfig,
    *,
    rows: int,
    seq: int,
    calls: int,
    shards: int,
    expert: int,
    training: bool,
    remat: str,
    itemsize: int,
    link_bandwidth: float,
) -> dict[str, float]:
    """The expert all-to-all of one program call by the formula above: ``rows`` rows of ``seq``
    positions in ``calls`` sequential chunks (micro-batches), over ``shards`` batch shards:
    ``T_l = rows seq / (calls shards)``, ``L calls (n R + n_ids R_ids)`` bytes a chip and their
    ICI seconds on a ring of ``P`` chips."""
    tokens = rows * seq / (calls * shards)
    row_bytes, id_bytes = exchange_bytes(config, tokens, expert, itemsize)
    n_rows, n_ids = exchanges_per_layer(training=training, remat=remat)
    trips = config.num_hidden_layers * calls
    return {
        "bytes": trips * (n_rows * row_bytes + n_ids * id_bytes),
        "ici_s": trips
        * (
            n_rows * est.ici_time_s("all-to-all", row_bytes, expert, link_bandwidth)
            + n_ids * est.ici_time_s("all-to-all", id_bytes, expert, link_bandwidth)
        ),
        "tokens_per_chip": tokens,
        "row_exchange_bytes": row_bytes,
    }


def gathered_layer_bytes(config: models.ModelConfig, expert: int, tensor: int, itemsize: int):
    """``3 (E / P) D (F / t) c``: one layer's local experts, whole on ``D``, on a chip."""
    e, d, f = config.num_experts, config.hidden_size, config.moe_intermediate_size
    return 3 * (e // expert) * d * (f // tensor) * itemsize


def update_expert_traffic(
    config: models.ModelConfig,
    *,
    rows: int,
    seq: int,
    micro_batches: int,
    mesh_sizes: Mapping[str, int],
    remat: str,
    itemsize: int,
    link_bandwidth: float,
) -> dict[str, float]:
    """Modelled ICI seconds of one update's MoE traffic on a chip, for the mesh ``mesh_sizes``
    (``data, fsdp, expert, tensor``): the exchange (``expected_exchange``) and the experts'
    weights, per layer and micro-batch gathered over fsdp twice (forward, backward; layer remat
    reuses the backward's) and their gradients reduce-scattered once, in the compute dtype:
    ``6 ici(all-gather, G / 3, f) + 3 ici(reduce-scatter, G / 3 f, f)`` with ``G`` the
    ``gathered_layer_bytes``. What XLA:TPU emits for Qwen3-30B-A3B on v5p-64 (6 gathers and 3
    reduce-scatters a layer and micro-batch); other compilers may keep gathered weights."""
    expert, fsdp, tensor = mesh_sizes.get("expert", 1), mesh_sizes["fsdp"], mesh_sizes["tensor"]
    chips = math.prod(mesh_sizes.values())
    exchange = expected_exchange(
        config,
        rows=rows,
        seq=seq,
        calls=micro_batches,
        shards=chips // tensor,
        expert=expert,
        training=True,
        remat=remat,
        itemsize=itemsize,
        link_bandwidth=link_bandwidth,
    )
    weight = gathered_layer_bytes(config, expert, tensor, itemsize) / 3
    per_layer = 6 * est.ici_time_s("all-gather", weight, fsdp, link_bandwidth)
    per_layer += 3 * est.ici_time_s("reduce-scatter", weight / fsdp, fsdp, link_bandwidth)
    weights_s = config.num_hidden_layers * micro_batches * per_layer
    return {
        "all_to_all_s": exchange["ici_s"],
        "weights_s": weights_s,
        "total_s": exchange["ici_s"] + weights_s,
    }


def expert_axis_sizes(
    config: models.ModelConfig, mesh_sizes: Mapping[str, int], devices: Sequence[Any] = ()
) -> list[int]:
    """``mesh.expert`` sizes the trainer's chips allow with ``mesh.fsdp=-1``: ``P`` dividing
    ``E`` and ``chips / (data tensor)`` and, given the mesh's ``devices``, that the slice's
    torus lays out (``plan._job.mesh_maps``)."""
    free = math.prod(mesh_sizes.values()) // (mesh_sizes["data"] * mesh_sizes["tensor"])
    sizes = [p for p in range(1, free + 1) if free % p == 0 and config.num_experts % p == 0]
    if devices:
        sizes = [
            p
            for p in sizes
            if mesh_maps(devices, **_with_expert(mesh_sizes, p)) or p == mesh_sizes.get("expert", 1)
        ]
    return sizes


def _with_expert(mesh_sizes: Mapping[str, int], expert: int) -> dict[str, int]:
    chips = math.prod(mesh_sizes.values())
    data, tensor = mesh_sizes["data"], mesh_sizes["tensor"]
    return {"data": data, "fsdp": chips // (data * tensor * expert), "expert": expert,
            "tensor": tensor}  # fmt: skip


# -- the HLO: whole-expert gathers ---------------------------------------------------------


def whole_expert_gathers(
    module: hlo_lib.HloModule,
    ops: Sequence[hlo_lib.CollectiveOp],
    config: models.ModelConfig,
    mesh_sizes: Mapping[str, int],
) -> list[dict[str, Any]]:
    """The all-gathers among ``ops`` whose result is every expert's weight: an array shaped
    ``[..., E, D', F']`` or ``[..., E, F', D']`` (a weight's own order) with ``D' = D / a``
    (``a`` dividing fsdp), ``F' = F / b`` (``b`` dividing tensor) and leading dims of the
    layer stack only (``L`` or 1), each with its ``shape``, ``bytes`` and trip ``multiplier``.
    (Activations with an expert axis, such as the router's ``[L, B, S, E]`` logits, end in it
    and are not matched.)"""
    e, d, f = config.num_experts, config.hidden_size, config.moe_intermediate_size
    fsdp, tensor = mesh_sizes.get("fsdp", 1), mesh_sizes.get("tensor", 1)
    d_sizes = {d // a for a in range(1, fsdp + 1) if fsdp % a == 0 and d % a == 0}
    f_sizes = {f // b for b in range(1, tensor + 1) if tensor % b == 0 and f % b == 0}
    leading = {1, config.num_hidden_layers}
    found = []
    for op in ops:
        if op.kind != "all-gather":
            continue
        for shape in _result_shapes(module, op):
            if len(shape) < 3 or shape[-3] != e or not set(shape[:-3]) <= leading:
                continue
            a, b = shape[-2:]
            if (a in d_sizes and b in f_sizes) or (a in f_sizes and b in d_sizes):
                found.append({"shape": list(shape), "bytes": op.bytes, "multiplier": op.multiplier})
                break
    return found


def _result_shapes(module: hlo_lib.HloModule, op: hlo_lib.CollectiveOp) -> list[tuple[int, ...]]:
    comp = module.computations.get(op.computation)
    ins = None if comp is None else comp.by_name.get(op.name)
    if ins is None:
        return []
    done = next(
        (i for i in comp.instructions if i.opcode.endswith("-done") and op.name in i.operands),
        None,
    )
    text = (done or ins).type_text
    shapes = [shape for _, shape in hlo_lib.array_shapes(text)]
    if done is None and ins.opcode.endswith("-start") and len(shapes) > 1:
        shapes = shapes[len(shapes) // 2 :]  # (operands, results, ...): the results
    return shapes


def expert_rows(module: hlo_lib.HloModule) -> int:
    """Rows one grouped expert matmul of the program multiplies, as compiled: the most rows
    (first dim of a rank-2 result) among its ragged dots (``jax.lax.ragged_dot``: the HLO
    ``ragged-dot`` op, XLA:TPU's ``ragged-dot-*`` kernel call); 0 without one."""
    rows = 0
    for site in hlo_lib.walk(module, trip_weighted=False):
        ins = site.ins
        ragged = ins.opcode == "ragged-dot" or (
            ins.opcode == "custom-call"
            and ("ragged-dot" in ins.name or "ragged_dot" in hlo_lib.op_name(ins))
        )
        shapes = hlo_lib.array_shapes(ins.type_text) if ragged else []
        if len(shapes) == 1 and len(shapes[0][1]) == 2:
            rows = max(rows, shapes[0][1][0])
    return rows


def program_moe(
    module: hlo_lib.HloModule,
    ops: Sequence[hlo_lib.CollectiveOp],
    config: models.ModelConfig,
    mesh_sizes: Mapping[str, int],
    link_bandwidth: float,
    *,
    check_gathers: bool = True,
) -> dict[str, Any]:
    """A program's MoE figures from its optimized HLO (``ops``: its de-duplicated, trip
    weighted collectives): ``expert_all_to_all`` (``exchange_summary``),
    ``whole_expert_gathers`` (None when not checked: a weight program) and ``expert_rows``
    (``expert_rows``: the rows of its grouped expert matmuls)."""
    return {
        "expert_all_to_all": exchange_summary(ops, link_bandwidth),
        "expert_rows": expert_rows(module),
        "whole_expert_gathers": (
            whole_expert_gathers(module, ops, config, mesh_sizes) if check_gathers else None
        ),
    }


def forward_calls(job) -> int:
    """Micro-batches of a log-prob forward over the rollout batch: 1, or what a token budget
    (``trainer.micro_batch_tokens``) asks for (``train.rl.config.forward_micro_batching``)."""
    micro = forward_micro_batching(job.cfg.trainer, parallel.current_platform(job.mesh)[0])
    if isinstance(micro, int):
        return micro
    return micro.micro_batches(job.shape.rows, job.shape.seq_len, parallel.batch_shards(job.mesh))


def _joint(job) -> bool:
    """PPO's joint optimizer: the update is policy and critic together."""
    return job.aux is not None and job.aux.joint


# -- replicated expert compute ---------------------------------------------------------------


def _tokens(job, name: str) -> tuple[float, int, float] | None:
    """``(tokens a layer call routes over the whole mesh, calls of the layer stack, passes of
    the experts' matmuls a token: 1 forward, 3 + remat an update)`` of a program, or None
    (packed, the continuous engine, a program not covered)."""
    shape, packing = job.shape, job.packing

    def packed(forward) -> bool:
        return packing is not None and forward is not None and forward.packed

    if name == "update" and not packed(packing and packing.update) and not _joint(job):
        passes = 4 if shape.remat != "none" else 3  # layer and offload recompute alike
        k = shape.micro_batches
        return shape.minibatch_rows * shape.seq_len / k, k, passes
    if name in _FORWARDS and not packed(packing and packing.forwards):
        calls = forward_calls(job)
        return shape.rows * shape.seq_len / calls, calls, 1
    if job.cfg.rollout.engine == "continuous" or job.split is not None:
        return None
    if name == "prefill":
        return shape.prompts * shape.prompt_len, 1, 1
    if name == "decode_step":
        return shape.rows, 1, 1
    return None


def expert_matmul_flops(job, name: str) -> float | None:
    """The routed experts' matmul FLOPs of one call of a program over the whole mesh, as
    ``plan.flops`` counts them: ``L x 2 k 3 D F`` a token and pass (None: not covered)."""
    tokens, config = _tokens(job, name), job.model_config
    if tokens is None:
        return None
    total, calls, passes = tokens
    per_token = config.num_hidden_layers * 2 * config.num_experts_per_tok * 3
    return per_token * config.hidden_size * config.moe_intermediate_size * total * calls * passes


def replication(job, name: str, moe: Mapping[str, Any]) -> dict[str, float] | None:
    """How many tokens' worth of rows a chip's grouped expert matmuls take, against its own.

    Each chip should route only its own ``T_l`` tokens (the batch over its mesh's batch shards
    ``s``): ``T_l k`` rows a matmul, ``P T_l k`` with an expert axis (the exchange's padded
    buffer). ``factor`` = the compiled rows (``expert_rows``) over that; above 1 without an
    expert axis the chip runs the experts on other chips' tokens too (the single-program MoE
    layer sorts every token of the batch by expert: XLA cannot split the sort, so every chip
    does the whole batch's expert matmuls), and ``extra_flops`` = ``(factor - 1)`` x the
    program's expert matmul FLOPs (``expert_matmul_flops``) is work the analytic count leaves
    out. None without ragged dots in the HLO (XLA:CPU expands them) or for a program not
    covered."""
    rows, config = moe.get("expert_rows", 0), job.model_config
    tokens, flops = _tokens(job, name), expert_matmul_flops(job, name)
    if not rows or tokens is None:
        return None
    on_sampler = name in ("prefill", "decode_step") and not job.serving.is_trainer_layout
    mesh = job.serving.mesh if on_sampler else job.mesh
    expert = dict(mesh.shape).get("expert", 1)
    shards = parallel.batch_shards(mesh)
    routed = expert * tokens[0] / shards * config.num_experts_per_tok
    factor = rows / routed
    extra = (factor - 1) * flops if expert == 1 and factor > 1.01 else 0.0
    return {"expert_rows": rows, "routed_rows": routed, "factor": factor, "extra_flops": extra}


# -- memory --------------------------------------------------------------------------------


def routed_names(config: models.ModelConfig) -> frozenset[str]:
    """Names of the routed experts' parameters (``expert_w_*``, ``expert_b_*``): the leaves
    with an ``expert`` axis that is not their last (the router's ``[L, D, E]`` and its bias
    end in it)."""
    flat = jax.tree_util.tree_flatten_with_path(
        models.logical_axes(config), is_leaf=parallel.is_logical_axes
    )[0]
    return frozenset(
        str(path[-1].key)
        for path, axes in flat
        if "expert" in axes and axes.index("expert") < len(axes) - 1
    )


def routed_bytes(tree: Any, names: frozenset[str]) -> int:
    """Bytes a chip holds of the leaves of ``tree`` (abstract, with shardings) named in
    ``names`` (a leaf is named by its last dict key: ``opt_state``'s moments too)."""
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [getattr(k, "key", None) for k in path]
        if any(k in names for k in keys if isinstance(k, str)):
            sharding = getattr(leaf, "sharding", None)
            shape = tuple(leaf.shape)
            shape = shape if sharding is None else sharding.shard_shape(shape)
            total += math.prod(shape) * leaf.dtype.itemsize
    return total


def expert_memory(job) -> dict[str, Any]:
    """Per-chip bytes of the routed experts in each resident part (``memory_bytes``:
    ``parameters, optimizer_state, reference, frozen_base, sampler_weights``) and in the
    update's transients (their ``gradient_bytes``, one layer's local experts gathered over
    fsdp: ``gathered_layer_bytes``), from the job's abstract state and layouts."""
    config, state, mesh = job.model_config, job.train_state, job.mesh
    names = routed_names(config)
    c = jnp.dtype(config.compute_dtype)
    lora = config.lora is not None
    params = 0 if state is None or lora else routed_bytes(state.params, names)
    parts = {
        "parameters": params,
        "optimizer_state": 0 if state is None or lora else routed_bytes(state.opt_state, names),
        "reference": routed_bytes(job.reference_params, names),
        "frozen_base": 0,
        "sampler_weights": 0,
    }
    trainer = parallel.logical_to_sharding(
        models.logical_axes(config),
        mesh,
        parallel.PARAM_RULES,
        shapes=models.param_shapes(config),
    )
    in_compute = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, c, sharding=sh),
        models.param_shapes(config),
        trainer,
    )
    if lora:  # the experts are in the frozen base, in the compute dtype
        parts["frozen_base"] = routed_bytes(in_compute, names)
    layout = job.serving
    if layout is not None and job.split is None:
        if not layout.is_trainer_layout:  # the serving copy: every expert, tensor-split
            served = jax.tree.map(
                lambda s, sh: jax.ShapeDtypeStruct(s.shape, c, sharding=sh),
                models.param_shapes(config),
                layout.shardings,
            )
            parts["sampler_weights"] = routed_bytes(served, names)
        elif job.state.params_compute:  # the decode loop's compute-dtype copy
            parts["sampler_weights"] = routed_bytes(in_compute, names)
    resident = sum(v for k, v in parts.items() if k != "sampler_weights")
    sizes = dict(mesh.shape)
    total = job.state.resident
    return {
        "memory_bytes": parts,
        "resident_bytes": resident,
        "share_of_resident": resident / total if total else 0.0,
        # Transient in the update: the experts' gradients (the masters' dtype) and one layer's
        # local experts gathered over fsdp in the compute dtype.
        "gradient_bytes": params,
        "gathered_layer_bytes": gathered_layer_bytes(
            config, sizes.get("expert", 1), sizes["tensor"], c.itemsize
        ),
    }


# -- the report ----------------------------------------------------------------------------


def _expected(job, name: str, program: Mapping[str, Any]) -> dict[str, float] | None:
    """The formula's exchange of a policy program on the trainer's mesh (None: packed, or a
    program the formula does not cover)."""
    shape, sizes = job.shape, dict(job.mesh.shape)
    if program.get("packing") is not None:
        return None
    if name == "update" and (job.aux is None or not job.aux.joint):
        rows, calls, training = shape.minibatch_rows, shape.micro_batches, True
    elif name in _FORWARDS:
        rows, calls, training = shape.rows, forward_calls(job), False
    else:
        return None
    return expected_exchange(
        job.model_config,
        rows=rows,
        seq=shape.seq_len,
        calls=calls,
        shards=parallel.batch_shards(job.mesh),
        expert=sizes.get("expert", 1),
        training=training,
        remat=shape.remat,
        itemsize=jnp.dtype(job.model_config.compute_dtype).itemsize,
        link_bandwidth=job.spec.ici_bandwidth_bytes_per_s_per_link,
    )


def moe_report(job, programs: Mapping[str, dict]) -> dict[str, Any] | None:
    """The report's ``moe`` entry (None for a dense model): the experts, the mesh's expert
    axis, total and active parameters, the experts' memory per chip, each program's expert
    all-to-all (bytes, ICI seconds, the formula's bytes) and the whole-expert gather check."""
    config = job.model_config
    if not is_moe(config):
        return None
    sizes = dict(job.mesh.shape)
    expert = sizes.get("expert", 1)
    exchanges, gathers, replicated, unchecked = {}, [], {}, []
    for name, p in programs.items():
        moe = p.get("moe")
        if moe is None:
            if name in ("update", *_FORWARDS) and not p.get("shares_compile_of"):
                unchecked.append(name)  # not compiled: no HLO to read
            continue
        if moe.get("replication"):
            replicated[name] = {**moe["replication"], "calls_per_step": p["calls_per_step"]}
        a2a = moe["expert_all_to_all"]
        expected = _expected(job, name, p)
        exchanges[name] = {
            **a2a,
            "calls_per_step": p["calls_per_step"],
            "ici_s_per_step": a2a["ici_s"] * p["calls_per_step"],
            "share_of_ici": a2a["ici_s"] / p["times"]["ici_s"] if p["times"]["ici_s"] else 0.0,
            "expected_bytes": None if expected is None else expected["bytes"],
        }
        for gather in moe["whole_expert_gathers"] or ():
            gathers.append({"program": name, **gather})
    memory = expert_memory(job)
    return {
        "experts": config.num_experts,
        "experts_per_token": config.num_experts_per_tok,
        "expert_axis": expert,
        "experts_per_chip": config.num_experts // expert,
        # The experts' [E, D, F] split: E over expert, D over fsdp, F over tensor.
        "expert_weight_shards": {
            "expert": expert,
            "fsdp": sizes["fsdp"],
            "tensor": sizes["tensor"],
        },
        "params": models.param_count(config),
        "active_params": flops_lib.active_param_count(config),
        "routed_expert_params": flops_lib.routed_expert_params(config),
        **memory,
        "all_to_all": exchanges,
        "all_to_all_s_per_step": sum(e["ici_s_per_step"] for e in exchanges.values()),
        # Rows sent per real row: the dense exchange's C = T_l k slots to each of P shards.
        "all_to_all_padding": expert,
        "gathers_every_expert": bool(gathers),
        "whole_expert_gathers": gathers,
        "gathers_unchecked": unchecked,
        # The grouped expert matmuls' rows as compiled against a chip's own routed tokens
        # (``replication``); extra_flops: other chips' tokens, in the compute times.
        "replication": replicated,
        "replicated_expert_flops_per_step": sum(
            r["extra_flops"] * r["calls_per_step"] for r in replicated.values()
        ),
    }


# -- advice --------------------------------------------------------------------------------


def _fmt(nbytes: float) -> str:
    return f"{nbytes / GiB:.3g} GiB"


def _transients(job, expert: int, tokens_per_chip: float) -> float:
    """Modelled MoE transients of one layer on a chip with ``mesh.expert=expert``: the local
    experts gathered over fsdp (none when fsdp is 1) and three buffers of the rows its grouped
    matmuls take (sorted rows, their outputs, the combine): ``P T_l k`` rows of ``D`` with an
    expert axis (the exchange's padded ``[P, C, D]``), ``s T_l k`` without one on ``s`` batch
    shards (every chip sorts the whole batch: ``replication``)."""
    config, sizes = job.model_config, _with_expert(dict(job.mesh.shape), expert)
    c = jnp.dtype(config.compute_dtype).itemsize
    gathered = gathered_layer_bytes(config, expert, sizes["tensor"], c) if sizes["fsdp"] > 1 else 0
    shards = math.prod(sizes.values()) // sizes["tensor"]
    rows = (expert if expert > 1 else shards) * tokens_per_chip * config.num_experts_per_tok
    return gathered + 3 * rows * config.hidden_size * c


def moe_suggestions(job, programs: Mapping[str, dict]) -> list[str]:
    """What shrinks a mixture of experts' programs that are over: ``mesh.expert`` where the
    modelled per-layer MoE transients (``_transients``) are least at another allowed size,
    and for a log-prob forward over the whole batch a token budget
    (``trainer.micro_batch_tokens``: one row a chip at a time), since a forward's transients
    grow with the tokens a chip routes at once."""
    config, shape = job.model_config, job.shape
    if not is_moe(config) or job.split is not None:
        return []
    sizes = dict(job.mesh.shape)
    now = sizes.get("expert", 1)
    usable = job.spec.usable_hbm_bytes_per_chip
    shards = parallel.batch_shards(job.mesh)
    allowed = expert_axis_sizes(config, sizes, list(job.mesh.devices.flat))
    out = []
    for name in ("update", *_FORWARDS):
        p = programs.get(name)
        if p is None or (p["fits"] and p["compiled"]):
            continue
        if name == "update":
            rows, calls = shape.minibatch_rows, shape.micro_batches
        else:
            rows, calls = shape.rows, forward_calls(job)
        tokens = rows * shape.seq_len / (calls * shards)
        model = {q: _transients(job, q, tokens) for q in allowed}
        best = min(model, key=model.get)
        over = f"{name} is over ({p['total_gib']:.2f} of {usable / GiB:.2f} GiB)"
        budget = any(line.startswith("trainer.micro_batch_tokens") for line in out)
        if name != "update" and tokens > shape.seq_len and not budget:
            one_row = _transients(job, now, shape.seq_len)
            out.append(
                f"trainer.micro_batch_tokens={shape.seq_len}: {over}; the log-prob forwards "
                f"then run one row a chip at a time, and their modelled per-layer MoE "
                f"transients go from {_fmt(model[now])} to {_fmt(one_row)} a chip (the "
                "grouped matmuls' rows and the exchange's buffers grow with the tokens a chip "
                "routes at once)"
            )
        named = any(line.startswith("mesh.expert") for line in out)
        if best == now or model[best] >= model.get(now, math.inf) or named:
            continue
        if now == 1 and shards > 1:
            why = (
                f"without an expert axis every chip sorts and runs the whole batch's tokens "
                f"through the experts ({shards}x its own)"
            )
        elif best > now:
            why = f"fewer experts gathered a layer ({config.num_experts // best} a chip)"
        else:
            why = (
                "smaller exchange buffers (P x the rows a chip routes: models.moe's dense exchange)"
            )
        out.append(
            f"mesh.expert={best} (mesh.fsdp=-1; now {now}): {over}; its per-layer MoE "
            f"transients (local experts gathered over fsdp, three buffers of the rows the "
            f"grouped matmuls take; modelled) go from {_fmt(model[now])} to {_fmt(model[best])} "
            f"a chip: {why}"
        )
    return out


def moe_hints(job, programs: Mapping[str, dict]) -> list[str]:
    """``mesh.expert`` for an update that is ICI-bound, or that runs other chips' tokens
    through the experts (no expert axis: ``replication``).

    Each allowed size ``P`` is modelled as ``max(compute(P), ICI(P))``: ``ICI(P)`` the
    update's compiled collectives less today's modelled MoE traffic plus ``P``'s
    (``update_expert_traffic``), ``compute(P)`` the analytic compute, plus, without an expert
    axis on ``s > 1`` batch shards, ``s - 1`` times the experts' matmuls (every chip does the
    whole batch's). A size whose modelled time is 10% or more below today's is named."""
    config, shape = job.model_config, job.shape
    update = programs.get("update")
    if not is_moe(config) or update is None or not update["compiled"] or job.split is not None:
        return []
    if _joint(job) or update.get("moe") is None:
        return []
    times, rep = update["times"], update["moe"].get("replication") or {}
    extra = rep.get("extra_flops", 0.0)
    if times["bound"] != "ici" and not extra:
        return []
    sizes = dict(job.mesh.shape)
    now, chips = sizes.get("expert", 1), job.mesh.size
    peak = chips * job.spec.peak_bf16_flops_per_chip
    c = jnp.dtype(config.compute_dtype).itemsize
    link = job.spec.ici_bandwidth_bytes_per_s_per_link
    traffic = {
        q: update_expert_traffic(
            config,
            rows=shape.minibatch_rows,
            seq=shape.seq_len,
            micro_batches=shape.micro_batches,
            mesh_sizes=_with_expert(sizes, q),
            remat=shape.remat,
            itemsize=c,
            link_bandwidth=link,
        )["total_s"]
        for q in expert_axis_sizes(config, sizes, list(job.mesh.devices.flat))
    }
    shards = chips // sizes["tensor"]
    base = times["compute_s"] - extra / peak
    replicated = (shards - 1) * (expert_matmul_flops(job, "update") or 0.0) / peak
    rest = max(times["ici_s"] - traffic.get(now, 0.0), 0.0)
    compute = {q: base + (replicated if q == 1 else 0.0) for q in traffic}
    ici = {q: rest + t for q, t in traffic.items()}
    step = {q: max(compute[q], ici[q], times["hbm_s"] or 0.0) for q in traffic}
    best = min(step, key=step.get)
    table = ", ".join(
        f"{q}: {compute[q]:.3g} s compute / {ici[q]:.3g} s ICI" for q in sorted(traffic)
    )
    why = (
        f"without an expert axis every chip runs the experts on the whole batch's tokens "
        f"({rep['factor']:.0f}x its own: {extra / peak:.3g} s of its {times['compute_s']:.3g} s "
        "of compute)"
        if extra
        else f"the update is ICI-bound ({times['ici_s']:.3g} s of collectives against "
        f"{times['compute_s']:.3g} s of compute)"
    )
    if best != now and step[best] <= 0.9 * step[now]:
        after = "compute-bound" if compute[best] >= ici[best] else "ICI-bound"
        return [
            f"mesh.expert={best} (mesh.fsdp=-1; now {now}): {why}; modelled per mesh.expert "
            f"(the experts' all-to-all, padded P-fold by models.moe's dense exchange, and the "
            f"FSDP gathers of E / P experts a layer): {table}; about {step[best]:.3g} s an "
            f"update with mesh.expert={best}, {after}. Plan it to see."
        ]
    a2a = update["moe"]["expert_all_to_all"]["ici_s"]
    if a2a >= 0.5 * times["ici_s"]:
        instead = (
            f"more chips (fewer tokens a chip to exchange; each exchange moves {now}x the rows "
            "a chip routes, models.moe's dense all-to-all)"
        )
    else:
        instead = (
            "fewer trainer.micro_batches (fewer gathers of the experts' weights) or more chips"
        )
    return [
        f"{why}, {a2a:.3g} s of it the experts' all-to-all; no mesh.expert does much better by "
        f"the model ({table}): {instead}"
    ]


def moe_lines(moe: Mapping[str, Any]) -> list[str]:
    """The text report's lines of the ``moe`` entry."""
    mem = moe["memory_bytes"]
    shards = moe["expert_weight_shards"]
    lines = [
        f"MoE: {moe['experts']} experts, {moe['experts_per_token']} a token; "
        f"{moe['params'] / 1e9:.2f} B parameters, {moe['active_params'] / 1e9:.2f} B active "
        f"(FLOPs, MFU and goodput count the active ones); mesh.expert {moe['expert_axis']}: "
        f"{moe['experts_per_chip']} experts a chip, [E, D, F] split over expert {shards['expert']}"
        f" x fsdp {shards['fsdp']} x tensor {shards['tensor']}",
        f"  experts' share of a chip: params {_fmt(mem['parameters'])}, optim "
        f"{_fmt(mem['optimizer_state'])}, ref {_fmt(mem['reference'])}"
        + (f", base {_fmt(mem['frozen_base'])}" if mem["frozen_base"] else "")
        + f" ({moe['share_of_resident']:.0%} of the resident state), sampler "
        f"{_fmt(mem['sampler_weights'])}; in the update: gradients "
        f"{_fmt(moe['gradient_bytes'])}, one layer's local experts gathered "
        f"{_fmt(moe['gathered_layer_bytes'])}",
    ]
    moved = [
        f"{name} {a['bytes'] / GiB:,.1f} GiB in {a['exchanges']:,} exchanges, "
        f"{a['ici_s'] * 1e3:,.1f} ms ({a['share_of_ici']:.0%} of its ICI) x {a['calls_per_step']}"
        for name, a in moe["all_to_all"].items()
        if a["bytes"]
    ]
    if moved:
        lines.append(
            "  expert all-to-all a call (ICI): "
            + "; ".join(moved)
            + f"; {moe['all_to_all_s_per_step']:.3g} s a step, the rows padded "
            f"{moe['all_to_all_padding']}x (models.moe's dense exchange)"
        )
    else:
        lines.append("  expert all-to-all: none (no expert axis: every chip runs every expert)")
    extra = {n: r for n, r in moe["replication"].items() if r["extra_flops"]}
    if extra:
        lines.append(
            "  every chip runs the experts on other chips' tokens (a mesh without an expert "
            "axis, the sampler's serving layout included: the MoE layer sorts the whole "
            "batch by expert): "
            + ", ".join(f"{n} {r['factor']:.0f}x its own rows" for n, r in extra.items())
            + f"; {moe['replicated_expert_flops_per_step']:.3g} FLOPs a step beyond the "
            "analytic count, added to the compute times"
        )
    if moe["gathers_unchecked"]:
        lines.append(
            f"  whole-expert gathers not checked in {', '.join(moe['gathers_unchecked'])} "
            "(not compiled)"
        )
    if moe["gathers_every_expert"]:
        where = sorted({g["program"] for g in moe["whole_expert_gathers"]})
        g = max(moe["whole_expert_gathers"], key=lambda g: g["bytes"])
        note = (
            "FSDP without an expert axis"
            if moe["expert_axis"] == 1
            else "WARNING: the expert axis should keep them split"
        )
        lines.append(
            f"  all {moe['experts']} experts gathered on every chip in {', '.join(where)} "
            f"(e.g. {g['shape']}, {_fmt(g['bytes'])} x {g['multiplier']}): {note}"
        )
    elif shards["fsdp"] > 1:
        checked = " compiled" if moe["gathers_unchecked"] else ""
        lines.append(
            f"  no{checked} program gathers every expert on a chip (each gathers its "
            f"{moe['experts_per_chip']} over fsdp)"
        )
    else:
        lines.append("  no program gathers the experts (fsdp 1: each chip's are whole)")
    return lines


__all__ = [
    "EXCHANGE_PRIMITIVES",
    "exchange_bytes",
    "exchange_summary",
    "exchanges_per_layer",
    "expected_exchange",
    "expert_matmul_flops",
    "expert_rows",
    "expert_axis_sizes",
    "expert_memory",
    "gathered_layer_bytes",
    "is_expert_exchange",
    "is_moe",
    "moe_hints",
    "moe_lines",
    "moe_report",
    "moe_suggestions",
    "program_moe",
    "replication",
    "routed_bytes",
    "routed_names",
    "update_expert_traffic",
    "whole_expert_gathers",
]
