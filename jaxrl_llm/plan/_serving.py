"""The rollout's programs in a plan: the reshard into the sampler's serving layout, the
prefill and one decode step on it (``jaxrl_llm.sampling.serving``), as ``train`` runs them."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl_llm import parallel
from jaxrl_llm.models import lora
from jaxrl_llm.plan import flops as flops_lib
from jaxrl_llm.plan._engine import (
    abstract_key,
    abstract_sampling_params,
    engine_shape,
    lower_engine_programs,
)
from jaxrl_llm.plan._job import (
    Lowering,
    Program,
    _replicated,
    abstract_sequences,
    shard_bytes,
    with_shardings,
)
from jaxrl_llm.plan._lora import policy, reshard_programs, serving_trees
from jaxrl_llm.plan._routing import records_routing
from jaxrl_llm.plan._split import lower_split_programs
from jaxrl_llm.sampling import serving, strategies
from jaxrl_llm.sampling.generate import decode_program, prefill_program
from jaxrl_llm.sampling.state import state_logical_axes
from jaxrl_llm.train import adapters
from jaxrl_llm.train.rl.serving import rollout_layout

PyTree = Any


def choose_layout(cfg, model_config, mesh, shape, spec, sizes) -> serving.ServingLayout:
    """The layout ``train`` would pick (``train.rl.serving.trainer_sampler``), with the chip's
    usable HBM less the resident state (``sizes.resident``) as the free memory."""
    budget = spec.usable_hbm_bytes_per_chip - sizes.resident
    return rollout_layout(cfg, model_config, mesh, kv_slots=shape.seq_len, budget_bytes=budget)


def roofline_mesh(job) -> Any:
    """The mesh of the decode roofline: the sampler's serving layout, or the one ``auto``
    would choose when the job decodes on the trainer's layout (the floor it forgoes)."""
    if not job.serving.is_trainer_layout or dict(job.mesh.shape)["fsdp"] == 1:
        return job.serving.mesh
    auto = dataclasses.replace(job.cfg.rollout, tensor_parallel="auto")
    cfg = dataclasses.replace(job.cfg, rollout=auto)
    return choose_layout(cfg, job.model_config, job.mesh, job.shape, job.spec, job.state).mesh


