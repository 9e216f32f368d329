"""The RL loop: rollout → reward → advantages → K epochs × minibatches of the sharded step.

``run(config)`` is the whole job behind ``jaxrl-llm train``. Each step draws prompts, samples G
completions per prompt, scores them on the host, optionally replaces zero-variance groups (DAPO
dynamic sampling), recomputes old (and reference) log-probs with the training forward,
computes advantages, and runs the jitted policy step over minibatches. Evaluation, metrics and
orbax checkpoints happen between steps. Every random draw is a function of ``(seed, step)`` and
the data position is checkpointed, so a resumed run repeats an uninterrupted one exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import data, models, objectives, parallel, rewards, sampling
from jaxrl_llm.train import rollout as rollout_lib
from jaxrl_llm.train.checkpoint import Checkpointer
from jaxrl_llm.train.config import TrainConfig
from jaxrl_llm.train.config_io import save_config
from jaxrl_llm.train.metrics import MetricsWriter, ProgressBar, plot
from jaxrl_llm.train.optim import make_optimizer
from jaxrl_llm.train.state import create_train_state
from jaxrl_llm.train.step import jit_step, make_logprob_fn, make_policy_step, make_sft_step
from jaxrl_llm.types import RolloutBatch

log = logging.getLogger("jaxrl_llm")

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_REFERENCE_MODES = ("frozen", "refresh", "ema")


def make_run_mesh(section) -> jax.sharding.Mesh:
    """The mesh of ``mesh.*``; without a ``-1`` the first ``data·fsdp·tensor`` devices are used."""
    sizes = (section.data, section.fsdp, section.tensor)
    devices = None
    if -1 not in sizes:
        count = int(np.prod(sizes))
        if count > jax.device_count():
            raise ValueError(f"mesh {sizes} needs {count} devices; {jax.device_count()} available")
        devices = jax.devices()[:count]
    return parallel.make_mesh(*sizes, devices=devices)


def build_policy(cfg: TrainConfig, mesh):
    """``(tokenizer, model_config, params or None)``; ``None`` means initialise randomly."""
    if cfg.model.dtype not in _DTYPES:
        raise ValueError(f"model.dtype must be one of {tuple(_DTYPES)}, got {cfg.model.dtype!r}")
    if cfg.model.path is not None:
        model_config, params = models.load_pretrained(
            cfg.model.path, dtype=_DTYPES[cfg.model.dtype], mesh=mesh
        )
        return models.load_tokenizer(cfg.model.path), model_config, params
    tokenizer = data.build_char_tokenizer(data.ARITHMETIC_ALPHABET)
    tiny = cfg.model.tiny
    # Like Megatron's padded vocabulary: the embedding rows are split over the
    # tensor axis, so round the row count up to a multiple of 8 and of that axis
    # (the same count with or without a mesh, so runs match across meshes). The
    # extra ids decode to nothing and earn no reward; the policy learns to avoid them.
    tensor = 1 if mesh is None else dict(mesh.shape).get("tensor", 1)
    multiple = math.lcm(8, tensor)
    vocab_size = -(-len(tokenizer) // multiple) * multiple
    model_config = models.ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=vocab_size,
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        head_dim=tiny.head_dim,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=(tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer, model_config, None


def load_examples(cfg: TrainConfig) -> tuple[list, list]:
    """``(train, eval)`` examples of the configured task."""
    section = cfg.data
    if section.task == "arithmetic":
        examples = data.arithmetic_examples(
            section.num_train + section.eval_size,
            seed=cfg.seed,
            digits=section.digits,
            ops=section.ops,
        )
        return examples[section.eval_size :], examples[: section.eval_size]
    if section.task != "jsonl":
        raise ValueError(f"data.task must be 'arithmetic' or 'jsonl', got {section.task!r}")
    if section.train_path is None:
        raise ValueError("data.task=jsonl needs data.train_path")
    fields = {"prompt_field": section.prompt_field, "answer_field": section.answer_field}
    train = data.load_jsonl(section.train_path, **fields)
    if section.eval_path is not None:
        return train, data.load_jsonl(section.eval_path, **fields)[: section.eval_size]
    return data.split_eval(train, eval_size=section.eval_size, seed=cfg.seed)


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


@dataclasses.dataclass
class _Run:
    """What one run holds between steps (host-side orchestration, not traced)."""

    cfg: TrainConfig
    mesh: Any
    tokenizer: Any
    model_config: Any
    objective: objectives.Objective
    reward_fn: Any
    train_examples: list
    eval_examples: list

    def prompts(self, examples) -> list[str]:
        return [
            data.format_prompt(
                ex.prompt,
                self.tokenizer,
                chat_template=self.cfg.data.chat_template,
                system_prompt=self.cfg.data.system_prompt,
            )
            for ex in examples
        ]

    def to_device(self, host: RolloutBatch) -> RolloutBatch:
        """Pads prompts to a bucketed width (few compiled programs) and shards the rows."""
        width = sampling.bucket_length(host.prompt_tokens.shape[1])
        extra = width - host.prompt_tokens.shape[1]
        host = host._replace(
            prompt_tokens=np.pad(host.prompt_tokens, ((0, 0), (extra, 0))),
            prompt_mask=np.pad(host.prompt_mask, ((0, 0), (extra, 0))),
        )
        if jax.process_count() > 1:
            rows = parallel.process_local_slice(host.completion_mask.shape[0], self.mesh)
            host = jax.tree.map(lambda x: x[rows], host)
        return parallel.shard_batch(host, self.mesh)

    def sample(self, params, examples, key, *, temperature, group_size) -> rollout_lib.Samples:
        r = self.cfg.rollout
        return rollout_lib.sample_and_score(
            params,
            self.model_config,
            self.tokenizer,
            examples,
            self.prompts(examples),
            key=key,
            reward_fn=self.reward_fn,
            group_size=group_size,
            max_new_tokens=r.max_new_tokens,
            max_prompt_tokens=self.cfg.data.max_prompt_tokens,
            temperature=temperature,
            add_special_tokens=not self.cfg.data.chat_template,
            top_k=r.top_k if temperature > 0 else 0,
            top_p=r.top_p,
            min_p=r.min_p,
            mesh=self.mesh,
        )

    def evaluate(self, params) -> dict[str, float]:
        """Greedy accuracy and mean reward on the held-out prompts."""
        samples = self.sample(
            params, self.eval_examples, jax.random.key(0), temperature=0.0, group_size=1
        )
        return {
            "accuracy": float(samples.correct.mean()),
            "reward_mean": float(samples.rewards.mean()),
        }


def _sft_warmup(run: _Run, params, key) -> Any:
    """Supervised warm-up on demonstrations, so RL starts from a policy that sometimes succeeds."""
    section = run.cfg.sft_warmup
    optimizer = make_optimizer(section.learning_rate, max_grad_norm=1.0)
    state, shardings = create_train_state(
        run.model_config, optimizer, key=key, mesh=run.mesh, params=params
    )
    step = jit_step(
        make_sft_step(
            run.model_config,
            optimizer,
            chunk_size=run.cfg.model.chunk_size,
            param_shardings=shardings.params,
        ),
        shardings,
    )
    rng = np.random.default_rng([run.cfg.seed, 1])
    for i in range(section.steps):
        idx = rng.integers(0, len(run.train_examples), section.batch_size)
        examples = [run.train_examples[j] for j in idx]
        prompt_tokens, prompt_mask = rollout_lib.encode_prompts(
            run.tokenizer,
            run.prompts(examples),
            max_prompt_tokens=run.cfg.data.max_prompt_tokens,
            add_special_tokens=not run.cfg.data.chat_template,
        )
        completion_tokens, completion_mask = rollout_lib.encode_completions(
            run.tokenizer,
            [data.demonstration(ex) for ex in examples],
            max_tokens=run.cfg.rollout.max_new_tokens,
        )
        zeros = np.zeros(completion_mask.shape, np.float32)
        host = RolloutBatch(
            completion_mask=completion_mask,
            old_logprobs=zeros,
            advantages=zeros[:, 0],
            prompt_tokens=prompt_tokens,
            prompt_mask=prompt_mask,
            completion_tokens=completion_tokens,
        )
        state, metrics = step(state, run.to_device(host))
        if (i + 1) % 100 == 0 or i + 1 == section.steps:
            log.info("sft step %d/%d nll %.4f", i + 1, section.steps, float(metrics["nll"]))
    return state.params


class RLTrainer:
    """One RL run: owns the state, the reference, the data position and the writers."""

    def __init__(self, cfg: TrainConfig):
        parallel.initialize_distributed()
        self.cfg = cfg
        self.run_dir = pathlib.Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.is_main = jax.process_index() == 0
        if self.is_main:
            save_config(cfg, self.run_dir / "config.yaml")
        objective = objectives.make(cfg.objective.name, **dict(cfg.objective.overrides))
        if objective.advantage in ("gae", "prime", "remax"):
            raise ValueError(
                f"objective {objective.name!r} ({objective.advantage} advantages) needs a critic, "
                "a process reward model or greedy baselines, which this loop does not build"
            )
        if cfg.reference.mode not in _REFERENCE_MODES:
            raise ValueError(f"reference.mode must be one of {_REFERENCE_MODES}")
        mesh = make_run_mesh(cfg.mesh)
        tokenizer, model_config, params = build_policy(cfg, mesh)
        train_examples, eval_examples = load_examples(cfg)
        reward_fn = rewards.combine_rewards(
            [(rewards.make_reward(t.name, **dict(t.kwargs)), t.weight) for t in cfg.rewards]
        )
        self.run = _Run(
            cfg, mesh, tokenizer, model_config, objective, reward_fn, train_examples, eval_examples
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
        self.metrics_writer = MetricsWriter(self.run_dir, tensorboard=cfg.logging.tensorboard)
        self._initial_params = params

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

    def _setup_state(self):
        run, cfg = self.run, self.cfg
        init_key, sft_key = jax.random.split(self.key)
        latest = self.checkpointer.latest_step()
        if latest is not None and not cfg.resume:
            raise ValueError(
                f"{self.run_dir} already holds checkpoints (latest step {latest}): pass "
                "resume=true to continue, or choose another run_dir"
            )
        params = self._initial_params
        if latest is None and cfg.sft_warmup.steps > 0:
            log.info("SFT warm-up: %d steps", cfg.sft_warmup.steps)
            params = _sft_warmup(run, params, sft_key)
        self.state, self.shardings = create_train_state(
            run.model_config, self.optimizer, key=init_key, mesh=run.mesh, params=params
        )
        self.copy_params = jax.jit(
            lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.shardings.params
        )
        needs_ref = run.objective.needs_reference
        self.reference = self.copy_params(self.state.params) if needs_ref else None
        self.reference_dirty = needs_ref
        self.extra: dict[str, Any] = {}
        if latest is not None:
            self._restore(latest)
        else:
            self.metrics_writer.truncate(0)

    def _restore(self, step: int) -> None:
        abstract = lambda tree: jax.tree.map(  # noqa: E731
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
        )
        state, extra, reference = self.checkpointer.restore(
            step,
            abstract_state=abstract(self.state),
            abstract_reference=None if self.reference is None else abstract(self.reference),
        )
        self.state, self.extra = state, dict(extra)
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
            self.state,
            extra=self.extra,
            reference_params=self.reference if self.reference_dirty else None,
        )
        self.reference_dirty = False

    def _update_reference(self, step: int) -> None:
        ref = self.cfg.reference
        if self.reference is None:
            return
        if ref.mode == "refresh" and ref.refresh_every and step % ref.refresh_every == 0:
            self.reference = self.copy_params(self.state.params)
            self.reference_dirty = True
        elif ref.mode == "ema":
            self.reference = _ema(self.reference, self.state.params, ref.ema_decay)
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
                self.state.params,
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
        old = rollout_lib.fetch(self.logprob_fn(self.state.params, device_batch))
        ref = None
        if self.reference is not None:
            ref = rollout_lib.fetch(self.logprob_fn(self.reference, device_batch))
        adv, _ = self.advantage_fn(samples.rewards, samples.completion_mask, old, ref)
        adv = np.asarray(adv, np.float32)
        t_logprobs = time.perf_counter() - t1
        host = host._replace(old_logprobs=old, ref_logprobs=ref, advantages=adv)

        t2 = time.perf_counter()
        updates = []
        minibatches = cfg.trainer.minibatches
        for epoch in range(cfg.trainer.epochs):
            order = np.random.default_rng([cfg.seed, step, epoch]).permutation(rows)
            for part in np.split(order, minibatches):
                minibatch = jax.tree.map(lambda x, rows=part: x[rows], host)
                self.state, metrics = self.update_fn(self.state, run.to_device(minibatch))
                updates.append(metrics)
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
            **update_metrics,
            "time/rollout": t_rollout,
            "time/logprobs": t_logprobs,
            "time/update": t_update,
            "time/step": time.perf_counter() - t0,
            "tokens_per_s": float(lengths.sum()) / max(t_rollout, 1e-9),
        }
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
            self.extra["eval_before_rl"] = self.run.evaluate(self.state.params)
            log.info("eval before RL: %s", self.extra["eval_before_rl"])
        start = int(self.state.step) // (cfg.trainer.epochs * cfg.trainer.minibatches)
        bar = ProgressBar(cfg.trainer.max_steps, initial=start, disable=not cfg.logging.progress)
        for step in range(start, cfg.trainer.max_steps):
            metrics = self.step(step)
            if cfg.trainer.eval_every and (step + 1) % cfg.trainer.eval_every == 0:
                metrics.update(
                    {f"eval/{k}": v for k, v in self.run.evaluate(self.state.params).items()}
                )
            if self.is_main:
                self.metrics_writer.write(step + 1, metrics)
            bar.update(metrics)
            if (step + 1) % cfg.checkpoint.every_steps == 0 or step + 1 == cfg.trainer.max_steps:
                self._save(step + 1)
        bar.close()
        after = self.run.evaluate(self.state.params)
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


@functools.partial(jax.jit, static_argnums=2)
def _ema(reference, params, decay: float):
    return jax.tree.map(
        lambda r, p: decay * r + (1.0 - decay) * p.astype(r.dtype), reference, params
    )


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Runs an RL job from a resolved config; returns the summary written to summary.json."""
    return RLTrainer(cfg).train()
