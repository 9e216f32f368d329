"""The run configuration: a tree of frozen dataclasses that YAML configs map onto.

Defaults describe the built-in tiny CPU task (``jaxrl-llm train`` with no config): a tiny
Llama-shaped model with a character tokenizer learns 1–2 digit arithmetic, first from
demonstrations (a short SFT warm-up), then with GRPO. A config is resolved into plain Python
values before anything is jitted; it never enters traced code.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class TinyModelConfig:
    """Size of the built-in Llama-shaped model (used when ``model.path`` is null).

    ``vocab_multiple`` pads the character vocabulary to a multiple of it (and of the mesh's
    tensor axis, which must divide the embedding rows).
    """

    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    vocab_multiple: int = 1


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Which policy to train.

    Attributes:
      path: a Hugging Face model directory (config.json + safetensors + tokenizer); null = the
        built-in tiny model with the character tokenizer.
      dtype: parameter dtype (``float32`` | ``bfloat16``).
      tiny: size of the built-in model.
      chunk_size: sequence chunk of the log-prob computation (null: automatic).
      remat: ``none`` or ``layer``: recompute each transformer layer in the backward pass
        instead of storing its activations (less memory, about one more forward of compute).
    """

    path: str | None = None
    dtype: str = "float32"
    tiny: TinyModelConfig = TinyModelConfig()
    chunk_size: int | None = None
    remat: str = "none"


@dataclasses.dataclass(frozen=True)
class DataSection:
    """Prompts and answers.

    Attributes:
      task: ``arithmetic`` (built-in) or ``jsonl``.
      train_path: JSONL file with ``prompt`` / ``answer`` fields (``task: jsonl``).
      eval_path: held-out JSONL; null = split ``eval_size`` examples off the training file.
      eval_size: number of held-out prompts evaluated before / after RL and every
        ``trainer.eval_every`` steps.
      prompt_field, answer_field: JSONL field names.
      chat_template: wrap prompts with the tokenizer's chat template.
      system_prompt: optional system message for the chat template.
      max_prompt_tokens: longer prompts are an error (never silently truncated).
      num_train: built-in task size (training prompts).
      digits: built-in task operand digit counts.
      ops: built-in task operators.
    """

    task: str = "arithmetic"
    train_path: str | None = None
    eval_path: str | None = None
    eval_size: int = 128
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    chat_template: bool = False
    system_prompt: str | None = None
    max_prompt_tokens: int = 512
    num_train: int = 4000
    digits: tuple[int, ...] = (1, 2)
    ops: tuple[str, ...] = ("+", "-")


@dataclasses.dataclass(frozen=True)
class RewardTerm:
    """One weighted reward function: a name from ``jaxrl_llm.rewards.REWARDS``, or
    ``"package.module:function"`` for your own ``fn(prompt, completion, example) -> float``.

    ``kwargs`` are the reward's keyword settings, e.g. ``overlong`` needs
    ``{max_tokens: 512, buffer_tokens: 64}`` (counted in tokens).
    """

    name: str = "math_match"
    weight: float = 1.0
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ObjectiveSection:
    """An objective preset and overrides of any of its fields (``jaxrl_llm.objectives``)."""

    name: str = "grpo"
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)


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
    """

    prompts_per_step: int = 32
    group_size: int = 8
    max_new_tokens: int = 6
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_resample_attempts: int = 4


@dataclasses.dataclass(frozen=True)
class TrainerSection:
    """The optimisation.

    Attributes:
      max_steps: RL steps.
      epochs: K update epochs over each rollout batch.
      minibatches: optimizer steps per epoch (each over ``B / minibatches`` rows).
      micro_batches: gradient-accumulation micro-batches inside each optimizer step.
      learning_rate, schedule, warmup_steps, weight_decay, max_grad_norm: optax AdamW.
      eval_every: evaluate on held-out prompts every N steps (0 = only before / after).
    """

    max_steps: int = 200
    epochs: int = 1
    minibatches: int = 1
    micro_batches: int = 1
    learning_rate: float = 5e-4
    schedule: str = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    eval_every: int = 0


@dataclasses.dataclass(frozen=True)
class SFTWarmupSection:
    """Supervised warm-up on demonstrations before RL (built-in task; 0 steps = off)."""

    steps: int = 800
    batch_size: int = 64
    learning_rate: float = 3e-3


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
class CheckpointSection:
    """orbax checkpoints of the whole state, the data position and the reference."""

    every_steps: int = 100
    keep: int = 2
    async_save: bool = True


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """Device mesh sizes (``-1`` fills with the remaining devices)."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1


@dataclasses.dataclass(frozen=True)
class LoggingSection:
    tensorboard: bool = True
    plots: bool = True
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A whole RL run (``job: rl``; ``preference`` / ``reward_model`` jobs have their own
    config in ``train.preference``). Keys other code relies on: ``run_dir``, ``seed``, ``resume``,
    ``trainer.max_steps``, ``checkpoint.every_steps``, ``mesh.data|fsdp|tensor``."""

    job: str = "rl"
    run_dir: str = "runs/default"
    seed: int = 0
    resume: bool = False
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    rewards: tuple[RewardTerm, ...] = (RewardTerm(),)
    objective: ObjectiveSection = ObjectiveSection()
    rollout: RolloutSection = RolloutSection()
    trainer: TrainerSection = TrainerSection()
    sft_warmup: SFTWarmupSection = SFTWarmupSection()
    reference: ReferenceSection = ReferenceSection()
    critic: CriticSection = CriticSection()
    prime: PrimeSection = PrimeSection()
    reward_model: RewardModelSection = RewardModelSection()
    checkpoint: CheckpointSection = CheckpointSection()
    mesh: MeshSection = MeshSection()
    logging: LoggingSection = LoggingSection()
