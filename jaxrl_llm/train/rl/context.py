"""What an RL run holds between steps: task data, rewards, stop tokens, and how to sample.

:class:`RunContext` is host-side orchestration (never traced): it formats prompts, samples and
scores a batch (adding a learned reward model's scores on device), places batches on the mesh
and evaluates greedily on the held-out prompts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import pathlib
from typing import Any

import jax
import numpy as np

from jaxrl_llm import data, models, objectives, parallel, rewards
from jaxrl_llm.evaluation.sampled import sampled_report
from jaxrl_llm.models import heads
from jaxrl_llm.train import packing as packing_lib
from jaxrl_llm.train import setup
from jaxrl_llm.train.rl import episodes, tasks
from jaxrl_llm.train.rl import rollout as rollout_lib
from jaxrl_llm.train.rl.config import RM_NORMALIZE, TrainConfig
from jaxrl_llm.train.rl.spec import SamplerSettings, sampler_settings
from jaxrl_llm.types import Sequences

log = logging.getLogger("jaxrl_llm")


def load_examples(cfg: TrainConfig, tokenizer: Any = None) -> tuple[list, list]:
    """``(train, eval)`` examples of the configured task; with the ``tokenizer``, checked to be
    readable by it (``tasks.check_readable``) and screened for prompts over
    ``data.max_prompt_tokens`` (``screen_prompts``)."""
    train, held_out = _load_examples(cfg)
    if tokenizer is None:
        return train, held_out
    tasks.check_readable(tokenizer, train + held_out, builtin=cfg.model.path is None)
    return (
        screen_prompts(cfg, tokenizer, train, "train"),
        screen_prompts(cfg, tokenizer, held_out, "eval"),
    )


def task_reward(cfg: TrainConfig):
    """The configured reward: ``rewards``' terms, made and weighted (``combine_rewards``)."""
    return rewards.combine_rewards(
        [(rewards.make_reward(t.name, **dict(t.kwargs)), t.weight) for t in cfg.rewards]
    )


def screen_prompts(cfg: TrainConfig, tokenizer: Any, examples: list, split: str) -> list:
    """``examples`` whose formatted prompt (chat template, system prompt, as the rollout
    tokenises it) fits ``data.max_prompt_tokens``; the others are dropped
    (``data.overlong_prompts=filter``), refused (``error``) or cut to fit
    (``truncate``: ``tasks.truncate_example``, keeping the ``data.truncation_side``), and
    counted in a log line.

    Raises:
      ValueError: ``error`` mode and an overlong prompt (naming it, its length and the key),
        or no example left at all.
    """
    section, limit = cfg.data, cfg.data.max_prompt_tokens
    kept, dropped, truncated, longest = [], 0, 0, 0
    for ex in examples:
        text, length = tasks.formatted_length(section, tokenizer, ex)
        if length <= limit:
            kept.append(ex)
            continue
        if section.overlong_prompts == "error":
            raise ValueError(
                f"a {split} prompt of {length} tokens exceeds data.max_prompt_tokens={limit} "
                f"({text[:80]!r}...): raise the limit or set data.overlong_prompts=filter or "
                "truncate"
            )
        longest = max(longest, length)
        fitted = None
        if section.overlong_prompts == "truncate":
            fitted = tasks.truncate_example(section, tokenizer, ex, limit)
        if fitted is None:
            dropped += 1
        else:
            kept.append(fitted[0])
            truncated += 1
    if truncated:
        log.warning(
            "data: truncated %d of %d %s prompts longer than data.max_prompt_tokens=%d (longest "
            "%d tokens) to their %s",
            truncated,
            len(examples),
            split,
            limit,
            longest,
            "end" if section.truncation_side == "left" else "beginning",
        )
    if dropped:
        log.warning(
            "data: dropped %d of %d %s prompts longer than data.max_prompt_tokens=%d (longest "
            "%d tokens)%s",
            dropped,
            len(examples),
            split,
            limit,
            longest,
            ": the chat template, system prompt or earlier turns alone exceed it"
            if section.overlong_prompts == "truncate"
            else "",
        )
    if examples and not kept:
        raise ValueError(
            f"every {split} prompt exceeds data.max_prompt_tokens={limit} (longest {longest} "
            "tokens): raise the limit"
        )
    return kept


