"""The policy's programs of an RL step, built once as data for their two consumers.

``policy_programs`` builds the jitted functions ``RLTrainer`` calls every step, the way MaxText's
``train_compile`` lowers the very ``train_step`` its trainer runs: ``jaxrl-llm train`` calls
them on real batches, ``jaxrl-llm plan`` lowers the same functions with abstract arguments on a
deviceless topology and only does the accounting. Nothing here knows which consumer it serves.

* ``update``: one policy step on a minibatch (``make_policy_step`` under ``jit_step``; a LoRA
  run's frozen base passed to every call), ``epochs x minibatches`` calls a step;
* ``logprobs``: the behaviour policy's log-probs over the rollout batch (``make_logprob_fn``),
  skipped (0 calls) when the update is on-policy and takes its own;
* ``ref_logprobs``: the reference's, when the objective keeps one (a LoRA run's reference is
  its base: the same forward with the adapters off).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from jaxrl_llm import parallel
from jaxrl_llm.models import lora
from jaxrl_llm.train.forward import make_logprob_fn
from jaxrl_llm.train.rl.config import forward_micro_batching, micro_batching, teacher_top_k
from jaxrl_llm.train.rl.policy import make_policy_step, router_loss
from jaxrl_llm.train.rl.spec import RunSpec
from jaxrl_llm.train.rl.updates import on_policy_update, update_objective
from jaxrl_llm.train.step import jit_step

PyTree = Any


@dataclasses.dataclass(frozen=True)
class ProgramSpec:
    """One program of an RL step.

    Attributes:
      name: what ``plan`` reports it as (``update``, ``logprobs``, ``ref_logprobs``).
      fn: the jitted function ``train`` calls (and ``plan`` lowers).
      calls_per_step: how often one RL step calls it.
      builder: the public function that built ``fn`` (``plan --json`` names it).
      config: the model config the program runs (a LoRA reference: the base's).
    """

    name: str
    fn: Callable
    calls_per_step: int
    builder: str
    config: Any


def takes_own_logprobs(run: RunSpec) -> bool:
    """The update's behaviour log-probs are its own forward's (``updates.on_policy_update``:
    one update per rollout batch, nothing needing them before) and not the sampler's: its
    batch holds no old log-probs and no behaviour forward runs."""
    return on_policy_update(run) and run.sampler.logprobs != "sampler"


def check_replay_model(mode: str, model_config: Any) -> None:
    """Refuses ``model.routing_replay`` (``measure`` / ``rollout``) for a dense model.

    Raises:
      ValueError: the mode is not ``off`` and ``model_config`` has no experts.
    """
    if mode != "off" and not model_config.is_moe:
        raise ValueError(
            f"model.routing_replay={mode} applies to mixture-of-experts models; "
            f"{model_config.architecture} here is dense: set model.routing_replay=off"
        )


def builder_name(builder: Callable) -> str:
    """``module.qualname`` of a program's builder (``ProgramSpec.builder``)."""
    return f"{builder.__module__}.{builder.__qualname__}"


def policy_programs(
    run: RunSpec,
    model_config: Any,
    optimizer: Any,
    shardings: Any,
    *,
    frozen: PyTree | None = None,
    frozen_shardings: PyTree | None = None,
) -> dict[str, ProgramSpec]:
    """The policy's ``update``, ``logprobs`` and ``ref_logprobs`` programs (see module).

    Args:
      run: the resolved job (``spec.resolve``).
      model_config: the policy's ``ModelConfig`` (computing in the job's compute dtype).
      optimizer: the policy's optax transformation.
      shardings: the train state's ``NamedSharding``s (its mesh is the trainer's).
      frozen: a LoRA run's frozen base (concrete, or abstract for ``plan``); with
        ``frozen_shardings``, their shardings. None: every weight is trained.

    Returns:
      ``{name: ProgramSpec}``; ``ref_logprobs`` only when the objective keeps a reference.
    """
    cfg = run.config
    check_replay_model(cfg.model.replay_mode, model_config)
    mesh = jax.tree.leaves(shardings)[0].mesh
    platform = parallel.current_platform(mesh)[0]
    temperature, chunk = cfg.rollout.temperature, cfg.model.chunk_size
    update = jit_step(
        make_policy_step(
            model_config,
            update_objective(run.objective),
            optimizer,
            micro_batches=micro_batching(cfg.trainer, platform),
            temperature=temperature,
            chunk_size=chunk,
            remat=cfg.model.remat,
            param_shardings=shardings.params,
            router=router_loss(
                model_config, cfg.model.router_aux_loss_coef, cfg.model.router_z_loss_coef
            ),
            replay_routing=cfg.model.replay_mode == "rollout",
        ),
        shardings,
        frozen=frozen,
        frozen_shardings=frozen_shardings,
    )
    forward = functools.partial(
        make_logprob_fn,
        temperature=temperature,
        chunk_size=chunk,
        micro_batches=forward_micro_batching(cfg.trainer, platform),
    )
    policy_shardings = (
        shardings.params
        if frozen_shardings is None
        else lora.combine(frozen_shardings, shardings.params)
    )
    # The behaviour forward is skipped when the update takes its own log-probs (on-policy)
    # or the sampler's (rollout.logprobs=sampler).
    sampler = run.sampler.logprobs == "sampler"
    behaviour = not (takes_own_logprobs(run) or sampler)
    programs = {
        "update": ProgramSpec(
            "update",
            update,
            run.shape.updates_per_step,
            builder_name(make_policy_step),
            model_config,
        ),
        "logprobs": ProgramSpec(
            "logprobs",
            forward(model_config, param_shardings=policy_shardings),
            int(behaviour),
            builder_name(make_logprob_fn),
            model_config,
        ),
    }
    if run.objective.needs_reference:
        if frozen_shardings is None:
            reference = programs["logprobs"]
        else:  # the base, adapters off
            base = lora.base_config(model_config)
            reference = ProgramSpec(
                "ref_logprobs",
                forward(base, param_shardings=frozen_shardings),
                1,
                builder_name(make_logprob_fn),
                base,
            )
        programs["ref_logprobs"] = dataclasses.replace(
            reference, name="ref_logprobs", calls_per_step=1
        )
    return programs


def distill_top_k(run: RunSpec, teacher_config: Any) -> int | None:
    """``k`` of the teacher's top-k log-probs the update's JSD loss reads
    (``Objective.distill_loss``; ``config.teacher_top_k``: the vocabulary for the full
    distribution), or None when the objective has no JSD loss."""
    if run.objective.distill.loss is None:
        return None
    shape = run.shape
    return teacher_top_k(run.objective, teacher_config.vocab_size, shape.rows, shape.completion_len)


def teacher_program(run: RunSpec, teacher_config: Any, teacher_shardings: Any) -> ProgramSpec:
    """``teacher_logprobs``: a distillation teacher's log-probs of the rollout batch, once a
    step, by the forward the policy's log-probs use (same temperature, chunking and
    micro-batches); ``teacher_shardings`` place its frozen weights.

    With a JSD loss (``Objective.distill_loss``) the same chunked forward also returns the
    teacher's ``k`` most likely tokens at each completion position (``distill_top_k``): the
    function then returns a ``logprobs.LogprobOutputs`` (``logprobs [B, T]``,
    ``top_logprobs [B, T, k]`` f32, ``top_ids [B, T, k]`` int32), never a ``[B, T, V]``
    array (unless ``k = V``, the full vocabulary)."""
    cfg = run.config
    mesh = jax.tree.leaves(teacher_shardings)[0].mesh
    fn = make_logprob_fn(
        teacher_config,
        temperature=cfg.rollout.temperature,
        chunk_size=cfg.model.chunk_size,
        micro_batches=forward_micro_batching(cfg.trainer, parallel.current_platform(mesh)[0]),
        param_shardings=teacher_shardings,
        top_k=distill_top_k(run, teacher_config),
    )
    return ProgramSpec("teacher_logprobs", fn, 1, builder_name(make_logprob_fn), teacher_config)


__all__ = [
    "ProgramSpec",
    "builder_name",
    "check_replay_model",
    "distill_top_k",
    "policy_programs",
    "takes_own_logprobs",
    "teacher_program",
]
