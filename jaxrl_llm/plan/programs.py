"""The programs ``jaxrl-llm train`` runs for an RL job, built for a TPU slice and planned.

``plan_job(cfg, spec)`` lowers, with abstract arguments only (``jax.eval_shape``, nothing
materialised), exactly what ``train.rl.trainer.RLTrainer`` compiles and calls each RL step, on
the trainer's mesh (``mesh.data/fsdp/tensor`` over the slice's compile-only devices):

* ``update``: ``jit_step(make_policy_step(...), shardings)`` on one minibatch of
  ``B / trainer.minibatches`` rows (``trainer.micro_batches``, ``model.remat``,
  ``model.chunk_size`` as configured), run ``trainer.epochs x trainer.minibatches`` times a step;
* ``logprobs``: ``make_logprob_fn`` (the behaviour policy's log-probs) over all ``B`` rows, and
  ``ref_logprobs`` (the same program on the reference) when the objective needs a reference;
* ``prefill``: ``sampling.generate``'s jitted ``prefill_program`` of ``prompts_per_step`` prompts,
  its cache grown to ``group_size`` rows each of ``P + T`` slots in the compute dtype;
* ``decode_step``: the jitted decode loop ``decode_program`` itself (layers stacked, as on TPU; the
  weights cast once to the compute dtype); one trip of its ``while`` loop is one decode step,
  run ``T = rollout.max_new_tokens`` times a step.

Widths: ``B = prompts_per_step x group_size`` rows, prompts ``P = bucket_length(
data.max_prompt_tokens)`` (the trainer pads to that bucket), completions
``T = rollout.max_new_tokens``. The sampler runs on the layout ``train`` chooses for it
(``rollout.tensor_parallel``: its own serving layout, resharded into by the ``reshard``
program, or the trainer's).

With ``trainer.packing`` on (or ``auto`` and worth it by the length model), the update and the
behaviour, reference and teacher log-prob forwards (and PPO's critic or joint update) are
lowered packed, as ``train`` calls them: the forwards with a stacked packing plan
``[K, shards, rows, W]`` as a third argument, each minibatch with ``packing=plan``; the rows
per shard come from the length model (``plan._packing``), and their FLOPs and tokens count the
packed rows.

A LoRA job (``model.lora``) is planned as ``train`` runs it (``plan._lora``): the train state
holds the adapters, the frozen base (compute dtype, also the reference) is the update's third
argument and an argument of the log-prob forwards, ``ref_logprobs`` runs the base alone, and
on a serving layout ``reshard`` moves the adapters each step and ``reshard_base`` the base
once a run (its copy kept).

A mixture-of-experts policy (``plan._moe``) is lowered as ``train`` runs it (``mesh.expert``:
expert parallelism); the report adds the experts' share of each chip's memory, each program's
expert all-to-all (trip weighted), the check that no program gathers every expert on a chip,
the expert matmuls a chip runs for other chips' tokens (added to its compute), and
``mesh.expert`` advice.

PPO's critic and PRIME's implicit PRM are planned as their trainers build them
(``plan._aux``): a separate critic adds ``values`` and ``critic_update``; with
``critic.optimizer=joint`` one state holds policy and critic and the ``update`` is the joint
step; ``critic.init=reward_model`` takes the critic's architecture from ``critic.path``'s
config.json. The frozen side models (``plan._frozen_model``) are resident all run in the
compute dtype and run once over each rollout batch: a learned reward model
(``reward_model.path``) scores it (``rm_scores``), on-policy distillation's teacher
(``teacher.path``) gives its log-probs (``teacher_logprobs``,
``train.rl.programs.teacher_program``).

Memory per chip counts what is alive during each program, not only its arguments: the train
state (parameters, optimizer state), the frozen reference and the rollout batch stay resident
all step, so each program's peak (``compiled.memory_analysis()``, see ``estimate``) is added to
whatever of those it does not take as an argument. Each total is split into parts:
``parameters, optimizer_state, reference, frozen_base`` (LoRA), ``aux_model``, ``reward_model``,
``teacher``, ``sampler_weights`` (the compute-dtype copy the decode loop reads), ``kv_cache,
inputs`` (the program's batch and the rollout batch) and ``temporaries`` (the rest: gradients
and activations of the update, activations of the forwards, the step's intermediates).

Time per program is a roofline (``estimate.roofline``): analytic matmul FLOPs with causal
attention (``plan.flops``), HBM bytes from the optimized HLO (the decode step's from
``decode_hbm_bytes_per_chip``, a model of the trainer layout) and trip-weighted collectives
from the optimized HLO, each XLA:TPU async collective counted once (``unique_collectives``).
The RL step adds them up as ``epochs x minibatches x update + (1 or 2) x logprobs + prefill +
T x decode_step``, which assumes every row decodes all ``T`` tokens (no early EOS).
"""

from __future__ import annotations

from jaxrl_llm.plan._analysis import (  # noqa: F401 (re-exported)
    build_job,
    decode_hbm_bytes_per_chip,
    loop_body_module,
    memory_parts,
    unique_collectives,
)
from jaxrl_llm.plan._job import (  # noqa: F401 (re-exported)
    ASSUMPTIONS,
    MEMORY_PARTS,
    PROGRAMS,
    Job,
    JobShape,
    PlanError,
    Program,
    StateBytes,
    abstract_rollout_batch,
    abstract_sequences,
    abstract_train_state,
    job_shape,
    plan_mesh,
    plan_model_config,
    plannable_objective,
    shard_bytes,
    state_bytes,
    with_shardings,
)
from jaxrl_llm.plan._report import (  # noqa: F401 (re-exported)
    _program_report,
    bigger_topology,
    compile_job,
    decode_hints,
    plan_job,
    suggestions,
    summarise,
)

__all__ = [
    "ASSUMPTIONS",
    "MEMORY_PARTS",
    "PROGRAMS",
    "Job",
    "JobShape",
    "PlanError",
    "Program",
    "StateBytes",
    "abstract_rollout_batch",
    "abstract_sequences",
    "abstract_train_state",
    "bigger_topology",
    "build_job",
    "compile_job",
    "decode_hbm_bytes_per_chip",
    "decode_hints",
    "job_shape",
    "loop_body_module",
    "memory_parts",
    "plan_job",
    "plan_mesh",
    "plan_model_config",
    "plannable_objective",
    "shard_bytes",
    "state_bytes",
    "suggestions",
    "summarise",
    "unique_collectives",
    "with_shardings",
]