def _load_examples(cfg: TrainConfig) -> tuple[list, list]:
    return tasks.load_task(cfg.data, cfg.seed)


def reward_model_program(rm_config) -> Any:
    """The learned reward model's scoring program (``rm_scores``): ``heads.sequence_scores``
    of ``rm_config`` jitted, ``(params, seqs, packing=None) -> [B]``; the trainer calls it,
    ``plan`` lowers it. ``packing``: a one-micro-batch stacked plan of ``seqs``' rows
    (``reward_model_plan``; leaves ``[1, shards, rows, W]``): the backbone runs over packed
    rows, the same scores; None: padded."""

    def score_fn(params, seqs: Sequences, packing=None):
        plan = None if packing is None else packing_lib.micro_plan(packing, 0)
        return heads.sequence_scores(params, rm_config, *seqs, packing=plan)

    return jax.jit(score_fn)


def reward_model_plan(mode: Any, seqs: Sequences, mesh) -> Any:
    """The packing plan (on device) of the reward model's scoring forward over the host rows
    ``seqs`` (prompts already bucketed), one micro-batch, per data shard of ``mesh``; or None
    (padded) when ``mode`` (``trainer.packing``, ``train.packing.worth_packing``) says so."""
    mode = packing_lib.packing_mode(mode)
    if mode == "off":
        return None
    plan = packing_lib.plan_micro_batches(
        seqs.prompt_mask,
        seqs.completion_mask,
        micro_batches=1,
        shards=parallel.batch_shards(mesh),
    )
    if not packing_lib.worth_packing(plan, len(seqs.completion_mask), mode):
        return None
    return packing_lib.place_plan(plan, mesh)


def load_reward_model(cfg: TrainConfig, precision, policy_config, mesh):
    """``(score_fn, params)`` of ``reward_model.path`` (scored on device), or None: frozen,
    stored in the compute dtype (nothing updates it)."""
    path = cfg.reward_model.path
    if path is None:
        return None
    rm_config, params = setup.load_model(
        path,
        precision,
        head="scalar",
        frozen=True,
        mesh=mesh,
        policy=policy_config,
        key="reward_model.path",
    )
    return reward_model_program(rm_config), params


def load_teacher(cfg: TrainConfig, precision, policy_config, tokenizer, mesh):
    """``(config, params)`` of ``teacher.path`` (on-policy distillation), or None: frozen,
    in the compute dtype, on the trainer's mesh.

    Raises:
      ValueError: a teacher whose vocabulary differs from the policy's (size, or the
        tokenizer saved beside it).
    """
    path = cfg.teacher.path
    if path is None:
        return None
    config, params = setup.load_model(
        path, precision, frozen=True, mesh=mesh, policy=policy_config, key="teacher.path"
    )
    if any(pathlib.Path(path, name).is_file() for name in TOKENIZER_FILES):
        theirs = models.load_tokenizer(path).get_vocab()
        if theirs != tokenizer.get_vocab():
            differ = sorted(set(theirs.items()) ^ set(tokenizer.get_vocab().items()))[:3]
            raise ValueError(
                f"teacher.path {path!r}: its tokenizer is not the policy's (e.g. {differ}); "
                "distillation compares log-probs token by token, so they must share one"
            )
    return config, params


