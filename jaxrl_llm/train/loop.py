"""The RL loop: rollout → reward → advantages → K epochs × minibatches of the sharded step.

``run(config)`` is the whole job behind ``jaxrl-llm train``. Each step draws prompts, samples G
completions per prompt, scores them on the host, optionally replaces zero-variance groups (DAPO
dynamic sampling), recomputes old (and reference) log-probs with the training forward,
computes advantages, and runs the jitted policy step over minibatches. Evaluation, metrics and
orbax checkpoints happen between steps. Every random draw is a function of ``(seed, step)`` and
the data position is checkpointed, so a resumed run repeats an uninterrupted one exactly.
"""

from __future__ import annotations

import functools
import logging
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import data, objectives, parallel, rewards
from jaxrl_llm.train import rollout as rollout_lib
from jaxrl_llm.train.checkpoint import Checkpointer
from jaxrl_llm.train.config import TrainConfig
from jaxrl_llm.train.config_io import save_config
from jaxrl_llm.train.metrics import MetricsWriter, ProgressBar, plot
from jaxrl_llm.train.optim import make_optimizer
from jaxrl_llm.train.run_setup import (  # noqa: F401  (re-exported: the loop's public pieces)
    RunContext,
    build_policy,
    load_examples,
    load_reward_model,
    make_run_mesh,
    sft_warmup,
)
from jaxrl_llm.train.state import create_train_state
from jaxrl_llm.train.step import jit_step, make_logprob_fn, make_policy_step
from jaxrl_llm.types import RolloutBatch

log = logging.getLogger("jaxrl_llm")

_REFERENCE_MODES = ("frozen", "refresh", "ema")


def _mean_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    out = {}
    for key in rows[0]:
        values = np.array([float(r[key]) for r in rows])
        if key.endswith("_max"):
            out[key] = float(values.max())
        elif key.endswith("_min"):
            out[key] = float(values.min())
        else:
            out[key] = float(values.mean())
    return out


