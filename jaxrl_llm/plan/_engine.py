"""The continuous engine's programs in a plan (``rollout.engine=continuous``): its refill
(``sampling.slots.refill``) and its decode loop (``sampling.slots.burst``) over
``rollout.slots`` slots and their KV cache — a contiguous one, or the paged pool of
``rollout.kv_blocks`` blocks of ``rollout.kv_block_size`` slots — as ``train`` runs them.

The plan counts the worst case: every completion runs to ``rollout.max_new_tokens``, so each
wave of ``slots`` rows is one refill and ``max_new_tokens`` decode steps, and a step of the RL
job runs ``ceil(rows / slots)`` waves (long-tailed lengths finish sooner; the engine's
``EngineStats`` report what a run did).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl_llm import parallel
from jaxrl_llm.plan import flops as flops_lib
from jaxrl_llm.plan._job import PlanError, Program, _replicated, _rows, shard_bytes, with_shardings
from jaxrl_llm.sampling import slots as slots_lib
from jaxrl_llm.sampling.admission import Admission, pow2
from jaxrl_llm.sampling.paging import blocks_for, paged_pool
from jaxrl_llm.sampling.state import SamplingParams

PyTree = Any


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """What the continuous engine decodes: ``slots`` rows over ``width`` cache slots each
    (a paged pool's rows round up to whole blocks), ``waves`` of them per RL step."""

    slots: int
    width: int
    waves: int
    paged: tuple[int, int] | None  # (blocks, block_size)


def engine_shape(cfg, shape, mesh) -> EngineShape:
    """The engine ``train`` builds for one draw (``train.rl.rollout._continuous``).

    Raises:
      PlanError: slots the mesh's batch shards do not divide, a bad paged pool, or
        ``rollout.decode_layers=per_layer`` (the engine's per-layer layout is not planned).
    """
    r = cfg.rollout
    if r.decode_layers == "per_layer":
        raise PlanError(
            "rollout.decode_layers=per_layer with rollout.engine=continuous is not planned yet"
        )
    slots = min(r.slots or shape.rows, shape.rows)
    shards = parallel.batch_shards(mesh)
    if slots % shards:
        raise PlanError(
            f"rollout.slots={slots} must be a multiple of the sampler mesh's {shards} batch "
            "shards (data x fsdp)"
        )
    try:
        paged = paged_pool(
            r.kv_block_size or None, r.kv_blocks, slots, shape.prompt_len, shape.completion_len
        )
    except ValueError as err:
        raise PlanError(str(err)) from None
    width = shape.prompt_len + shape.completion_len
    if paged is not None:
        width = blocks_for(width, paged[1]) * paged[1]
        if paged[0] % shards:
            raise PlanError(
                f"rollout.kv_blocks={paged[0]} must be a multiple of the sampler mesh's "
                f"{shards} batch shards (each shard's slots take blocks of its own)"
            )
    return EngineShape(slots, width, math.ceil(shape.rows / slots), paged)


# Slots of SamplingParams.eos_ids the sampler pads to (sampling.state pads to >= 4).
_EOS_SLOTS = 4


def abstract_key(mesh: Mesh) -> Any:
    """A typed PRNG key replicated over ``mesh`` (the sampler's draw key)."""
    return _replicated(mesh, (), jax.eval_shape(lambda: jax.random.key(0)).dtype)


def abstract_sampling_params(mesh: Mesh) -> SamplingParams:
    """The sampler's traced ``SamplingParams`` (temperature, top-p, min-p, stop and pad ids),
    replicated over ``mesh``."""
    scalar = lambda dtype: _replicated(mesh, (), dtype)  # noqa: E731
    return SamplingParams(
        temperature=scalar(jnp.float32),
        top_p=scalar(jnp.float32),
        min_p=scalar(jnp.float32),
        eos_ids=_replicated(mesh, (_EOS_SLOTS,), jnp.int32),
        pad_id=scalar(jnp.int32),
    )


# The engine's refill (``slots.refill``: prefill, then admit) as one program (the plan's memory
# counts both at once: an upper bound).
_refill = jax.jit(
    slots_lib.refill, static_argnames=("config", "prompt_width", "mesh"), donate_argnames="state"
)


def lower_engine_programs(
    programs: dict[str, Program],
    cfg,
    model_config,
    params: PyTree,
    smesh,
    shape,
    *,
    top_k: int,
    weights_arg: dict[str, int],
    resident: dict[str, int],
    inner: dict[str, int],
    hbm: float | None,
    record_routing: bool = False,
) -> None:
    """Adds the engine's ``prefill`` (one refill of every slot) and ``decode_step`` (its
    decode loop, one step a trip) to ``programs``; ``record_routing``: the slots' state
    carries the routing buffer (``model.routing_replay``, ``Engine(record_routing=True)``)."""
    key, sampling = abstract_key(smesh), abstract_sampling_params(smesh)
    eng = engine_shape(cfg, shape, smesh)
    p_len, t_len, group = shape.prompt_len, shape.completion_len, shape.group_size
    shards = parallel.batch_shards(smesh)
    cache_dtype = jnp.dtype(model_config.compute_dtype)
    with jax.set_mesh(smesh):
        state = jax.eval_shape(
            lambda: slots_lib.init_state(
                model_config,
                slots=eng.slots,
                prompt_width=p_len,
                max_new_tokens=t_len,
                cache_dtype=cache_dtype,
                pad_id=0,
                unstacked=False,
                paged=eng.paged,
                record_routing=record_routing,
            )
        )
        state = with_shardings(state, slots_lib.shardings(state, smesh))
        cache = shard_bytes(state.cache)
        routing = 0 if state.routing is None else shard_bytes(state.routing)
        # A refill of every slot: the G samples of a prompt share its prefill row.
        prompts = shards * pow2(-(-math.ceil(eng.slots / group) // shards))
        admitted = pow2(eng.slots)
        index = _replicated(smesh, (admitted,), jnp.int32)
        table = paged = None
        if eng.paged is not None:
            table = _replicated(smesh, (eng.slots, eng.width // eng.paged[1]), jnp.int32)
            paged = (index, _replicated(smesh, (admitted, eng.width // eng.paged[1]), jnp.int32))
        # Each admitted request's holder slot and prompt length: the engine always passes
        # them (a prompt a live slot holds is copied from it, not prefilled again).
        admitted_arrays = Admission(
            _rows(smesh, (prompts, p_len), jnp.int32),
            _rows(smesh, (prompts, p_len), jnp.bool_),
            owner=index,
            slot=index,
            limit=index,
            request=index,
            source=index,
            length=index,
            table=table,
            dest=paged,
        )
        prefill_flops = flops_lib.forward_flops(
            model_config, prompts, p_len, kv_len=p_len, logits_positions=1
        )
        programs["prefill"] = Program(
            name="prefill",
            lowered=_refill.lower(
                params,
                state,
                admitted_arrays,
                _replicated(smesh, (), jnp.int32),
                config=model_config,
                prompt_width=p_len,
                mesh=smesh,
            ),
            calls_per_step=eng.waves,
            flops=prefill_flops,
            model_flops=prefill_flops,
            tokens=prompts * p_len,
            argument_parts={**weights_arg, "kv_cache": cache},
            resident=resident,
            inner_parts=inner,
            routing_bytes=routing,
        )
        burst_args = (
            params,
            state,
            _replicated(smesh, (), jnp.int32),
            key,
            sampling,
            _replicated(smesh, (1, 1), jnp.int32),  # no stop sequences
            table,
        )
        decode = flops_lib.decode_flops(model_config, eng.slots, eng.width)
        programs["decode_step"] = Program(
            name="decode_step",
            lowered=slots_lib.burst.lower(
                *burst_args, config=model_config, top_k=top_k, mesh=smesh
            ),
            calls_per_step=eng.waves * t_len,
            flops=decode,
            model_flops=decode,
            tokens=eng.slots,
            argument_parts={**weights_arg, "kv_cache": cache},
            resident=resident,
            inner_parts=inner,
            routing_bytes=routing,
            hbm_bytes=hbm,
            per_step_loop=True,
        )