#: Files of a saved Hugging Face tokenizer (any one of them: the directory has one).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def normalize_scores(scores: np.ndarray, mode: str) -> np.ndarray:
    """``batch``: ``(s − mean) / (std + 1e-6)`` over the rollout batch, ``std`` the population
    std (ddof 0), in float64 then cast to float32 (a single score is left as it is);
    ``none``: unchanged (float32)."""
    if mode not in RM_NORMALIZE:
        raise ValueError(f"reward_model.normalize must be one of {RM_NORMALIZE}, got {mode!r}")
    scores = np.asarray(scores, np.float64)
    if mode == "batch" and scores.size > 1:
        scores = (scores - scores.mean()) / (scores.std() + 1e-6)
    return scores.astype(np.float32)


@dataclasses.dataclass
class RunContext:
    """What one RL run holds between steps (host-side orchestration, not traced)."""

    cfg: TrainConfig
    mesh: Any
    tokenizer: Any
    model_config: Any
    objective: objectives.Objective
    reward_fn: Any
    train_examples: list
    eval_examples: list
    stop_ids: tuple[int, ...]
    reward_model: Any = None  # (score_fn, params) of a learned reward model, or None
    env: Any = None  # the multi-turn environment of env.name (``envs.Environment``), or None
    scorer: Any = None  # a ``rewards.ScoringPool`` (rollout.reward_workers > 0), or None
    sampler_config: Any = None  # the sampler's model when not ``model_config`` (merged LoRA)

    @functools.cached_property
    def settings(self) -> SamplerSettings:
        """The run's resolved sampler settings (``spec.sampler_settings``)."""
        return sampler_settings(self.cfg)

    @functools.cached_property
    def drawer(self) -> rollout_lib.Drawer:
        """How this run draws samples: its environment's episodes (``env.name``), else the
        continuous or the static engine (``rollout.engine``)."""
        if self.env is not None:
            return episodes.EpisodeDrawer(self)
        if self.settings.engine == "continuous":
            return rollout_lib.ContinuousDrawer(self)
        return rollout_lib.StaticDrawer(self)

    @property
    def sampling_config(self):
        """The ``ModelConfig`` the sampler decodes: a LoRA run's base with merged weights
        (``model.lora.sampler``), else the policy's."""
        return self.model_config if self.sampler_config is None else self.sampler_config

    def prompts(self, examples) -> list[str]:
        return [
            data.format_example(
                ex,
                self.tokenizer,
                chat_template=self.cfg.data.chat_template,
                system_prompt=self.cfg.data.system_prompt,
            )
            for ex in examples
        ]

    def to_device(self, host):
        """Pads prompts to a bucketed width (few compiled programs) and shards the rows."""
        return setup.to_device(setup.bucket_prompts(host), self.mesh)

    def sample(
        self,
        params,
        examples,
        key,
        *,
        temperature,
        group_size,
        timer=None,
        mesh=None,
        defer=False,
        updates=None,
        version=0,
    ) -> rollout_lib.Samples:
        """``group_size`` completions of each example's prompt, scored (learned reward added),
        by the run's :attr:`drawer`.

        ``mesh``: the mesh ``params`` live on (default: the run's; the trainer passes its
        serving layout's, ``sampling.serving``). ``defer``: with scoring workers
        (``rollout.reward_workers``) return while they score (``Samples.scoring``);
        :meth:`finish_scoring` completes the draw. ``updates``, ``version``: partial rollouts
        (``rollout_lib.DrawRequest``)."""
        request = rollout_lib.DrawRequest(
            temperature=temperature,
            group_size=group_size,
            mesh=self.mesh if mesh is None else mesh,
            timer=timer,
            defer=defer,
            updates=updates,
            version=version,
        )
        samples = self.drawer.draw(params, examples, key, request)
        return samples if samples.scoring else self._scored(samples, timer)

    def finish_scoring(self, samples: rollout_lib.Samples, timer=None) -> rollout_lib.Samples:
        """A deferred draw (``sample(defer=True)``) completed: waits for the scoring workers
        (the ``scoring`` phase) and adds the learned reward; a scored draw comes back as is."""
        return self._scored(samples, timer) if samples.scoring else samples

    def _scored(self, samples: rollout_lib.Samples, timer) -> rollout_lib.Samples:
        with timer.phase("scoring") if timer else contextlib.nullcontext():
            return self.add_learned_reward(rollout_lib.finish_scoring(samples))

    def add_learned_reward(self, samples: rollout_lib.Samples) -> rollout_lib.Samples:
        """Adds ``weight * normalise(RM score)`` of the learned reward model, scored on device
        (over packed rows with ``trainer.packing``: ``reward_model_plan``)."""
        if self.reward_model is None:
            return samples
        score_fn, rm_params = self.reward_model
        section = self.cfg.reward_model
        seqs = setup.bucket_prompts(
            Sequences(
                samples.prompt_tokens,
                samples.prompt_mask,
                samples.completion_tokens,
                samples.completion_mask,
            )
        )
        plan = reward_model_plan(self.cfg.trainer.packing, seqs, self.mesh)
        scores = parallel.fetch(score_fn(rm_params, setup.to_device(seqs, self.mesh), plan))
        scores = normalize_scores(scores, section.normalize)
        components = dict(samples.components)
        components["reward_model"] = scores
        return samples._replace(
            rewards=(samples.rewards + section.weight * scores).astype(np.float32),
            components=components,
        )

    def evaluate(self, params, *, mesh=None) -> tuple[dict[str, float], rollout_lib.Samples]:
        """Greedy accuracy and mean reward on the held-out prompts, and the samples; with
        ``trainer.eval_k > 1`` also pass@k, mean@k, maj@k of ``eval_k`` samples a prompt
        (``evaluation.sampled_report``, seeded by the run seed: every evaluation of a run
        draws with the same key)."""
        samples = self.sample(
            params, self.eval_examples, jax.random.key(0), temperature=0.0, group_size=1, mesh=mesh
        )
        metrics = {
            "accuracy": float(samples.correct.mean()),
            "reward_mean": float(samples.rewards.mean()),
        }
        t = self.cfg.trainer
        if t.eval_k > 1:
            temperature = (
                self.cfg.rollout.temperature if t.eval_temperature is None else t.eval_temperature
            )
            summary, _ = sampled_report(
                self,
                params,
                self.eval_examples,
                k=t.eval_k,
                samples=t.eval_k,
                temperature=temperature,
                seed=self.cfg.seed,
                mesh=mesh,
                batch_prompts=eval_batch_prompts(self.cfg.rollout, t.eval_k),
            )
            metrics |= {key: value for key, value in summary.items() if "@" in key}
        return metrics, samples


