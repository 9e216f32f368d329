"""An RL job's configuration resolved once: every check, and the values its consumers read.

``resolve(cfg)`` runs every check an RL job makes before it builds anything (the sections'
values, the objective and the trainer that supplies its inputs, LoRA, remat, dtypes, the
asynchronous loop) and returns a :class:`RunSpec`: the objective, the trainer kind, the
precision (every dtype named, never ``auto`` or None), the step's shape (rows, minibatch rows,
prompt and completion widths) and the sampler's settings. ``jaxrl-llm train``, ``plan``,
``eval`` and a sampler process all call it, so they refuse the same configs and read the same
values; ``plan`` resolves for the TPU backend it compiles for (``backend="tpu"``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax

from jaxrl_llm import models, objectives, parallel
from jaxrl_llm.sampling.prompts import bucket_length
from jaxrl_llm.sampling.strategies import effective_top_k
from jaxrl_llm.train import adapters
from jaxrl_llm.train.precision import Precision, resolve_precision
from jaxrl_llm.train.rl.config import TrainConfig, check_config, micro_batching, rollout_rows
from jaxrl_llm.train.step import TokenBudget

log = logging.getLogger("jaxrl_llm")

#: The optional estimator inputs (``objectives.OPTIONAL_INPUTS``) each trainer kind computes:
#: ``policy`` (``RLTrainer``: also each reward function's column, ``rollout.reward_columns``),
#: ``ppo`` (a critic) and ``prime`` (an implicit PRM).
TRAINER_SUPPLIES = {
    "policy": ("old_logprobs", "ref_logprobs", "reward_columns", "teacher_logprobs"),
    "ppo": ("old_logprobs", "ref_logprobs", "values"),
    "prime": ("old_logprobs", "ref_logprobs", "process_rewards"),
}


@dataclasses.dataclass(frozen=True)
class JobShape:
    """The sizes of one RL step, as the trainer runs it.

    Attributes:
      prompts: N, ``rollout.prompts_per_step``.
      group_size: G, completions per prompt.
      rows: ``B = N x G``, the rollout batch.
      epochs, minibatches, micro_batches: ``trainer.*``.
      minibatch_rows: ``B / minibatches``, rows of one update step.
      prompt_len: P, ``bucket_length(data.max_prompt_tokens)`` (what the trainer pads to).
      completion_len: T, ``rollout.max_new_tokens``.
      remat, chunk_size: ``model.remat``, ``model.chunk_size``.
      needs_reference: the objective keeps a reference policy (a second log-prob forward).
      reference_mode: ``reference.mode``.
    """

    prompts: int
    group_size: int
    rows: int
    epochs: int
    minibatches: int
    micro_batches: int
    minibatch_rows: int
    prompt_len: int
    completion_len: int
    remat: str
    chunk_size: int | None
    needs_reference: bool
    reference_mode: str

    @property
    def seq_len(self) -> int:
        """``P + T``: the positions a log-prob forward runs over, the KV cache's slots."""
        return self.prompt_len + self.completion_len

    @property
    def updates_per_step(self) -> int:
        """Optimizer steps per RL step: ``epochs x minibatches``."""
        return self.epochs * self.minibatches


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
    """How the rollouts are drawn (``rollout.*``), resolved.

    Attributes:
      engine: ``static`` or ``continuous``.
      max_new_tokens: the completion limit, T.
      temperature, top_k, top_p, min_p: the sampling distribution (``top_k`` as configured;
        ``sampling`` gives the one a call uses).
      slots, burst, decode_layers, kv_block_size, kv_blocks: the engine's settings.
      max_staleness: rollouts drawn ahead of the update (0: synchronous).
      partial: partial rollouts (weights taken between decode bursts).
      logprobs: the update's behaviour log-probs: ``recompute`` or ``sampler``.
    """

    engine: str
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    slots: int | None
    burst: int
    decode_layers: str
    kv_block_size: int
    kv_blocks: int | None
    max_staleness: int
    partial: bool
    logprobs: str

    def sampling(self, temperature: float | None = None) -> dict[str, Any]:
        """``temperature, top_k, top_p, min_p`` of a sampler call at the rollout's temperature
        or another (an evaluation's); greedy (0) turns top-k off (``effective_top_k``)."""
        t = self.temperature if temperature is None else temperature
        top_k = effective_top_k(self.top_k, t)
        return dict(temperature=t, top_k=top_k, top_p=self.top_p, min_p=self.min_p)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """An RL job resolved (``resolve``): the config and what every consumer reads from it."""

    config: TrainConfig
    objective: objectives.Objective
    kind: str
    precision: Precision
    shape: JobShape
    sampler: SamplerSettings

    def shape_on(self, mesh: Any) -> JobShape:
        """``shape`` with the micro-batches the trainer runs on ``mesh``'s devices
        (``trainer.micro_batch_tokens`` resolved for the step's batch shape)."""
        micro = micro_batching(self.config.trainer, parallel.current_platform(mesh)[0])
        if not isinstance(micro, TokenBudget):
            return self.shape
        count = micro.micro_batches(
            self.shape.minibatch_rows, self.shape.seq_len, parallel.batch_shards(mesh)
        )
        return dataclasses.replace(self.shape, micro_batches=count)


