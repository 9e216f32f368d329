"""Config sections every job shares: the model, SFT warm-up, checkpoints, mesh and logging.

A job's config is a tree of frozen dataclasses that YAML maps onto (``train.config_io``): the RL
job's is ``train.rl.config.TrainConfig``, the preference / reward-model job's
``train.preference.config.PreferenceConfig``; both reuse these sections. A config is resolved
into plain Python values before anything is jitted; it never enters traced code.
"""

from __future__ import annotations

import dataclasses


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
      remat: ``none`` or ``layer``: recompute each transformer layer in the backward pass
        instead of storing its activations (less memory, about one more forward of compute).
    """

    path: str | None = None
    architecture: str | None = None
    param_dtype: str = "float32"
    compute_dtype: str = "auto"
    tiny: TinyModelConfig = TinyModelConfig()
    chunk_size: int | None = None
    remat: str = "none"


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
    """What a run writes besides ``metrics.jsonl`` and ``summary.json``.

    Attributes:
      tensorboard: TensorBoard events under ``tensorboard/`` (when tensorboardX is installed).
      plots: ``plots/*.png`` at every evaluation and at the end.
      progress: a progress bar.
      show_samples: completions printed at each evaluation (all go to ``samples.jsonl``).
    """

    tensorboard: bool = True
    plots: bool = True
    progress: bool = True
    show_samples: int = 4