def eval_batch_prompts(rollout, samples: int) -> int:
    """Prompts an evaluation drawing ``samples`` completions a prompt samples at a time: about
    a rollout batch's rows (``prompts_per_step x group_size``, what the sampler holds in
    training), in whole multiples of ``prompts_per_step`` (which the mesh's batch shards
    divide, as they divide ``data.eval_size``, so every batch does)."""
    return rollout.prompts_per_step * max(1, rollout.group_size // samples)


def make_run_context(
    cfg: TrainConfig, mesh, tokenizer, model_config, objective, *, reward_model=None
) -> RunContext:
    """A run's :class:`RunContext`: the task's examples (screened against the prompt limit),
    its reward, stop tokens, environment and scoring workers (``rollout.reward_workers``)."""
    train_examples, eval_examples = load_examples(cfg, tokenizer)
    reward_fn = task_reward(cfg)
    workers = cfg.rollout.reward_workers
    return RunContext(
        cfg,
        mesh,
        tokenizer,
        model_config,
        objective,
        reward_fn,
        train_examples,
        eval_examples,
        stop_ids=data.stop_token_ids(tokenizer, model_config, cfg.model.path),
        reward_model=reward_model,
        env=episodes.make_run_env(cfg, reward_fn),
        scorer=rewards.ScoringPool(reward_fn, workers) if workers else None,
    )
