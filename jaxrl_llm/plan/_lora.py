"""``plan`` for a LoRA job (``model.lora``), as ``train`` runs it (``train.adapters``).

A LoRA run keeps, per chip (``jaxrl_llm.train.adapters``, ``RLTrainer.setup``):

* the **adapters** as the train state's parameters (``layers/<w>_lora_a`` / ``_lora_b``, master
  weights in ``model.param_dtype``) with the optimizer state over them only (the
  ``parameters`` and ``optimizer_state`` parts);
* the **frozen base** (every weight of the model, in the compute dtype, sharded by the
  parameter rules; no gradient, no moments), a separate tree the update takes as its third
  argument (``jit_step(..., frozen=base)``) -- the ``frozen_base`` part. It is also the
  reference policy (adapters switched off, ``lora.base_config``): there is no reference copy;
* on a serving layout, the base's copy in the sampler's layout, made once per run and kept all
  run (``RLTrainer.serving_base``: resident ``sampler_weights`` in every program), beside which
  each RL step reshards only the adapters (``adapters.serving_reshards``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm import models
from jaxrl_llm.models import lora
from jaxrl_llm.plan import flops as flops_lib
from jaxrl_llm.plan._job import Program, shard_bytes
from jaxrl_llm.train import adapters
from jaxrl_llm.train.state import TrainState, abstract_train_state

PyTree = Any

ASSUMPTIONS = (
    "LoRA (model.lora): only the adapters are trained (f32 masters and AdamW moments); the "
    "frozen base is one tree in the compute dtype, also the reference policy (counted once); "
    "on a serving layout its sampler copy is made once per run and kept, and each RL step "
    "reshards only the adapters (the base's reshard, program reshard_base, runs once a run)",
    "LoRA FLOPs: the update does the base's forward and its activation gradients but no base "
    "weight gradients, plus the adapters' forward and backward (plan.flops.train_flops); MFU "
    "counts these without the remat recompute",
)


class Frozen(NamedTuple):
    """A LoRA job's frozen base: abstract leaves in the compute dtype on the trainer's layout
    (``base``) and their ``NamedSharding``s (``shardings``)."""

    base: PyTree
    shardings: PyTree


def abstract_lora_state(
    model_config: models.ModelConfig, optimizer, mesh, param_dtype
) -> tuple[TrainState, TrainState, Frozen]:
    """``(adapters' abstract state, its shardings, frozen base)`` as ``create_lora_state``
    builds them, shapes only (``jax.eval_shape``; nothing is allocated).

    The state's parameters are the adapters in ``param_dtype`` (``lora.init_adapters``), its
    optimizer state covers them only; the base is ``models.param_shapes`` less the adapters,
    every leaf in ``adapters.base_dtype`` (the compute dtype), sharded by the parameter rules
    (``adapters.shardings_of``).
    """
    base_shardings, _ = adapters.shardings_of(model_config, mesh)
    adapter_axes = lora.split(models.logical_axes(model_config))[1]
    state, shardings = abstract_train_state(
        model_config,
        optimizer,
        mesh=mesh,
        init_params=lambda key: lora.init_adapters(model_config, key, dtype=param_dtype),
        params_axes=adapter_axes,
    )
    dtype = adapters.base_dtype(model_config, param_dtype)
    base = jax.tree.map(
        lambda shape, sharding: jax.ShapeDtypeStruct(shape.shape, dtype, sharding=sharding),
        lora.split(models.param_shapes(model_config))[0],
        base_shardings,
    )
    return state, shardings, Frozen(base, base_shardings)


def policy(params: PyTree, frozen: Frozen | None) -> PyTree:
    """The policy's parameters (``RLTrainer.policy_params``): ``params``, or for LoRA the base
    with the adapters ``params`` added (no copy)."""
    return params if frozen is None else lora.combine(frozen.base, params)


def policy_shardings(shardings: PyTree, frozen: Frozen | None) -> PyTree:
    """``RLTrainer.policy_shardings``: the ``NamedSharding`` tree of :func:`policy`."""
    return shardings if frozen is None else lora.combine(frozen.shardings, shardings)


def serving_trees(model_config: models.ModelConfig, layout) -> tuple[PyTree, PyTree]:
    """``(serving base, served adapters)``: the sampler's compute-dtype copies on a serving
    ``layout`` (``RLTrainer.sampler_params``: ``lora.combine`` of the two is decoded)."""
    compute = jnp.dtype(model_config.compute_dtype)
    base_shardings, adapter_shardings = lora.split(layout.shardings)
    base_shapes, adapter_shapes = lora.split(models.param_shapes(model_config))

    def served(shapes, shardings):
        return jax.tree.map(
            lambda p, s: jax.ShapeDtypeStruct(
                p.shape, compute if jnp.issubdtype(p.dtype, jnp.floating) else p.dtype, sharding=s
            ),
            shapes,
            shardings,
        )

    return served(base_shapes, base_shardings), served(adapter_shapes, adapter_shardings)


def reshard_programs(
    model_config, layout, state, frozen: Frozen, sizes, resident: dict[str, int]
) -> tuple[Program, Program, int]:
    """``(reshard, reshard_base, served adapter bytes)``: the per-step reshard of the adapters
    and the once-a-run reshard of the base into the serving ``layout``
    (``adapters.serving_reshards``), with their memory parts (``resident``: what else is alive,
    the optimizer state and reference)."""
    reshard_base, reshard_adapters = adapters.serving_reshards(model_config, layout)
    served = shard_bytes(serving_trees(model_config, layout)[1])

    def program(name, fn, args, calls, argument_parts, alive, made):
        return Program(
            name=name,
            lowered=fn.lower(args),
            calls_per_step=calls,
            flops=0.0,
            model_flops=0.0,
            tokens=0,
            argument_parts=argument_parts,
            resident=alive,
            inner_parts={"sampler_weights": made},
        )

    adapters_program = program(
        "reshard",
        reshard_adapters,
        state.params,
        1,
        {"parameters": sizes.params},
        {**resident, "frozen_base": sizes.base, "sampler_weights": sizes.serving_base},
        served,
    )
    base_program = program(
        "reshard_base",
        reshard_base,
        frozen.base,
        0,  # once per run, before the first rollout
        {"frozen_base": sizes.base},
        {**resident, "parameters": sizes.params},
        sizes.serving_base,
    )
    return adapters_program, base_program, served


def lora_report(model_config: models.ModelConfig) -> dict[str, Any] | None:
    """The report's ``model.lora``: rank, alpha, targets and the adapters' parameter count."""
    spec = model_config.lora
    if spec is None:
        return None
    return {
        "rank": spec.rank,
        "alpha": spec.alpha,
        "rslora": spec.rslora,
        "targets": list(spec.targets),
        "adapter_params": flops_lib.adapter_params(model_config),
    }


__all__ = [
    "ASSUMPTIONS",
    "Frozen",
    "abstract_lora_state",
    "lora_report",
    "policy",
    "policy_shardings",
    "reshard_programs",
    "serving_trees",
]