def trainer_kind(objective: objectives.Objective) -> str:
    """The trainer kind (``TRAINER_SUPPLIES``) that computes every input ``objective``'s
    advantage estimator requires.

    Raises:
      ValueError: no trainer computes them.
    """
    for kind, supplies in TRAINER_SUPPLIES.items():
        if set(objective.estimator_requires) <= set(supplies):
            return kind
    raise ValueError(
        f"objective {objective.name!r}: no trainer supplies the inputs its advantage "
        f"estimator {objective.advantage.name!r} requires {objective.estimator_requires}"
    )


def check_staleness(cfg: Any, objective: Any, *, warn: bool = True) -> None:
    """Refuses what the asynchronous loop cannot run yet; warns of an uncorrected one
    (``warn``).

    Raises:
      ValueError: ``rollout.partial`` without ``max_staleness`` and the continuous engine;
        ``rollout.max_staleness >= 1`` in a multi-process job whose processes all sample and
        train (each would interleave its rollout and update programs in its own order:
        collectives could hang); the sampler on processes of its own
        (``mesh.rollout_devices``, ``train.rl.remote``) runs it.
    """
    r = cfg.rollout
    if r.partial and (not r.max_staleness or r.engine != "continuous"):
        raise ValueError(
            "rollout.partial (partial rollouts: weights taken between decode bursts) needs "
            f"rollout.max_staleness >= 1 and rollout.engine=continuous; got max_staleness="
            f"{r.max_staleness}, engine={r.engine!r}"
        )
    if not r.max_staleness:
        return
    if jax.process_count() > 1 and not cfg.mesh.rollout_devices:
        raise ValueError(
            f"rollout.max_staleness={r.max_staleness}: on {jax.process_count()} "
            "processes the asynchronous loop needs the sampler on processes of its own "
            "(mesh.rollout_devices); set one of them"
        )
    if warn and objective.correction is None and r.logprobs == "recompute":
        log.warning(
            "rollout.max_staleness=%d without a rollout_correction: the stale batches' old "
            "log-probs are recomputed by the current weights (ratio 1 at the first update); "
            "set objective.overrides.rollout_correction or rollout.logprobs=sampler",
            r.max_staleness,
        )


def check_routing_replay(cfg: TrainConfig) -> None:
    """Refuses a ``model.routing_replay`` the run cannot record or replay (a dense model is
    refused where the model is known, ``programs.check_replay_model``).

    Every trainer replays in the policy's forwards (behaviour, reference, update; PPO's joint
    step too); PPO's critic and PRIME's implicit PRM are models of their own and route by
    their own routers.

    Raises:
      ValueError: a multi-turn environment (``env.name``: its episodes do not record the
        routing). A sampler on processes of its own (``train.rl.remote``) is refused by
        ``RLTrainer``.
    """
    mode = cfg.model.replay_mode
    if mode == "off":
        return
    key = f"model.routing_replay={mode}"
    if cfg.env.name:
        raise ValueError(
            f"{key}: multi-turn episodes (env.name={cfg.env.name!r}) do not record the "
            "routing yet; set model.routing_replay=off"
        )


def resolve(cfg: TrainConfig, *, backend: str | None = None, training: bool = True) -> RunSpec:
    """Every check of an RL job, and its resolved values.

    Args:
      cfg: the job's config.
      backend: the backend the job computes on (``compute_dtype: auto`` depends on it);
        default ``jax.default_backend()``; ``plan`` passes ``"tpu"``.
      training: the caller trains (False: ``eval`` of a run; no warnings about training).

    Raises:
      ValueError: naming the key(s) of an invalid or inconsistent setting.
    """
    objective = check_config(cfg)
    kind = trainer_kind(objective)
    check_staleness(cfg, objective, warn=training)
    check_routing_replay(cfg)
    adapters.check_lora_job(cfg, "rl", objective)
    m, r, t = cfg.model, cfg.rollout, cfg.trainer
    if m.remat not in models.REMAT_POLICIES:
        raise ValueError(f"model.remat must be one of {models.REMAT_POLICIES}, got {m.remat!r}")
    precision = resolve_precision(m, t.optimizer_state_dtype, backend=backend)
    rows = rollout_rows(r)
    return RunSpec(
        config=cfg,
        objective=objective,
        kind=kind,
        precision=precision,
        shape=JobShape(
            prompts=r.prompts_per_step,
            group_size=r.group_size,
            rows=rows,
            epochs=t.epochs,
            minibatches=t.minibatches,
            micro_batches=t.micro_batches,
            minibatch_rows=rows // t.minibatches,
            prompt_len=bucket_length(cfg.data.max_prompt_tokens),
            completion_len=r.max_new_tokens,
            remat=m.remat,
            chunk_size=m.chunk_size,
            needs_reference=objective.needs_reference,
            reference_mode=cfg.reference.mode,
        ),
        sampler=sampler_settings(cfg),
    )


def sampler_settings(cfg: TrainConfig) -> SamplerSettings:
    """The :class:`SamplerSettings` of ``cfg.rollout`` (``resolve`` checks them first)."""
    r = cfg.rollout
    return SamplerSettings(
        engine=r.engine,
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        min_p=r.min_p,
        slots=r.slots,
        burst=r.burst,
        decode_layers=r.decode_layers,
        kv_block_size=r.kv_block_size,
        kv_blocks=r.kv_blocks,
        max_staleness=r.max_staleness,
        partial=r.partial,
        logprobs=r.logprobs,
    )


__all__ = [
    "TRAINER_SUPPLIES",
    "JobShape",
    "Precision",
    "RunSpec",
    "SamplerSettings",
    "check_routing_replay",
    "check_staleness",
    "resolve",
    "sampler_settings",
    "trainer_kind",
]
