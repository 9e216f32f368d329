"""The RL job's configuration (``job: rl``) and the one check every RL run passes first.

Defaults describe the built-in tiny CPU task (``jaxrl-llm train`` with no config): a tiny
Llama-shaped model with a character tokenizer learns 1–2 digit arithmetic, first from
demonstrations (a short SFT warm-up), then with GRPO.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxrl_llm import objectives, user_code
from jaxrl_llm.sampling.layout import DECODE_LAYERS
from jaxrl_llm.sampling.serving import TENSOR_CHOICES
from jaxrl_llm.train.config import (
    CheckpointSection,
    LoggingSection,
    MeshSection,
    ModelSection,
    OptimizerSection,
    RLWarmupSection,
)
from jaxrl_llm.train.packing import packing_mode
from jaxrl_llm.train.rl.tasks import DATA_TASKS, OVERLONG_PROMPTS, check_data  # noqa: F401
from jaxrl_llm.train.step import TokenBudget


@dataclasses.dataclass(frozen=True)
class DataSection:
    """Prompts and answers.

    Attributes:
      task: ``arithmetic`` (built-in), ``jsonl`` or ``hf`` (docs/datasets.md).
      train_path: JSONL file with ``prompt`` / ``answer`` fields (``task: jsonl``).
      eval_path: held-out JSONL; null = split ``eval_size`` examples off the training file.
      path, split, eval_split: ``task: hf``'s dataset on disk, its training split and its
        held-out split (null = split ``eval_size`` examples off the training split).
      eval_size: number of held-out prompts evaluated before / after RL and every
        ``trainer.eval_every`` steps.
      prompt_field, answer_field: field names; ``prompt_key`` / ``answer_key`` override them.
      messages_key: ``hf`` column of chat messages used as the prompt (needs chat_template).
      shuffle: ``hf``: rows in the seeded order ``default_rng(seed).permutation(N)``.
      chat_template: wrap prompts with the tokenizer's chat template.
      system_prompt: optional system message for the chat template.
      max_prompt_tokens: the longest prompt (formatted, in tokens).
      overlong_prompts: what a longer prompt does, checked once when the task loads:
        ``filter`` (dropped, and the count of each split logged), ``error`` (the run stops
        before training, naming the first such prompt) or ``truncate`` (its text is cut to fit,
        keeping the end with ``truncation_side: left`` as verl's, the start with ``right``).
      num_train, digits, ops: the built-in task's size (training prompts), operand digit
        counts and operators.
      slip_rate: ``task: carry_slips``: the share of carrying (borrowing) problems whose
        warm-up demonstration drops the carry (``data.carry_slips``).
    """

    task: str = "arithmetic"
    train_path: str | None = None
    eval_path: str | None = None
    path: str | None = None
    split: str = "train"
    eval_split: str | None = None
    eval_size: int = 128
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    prompt_key: str | None = None
    answer_key: str | None = None
    messages_key: str | None = None
    shuffle: bool = True
    chat_template: bool = False
    system_prompt: str | None = None
    max_prompt_tokens: int = 512
    overlong_prompts: str = "filter"
    truncation_side: str = "left"
    num_train: int = 4000
    digits: tuple[int, ...] = (1, 2)
    ops: tuple[str, ...] = ("+", "-")
    slip_rate: float = 0.7


@dataclasses.dataclass(frozen=True)
class RewardTerm:
    """One weighted reward function: a name from ``jaxrl_llm.rewards.REWARDS``, or
    ``"package.module:function"`` for your own ``fn(prompt, completion, example) -> float``;
    ``kwargs`` its keyword settings, e.g. ``overlong``'s ``{max_tokens: 512, buffer_tokens: 64}``.
    """

    name: str = "math_match"
    weight: float = 1.0
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ObjectiveSection:
    """An objective preset and overrides of any of its fields (``jaxrl_llm.objectives``).

    Attributes:
      name: a preset of ``objectives.available()``.
      overrides: fields of ``objectives.Objective``, e.g. ``{clip_high: 0.28}`` or
        ``{surrogate: my_surrogate}`` for one registered with ``objectives.register_surrogate``.
      imports: modules imported before the objective is built (where your own surrogates and
        estimators register themselves), e.g. ``[my_pkg.losses]``.
    """

    name: str = "grpo"
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    imports: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """Sampling.

    Attributes:
      prompts_per_step: prompts per RL step (each sampled ``group_size`` times).
      group_size: completions per prompt, G.
      max_new_tokens: completion length limit (T).
      temperature, top_p, top_k, min_p: sampling; the trainer recomputes log-probs at the same
        temperature.
      max_resample_attempts: DAPO dynamic sampling: extra draws allowed to replace groups whose
        rewards are all equal; groups still missing after that are kept with a zero mask.
      engine: ``static`` (one batch: every row decodes until the longest finishes) or
        ``continuous`` (``sampling.engine``: ``slots`` decode slots refilled as completions
        finish, the rest moved to smaller programs as the batch drains).
      slots: the continuous engine's decode slots (default: every row of the draw).
      burst: the continuous engine's decode steps per host round trip.
      logprobs: the update's behaviour log-probs: ``recompute`` (a trainer forward, skipped when
        the update is on-policy) or ``sampler`` (the sampler's own: verl's "bypass" mode); every
        step reports their distance (``rollout/logprob_diff_mean``, ``_max``, ``rollout/k3``).
      tensor_parallel: the sampler's tensor-parallel size (``auto``, ``trainer`` or an int;
        ``sampling.serving``).
      decode_layers: the decode loop's weights and cache ``stacked`` or ``per_layer`` (``auto``:
        per layer on CPU; on TPU per layer is as fast or faster, for a copy of the weights:
        ``sampling.layout.worth_unstacking``).
      reward_workers: processes that score completions (``rewards.ScoringPool``: verifiers
        such as ``code_exec`` run in parallel, off the trainer's process); 0 = in-process.
      max_staleness: rollouts generated ahead, beside the update (``train.rl.pipeline``): a
        step trains on samples of parameters up to this many updates old; 0 = synchronous.
      partial: partial rollouts (with ``max_staleness`` and the continuous engine): a rollout
        in flight takes each update's weights between bursts, each token tagged with its version.
      kv_block_size, kv_blocks: the continuous engine's paged KV cache (``sampling.paging``):
        blocks of this many slots (0: contiguous rows) and how many (default: every slot's
        longest request; fewer preempt and recompute the newest requests when they run out).
      expected_length_fraction: the expected mean completion length as a fraction ``f`` of
        ``max_new_tokens`` (``0 < f <= 1``; long chain-of-thought runs report about 0.3), for
        ``jaxrl-llm plan``'s real-token figures (goodput, MFU over real tokens); None:
        unknown (plan then counts full-length completions). Training ignores it.
    """

    prompts_per_step: int = 32
    group_size: int = 8
    max_new_tokens: int = 6
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_resample_attempts: int = 4
    engine: str = "static"
    slots: int | None = None
    burst: int = 8
    logprobs: str = "recompute"
    tensor_parallel: int | str = "auto"
    decode_layers: str = "auto"
    reward_workers: int = 0
    max_staleness: int = 0
    partial: bool = False
    kv_block_size: int = 0
    kv_blocks: int | None = None
    expected_length_fraction: float | None = None


ROLLOUT_ENGINES = ("static", "continuous")
ROLLOUT_LOGPROBS = ("recompute", "sampler")


@dataclasses.dataclass(frozen=True)
class TrainerSection(OptimizerSection):
    """The optimisation: the optimizer's fields (``OptimizerSection``) and these.

    Attributes:
      max_steps: RL steps.
      epochs: K update epochs over each rollout batch.
      minibatches: optimizer steps per epoch (each over ``B / minibatches`` rows).
      micro_batches: gradient-accumulation micro-batches inside each optimizer step (with
        ``micro_batch_tokens``: the least number of them).
      micro_batch_tokens: at most this many positions (prompt + completion) per device in
        one micro-batch: more micro-batches when a step's batch is larger (the count is
        chosen per padded batch shape, ``train.step.TokenBudget``); the update is the same,
        only its schedule changes. ``auto``: 4096 on CPU, where smaller working sets run
        faster (the frozen forwards: ``CPU_FORWARD_TOKENS``), and off elsewhere (``null``:
        exactly ``micro_batches``).
      eval_every: evaluate on held-out prompts every N steps (``eval/*`` metrics, plotted);
        0 = only before and after training.
      eval_k: besides greedy accuracy, each evaluation samples every held-out prompt
        ``eval_k`` times and reports ``pass@1``, ``pass@k``, ``mean@k``, ``maj@k`` with their
        95% bootstrap bounds (``_low`` / ``_high``), as ``jaxrl-llm eval --k`` does; 1 = greedy
        accuracy only.
      eval_temperature: the temperature of those samples (null: ``rollout.temperature``).
      stop_without_signal: stop the run (with advice) after this many steps in a row whose
        trained advantages are all exactly 0 (no learning signal: every group's completions
        got the same reward); the first such step is warned at once. 0: never stop.
      packing: sequence packing of the policy's training-side forwards (the update, the
        behaviour, reference and teacher log-probs; ``train.packing``): several sequences a
        row, attention within each, so no FLOPs go to padding and the losses see the same
        log-probs. ``on``: every batch; ``auto``: a batch whose packed rows are at most 3/4 of
        its padded rows (long-tailed lengths); ``off`` (the default): padded rows.
    """

    max_steps: int = 200
    epochs: int = 1
    minibatches: int = 1
    micro_batches: int = 1
    micro_batch_tokens: int | str | None = "auto"
    eval_every: int = 50
    eval_k: int = 1
    eval_temperature: float | None = None
    stop_without_signal: int = 20
    packing: bool | str = False


@dataclasses.dataclass(frozen=True)
class ReferenceSection:
    """The reference policy of the KL term.

    Attributes:
      mode: ``frozen`` (the initial policy), ``refresh`` (π_ref ← π_θ every
        ``refresh_every`` steps, DeepSeekMath's iterative scheme) or ``ema``
        (π_ref ← (1 − ema_decay)·π_θ + ema_decay·π_ref each step). No reference is built when
        the objective needs none.
    """

    mode: str = "frozen"
    refresh_every: int = 0
    ema_decay: float = 0.99


@dataclasses.dataclass(frozen=True)
class CriticSection:
    """PPO's value model: the transformer with a scalar head (``models.heads``).

    Attributes:
      init: ``policy`` (copy the policy's backbone, as verl and TRL do), ``reward_model`` (the
        backbone and head of the reward model at ``path``) or ``random``.
      path: a scalar-head model directory (``init: reward_model``).
      optimizer: ``separate`` (its own AdamW, learning rate below) or ``joint`` (one optimizer
        over policy and value parameters, loss ``pg + value_coef * vf``).
      learning_rate, max_grad_norm: the separate optimizer (``joint`` uses ``trainer.*``).
      warmup_steps: RL steps that train only the critic (the policy stays put), so advantages
        come from a fitted value function.
    """

    init: str = "policy"
    path: str | None = None
    optimizer: str = "separate"
    learning_rate: float = 1e-3
    max_grad_norm: float = 1.0
    warmup_steps: int = 0


@dataclasses.dataclass(frozen=True)
class PrimeSection:
    """PRIME's implicit process reward model: a trainable copy of the policy.

    Attributes:
      learning_rate, max_grad_norm: its AdamW.
      update: ``before`` (update on the step's outcome labels, then score — the PRIME paper's
        order) or ``after`` (score with the current PRM, then update).
    """

    learning_rate: float = 1e-3
    max_grad_norm: float = 1.0
    update: str = "before"


@dataclasses.dataclass(frozen=True)
class TeacherSection:
    """On-policy distillation's teacher: a frozen causal LM scoring the policy's own samples.

    Attributes:
      path: a Hugging Face checkpoint directory whose vocabulary is the policy's (they share
        the tokenizer); read by the objectives whose estimator takes the teacher's log-probs
        (``distill``: ``distill`` advantages; ``grpo_distill`` with a reward too). Stored in the
        compute dtype; its log-probs come from the same forward as the policy's.
      devices: 0 (the default): the teacher shares the trainer's devices; N: it lives on
        devices of its own, the last N of those the trainer would take (fsdp over them; one
        process), and the trainer's mesh takes the rest. Its forward then runs there, over
        the batch copied to them (packed for their batch shards), and its log-probs are
        copied back: a teacher too large to sit beside the policy's state, or one whose
        forward should not queue behind the trainer's programs.
      loss: ``jsd``: GKD's generalised JSD to the teacher's next-token distribution is added
        to the loss at every trained token (``Objective.distill_loss``; the
        ``distill_gkd`` objective trains by it alone); ``none``: no such loss; null: the
        objective's.
      jsd_beta: its ``β`` in ``[0, 1]`` (0: forward KL, 1: reverse KL; null: the objective's,
        0.5 unless set).
      top_k: the teacher's ``k`` most likely tokens the JSD is restricted to (both
        distributions renormalised over them): the teacher's forward returns their log-probs
        and ids ``[B, T, k]``, the update gathers the policy's log-probs of them in its own
        forward; null: the objective's (the whole vocabulary unless set, refused past
        ``FULL_VOCAB_BYTES`` of stored teacher log-probs).
      coef: the weight of the teacher's term: the JSD loss's with ``loss: jsd``, else the
        sampled-token advantage's (``distill`` / ``grpo_distill``: the objective's
        ``distill_coef``); null: the objective's (1.0).
    """

    path: str | None = None
    devices: int = 0
    loss: str | None = None
    jsd_beta: float | None = None
    top_k: int | None = None
    coef: float | None = None


@dataclasses.dataclass(frozen=True)
class RewardModelSection:
    """A trained scalar-head reward model scoring completions on device, added to the rewards.

    Attributes:
      path: a directory saved by ``models.heads.save_scalar_model`` (e.g. a ``job:
        reward_model`` run's ``reward_model/``); null = no learned reward.
      weight: its weight in the total reward.
      normalize: ``batch`` (z-score over the rollout batch, as verl/TRL users whiten scores),
        ``none``.
    """

    path: str | None = None
    weight: float = 1.0
    normalize: str = "batch"


@dataclasses.dataclass(frozen=True)
class EnvSection:
    """A multi-turn environment (``jaxrl_llm.envs``); null ``name`` = single-turn prompts.

    Each episode starts from ``reset(example)``'s messages; the policy and the environment
    take turns (tool calls answered by tool results) until the environment says done. The
    whole episode after the prompt is one completion of at most ``rollout.max_new_tokens``
    tokens, the environment's tokens in it with loss mask 0; its reward is the sum of the
    turns' rewards (``ToolEnv`` scores the final answer with the configured ``rewards``).

    Attributes:
      name: a key of ``envs.ENVIRONMENTS`` (``calculator``) or ``"package.module:factory"``
        for your own ``factory(reward_fn=..., **kwargs) -> Environment``.
      kwargs: the environment's settings (e.g. ``{timeout_s: 2.0, system_prompt: ...}``).
      max_turns: assistant turns an episode.
      max_turn_tokens: tokens one assistant turn may sample (null: what the episode has left).
    """

    name: str | None = None
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    max_turns: int = 4
    max_turn_tokens: int | None = None


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A whole RL run (``job: rl``; ``preference`` / ``reward_model`` jobs have their own
    config in ``train.preference``). Keys other code relies on: ``run_dir``, ``seed``, ``resume``,
    ``trainer.max_steps``, ``checkpoint.every_steps``, ``mesh.data|fsdp|tensor``."""

    job: str = "rl"
    run_dir: str = "runs/default"
    seed: int = 0
    resume: bool = False
    resume_force: bool = False
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    rewards: tuple[RewardTerm, ...] = (RewardTerm(),)
    objective: ObjectiveSection = ObjectiveSection()
    rollout: RolloutSection = RolloutSection()
    trainer: TrainerSection = TrainerSection()
    sft_warmup: RLWarmupSection = RLWarmupSection()
    reference: ReferenceSection = ReferenceSection()
    critic: CriticSection = CriticSection()
    prime: PrimeSection = PrimeSection()
    reward_model: RewardModelSection = RewardModelSection()
    teacher: TeacherSection = TeacherSection()
    env: EnvSection = EnvSection()
    checkpoint: CheckpointSection = CheckpointSection()
    mesh: MeshSection = MeshSection()
    logging: LoggingSection = LoggingSection()


REFERENCE_MODES = ("frozen", "refresh", "ema")
# trainer.micro_batch_tokens=auto on CPU (positions per micro-batch): the update's, and the
# frozen forwards' (no activations kept for a backward pass: on CPU a packed reference forward
# of 43k positions ran in 2.4 s at 16,384 a micro-batch, 3.9 s at 4,096, where the update runs
# fastest; benchmarks/bench_grpo_step.py --mean-fraction 0.3 --max-new-tokens 512).
CPU_MICRO_BATCH_TOKENS = 4096
CPU_FORWARD_TOKENS = 4 * CPU_MICRO_BATCH_TOKENS
CRITIC_INITS = ("policy", "reward_model", "random")
CRITIC_OPTIMIZERS = ("separate", "joint")
PRM_UPDATES = ("before", "after")
RM_NORMALIZE = ("batch", "none")


def _choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{key} must be one of {choices}, got {value!r}")


def _at_least(key: str, value: int | float, low: int | float) -> None:
    if not value >= low:
        raise ValueError(f"{key} must be >= {low}, got {value!r}")


def micro_batching(trainer: TrainerSection, platform: str) -> int | TokenBudget:
    """What ``make_step`` takes as ``micro_batches`` for a run on ``platform``.

    ``trainer.micro_batches`` when ``trainer.micro_batch_tokens`` is off (``null``, or ``auto``
    off CPU), else a ``TokenBudget`` with ``micro_batches`` as its minimum.
    """
    tokens = trainer.micro_batch_tokens
    if tokens == "auto":
        tokens = CPU_MICRO_BATCH_TOKENS if platform == "cpu" else None
    if tokens is None:
        return trainer.micro_batches
    return TokenBudget(tokens=tokens, minimum=trainer.micro_batches)


def forward_micro_batching(trainer: TrainerSection, platform: str) -> int | TokenBudget:
    """The same for the frozen log-prob forwards: the token budget alone (no floor), else 1.

    ``trainer.micro_batches`` sizes the update's activations (kept for the backward pass); a
    forward keeps none, so it runs whole unless a token budget asks otherwise. ``auto`` on CPU
    gives the forwards ``CPU_FORWARD_TOKENS``, larger than the update's.
    """
    if trainer.micro_batch_tokens == "auto" and platform == "cpu":
        return TokenBudget(CPU_FORWARD_TOKENS)
    micro = micro_batching(trainer, platform)
    return TokenBudget(micro.tokens) if isinstance(micro, TokenBudget) else 1


def rollout_rows(rollout: RolloutSection) -> int:
    """``B``, the rows of one rollout batch: ``prompts_per_step x group_size``."""
    return rollout.prompts_per_step * rollout.group_size


def make_objective(section: ObjectiveSection) -> objectives.Objective:
    """Imports ``objective.imports`` (user registrations), then builds the objective."""
    for module in section.imports:
        user_code.import_module(module, "objective.imports")
    try:
        return objectives.make(section.name, **dict(section.overrides))
    except ValueError as err:
        raise ValueError(f"objective: {err}") from None


TEACHER_LOSSES = ("none", "jsd")


def with_teacher(
    objective: objectives.Objective, teacher: TeacherSection, overrides: Any = ()
) -> objectives.Objective:
    """The objective with the ``teacher`` section's loss keys applied (``teacher.loss`` →
    ``distill_loss``, ``jsd_beta``, ``top_k`` → ``distill_top_k``, ``coef`` →
    ``distill_loss_coef`` with a JSD loss, else ``distill_coef``); unset keys (null) leave the
    objective's. ``overrides``: the ``objective.overrides`` names, which the teacher's keys
    may not set a second time.

    Raises:
      ValueError: naming the key of a bad value, a key set in both places, or JSD settings
        without a JSD loss.
    """
    fields: dict[str, Any] = {}
    if teacher.loss is not None:
        _choice("teacher.loss", teacher.loss, TEACHER_LOSSES)
        fields["distill_loss"] = None if teacher.loss == "none" else teacher.loss
    jsd = fields.get("distill_loss", objective.distill.loss) is not None
    beta, top_k, coef = teacher.jsd_beta, teacher.top_k, teacher.coef
    if beta is not None:
        if isinstance(beta, bool) or not isinstance(beta, int | float) or not 0 <= beta <= 1:
            raise ValueError(f"teacher.jsd_beta must be in [0, 1], got {beta!r}")
        fields["jsd_beta"] = float(beta)
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(
                f"teacher.top_k must be an integer >= 1 (the teacher's most likely tokens) or "
                f"null, got {top_k!r}"
            )
        fields["distill_top_k"] = top_k
    if (beta is not None or top_k is not None) and not jsd:
        raise ValueError(
            "teacher.jsd_beta and teacher.top_k shape the JSD distillation loss: set "
            "teacher.loss=jsd (or objective.name=distill_gkd)"
        )
    if coef is not None:
        if isinstance(coef, bool) or not isinstance(coef, int | float) or not coef >= 0:
            raise ValueError(f"teacher.coef must be a number >= 0, got {coef!r}")
        fields["distill_loss_coef" if jsd else "distill_coef"] = float(coef)
    twice = sorted(set(fields) & set(dict(overrides)))
    if twice:
        raise ValueError(
            f"objective.overrides sets {twice}, which the teacher section sets too "
            "(teacher.loss / jsd_beta / top_k / coef): set them in one place"
        )
    if not fields:
        return objective
    return objective.replace(**fields)


#: The most bytes of stored teacher log-probs and ids ``[B, T, V]`` (f32 + int32) a step may
#: carry for a JSD over the whole vocabulary (``teacher.top_k: null``); past it, set a k.
FULL_VOCAB_BYTES = 2**30


def teacher_top_k(objective: objectives.Objective, vocab: int, rows: int, length: int) -> int:
    """``k`` of the teacher's top-k for a JSD-distilling ``objective``: ``distill_top_k``, or
    the vocabulary ``V`` (the full distribution) when it is None.

    Raises:
      ValueError: a k larger than the vocabulary, or a full vocabulary whose ``[B, T, V]``
        log-probs and ids (``rows x length x vocab x 8`` bytes) exceed ``FULL_VOCAB_BYTES``.
    """
    k = objective.distill.top_k
    if k is not None:
        if k > vocab:
            raise ValueError(f"teacher.top_k={k} is larger than the vocabulary ({vocab} tokens)")
        return k
    size = rows * length * vocab * 8
    if size > FULL_VOCAB_BYTES:
        raise ValueError(
            f"teacher.top_k=null (the JSD over the whole vocabulary) stores the teacher's "
            f"[B, T, V] = [{rows}, {length}, {vocab}] log-probs and ids, {size / 2**30:.1f} GiB "
            f"a step (over {FULL_VOCAB_BYTES / 2**30:.0f} GiB): set teacher.top_k, e.g. 64"
        )
    return vocab


def check_teacher(cfg: TrainConfig, objective: objectives.Objective) -> None:
    """A teacher exactly when the objective distils (its advantages or a JSD loss), and a JSD
    loss only where the policy trainer's update computes it.

    Raises:
      ValueError: naming the key of the missing, unused or unsupported setting.
    """
    teacher = cfg.teacher
    by_advantage = "teacher_logprobs" in objective.estimator_requires
    if objective.needs_teacher and teacher.path is None:
        why = (
            f"{objective.advantage.name} advantages"
            if by_advantage
            else f"its {objective.distill.loss} distillation loss"
        )
        raise ValueError(
            f"objective {objective.name!r} ({why}) needs a teacher: set teacher.path to a "
            "Hugging Face checkpoint sharing the policy's tokenizer"
        )
    if teacher.path is not None and not objective.needs_teacher:
        raise ValueError(
            f"teacher.path is read by the distillation objectives (distill or grpo_distill "
            f"advantages, e.g. objective.name=distill, or a JSD loss: teacher.loss=jsd), not "
            f"by {objective.name!r}"
        )
    if teacher.coef is not None and not objective.needs_teacher:
        raise ValueError(
            "teacher.coef weighs a teacher's term: set teacher.path and a distillation "
            "objective (objective.name=distill) or teacher.loss=jsd"
        )
    if objective.distill.loss is not None and (
        objective.needs_critic or objective.needs_process_rewards
    ):
        raise ValueError(
            f"teacher.loss={objective.distill.loss} is computed by the policy trainer's update; "
            f"objective {objective.name!r} ({objective.advantage.name} advantages) trains a critic "
            "or a process reward model beside it, which it does not support yet"
        )


def check_config(cfg: TrainConfig) -> objectives.Objective:
    """Every check an RL run makes before it builds anything; returns the objective.

    Raises:
      ValueError: naming the key(s) of an invalid or inconsistent setting.
    """
    if cfg.job != "rl":
        raise ValueError(f"the RL trainer runs job 'rl', not {cfg.job!r}")
    objective = make_objective(cfg.objective)
    r, t = cfg.rollout, cfg.trainer
    for key, value in (
        ("rollout.prompts_per_step", r.prompts_per_step),
        ("rollout.group_size", r.group_size),
        ("rollout.max_new_tokens", r.max_new_tokens),
        ("trainer.epochs", t.epochs),
        ("trainer.minibatches", t.minibatches),
        ("trainer.micro_batches", t.micro_batches),
        ("checkpoint.every_steps", cfg.checkpoint.every_steps),
        ("data.eval_size", cfg.data.eval_size),
    ):
        _at_least(key, value, 1)
    _at_least("trainer.max_steps", t.max_steps, 0)  # 0: the warm-up only (evaluated, exported)
    _at_least("rollout.temperature", r.temperature, 0.0)
    _at_least("rollout.burst", r.burst, 1)
    _at_least("rollout.reward_workers", r.reward_workers, 0)
    _at_least("rollout.max_staleness", r.max_staleness, 0)
    _at_least("rollout.slots", 1 if r.slots is None else r.slots, 1)
    _choice("rollout.logprobs", r.logprobs, ROLLOUT_LOGPROBS)
    _choice("rollout.engine", r.engine, ROLLOUT_ENGINES)
    _choice("rollout.decode_layers", r.decode_layers, DECODE_LAYERS)
    _at_least("rollout.kv_block_size", r.kv_block_size, 0)
    _at_least("rollout.kv_blocks", 1 if r.kv_blocks is None else r.kv_blocks, 1)
    packing_mode(t.packing)  # one of auto, on, off
    fraction = r.expected_length_fraction
    if fraction is not None and not (isinstance(fraction, int | float) and 0 < fraction <= 1):
        raise ValueError(
            f"rollout.expected_length_fraction must be in (0, 1] (the expected mean completion "
            f"length over rollout.max_new_tokens) or null, got {fraction!r}"
        )
    if (r.kv_block_size or r.kv_blocks) and (r.engine != "continuous" or not r.kv_block_size):
        raise ValueError(
            "rollout.kv_blocks and rollout.kv_block_size (a paged KV cache) need "
            f"rollout.engine=continuous and kv_block_size >= 1; got engine={r.engine!r}, "
            f"kv_block_size={r.kv_block_size}"
        )
    fix = objective.correction
    if fix is not None and (fix.mode == "bypass") != (r.logprobs == "sampler"):
        need = "sampler" if fix.mode == "bypass" else "recompute"  # the old policy's
        raise ValueError(f"rollout_correction mode={fix.mode} needs rollout.logprobs={need}")
    tp = r.tensor_parallel
    if isinstance(tp, bool) or not (tp in TENSOR_CHOICES or (isinstance(tp, int) and tp >= 1)):
        raise ValueError(
            f"rollout.tensor_parallel must be one of {TENSOR_CHOICES} or a positive int, got {tp!r}"
        )
    _at_least("rollout.max_resample_attempts", r.max_resample_attempts, 0)
    _at_least("trainer.eval_every", t.eval_every, 0)
    _at_least("trainer.eval_k", t.eval_k, 1)
    _at_least("trainer.stop_without_signal", t.stop_without_signal, 0)
    if t.eval_temperature is not None:
        _at_least("trainer.eval_temperature", t.eval_temperature, 0.0)
    tokens = t.micro_batch_tokens
    if not (tokens is None or tokens == "auto" or (isinstance(tokens, int) and tokens >= 1)):
        raise ValueError(
            f"trainer.micro_batch_tokens must be 'auto', null or an integer >= 1 (positions "
            f"per device per micro-batch), got {tokens!r}"
        )
    rows = rollout_rows(r)
    if rows % t.minibatches:
        raise ValueError(
            f"trainer.minibatches={t.minibatches} does not divide the rollout batch "
            f"{rows} (rollout.prompts_per_step x rollout.group_size)"
        )
    if (rows // t.minibatches) % t.micro_batches:
        raise ValueError(
            f"trainer.micro_batches={t.micro_batches} does not divide the minibatch of "
            f"{rows // t.minibatches} rows"
        )
    check_data(cfg.data)
    ref = cfg.reference
    _choice("reference.mode", ref.mode, REFERENCE_MODES)
    if ref.mode == "refresh" and ref.refresh_every < 1:
        raise ValueError(
            f"reference.mode=refresh needs reference.refresh_every >= 1 (steps between "
            f"refreshes), got {ref.refresh_every}"
        )
    if ref.mode == "ema" and not 0.0 <= ref.ema_decay < 1.0:
        raise ValueError(f"reference.ema_decay must be in [0, 1), got {ref.ema_decay}")
    _choice("reward_model.normalize", cfg.reward_model.normalize, RM_NORMALIZE)
    objective = with_teacher(objective, cfg.teacher, cfg.objective.overrides)
    if r.group_size < objective.min_group_size:
        raise ValueError(
            f"objective {objective.name!r} ({objective.advantage.name} advantages) needs "
            f"rollout.group_size >= {objective.min_group_size}, got {r.group_size}"
        )
    if objective.needs_critic:
        critic = cfg.critic
        _choice("critic.init", critic.init, CRITIC_INITS)
        _choice("critic.optimizer", critic.optimizer, CRITIC_OPTIMIZERS)
        if critic.init == "reward_model" and critic.path is None:
            raise ValueError("critic.init=reward_model needs critic.path (a scalar-head model)")
        _at_least("critic.warmup_steps", critic.warmup_steps, 0)
    if objective.needs_process_rewards:
        _choice("prime.update", cfg.prime.update, PRM_UPDATES)
    check_teacher(cfg, objective)
    _at_least("teacher.devices", cfg.teacher.devices, 0)
    if cfg.teacher.devices and cfg.teacher.path is None:
        raise ValueError("teacher.devices places a teacher: set teacher.path too")
    if cfg.teacher.devices and jax.process_count() > 1:
        raise ValueError(
            f"teacher.devices={cfg.teacher.devices} runs on one process so far (this job has "
            f"{jax.process_count()}); set teacher.devices=0 to share the trainer's devices"
        )
    from jaxrl_llm.train.rl.episodes import check_env  # noqa: PLC0415  (imports envs)

    check_env(cfg, objective)
    return objective
