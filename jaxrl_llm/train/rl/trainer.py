"""The RL trainer: rollout → reward → advantages → K epochs × minibatches of the sharded step.

Each step samples G completions per prompt (on the sampler's layout), scores them on the host
(DAPO dynamic sampling optional), computes log-probs and advantages on device, and runs the
jitted policy step over minibatches drawn on device: the batch stays on device throughout.
Every random draw is a function of ``(seed, step)`` and the data position is checkpointed, so a
resumed run repeats an uninterrupted one exactly. PPO (``train.rl.ppo``) and PRIME
(``train.rl.prime``) extend it through the ``score`` / ``update`` hooks.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import data, objectives, parallel
from jaxrl_llm.logprobs import LogprobOutputs
from jaxrl_llm.models import lora
from jaxrl_llm.packing import balance_rows
from jaxrl_llm.train import adapters, core, export, setup
from jaxrl_llm.train import packing as packing_lib
from jaxrl_llm.train.core import PhaseTimer, Trainer
from jaxrl_llm.train.optim import make_trainer_optimizer
from jaxrl_llm.train.plots import RL_PLOT_KEYS
from jaxrl_llm.train.rl import remote, warmup, watch
from jaxrl_llm.train.rl import rollout as rollout_lib
from jaxrl_llm.train.rl.config import (
    TrainConfig,
    forward_micro_batching,
    micro_batching,
)
from jaxrl_llm.train.rl.context import load_reward_model, load_teacher, make_run_context
from jaxrl_llm.train.rl.pipeline import IN_FLIGHT_DIR, Pipeline
from jaxrl_llm.train.rl.programs import (
    distill_top_k,
    policy_programs,
    takes_own_logprobs,
    teacher_program,
)
from jaxrl_llm.train.rl.sampler_role import SamplerRole
from jaxrl_llm.train.rl.spec import TRAINER_SUPPLIES, resolve
from jaxrl_llm.train.rl.updates import (  # noqa: F401 (on_policy_update re-exported)
    correct_batch,
    ema,
    mean_metrics,
    on_policy_update,
    take_rows,
)
from jaxrl_llm.train.rl.warmup import SFT_WARMUP_STEPS_BUILTIN
from jaxrl_llm.train.state import create_train_state
from jaxrl_llm.train.step import TokenBudget
from jaxrl_llm.types import RolloutBatch, Sequences

log = logging.getLogger("jaxrl_llm")

SAMPLES_FILE = "samples.jsonl"


def _param_count(model_config) -> int:
    from jaxrl_llm import models  # noqa: PLC0415

    shapes = models.param_shapes(model_config)
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(shapes)))


def advantage_metrics(advantages: np.ndarray, trained: np.ndarray) -> dict[str, float]:
    """Mean, std, max and min of the advantages the update trains on: per row (``[B]``) over
    the rows with a trained token, per token (``[B, T]``) over the trained tokens; all 0 when
    there are none (a batch of dynamic sampling's filler rows only)."""
    trained = np.asarray(trained) > 0
    if advantages.ndim == 1:
        valid = advantages[trained.any(axis=1)]
    else:
        valid = advantages[trained]
    if not valid.size:
        valid = np.zeros(1, np.float32)
    return {
        "advantage_mean": float(valid.mean()),
        "advantage_std": float(valid.std()),
        "advantage_max": float(valid.max()),
        "advantage_min": float(valid.min()),
    }


@jax.jit
def reverse_kl(student, teacher, mask) -> jax.Array:
    """The mean over the trained tokens of ``log π_old − log π_T``: the per-token reverse KL
    to the teacher that on-policy distillation lowers (0 with no trained token). Computed on
    device: a scalar, not three ``[B, T]`` arrays, comes back to the host."""
    mask = mask.astype(jnp.float32)
    count = jnp.sum(mask)
    total = jnp.sum(jnp.where(mask > 0, student - teacher, 0.0))
    return jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0)


class StepForwards(NamedTuple):
    """The frozen forwards of one step's batch, ``[B, T]`` on device (None when not run):
    behaviour (``old``: recomputed, the sampler's, or None on-policy), reference and
    distillation teacher log-probs, and the packing plan they ran with (``packing_plan`` for
    the frozen forwards' micro-batching; None: padded), which other forwards of the same rows
    and micro-batching reuse. ``teacher_top``: with a JSD distillation loss
    (``Objective.distill_loss``), the teacher's ``(top_logprobs, top_ids)`` ``[B, T, k]``
    from the same forward as ``teacher``, which the step puts in the update's batch
    (``RolloutBatch.teacher_top_logprobs`` / ``teacher_top_ids``) after ``score``."""

    old: Any = None
    ref: Any = None
    teacher: Any = None
    plan: Any = None
    teacher_top: Any = None