class RLTrainer:
    """One RL run: owns the state, the reference, the data position and the writers."""

    def __init__(self, cfg: TrainConfig):
        parallel.initialize_distributed()
        self.cfg = cfg
        self.run_dir = pathlib.Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.is_main = jax.process_index() == 0
        if cfg.job != "rl":
            raise ValueError(f"RLTrainer runs job 'rl', not {cfg.job!r}")
        objective = objectives.make(cfg.objective.name, **dict(cfg.objective.overrides))
        self._check_objective(objective)
        _check_reference(cfg.reference)
        mesh = make_run_mesh(cfg.mesh)
        tokenizer, model_config, params = build_policy(cfg, mesh)
        train_examples, eval_examples = load_examples(cfg)
        reward_fn = rewards.combine_rewards(
            [(rewards.make_reward(t.name, **dict(t.kwargs)), t.weight) for t in cfg.rewards]
        )
        self.run = RunContext(
            cfg,
            mesh,
            tokenizer,
            model_config,
            objective,
            reward_fn,
            train_examples,
            eval_examples,
            reward_model=load_reward_model(cfg, model_config, mesh),
        )
        self._check_sizes(mesh)
        self.sampler = data.PromptSampler(train_examples, seed=cfg.seed)
        self.key = jax.random.key(cfg.seed)
        t = cfg.trainer
        self.optimizer = make_optimizer(
            t.learning_rate,
            schedule=t.schedule,
            warmup_steps=t.warmup_steps,
            total_steps=t.max_steps * t.epochs * t.minibatches,
            weight_decay=t.weight_decay,
            max_grad_norm=t.max_grad_norm,
        )
        self.checkpointer = Checkpointer(
            self.run_dir / "checkpoints",
            keep=cfg.checkpoint.keep,
            async_save=cfg.checkpoint.async_save,
        )
        latest = self.checkpointer.latest_step()
        if latest is not None and not cfg.resume:
            raise ValueError(
                f"{self.run_dir} already holds checkpoints (latest step {latest}): pass "
                "resume=true to continue, or choose another run_dir"
            )
        # Only a config that passed every check is written to the run directory.
        if self.is_main:
            save_config(cfg, self.run_dir / "config.yaml")
        self.metrics_writer = MetricsWriter(self.run_dir, tensorboard=cfg.logging.tensorboard)
        self._initial_params = params

    def _check_objective(self, objective: objectives.Objective) -> None:
        if objective.advantage in ("gae", "prime"):
            raise ValueError(
                f"objective {objective.name!r} ({objective.advantage} advantages) needs a critic "
                "or a process reward model: run it with train.loop.run, which picks the trainer"
            )

    def _check_sizes(self, mesh) -> None:
        cfg = self.cfg
        shards = int(np.prod([mesh.shape[a] for a in parallel.batch_mesh_axes(mesh)]))
        rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        minibatch = rows // max(cfg.trainer.minibatches, 1)
        checks = {
            "rollout batch (prompts_per_step x group_size)": rows,
            "minibatch": minibatch,
            "data.eval_size": cfg.data.eval_size,
        }
        if cfg.sft_warmup.steps:
            checks["sft_warmup.batch_size"] = cfg.sft_warmup.batch_size
        if rows % max(cfg.trainer.minibatches, 1):
            raise ValueError(
                f"trainer.minibatches={cfg.trainer.minibatches} does not divide {rows}"
            )
        for name, size in checks.items():
            if size % shards:
                raise ValueError(
                    f"{name}={size} does not divide into the {shards} batch shards of the mesh "
                    f"{dict(mesh.shape)}"
                )

    # -- state -------------------------------------------------------------------------------

    @property
    def policy_params(self):
        """The policy's parameters (subclasses may keep them inside a larger state)."""
        return self.state.params

    def checkpoint_state(self):
        """The pytree checkpointed at each save (subclasses add their other networks)."""
        return self.state

    def set_checkpoint_state(self, tree) -> None:
        self.state = tree

    def _setup_state(self):
        run, cfg = self.run, self.cfg
        init_key, sft_key = jax.random.split(self.key)
        latest = self.checkpointer.latest_step()
        params, self._initial_params = self._initial_params, None  # the state takes them over
        if latest is None and cfg.sft_warmup.steps > 0:
            log.info("SFT warm-up: %d steps", cfg.sft_warmup.steps)
            params = sft_warmup(run, params, sft_key)
        self.state, self.shardings = create_train_state(
            run.model_config, self.optimizer, key=init_key, mesh=run.mesh, params=params
        )
        self.copy_params = jax.jit(
            lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.shardings.params
        )
        self._setup_extra_networks()
        needs_ref = run.objective.needs_reference
        self.reference = self.copy_params(self.policy_params) if needs_ref else None
        if needs_ref and cfg.reference.mode == "ema":
            # An f32 average: in bf16 the (1 - decay)-sized steps towards the policy round away.
            self.reference = jax.tree.map(lambda x: x.astype(jnp.float32), self.reference)
        self.reference_dirty = needs_ref
        self.extra: dict[str, Any] = {}
        # Checkpoints are numbered by RL step; the optimizer's step count is not one (several
        # updates per RL step, none for a policy held still during a critic warm-up).
        self.start_step = 0 if latest is None else latest
        if latest is not None:
            self._restore(latest)
        else:
            self.metrics_writer.truncate(0)

    def _setup_extra_networks(self) -> None:
        """Hook: critics, process reward models (created after the policy state)."""

    def _restore(self, step: int) -> None:
        abstract = lambda tree: jax.tree.map(  # noqa: E731
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
        )
        state, extra, reference = self.checkpointer.restore(
            step,
            abstract_state=abstract(self.checkpoint_state()),
            abstract_reference=None if self.reference is None else abstract(self.reference),
        )
        self.set_checkpoint_state(state)
        self.extra = dict(extra)
        if self.reference is not None:
            if reference is None:
                raise ValueError(f"checkpoint {step} has no reference parameters to resume from")
            self.reference = reference
            self.reference_dirty = False
        self.sampler.restore(extra["sampler"])
        self.metrics_writer.truncate(step)
        log.info("resumed from step %d", step)

    def _save(self, step: int) -> None:
        self.extra["sampler"] = self.sampler.state()
        self.checkpointer.save(
            step,
            self.checkpoint_state(),
            extra=self.extra,
            reference_params=self.reference if self.reference_dirty else None,
        )
        self.reference_dirty = False

    def _update_reference(self, step: int) -> None:
        ref = self.cfg.reference
        if self.reference is None:
            return
        if ref.mode == "refresh" and ref.refresh_every and step % ref.refresh_every == 0:
            self.reference = self.copy_params(self.policy_params)
            self.reference_dirty = True
        elif ref.mode == "ema":
            self.reference = _ema(self.reference, self.policy_params, ref.ema_decay)
            self.reference_dirty = True

    # -- one step ----------------------------------------------------------------------------

    def _rollout(self, step: int) -> tuple[rollout_lib.Samples, dict[str, float]]:
        """Samples the step's groups; DAPO dynamic sampling replaces zero-variance groups."""
        run, r = self.run, self.cfg.rollout
        group = r.group_size
        step_key = jax.random.fold_in(self.key, step)
        kept: list[rollout_lib.Samples] = []
        dropped_pool: list[rollout_lib.Samples] = []
        need, dropped, attempts, zero_var_frac = r.prompts_per_step, 0, 0, None
        while need > 0:
            # Always a full draw: one sampler program, whatever is still missing.
            examples = self.sampler.next_batch(r.prompts_per_step)
            samples = run.sample(
                self.policy_params,
                examples,
                jax.random.fold_in(step_key, attempts),
                temperature=r.temperature,
                group_size=group,
            )
            constant = rollout_lib.constant_groups(samples.rewards, group)
            if zero_var_frac is None:
                zero_var_frac = float(constant.mean())
            if not run.objective.dynamic_sampling:
                kept.append(samples)
                need = 0
                break
            good = np.flatnonzero(~constant)[:need]
            kept.append(rollout_lib.select_groups(samples, good, group))
            dropped_pool.append(rollout_lib.select_groups(samples, np.flatnonzero(constant), group))
            dropped += int(constant.sum())
            need -= len(good)
            attempts += 1
            if attempts > r.max_resample_attempts:
                break
        filled = 0
        if need > 0:
            # Out of attempts: keep the batch shape (no re-trace) with zero-mask groups.
            pool = rollout_lib.concat_samples(dropped_pool)
            filler = rollout_lib.select_groups(pool, np.arange(need), group)
            kept.append(filler._replace(completion_mask=np.zeros_like(filler.completion_mask)))
            filled = need
        samples = rollout_lib.concat_samples(kept) if len(kept) > 1 else kept[0]
        info = {"zero_variance_frac": zero_var_frac}
        if run.objective.dynamic_sampling:
            info.update(
                {
                    "dynamic/dropped_groups": dropped,
                    "dynamic/filled_groups": filled,
                    "dynamic/attempts": attempts,
                }
            )
        return samples, info

    def step(self, step: int) -> dict[str, float]:
        run, cfg = self.run, self.cfg
        t0 = time.perf_counter()
        samples, info = self._rollout(step)
        t_rollout = time.perf_counter() - t0
        rows = samples.completion_mask.shape[0]
        zeros = np.zeros(samples.completion_mask.shape, np.float32)
        host = RolloutBatch(
            completion_mask=samples.completion_mask,
            old_logprobs=zeros,
            advantages=zeros,
            prompt_tokens=samples.prompt_tokens,
            prompt_mask=samples.prompt_mask,
            completion_tokens=samples.completion_tokens,
        )
        t1 = time.perf_counter()
        device_batch = run.to_device(host)
        old = rollout_lib.fetch(self.logprob_fn(self.policy_params, device_batch))
        ref = None
        if self.reference is not None:
            ref = rollout_lib.fetch(self.logprob_fn(self.reference, device_batch))
        host = host._replace(old_logprobs=old, ref_logprobs=ref, rewards=samples.rewards)
        host, score_metrics = self.score(step, samples, host, device_batch)
        adv = host.advantages
        t_logprobs = time.perf_counter() - t1

        t2 = time.perf_counter()
        updates = []
        minibatches = cfg.trainer.minibatches
        for epoch in range(cfg.trainer.epochs):
            order = np.random.default_rng([cfg.seed, step, epoch]).permutation(rows)
            for part in np.split(order, minibatches):
                minibatch = jax.tree.map(lambda x, rows=part: x[rows], host)
                updates.append(self.update(step, run.to_device(minibatch)))
        update_metrics = _mean_metrics(jax.device_get(updates))
        t_update = time.perf_counter() - t2
        self._update_reference(step + 1)

        mask = samples.completion_mask
        lengths = mask.sum(axis=1)
        valid_adv = adv if adv.ndim == 1 else adv[mask]
        metrics = {
            "reward_mean": float(samples.rewards.mean()),
            "reward_std": float(samples.rewards.std()),
            "accuracy": float(samples.correct.mean()),
            "advantage_mean": float(valid_adv.mean()),
            "advantage_std": float(valid_adv.std()),
            "advantage_max": float(valid_adv.max()),
            "advantage_min": float(valid_adv.min()),
            "completion_length_mean": float(lengths.mean()),
            "completion_length_max": float(lengths.max()),
            "completion_clipped_frac": float((~samples.finished).mean()),
            **{f"reward/{k}": float(np.mean(v)) for k, v in samples.components.items()},
            **{k: float(v) for k, v in info.items()},
            **score_metrics,
            **update_metrics,
            "time/rollout": t_rollout,
            "time/logprobs": t_logprobs,
            "time/update": t_update,
            "time/step": time.perf_counter() - t0,
            "tokens_per_s": float(lengths.sum()) / max(t_rollout, 1e-9),
        }
        return metrics

    def score(
        self, step: int, samples: rollout_lib.Samples, host: RolloutBatch, device_batch
    ) -> tuple[RolloutBatch, dict[str, float]]:
        """Hook: fills ``host.advantages`` (and whatever else the update needs)."""
        adv, _ = self.advantage_fn(
            samples.rewards, samples.completion_mask, host.old_logprobs, host.ref_logprobs
        )
        return host._replace(advantages=np.asarray(adv, np.float32)), {}

    def update(self, step: int, minibatch: RolloutBatch) -> dict[str, Any]:
        """Hook: one optimizer step on a device minibatch; returns its metrics."""
        self.state, metrics = self.update_fn(self.state, minibatch)
        return metrics

    # -- the run -----------------------------------------------------------------------------

    def _compile(self) -> None:
        run, cfg = self.run, self.cfg
        self.update_fn = jit_step(
            make_policy_step(
                run.model_config,
                run.objective,
                self.optimizer,
                micro_batches=cfg.trainer.micro_batches,
                temperature=cfg.rollout.temperature,
                chunk_size=cfg.model.chunk_size,
                remat=cfg.model.remat,
                param_shardings=self.shardings.params,
            ),
            self.shardings,
        )
        self.logprob_fn = make_logprob_fn(
            run.model_config,
            temperature=cfg.rollout.temperature,
            chunk_size=cfg.model.chunk_size,
            param_shardings=self.shardings.params,
        )
        self.advantage_fn = jax.jit(
            functools.partial(_advantages, run.objective, group_size=cfg.rollout.group_size)
        )

    def train(self) -> dict[str, Any]:
        cfg = self.cfg
        self._setup_state()
        self._compile()
        if "eval_before_rl" not in self.extra:
            self.extra["eval_before_rl"] = self.run.evaluate(self.policy_params)
            log.info("eval before RL: %s", self.extra["eval_before_rl"])
        start = self.start_step
        bar = ProgressBar(cfg.trainer.max_steps, initial=start, disable=not cfg.logging.progress)
        for step in range(start, cfg.trainer.max_steps):
            metrics = self.step(step)
            if cfg.trainer.eval_every and (step + 1) % cfg.trainer.eval_every == 0:
                metrics.update(
                    {f"eval/{k}": v for k, v in self.run.evaluate(self.policy_params).items()}
                )
            if self.is_main:
                self.metrics_writer.write(step + 1, metrics)
            bar.update(metrics)
            if (step + 1) % cfg.checkpoint.every_steps == 0 or step + 1 == cfg.trainer.max_steps:
                self._save(step + 1)
        bar.close()
        after = self.run.evaluate(self.policy_params)
        summary = {
            "eval_before_rl": self.extra["eval_before_rl"],
            "eval_after_rl": after,
            "steps": cfg.trainer.max_steps,
            "objective": self.run.objective.name,
        }
        self.checkpointer.wait()
        if self.is_main:
            self.metrics_writer.write_summary(summary)
            if cfg.logging.plots:
                plot(self.run_dir)
        self.metrics_writer.close()
        self.checkpointer.close()
        log.info("eval after RL: %s", after)
        return summary


