"""Config sections every job shares: the model, SFT warm-up, checkpoints, mesh and logging.

A job's config is a tree of frozen dataclasses that YAML maps onto (``train.config_io``): the RL
job's is ``train.rl.config.TrainConfig``, the preference / reward-model job's
``train.preference.config.PreferenceConfig``; both reuse these sections. A config is resolved
into plain Python values before anything is jitted; it never enters traced code.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal


@dataclasses.dataclass(frozen=True)
class TinyModelConfig:
    """Size of the built-in Llama-shaped model (used when ``model.path`` is null).

    ``vocab_multiple`` pads the character vocabulary to a multiple of it (and of the mesh's
    tensor axis, which must divide the embedding rows). ``experts > 0`` makes every layer's MLP
    a mixture of that many experts of width ``intermediate_size``, ``experts_per_token`` of
    them per token (Mixtral-shaped; ``models.moe``).
    """

    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    vocab_multiple: int = 1
    experts: int = 0
    experts_per_token: int = 2


@dataclasses.dataclass(frozen=True)
class LoraSection:
    """LoRA adapters (``model.lora``): only they are trained; the base is frozen.

    Attributes:
      rank: the adapters' rank r.
      alpha: scale numerator (scale = alpha / rank), PEFT's ``lora_alpha``.
      rslora: rank-stabilised scale ``alpha / sqrt(rank)`` (PEFT's ``use_rslora``).
      dropout: dropout on the adapters' input while training.
      targets: projections to adapt, from q, k, v, o, gate, up, down (default: all seven).
      sampler: how the RL sampler applies them: ``adapters`` (on the fly, every decode step),
        ``merged`` (merged into its copy of the base once per update; decoding runs the base
        model's program) or ``auto`` (merged where that moves fewer bytes and fits:
        ``train.adapters.merged_sampler``).
    """

    rank: int = 16
    alpha: float = 32.0
    rslora: bool = False
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    sampler: str = "auto"


ROUTING_REPLAY = ("off", "measure", "rollout")  # model.routing_replay


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Which policy to train.

    Attributes:
      path: a Hugging Face model directory (config.json + safetensors + tokenizer); null = the
        built-in tiny model with the character tokenizer.
      architecture: an architecture without weights: a name from ``configs/models/``
        (``qwen2.5-7b``, ``llama-3.1-70b``, ...) or a path to a Hugging Face ``config.json``.
        What ``jaxrl-llm plan`` compiles when ``path`` is null; a training job needs
        ``path`` (weights and tokenizer).
      param_dtype: dtype of the stored (master) weights the optimizer updates: ``float32``
        (default) or ``bfloat16`` (halves their memory, but small updates round away).
      compute_dtype: dtype of the matmuls and activations: ``auto`` (bfloat16 on TPU and GPU,
        float32 on CPU), ``float32`` or ``bfloat16``. Log-softmax, log-probs, losses and
        reductions are f32 either way. Applies to every model of the job (policy, critic,
        reward models) and to the sampler, whose KV cache is in it too.
      tiny: size of the built-in model.
      chunk_size: sequence chunk of the log-prob computation (null: automatic).
      remat: ``none``, ``layer`` (recompute each transformer layer in the backward pass instead
        of storing its activations: less memory, about one more forward of compute) or
        ``offload`` (``layer``, and the layer inputs it keeps in host memory; TPU/GPU).
      lora: train low-rank adapters on a frozen base instead of every weight (``LoraSection``);
        null = full fine-tuning. The base is kept in ``compute_dtype``, the adapters' master
        weights and moments in ``param_dtype``; the reference policy is the base itself.
      router_aux_loss_coef: weight of a mixture-of-experts policy's load-balancing loss
        (Switch / transformers' ``load_balancing_loss_func``) in the RL update; null = the
        checkpoint's ``router_aux_loss_coef`` (``config.json``; 0.001 for the Qwen MoE
        checkpoints and the built-in tiny MoE, 0.02 for Mixtral-8x7B), the weight HF training
        applies and Megatron-based RL recipes set (1e-3 for Qwen3-30B-A3B); 0 = off.
        Must stay null or 0 for a dense model.
      router_z_loss_coef: weight of the router z-loss (ST-MoE: the mean of
        ``logsumexp(router logits)^2``) in the RL update; 0 = off. Must be 0 for a dense model.
      routing_replay: routing replay for a mixture-of-experts RL policy (R3, Ma et al. 2025):
        ``off``; ``measure`` (the sampler records each token's experts and the update reports
        ``moe/routing_mismatch``, the share of completion tokens whose top-k set under the
        trainer's own router differs); ``rollout`` (also every training-side forward of the
        step, behaviour, reference and update, routes each token to the sampler's experts).
        Refused for a dense model and for a sampler on processes of its own.
    """

    path: str | None = None
    architecture: str | None = None
    param_dtype: str = "float32"
    compute_dtype: str = "auto"
    tiny: TinyModelConfig = TinyModelConfig()
    chunk_size: int | None = None
    remat: str = "none"
    lora: LoraSection | None = None
    router_aux_loss_coef: float | None = None
    router_z_loss_coef: float = 0.0
    routing_replay: bool | str = False

    def __post_init__(self):
        self.replay_mode  # noqa: B018  (checks model.routing_replay)
        coefs = (
            ("router_aux_loss_coef", self.router_aux_loss_coef),
            ("router_z_loss_coef", self.router_z_loss_coef),
        )
        for key, value in coefs:
            if value is None and key == "router_aux_loss_coef":
                continue
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (number and math.isfinite(value) and value >= 0):
                raise ValueError(f"model.{key} must be a finite number >= 0, got {value!r}")

    @property
    def replay_mode(self) -> str:
        """``model.routing_replay`` as one of ``ROUTING_REPLAY`` (YAML reads ``off`` as false).

        Raises:
          ValueError: anything else, naming the key.
        """
        value = self.routing_replay
        if value is False:
            return "off"
        if value not in ROUTING_REPLAY or value is True:
            raise ValueError(f"model.routing_replay must be one of {ROUTING_REPLAY}, got {value!r}")
        return value


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
    """The optimizer of a trainer section (``trainer.*`` of every job): AdamW after
    global-norm gradient clipping (``train.optim.make_trainer_optimizer``).

    Attributes:
      learning_rate: the peak learning rate.
      schedule: ``constant``, ``linear`` or ``cosine`` decay after the warm-up.
      warmup_steps: optimizer steps of linear warm-up from 0.
      final_lr_fraction: where the linear / cosine schedules end, as a fraction of the peak
        learning rate (0: decay to 0).
      weight_decay: AdamW's decoupled weight decay.
      max_grad_norm: the global-norm clip.
      optimizer_state_dtype: dtype of AdamW's moments: ``float32`` (default) or ``bfloat16``
        (halves their memory; the update is computed in f32 either way).
    """

    learning_rate: float = 2e-4
    schedule: str = "constant"
    warmup_steps: int = 0
    final_lr_fraction: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    optimizer_state_dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class SFTWarmupSection:
    """Supervised warm-up before the main job: RL on the task's demonstrations, preference jobs
    on the chosen completions.

    Attributes:
      steps: optimizer steps; null (the default) = on for the built-in tiny model (RL 2000,
        preference 600 steps), off for a loaded checkpoint (``model.path``). A run with a
        warm-up says so in its first lines.
      batch_size, learning_rate: the warm-up's batch and constant AdamW learning rate.
    """

    steps: int | None = None
    batch_size: int = 64
    learning_rate: float = 3e-3


@dataclasses.dataclass(frozen=True)
class RLWarmupSection(SFTWarmupSection):
    """An RL job's warm-up: :class:`SFTWarmupSection`, optionally stopped early once the policy
    solves enough of the task.

    Attributes:
      stop_at_accuracy: end the warm-up (before ``steps``) once greedy accuracy on a probe of
        ``data.eval_size`` *training* prompts (never the held-out ones) reaches this fraction,
        checked every ``check_every`` steps; null (the default) = always ``steps``. RL then
        starts from a policy of a given skill whatever the seed, device count or float
        summation order (the built-in model's warm-up crosses a sharp transition whose
        position those move by hundreds of steps).
      check_every: warm-up steps between probes.
    """

    stop_at_accuracy: float | None = None
    check_every: int = 50

    def __post_init__(self):
        stop = self.stop_at_accuracy
        if stop is not None and (isinstance(stop, bool) or not 0.0 < stop <= 1.0):
            raise ValueError(
                f"sft_warmup.stop_at_accuracy must be null or a fraction in (0, 1], got {stop!r}"
            )
        if self.check_every < 1:
            raise ValueError(f"sft_warmup.check_every must be >= 1, got {self.check_every}")


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    """orbax checkpoints of the whole state, the data position and the reference."""

    every_steps: int = 100
    keep: int = 2
    async_save: bool = True


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """Device mesh sizes (``-1`` fills with the remaining devices).

    ``expert``: expert parallelism for a mixture-of-experts model (a positive int, never
    filled; 1 = none). The mesh gains an ``expert`` axis of that size (``parallel.make_mesh``):
    each MoE layer's experts, and their optimizer moments, are split over it (``E / expert``
    experts per device, tokens exchanged by all-to-all; ``models.moe``), and every other layer
    treats it as one more data axis, so the batch splits over ``data x fsdp x expert``. The
    experts' count must divide by it; with ``fsdp: -1`` the fsdp axis takes the devices left.

    ``sequence``: context parallelism (a positive int, never filled; 1 = none). The mesh gains a
    ``sequence`` axis of that size: the training-side forwards (update, log-probs, critic)
    split every row's positions over it, gathering each layer's keys and values
    (``models.context_parallel``), and the weights are stored split over ``fsdp x sequence``.
    For completions too long for one chip's activations (32k-token chains of thought); not yet
    together with ``expert``.

    ``rollout_devices``: an RL job's first N devices only sample (their own serving mesh,
    weights copied over after each update); the trainer's mesh takes the rest. 0 = shared.
    On several processes the last N devices sample, and they must be whole processes
    (``train.rl.remote``: those processes only sample, process 0 trains).
    """

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    expert: int = 1
    sequence: int = 1
    rollout_devices: int = 0

    def __post_init__(self):
        for name, what in (("expert", "expert"), ("sequence", "context")):
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(
                    f"mesh.{name} must be a positive int (1: no {what} parallelism), got {size!r}"
                )
        if self.expert > 1 and self.sequence > 1:
            raise ValueError(
                f"mesh.expert={self.expert} and mesh.sequence={self.sequence}: expert and "
                "context parallelism do not combine yet; set one of them to 1"
            )


WANDB_MODES = ("online", "offline", "disabled")


@dataclasses.dataclass(frozen=True)
class WandbSection:
    """A Weights & Biases run mirroring ``metrics.jsonl`` (``logging.wandb``; see docs/logging.md).

    Attributes:
      project: the W&B project (required).
      mode: ``online`` (stream to the server), ``offline`` (write under ``<run_dir>/wandb/``
        only, for ``wandb sync`` later; needs no network or login) or ``disabled``; null (the
        default) = W&B's own default: the ``WANDB_MODE`` environment variable, else ``online``.
      entity: the W&B team or user (null: the login's default entity).
      name: the run's display name (null: the run directory's name).
      group, tags, notes: W&B's run grouping, tags and description.
    """

    project: str
    mode: Literal["online", "offline", "disabled"] | None = None
    entity: str | None = None
    name: str | None = None
    group: str | None = None
    tags: tuple[str, ...] = ()
    notes: str | None = None

    def __post_init__(self):
        if not self.project.strip():
            raise ValueError("logging.wandb.project must be a non-empty string")
        if self.mode is not None and self.mode not in WANDB_MODES:
            raise ValueError(
                f"logging.wandb.mode must be one of {', '.join(WANDB_MODES)} (or null), "
                f"got {self.mode!r}"
            )
        for key in ("entity", "name", "group"):
            if getattr(self, key) is not None and not getattr(self, key).strip():
                raise ValueError(f"logging.wandb.{key} must be null or a non-empty string")
        if any(not tag.strip() for tag in self.tags):
            raise ValueError(f"logging.wandb.tags must be non-empty strings, got {self.tags!r}")


@dataclasses.dataclass(frozen=True)
class LoggingSection:
    """What a run writes besides ``metrics.jsonl`` and ``summary.json``.

    Attributes:
      tensorboard: TensorBoard events under ``tensorboard/``: ``auto`` (the default) writes them
        when tensorboardX is installed (the ``tensorboard`` extra) and nothing otherwise;
        ``true`` says in one line when it is missing; ``false`` never.
      plots: ``plots/*.png`` at every evaluation and at the end.
      progress: progress bars (the SFT warm-up's and the steps').
      show_samples: completions printed at each evaluation (all go to ``samples.jsonl``).
      wandb: a W&B run logging the metrics, the config, the plots and the summary; null (the
        default) = off. Needs the ``wandb`` extra (``pip install "jaxrl-llm[wandb]"``).
    """

    tensorboard: bool | str = "auto"
    plots: bool = True
    progress: bool = True
    show_samples: int = 4
    wandb: WandbSection | None = None

    def __post_init__(self):
        if self.tensorboard not in (True, False, "auto"):
            raise ValueError(
                f"logging.tensorboard must be true, false or auto, got {self.tensorboard!r}"
            )
        if self.show_samples < 0:
            raise ValueError(f"logging.show_samples must be >= 0, got {self.show_samples}")