class RLTrainer(Trainer):
    """One RL run: owns the state, the reference, the data position and the writers."""

    plot_keys = RL_PLOT_KEYS
    eval_key = "eval_before_rl"
    #: A LoRA run's frozen base (``model.lora``; None: every weight is trained) and shardings.
    base: Any = None
    base_shardings: Any = None
    serving_base: Any = None  # the base in the sampler's layout (moved once)
    #: LoRA with ``model.lora.sampler`` merged: ``(base, adapters) -> merged base``, else None.
    merge_sampler: Any = None
    #: Score in the workers while the log-prob forwards run (False: wait first; benchmarks).
    defer_scoring = True

    def __init__(self, cfg: TrainConfig):
        parallel.initialize_distributed()
        if remote.setup_roles(cfg):
            raise ValueError(
                f"process {jax.process_index()} only samples (mesh.rollout_devices="
                f"{cfg.mesh.rollout_devices}): run the job with jaxrl_llm.train.rl.run.run, as "
                "`jaxrl-llm train` does, which runs this process's sampler loop"
            )
        super().__init__(cfg)
        self.spec = resolve(cfg)
        objective = self.spec.objective
        if remote.is_remote(cfg):
            if cfg.model.replay_mode != "off":
                raise ValueError(
                    f"model.routing_replay={cfg.model.replay_mode}: a sampler on processes "
                    "of its own (train.rl.remote) does not send the routing yet; set "
                    "model.routing_replay=off"
                )
            remote.check_remote(cfg)
        self.check_objective(objective)
        # A distillation loss trains whatever the advantages (GKD's: none at all).
        self.loss_gives_signal = objective.distill.loss is not None
        if not self.loss_gives_signal and not watch.group_size_gives_signal(
            objective, cfg.rollout.group_size
        ):
            log.warning(
                "rollout.group_size=%d: the %s estimator gives every completion advantage 0 "
                "(it compares completions within a group), so the policy cannot learn: set "
                "rollout.group_size >= 2",
                cfg.rollout.group_size,
                objective.advantage.name,
            )
        self.watch = watch.StepWatch(
            cfg.trainer.stop_without_signal, cfg.rollout.group_size, cfg.rollout.max_new_tokens
        )
        mesh = setup.make_run_mesh(cfg.mesh, reserve=cfg.teacher.devices)
        tokenizer, model_config, params = setup.build_policy(cfg, mesh, self.spec.precision)
        self.sft_steps = setup.sft_warmup_steps(cfg, SFT_WARMUP_STEPS_BUILTIN)
        self.run = make_run_context(
            cfg,
            mesh,
            tokenizer,
            model_config,
            objective,
            reward_model=load_reward_model(cfg, self.spec.precision, model_config, mesh),
        )
        # On-policy distillation's teacher: (config, frozen params) or None, on the trainer's
        # mesh or on devices of its own (``teacher.devices``: ``teacher_mesh``).
        self.teacher_mesh = None
        if cfg.teacher.devices:
            self.teacher_mesh = setup.reserved_mesh(cfg.mesh, cfg.teacher.devices)
            setup.check_batch_sizes(
                {"rollout batch on teacher.devices": self.spec.shape.rows}, self.teacher_mesh
            )
        self.teacher = load_teacher(
            cfg, self.spec.precision, model_config, tokenizer, self.teacher_mesh or mesh
        )
        if self.teacher is not None:  # a bad teacher.top_k is refused before any warm-up
            distill_top_k(self.spec, self.teacher[0])
        train_examples, eval_examples = self.run.train_examples, self.run.eval_examples
        rows = self.spec.shape.rows
        sizes = {
            "rollout batch (prompts_per_step x group_size)": rows,
            "minibatch": self.spec.shape.minibatch_rows,
            "data.eval_size": cfg.data.eval_size,
        }
        if self.sft_steps:
            sizes["sft_warmup.batch_size"] = cfg.sft_warmup.batch_size
        setup.check_batch_sizes(sizes, mesh)
        self.sampler = data.PromptSampler(train_examples, seed=cfg.seed, shuffle=cfg.data.shuffle)
        self.key = jax.random.key(cfg.seed)
        t = cfg.trainer
        self.optimizer = make_trainer_optimizer(
            t, total_steps=t.max_steps * t.epochs * t.minibatches
        )
        self.open_run()
        self._initial_params = params
        self.sampler_logprobs = cfg.rollout.logprobs == "sampler"
        self.on_policy = takes_own_logprobs(self.spec)
        self.start_lines(
            {
                "mesh": str(dict(mesh.shape)),
                "model": f"{model_config.architecture}, {_param_count(model_config) / 1e6:.2f}M "
                f"parameters ({cfg.model.path or 'built-in tiny model, random init'})",
                "task": f"{cfg.data.task}: {len(train_examples)} train / "
                f"{len(eval_examples)} eval prompts, "
                + ("through the chat template" if cfg.data.chat_template else "as raw text")
                + f", completions up to {cfg.rollout.max_new_tokens} tokens",
                "objective": f"{objective.name} ({objective.advantage.name} advantages, "
                f"{objective.surrogate.name}), {rows} completions per step",
                "sft warm-up": self._warmup_line(),
                **adapters.start_line(model_config),
                **({"teacher": self._teacher_line()} if self.teacher else {}),
                "old log-probs": "the sampler's own (rollout.logprobs=sampler)"
                if self.sampler_logprobs
                else "the update's own forward (one epoch, one minibatch: on-policy)"
                if self.on_policy
                else "recomputed before the update",
            }
        )

    #: The optional advantage-estimator inputs this trainer computes (``objectives``'
    #: ``OPTIONAL_INPUTS``); subclasses add theirs.
    SUPPLIES: tuple[str, ...] = TRAINER_SUPPLIES["policy"]

    def check_objective(self, objective: objectives.Objective) -> None:
        missing = sorted(set(objective.estimator_requires) - set(self.SUPPLIES))
        if missing:
            raise ValueError(
                f"objective {objective.name!r} ({objective.advantage.name} advantages) needs "
                f"{', '.join(missing)}, which {type(self).__name__} does not compute (a critic "
                "or a process reward model): run it with train.rl.run, which picks the trainer"
            )

    # -- state -------------------------------------------------------------------------------

    @property
    def mesh(self):
        return self.run.mesh

    @property
    def policy_trained(self):
        """The policy's trained parameters (every weight, or a LoRA run's adapters);
        subclasses may keep them inside a larger state."""
        return self.state.params

    @property
    def policy_params(self):
        """The policy's parameters: a LoRA run's are the frozen base with the trained
        adapters (no copy)."""
        if self.base is None:
            return self.policy_trained
        return lora.combine(self.base, self.policy_trained)

    def _teacher_line(self) -> str:
        """The start line's ``teacher``: its path and, with a JSD loss, the loss's settings."""
        objective = self.spec.objective
        if objective.distill.loss is None:
            return str(self.cfg.teacher.path)
        k = distill_top_k(self.spec, self.teacher[0])
        tokens = (
            "the whole vocabulary" if objective.distill.top_k is None else f"its top {k} tokens"
        )
        return (
            f"{self.cfg.teacher.path} (loss += {objective.distill.coef:g} x "
            f"JSD(beta={objective.distill.jsd_beta:g}) over {tokens})"
        )

    def _warmup_line(self) -> str:
        """The start line's ``sft warm-up``: what runs, or that a resumed run's is done."""
        if not self.sft_steps:
            return "off"
        if self.latest is not None:
            return f"done (resuming from step {self.latest})"
        return warmup.describe(self.cfg, self.sft_steps)

    def setup(self) -> None:
        run, cfg = self.run, self.cfg
        init_key, sft_key = jax.random.split(self.key)
        params, self._initial_params = self._initial_params, None  # the state takes them over
        if self.latest is None and self.sft_steps > 0:
            params, self.extra[core.WARMUP_KEY] = warmup.warm_up(
                cfg, run, params, steps=self.sft_steps, key=sft_key
            )
        # An adaptive entropy coefficient is state: checkpointed and resumed with the rest.
        control = None
        if run.objective.entropy.adaptive:
            control = objectives.entropy_control.init_control(run.objective)
        if run.model_config.lora is None:
            self.state, self.shardings = create_train_state(
                run.model_config,
                self.optimizer,
                key=init_key,
                mesh=run.mesh,
                params=params,
                param_dtype=self.spec.precision.param,
                entropy_control=control,
            )
        else:
            self.state, self.shardings, self.base, self.base_shardings = adapters.setup_run(
                cfg,
                run.model_config,
                self.optimizer,
                run.mesh,
                run_dir=self.run_dir,
                resuming=self.latest is not None,
                params=params,
                key=init_key,
                entropy_control=control,
            )
        self.copy_params = setup.copy_fn(self.shardings.params)
        self.row_sharding = setup.row_sharding(run.mesh)
        if self.latest is None and self.is_main:
            (self.run_dir / SAMPLES_FILE).unlink(missing_ok=True)
        self.setup_extra_networks()
        needs_ref = run.objective.needs_reference
        if self.base is not None:  # the base, adapters off: nothing to copy
            self.reference = self.base if needs_ref else None
        else:
            self.reference = self.copy_params(self.policy_params) if needs_ref else None
        if needs_ref and self.base is None and cfg.reference.mode == "ema":
            # An f32 average: in bf16 the (1 - decay)-sized steps towards the policy round away.
            self.reference = jax.tree.map(lambda x: x.astype(jnp.float32), self.reference)
        self.reference_dirty = needs_ref and self.base is None
        self.role = SamplerRole.of(cfg, run.model_config, run.mesh)  # last: budgets free memory
        self.serving, self.reshard = self.role.layout, self.role.send
        if self.base is not None and adapters.merged_sampler(cfg, run.model_config, self.serving):
            self.merge_sampler = adapters.merge_program(
                run.model_config, self.sampler_base_shardings
            )
            run.sampler_config = lora.base_config(run.model_config)
        self.step_rollout = rollout_lib.StepRollout(
            run, self.sampler, self.key, mesh=self.serving.mesh, defer=self.defer_scoring
        )
        self.pipeline = self.make_pipeline()
        self.compile()

    def setup_extra_networks(self) -> None:
        """Hook: critics, process reward models (created after the policy state)."""

    @property
    def platform(self) -> str:
        """The platform of the run's devices (``cpu``, ``gpu``, ``tpu``)."""
        return parallel.current_platform(self.run.mesh)[0]

    @property
    def micro_batches(self):
        """``make_step``'s ``micro_batches`` for this run's devices (``trainer.micro_batch_*``)."""
        return micro_batching(self.cfg.trainer, self.platform)

    def compile(self) -> None:
        run = self.run
        self.programs = policy_programs(
            self.spec,
            run.model_config,
            self.optimizer,
            self.shardings,
            frozen=self.base,
            frozen_shardings=self.base_shardings,
        )
        self.update_fn = self.programs["update"].fn
        self.logprob_fn = self.programs["logprobs"].fn
        self.ref_logprob_fn = self.programs.get("ref_logprobs", self.programs["logprobs"]).fn
        self.advantage_fn = objectives.advantage_fn(
            run.objective, group_size=self.spec.shape.group_size
        )
        if self.teacher is not None:
            teacher_config, teacher_params = self.teacher
            shardings = jax.tree.map(lambda x: x.sharding, teacher_params)
            self.programs["teacher_logprobs"] = teacher_program(
                self.spec, teacher_config, shardings
            )

    @property
    def sampler_base_shardings(self):
        """A LoRA run's base's shardings on the sampler's layout."""
        if self.serving.is_trainer_layout:
            return self.base_shardings
        return lora.split(self.serving.shardings)[0]

    # -- checkpoints ---------------------------------------------------------------------------

    @property
    def policy_shardings(self):
        """The ``NamedSharding`` tree of :attr:`policy_params`."""
        if self.base is None:
            return self.shardings.params
        return lora.combine(self.base_shardings, self.shardings.params)

    def reference_tree(self):
        return None if self.base is not None else self.reference  # LoRA: the base, reloaded

    def abstract_reference(self):
        if self.reference is None or self.base is not None:
            return None
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.reference
        )

    def restore_reference(self, tree) -> None:
        self.reference = tree

    def save_extra(self) -> dict[str, Any]:
        # First: the prompts the rollouts in flight drew are counted in the data position.
        self.pipeline.save_in_flight(
            self.completed_steps,
            self.run_dir / IN_FLIGHT_DIR,
            kept_steps=self.checkpointer.all_steps(),
            finish=self.run.finish_scoring,
            max_steps=self.cfg.trainer.max_steps,
        )
        return {"sampler": self.sampler.state()}

    def end_steps(self) -> None:
        self.pipeline.close()

    def restore_extra(self, extra: dict[str, Any]) -> None:
        self.sampler.restore(extra["sampler"])
        self.pipeline.restore_in_flight(self.latest, self.run_dir / IN_FLIGHT_DIR)

    def _update_reference(self, step: int) -> None:
        ref = self.cfg.reference
        if self.reference is None:
            return
        if ref.mode == "refresh" and ref.refresh_every and step % ref.refresh_every == 0:
            self.reference = self.copy_params(self.policy_params)
            self.reference_dirty = True
        elif ref.mode == "ema":
            self.reference = ema(self.reference, self.policy_params, ref.ema_decay)
            self.reference_dirty = True

    # -- one step ----------------------------------------------------------------------------

    def train_step(self, step: int, timer: PhaseTimer) -> dict[str, float]:
        run, cfg = self.run, self.cfg
        samples, info = self.rollout(step, timer)
        # Whole groups moved so that every data shard's frozen forwards get about the same
        # tokens; ``drawn[p]``: the drawn row at position p (None: the order as drawn).
        samples, drawn = self.balanced_groups(samples)
        mask = samples.completion_mask  # attended; trained: samples.loss_mask (multi-turn)
        trained = mask if samples.loss_mask is None else samples.loss_mask
        tokens = float(trained.sum())
        timer.count("rollout", tokens)
        with timer.phase("logprobs"):
            # Prompts padded to a bucketed width (as ``run.to_device``); the host copy's masks
            # plan the packing.
            host_seqs = setup.bucket_prompts(
                Sequences(
                    samples.prompt_tokens,
                    samples.prompt_mask,
                    samples.completion_tokens,
                    samples.completion_mask,
                )
            )
            seqs = setup.to_device(host_seqs, run.mesh)
            sampled = setup.to_device(samples.logprobs, run.mesh)
            routing = self.batch_routing(samples, host_seqs)
            plan = self.packing_plan(
                host_seqs.prompt_mask, mask, forward_micro_batching(cfg.trainer, self.platform)
            )
            # Routing replay: the frozen forwards route as the sampler did.
            replay = {} if routing is None or not self.replays_routing else {"routing": routing}
            if self.sampler_logprobs:
                old = sampled
            else:
                old = (
                    None
                    if self.on_policy
                    else self.logprob_fn(self.policy_params, seqs, plan, **replay)
                )
            ref = None
            if self.reference is not None:
                ref = self.ref_logprob_fn(self.reference, seqs, plan, **replay)
            teacher = None
            if self.teacher is not None:
                teacher = self.teacher_logprobs(host_seqs, seqs, plan)
        samples = run.finish_scoring(samples, timer)  # while the forwards run on device
        info = {**rollout_lib.zero_variance_info(samples, cfg.rollout.group_size), **info}
        with timer.phase("logprobs"):
            jax.block_until_ready((old, ref, teacher))
        teacher_top = None
        if isinstance(teacher, LogprobOutputs):  # a JSD loss: the teacher's top-k too
            teacher, teacher_top = teacher.logprobs, (teacher.top_logprobs, teacher.top_ids)
        recomputed = old is not None and not self.sampler_logprobs
        forwards = recomputed + (ref is not None) + (teacher is not None)
        timer.count("logprobs", tokens * forwards)
        with timer.phase("advantages"):
            device_rewards = setup.to_device(samples.rewards, run.mesh)
            attention = None if samples.loss_mask is None else seqs.completion_mask
            if attention is not None:  # the loss and advantages see the sampled tokens only
                seqs = seqs._replace(completion_mask=setup.to_device(trained, run.mesh))
            forwards = StepForwards(old, ref, teacher, plan, teacher_top)
            batch, score_metrics = self.score(step, samples, seqs, forwards, device_rewards)
            batch = batch._replace(
                rollout_logprobs=sampled, attention_mask=attention, routing=routing
            )
            if teacher_top is not None:
                batch = batch._replace(
                    teacher_top_logprobs=teacher_top[0], teacher_top_ids=teacher_top[1]
                )
            batch, corrected = correct_batch(run.objective, batch)
            adv = parallel.fetch(batch.advantages)
        with timer.phase("update"):
            updates = []
            rows = mask.shape[0]
            lengths = host_seqs.prompt_mask.sum(axis=1) + mask.sum(axis=1)
            # Minibatches are drawn over the rows as drawn, so that moving groups for the
            # frozen forwards leaves every minibatch's rows as they were.
            position = None if drawn is None else np.argsort(drawn)
            for epoch in range(cfg.trainer.epochs):
                order = np.random.default_rng([cfg.seed, step, epoch]).permutation(rows)
                order = order if position is None else position[order]
                for part in np.split(order, cfg.trainer.minibatches):
                    part = self.balanced(part, lengths)
                    minibatch = take_rows(batch, jnp.asarray(part), self.row_sharding)
                    plan = self.packing_plan(
                        host_seqs.prompt_mask[part], mask[part], self.micro_batches
                    )
                    minibatch = minibatch._replace(packing=plan)
                    updates.append(self.update(step, minibatch))
            update_metrics = mean_metrics(jax.device_get(updates))
        timer.count("update", tokens * cfg.trainer.epochs)
        self._update_reference(step + 1)

        lengths = mask.sum(axis=1)
        metrics = {
            "reward_mean": float(samples.rewards.mean()),
            "reward_std": float(samples.rewards.std()),
            "accuracy": float(samples.correct.mean()),
            **advantage_metrics(adv, trained),
            "completion_length_mean": float(lengths.mean()),
            "completion_length_max": float(lengths.max()),
            "completion_clipped_frac": float((~samples.finished).mean()),
            **{f"reward/{k}": float(np.mean(v)) for k, v in samples.components.items()},
            **{f"env/{k}": float(np.mean(v)) for k, v in (samples.info or {}).items()},
            **{k: float(v) for k, v in info.items()},
            **{k: float(v) for k, v in score_metrics.items()},
            **corrected,
            **update_metrics,
            "tokens_per_s": tokens / max(timer.seconds.get("rollout", 0.0), 1e-9),
        }
        watched = metrics
        if self.loss_gives_signal:  # all-zero advantages are no missing signal then
            watched = {k: v for k, v in metrics.items() if not k.startswith("advantage_")}
        self.watch.observe(step + 1, watched)
        return metrics

    @property
    def replays_routing(self) -> bool:
        """``model.routing_replay=rollout``: every training-side forward of the policy (and
        its reference) routes each token to the experts the sampler recorded."""
        return self.cfg.model.replay_mode == "rollout"

    def batch_routing(self, samples, host_seqs: Sequences):
        """The sampler's recorded routing ``[B, P + T, L, k]`` int32 on the trainer's mesh
        (sharded on B), its prompt columns left-padded with -1 to ``host_seqs``' bucketed
        prompt width; None when not recorded (``model.routing_replay=off``).

        Raises:
          ValueError: replay or measurement is on and the samples carry no routing.
        """
        if self.cfg.model.replay_mode == "off":
            return None
        routing = getattr(samples, "routing", None)
        if routing is None:
            raise ValueError(
                f"model.routing_replay={self.cfg.model.replay_mode}: the rollout carries "
                "no routing (Samples.routing; the drawer did not record it)"
            )
        routing = np.asarray(routing, np.int32)
        extra = host_seqs.prompt_tokens.shape[1] - samples.prompt_tokens.shape[1]
        want = host_seqs.prompt_tokens.shape[1] + host_seqs.completion_tokens.shape[1]
        if extra:
            routing = np.pad(routing, ((0, 0), (extra, 0), (0, 0), (0, 0)), constant_values=-1)
        if routing.shape[:2] != (len(routing), want) or len(routing) != len(samples.prompts):
            raise ValueError(
                f"Samples.routing {routing.shape} must be [B, P + T, L, k] with B="
                f"{len(samples.prompts)}, P + T={want}"
            )
        return setup.to_device(routing, self.run.mesh)

    def teacher_logprobs(self, host_seqs: Sequences, seqs: Sequences, plan):
        """The distillation teacher's ``[B, T]`` log-probs of the batch (dispatched, not
        waited for), on the trainer's mesh; with a JSD loss, the ``LogprobOutputs`` of
        ``teacher_program`` (its ``[B, T, k]`` top-k beside them). ``seqs`` / ``plan``: the
        batch and the frozen forwards' packing plan on the trainer's mesh; a teacher on
        devices of its own (``teacher_mesh``) gets ``host_seqs`` placed there and a plan for
        its batch shards."""
        fn = self.programs["teacher_logprobs"].fn
        if self.teacher_mesh is None:
            return fn(self.teacher[1], seqs, plan)
        there = setup.to_device(host_seqs, self.teacher_mesh)
        micro = forward_micro_batching(self.cfg.trainer, self.platform)
        own_plan = None
        if plan is not None:  # packed here: packed there too, for its own shards
            mask = np.asarray(host_seqs.completion_mask)
            own_plan = self.packing_plan(host_seqs.prompt_mask, mask, micro, self.teacher_mesh)
        with jax.set_mesh(self.teacher_mesh):  # not the trainer's mesh, which ``fit`` sets
            out = fn(self.teacher[1], there, own_plan)
        return jax.device_put(out, seqs.completion_mask.sharding)

    def balanced_groups(self, samples) -> tuple[Any, np.ndarray | None]:
        """``(samples, drawn)``: the step's groups laid out so that every data shard holds
        about the same tokens for the frozen forwards (behaviour, reference and teacher
        log-probs, PPO's values, PRIME's PRM), whole groups moved
        (``jaxrl_llm.packing.balance_rows`` over the groups' tokens), and ``drawn[p]``, the
        drawn row now at position ``p`` (None: left as drawn). As drawn when the forwards run
        padded (``trainer.packing=off``: every row costs its full width), on one shard, or
        when the shards do not split into whole groups. Everything after reads the rows
        together (a group's rows stay contiguous), so only the order changes."""
        if packing_lib.packing_mode(self.cfg.trainer.packing) == "off":
            return samples, None
        size = self.cfg.rollout.group_size
        shards = parallel.batch_shards(self.run.mesh)
        groups = len(samples.prompts) // size
        if shards == 1 or groups % shards:
            return samples, None
        tokens = samples.prompt_mask.sum(axis=1) + samples.completion_mask.sum(axis=1)
        order = balance_rows(tokens.reshape(groups, size).sum(axis=1), shards=shards)
        if (order == np.arange(groups)).all():
            return samples, None
        drawn = (order[:, None] * size + np.arange(size)).reshape(-1)
        return rollout_lib.select_groups(samples, order, size), drawn

    def balanced(self, part: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """A minibatch's rows ``part`` laid out so that every data shard and micro-batch of the
        update holds about the same tokens (``jaxrl_llm.packing.balance_rows``: the shards'
        packed rows, which the largest sets, even out); as drawn when the update runs padded
        (``trainer.packing=off``: every row costs its full width). The rows gathered, and so
        the update, are the same: its losses are sums over the minibatch."""
        if packing_lib.packing_mode(self.cfg.trainer.packing) == "off":
            return part
        micro = self.micro_batches
        micro = 1 if isinstance(micro, TokenBudget) else micro  # the budget picks K later
        shards = parallel.batch_shards(self.run.mesh)
        return part[balance_rows(lengths[part], shards=shards, micro_batches=micro)]

    def packing_plan(self, prompt_mask, completion_mask, micro_batching, mesh=None):
        """The stacked packing plan (on device) of these host rows for the forward whose
        micro-batching is ``micro_batching`` (``train.packing``; a token budget is spent on
        packed rows), or None: run padded (``trainer.packing=off``, or ``auto`` and rows
        near full). ``mesh``: where the forward runs (None: the trainer's)."""
        mode = packing_lib.packing_mode(self.cfg.trainer.packing)
        if mode == "off":
            return None
        mesh = self.run.mesh if mesh is None else mesh
        shards = parallel.batch_shards(mesh)
        if isinstance(micro_batching, TokenBudget):  # the budget counts packed rows
            plan = packing_lib.plan_by_budget(
                prompt_mask,
                completion_mask,
                tokens=micro_batching.tokens,
                minimum=micro_batching.minimum,
                shards=shards,
            )
        else:
            plan = packing_lib.plan_micro_batches(
                prompt_mask, completion_mask, micro_batches=micro_batching, shards=shards
            )
        if not packing_lib.worth_packing(plan, len(completion_mask), mode):
            return None
        return packing_lib.place_plan(plan, mesh)

    def score(
        self, step, samples, seqs, forwards: StepForwards, rewards
    ) -> tuple[RolloutBatch, dict]:
        """Hook: the update's batch (advantages, and whatever else the update needs) and its
        metrics (floats or device scalars)."""
        old, ref = forwards.old, forwards.ref
        extra, metrics = {}, {}
        requires = self.run.objective.estimator_requires
        if "reward_columns" in requires:  # e.g. GDPO
            columns = rollout_lib.reward_columns(samples)
            extra["reward_columns"] = setup.to_device(columns, self.run.mesh)
        if "teacher_logprobs" in requires:  # on-policy distillation
            extra["teacher_logprobs"] = forwards.teacher
            metrics["distill/reverse_kl"] = reverse_kl(old, forwards.teacher, seqs.completion_mask)
        adv, _ = self.advantage_fn(
            rewards, seqs.completion_mask, old_logprobs=old, ref_logprobs=ref, **extra
        )
        return self.rollout_batch(seqs, old, ref, rewards, adv), metrics

    @staticmethod
    def rollout_batch(seqs: Sequences, old, ref, rewards, advantages, **extra) -> RolloutBatch:
        return RolloutBatch(
            completion_mask=seqs.completion_mask,
            old_logprobs=old,
            advantages=advantages,
            ref_logprobs=ref,
            prompt_tokens=seqs.prompt_tokens,
            prompt_mask=seqs.prompt_mask,
            completion_tokens=seqs.completion_tokens,
            rewards=rewards,
            **extra,
        )

    def update(self, step: int, minibatch: RolloutBatch) -> dict[str, Any]:
        """Hook: one optimizer step on a device minibatch; returns its metrics."""
        self.state, metrics = self.update_fn(self.state, minibatch)
        return metrics

    # -- the rollout ---------------------------------------------------------------------------

    def sampler_params(self, timer: PhaseTimer | None = None):
        """The policy's parameters in the sampler's layout (``rollout.tensor_parallel``); a
        LoRA run's merged into one base copy with ``model.lora.sampler=merged``."""
        phase = timer.phase("reshard") if timer else contextlib.nullcontext()
        if self.merge_sampler is not None:
            with phase:
                return jax.block_until_ready(self.merge_sampler(*self._served_lora()))
        if self.serving.is_trainer_layout:  # else resharded on device
            return self.policy_params
        with phase:
            if self.base is None:
                return jax.block_until_ready(self.reshard(self.policy_params))
            return jax.block_until_ready(lora.combine(*self._served_lora()))

    def _served_lora(self):
        """A LoRA run's ``(base, adapters)`` on the sampler's layout: on a serving layout the
        base moves once per run, each update only the adapters."""
        if self.serving.is_trainer_layout:
            return self.base, self.policy_trained
        if self.serving_base is None:
            reshard_base, self.reshard_adapters = adapters.serving_reshards(
                self.run.model_config, self.serving
            )
            self.serving_base = reshard_base(self.base)
        return self.serving_base, self.reshard_adapters(self.policy_trained)

    def sampler_snapshot(self, timer: PhaseTimer | None = None):
        """:meth:`sampler_params` in buffers of their own when they would be the train
        state's (which the update donates): what a rollout running beside it decodes."""
        params = self.sampler_params(timer)
        own = self.merge_sampler is not None or not self.serving.is_trainer_layout
        if own or not self.spec.sampler.max_staleness:
            return params
        with timer.phase("reshard") if timer else contextlib.nullcontext():
            if self.base is None:
                return self.copy_params(params)
            return lora.combine(self.base, self.copy_params(self.policy_trained))

    def make_pipeline(self) -> Pipeline:
        """The run's pipeline, as the sampler's role brings batches (``SamplerRole.pipeline``)."""
        s = self.spec.sampler
        return self.role.pipeline(
            self.rollout_from,
            max_staleness=s.max_staleness,
            mesh=self.run.mesh,
            partial=s.partial,
            prompts=self.sampler,
        )

    def rollout(self, step: int, timer: PhaseTimer) -> tuple[rollout_lib.Samples, dict]:
        """The step's samples: this step's rollout or, with ``rollout.max_staleness``, one
        generated while earlier updates ran."""
        return self.pipeline.next(step, lambda: self.sampler_snapshot(timer), timer)

    def rollout_from(
        self, step: int, params: Any, timer: PhaseTimer, updates=None, version: int = 0
    ) -> tuple[rollout_lib.Samples, dict]:
        """The step's groups from ``params`` (``rollout_lib.StepRollout``; the pipeline's
        ``produce``)."""
        return self.step_rollout(step, params, timer, updates, version)

    # -- evaluation and outputs ----------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        params, mesh = self.role.evaluation(self.policy_params, self.sampler_params, self.run.mesh)
        metrics, samples = self.run.evaluate(params, mesh=mesh)
        self._write_samples(samples)
        return metrics

    def _write_samples(self, samples: rollout_lib.Samples) -> None:
        if self.is_main:
            rollout_lib.write_samples(
                self.run_dir / SAMPLES_FILE,
                self.completed_steps,
                samples,
                show=self.cfg.logging.show_samples,
            )

    def export(self, directory) -> None:
        if self.base is not None:
            adapters.export_adapter(
                directory,
                self.run.model_config,
                self.policy_params,
                self.run.tokenizer,
                base_model=adapters.base_model_path(self.cfg, self.run_dir),
                stop_ids=self.run.stop_ids,
            )
            return
        export.export_policy(
            directory,
            self.run.model_config,
            self.policy_params,
            self.run.tokenizer,
            stop_ids=self.run.stop_ids,
            source=self.cfg.model.path,
        )

    def summary(self) -> dict[str, Any]:
        warmed = {k: self.extra[k] for k in (core.WARMUP_KEY,) if k in self.extra}
        return {"objective": self.run.objective.name, **warmed}