def _advantages(objective, rewards, mask, old, ref, *, group_size):
    return objectives.compute_advantages(
        objective, rewards, mask, group_size=group_size, old_logprobs=old, ref_logprobs=ref
    )


def _check_reference(section) -> None:
    if section.mode not in _REFERENCE_MODES:
        raise ValueError(f"reference.mode must be one of {_REFERENCE_MODES}, got {section.mode!r}")
    if section.mode == "refresh" and section.refresh_every < 1:
        raise ValueError(
            f"reference.mode=refresh needs reference.refresh_every >= 1 (steps between "
            f"refreshes), got {section.refresh_every}"
        )
    if section.mode == "ema" and not 0.0 <= section.ema_decay < 1.0:
        raise ValueError(f"reference.ema_decay must be in [0, 1), got {section.ema_decay}")


@functools.partial(jax.jit, static_argnums=2)
def _ema(reference, params, decay: float):
    return jax.tree.map(
        lambda r, p: decay * r + (1.0 - decay) * p.astype(r.dtype), reference, params
    )


def trainer_for(cfg: TrainConfig) -> RLTrainer:
    """The trainer an objective needs: PPO's critic (``gae``), PRIME's process reward model
    (``prime``), or the plain policy trainer."""
    advantage = objectives.make(cfg.objective.name, **dict(cfg.objective.overrides)).advantage
    if advantage == "gae":
        from jaxrl_llm.train.ppo import PPOTrainer  # noqa: PLC0415  (imports this module)

        return PPOTrainer(cfg)
    if advantage == "prime":
        from jaxrl_llm.train.prime import PRIMETrainer  # noqa: PLC0415

        return PRIMETrainer(cfg)
    return RLTrainer(cfg)


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Runs an RL job from a resolved config; returns the summary written to summary.json."""
    return trainer_for(cfg).train()