def lower_sampler_programs(
    programs: dict[str, Program],
    low: Lowering,
    ref_bytes: dict[str, int],
    decode_hbm_bytes: Any,
) -> None:
    """Adds ``reshard`` (unless the sampler runs on the trainer's layout), ``prefill`` and
    ``decode_step`` to ``programs``; for a LoRA job (``frozen``: its base) the sampler decodes
    the base with the adapters applied on the fly, ``reshard`` moves the adapters only and
    ``reshard_base`` (once a run) the base.

    ``rollout.engine=continuous``: the engine's refill prefill and decode loop instead
    (``plan._engine``).

    ``decode_hbm_bytes(mesh, rows, kv_len)``: the analytic HBM bytes of one decode step on the
    trainer's layout (its weight gathers are not in the loop body XLA:TPU emits for small
    meshes); on a serving layout they are read off the HLO of one loop trip. ``free_bytes``: the
    chip's usable HBM less the resident state, where ``model.lora.sampler=auto`` checks that a
    merged copy fits (as ``train`` checks the devices' free memory). ``split``
    (``plan._split.Split``): the sampler on chips of its own, where it holds nothing else.
    """
    cfg, mesh, model_config, shape = low.cfg, low.mesh, low.model_config, low.shape
    state, sizes, layout, frozen, split = low.state, low.sizes, low.layout, low.frozen, low.split
    free_bytes = low.sampler_free
    r = cfg.rollout
    p_len, t_len, rows = shape.prompt_len, shape.completion_len, shape.rows
    resident = {"optimizer_state": sizes.optimizer, **ref_bytes}
    if split is not None:  # the sampler's own chips: its weights, cache and temporaries only
        smesh, hbm, inner = layout.mesh, None, {}
        params, served = lower_split_programs(
            programs, cfg, model_config, state, sizes, layout, mesh, split, resident
        )
        weights_arg, resident = {"sampler_weights": served}, {}
    elif layout.is_trainer_layout:
        smesh, params = mesh, policy(state.params, frozen)
        weights_arg = {"parameters": sizes.params}
        if frozen is not None:
            weights_arg["frozen_base"] = sizes.base
        inner = {"sampler_weights": sizes.params_compute}
        hbm = decode_hbm_bytes(mesh, rows, shape.seq_len)
    else:
        smesh = layout.mesh
        # The trainer's parameters (and a LoRA run's base) stay where they are while the
        # sampler holds its copy.
        resident = {"parameters": sizes.params, "frozen_base": sizes.base, **resident}
        inner = {}
        hbm = None
        if frozen is None:
            compute = jnp.dtype(model_config.compute_dtype)
            params = jax.tree.map(
                lambda p, s: jax.ShapeDtypeStruct(
                    p.shape,
                    compute if jnp.issubdtype(p.dtype, jnp.floating) else p.dtype,
                    sharding=s,
                ),
                state.params,
                layout.shardings,
            )
            served = shard_bytes(params)
            programs["reshard"] = Program(
                name="reshard",
                lowered=serving.make_reshard(model_config, layout).lower(state.params),
                calls_per_step=1,
                flops=0.0,
                model_flops=0.0,
                tokens=0,
                argument_parts={"parameters": sizes.params},
                resident={"optimizer_state": sizes.optimizer, **ref_bytes},
                inner_parts={"sampler_weights": served},
            )
        else:  # LoRA: the base's copy made once a run, the adapters' each step
            base_served, adapters_served = serving_trees(model_config, layout)
            params = lora.combine(base_served, adapters_served)
            programs["reshard"], programs["reshard_base"], adapter_bytes = reshard_programs(
                model_config,
                layout,
                state,
                frozen,
                sizes,
                {"optimizer_state": sizes.optimizer, **ref_bytes},
            )
            served = sizes.serving_base + adapter_bytes
        weights_arg = {"sampler_weights": served}

    if frozen is not None and adapters.merged_sampler(cfg, model_config, layout, free_bytes):
        model_config, params, merged = _merge_program(
            programs, model_config, params, weights_arg, resident
        )
        weights_arg = {
            **weights_arg,
            "sampler_weights": weights_arg.get("sampler_weights", 0) + merged,
        }
        inner = {}  # the merged copy is in the compute dtype already

    cache_dtype = jnp.dtype(model_config.compute_dtype)
    top_k = strategies.check_sampling_args(
        temperature=1.0,
        top_k=strategies.effective_top_k(r.top_k, r.temperature),
        top_p=1.0,
        min_p=0.0,
        vocab_size=model_config.vocab_size,
    )
    key = abstract_key(smesh)
    if r.engine == "continuous":
        engine = engine_shape(cfg, shape, smesh)
        lower_engine_programs(
            programs,
            cfg,
            model_config,
            params,
            smesh,
            shape,
            top_k=top_k,
            weights_arg=weights_arg,
            resident=resident,
            inner=inner,
            hbm=None if hbm is None else decode_hbm_bytes(mesh, engine.slots, engine.width),
            record_routing=records_routing(cfg),
        )
        return
    prompts = abstract_sequences(smesh, shape.prompts, p_len, 1)
    pad_id = _replicated(smesh, (), jnp.int32)
    prefill_kwargs = dict(
        config=model_config,
        max_new_tokens=t_len,
        num_samples=shape.group_size,
        cache_dtype=cache_dtype,
        mesh=smesh,
    )
    if records_routing(cfg):  # the state carries the routing buffer the decode loop fills
        prefill_kwargs["record_routing"] = True
    prefill_flops = flops_lib.forward_flops(
        model_config, shape.prompts, p_len, kv_len=p_len, logits_positions=1
    )
    with jax.set_mesh(smesh):
        prefill_args = (params, prompts.prompt_tokens, prompts.prompt_mask, pad_id)
        sampling_state = jax.eval_shape(
            lambda *a: prefill_program(*a, **prefill_kwargs), *prefill_args
        )
        sampling_state = with_shardings(
            sampling_state, _sampling_state_shardings(sampling_state, smesh)
        )
        cache = shard_bytes(sampling_state.cache)
        # The recorded routing's buffer (``model.routing_replay``), in the state it returns.
        routing = 0 if sampling_state.routing is None else shard_bytes(sampling_state.routing)
        programs["prefill"] = Program(
            name="prefill",
            lowered=prefill_program.lower(*prefill_args, **prefill_kwargs),
            calls_per_step=1,
            flops=prefill_flops,
            model_flops=prefill_flops,
            tokens=shape.prompts * p_len,
            argument_parts=weights_arg,
            resident=resident,
            inner_parts={**inner, "kv_cache": cache},
            routing_bytes=routing,
        )
        # The decode loop itself (``decode_program``, as ``generate`` calls it on TPU: layers
        # stacked, or per layer with ``rollout.decode_layers=per_layer``); its loop body is one
        # decode step.
        decode_args = (params, sampling_state, key, abstract_sampling_params(smesh))
        unroll = r.decode_layers == "per_layer"  # ``auto`` keeps the scan on accelerators
        decode_kwargs = dict(config=model_config, top_k=top_k, mesh=smesh, unroll=unroll)
        decode = flops_lib.decode_flops(model_config, rows, shape.seq_len)
        programs["decode_step"] = Program(
            name="decode_step",
            lowered=decode_program.lower(*decode_args, **decode_kwargs),
            calls_per_step=t_len,
            flops=decode,
            model_flops=decode,
            tokens=rows,
            argument_parts={**weights_arg, "kv_cache": cache},
            resident=resident,
            inner_parts=inner,
            hbm_bytes=hbm,
            per_step_loop=True,
            routing_bytes=routing,
        )


def _merge_program(
    programs, model_config, params, weights_arg, resident
) -> tuple[Any, PyTree, int]:
    """``model.lora.sampler`` merged (``RLTrainer.merge_sampler``): once a step the adapters
    are merged into a copy of the targeted base weights (``adapters.merge_program``), and the
    sampler decodes the base model on it. Adds ``merge``; returns the sampler's config, its
    parameters and the merged copy's bytes a chip."""
    base, trained = lora.split(params)
    shardings = jax.tree.map(lambda x: x.sharding, base)
    targeted = {lora.LORA_WEIGHTS[t][0] for t in model_config.lora.targets}
    merged = shard_bytes({k: v for k, v in base["layers"].items() if k in targeted})
    flops = 2.0 * model_config.lora.rank * sum(math.prod(base["layers"][k].shape) for k in targeted)
    programs["merge"] = Program(
        name="merge",
        lowered=adapters.merge_program(model_config, shardings).lower(base, trained),
        calls_per_step=1,
        flops=flops,
        model_flops=0.0,
        tokens=0,
        argument_parts=weights_arg,
        resident=resident,
        inner_parts={"sampler_weights": merged},
    )
    return lora.base_config(model_config), base, merged


def _sampling_state_shardings(state: PyTree, mesh: Mesh) -> PyTree:
    return parallel.logical_to_sharding(
        state_logical_axes(state), mesh, parallel.SAMPLING_RULES, shapes=state
    )
