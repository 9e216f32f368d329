"""The configuration of offline preference jobs (``job: preference``) and reward models
(``job: reward_model``): frozen dataclasses that YAML configs map onto.

Defaults describe the built-in task: the tiny Llama-shaped model of ``train.config`` with the
character tokenizer, a short SFT warm-up on the chosen answers, then DPO on synthetic
arithmetic pairs (chosen = the correct answer, rejected = a wrong one). ``check_config`` is
run before anything is built, so a bad combination fails with a message naming the keys.
"""

from __future__ import annotations

import dataclasses
import math

from jaxrl_llm.preference import (
    LOSS_TYPES,
    ORPO_NLL_MODES,
    check_dpo_settings,
    check_label_smoothing,
)
from jaxrl_llm.train.config import (
    CheckpointSection,
    LoggingSection,
    MeshSection,
    ModelSection,
    OptimizerSection,
    SFTWarmupSection,
)
from jaxrl_llm.train.packing import packing_mode

JOBS = ("preference", "reward_model")
LOSS_NAMES = ("dpo", "kto", "orpo", "simpo", "cpo", "alphapo", "bradley_terry")
REFERENCE_FREE = ("orpo", "simpo", "cpo", "alphapo", "bradley_terry")
#: The losses on AlphaPO-shaped rewards (``loss.alpha``).
ALPHA_LOSSES = ("simpo", "cpo", "alphapo")
REFERENCE_MODES = ("precompute", "on_the_fly")
DATA_TASKS = ("arithmetic", "jsonl")


@dataclasses.dataclass(frozen=True)
class PreferenceDataSection:
    """Preference pairs (or KTO's unpaired examples) and how they are tokenised.

    Attributes:
      task: ``arithmetic`` (built-in synthetic pairs) or ``jsonl``.
      train_path: JSONL of pairs (``prompt`` / ``chosen`` / ``rejected``) or, with
        ``unpaired``, of labelled completions (``prompt`` / ``completion`` / ``label``).
      eval_path: held-out JSONL of the same shape; null = split ``eval_size`` records off the
        training file.
      eval_size: held-out records (built-in task, or split off ``train_path``); with
        ``eval_path`` at most this many of its records are used.
      unpaired: the JSONL holds unpaired labelled completions (KTO only).
      prompt_field, chosen_field, rejected_field, completion_field, label_field: field names.
      margin_field: a numeric per-pair field used as the Bradley-Terry margin (every record
        must hold it); null = no margin.
      chat_template: wrap prompts with the tokenizer's chat template.
      system_prompt: optional system message for the chat template.
      max_prompt_tokens, max_completion_tokens: length limits (the completion's counts EOS).
      truncate: cut over-long prompts (keeping their end) and completions (keeping their
        start) instead of failing; the number cut is logged and written to ``summary.json``.
      num_train: built-in task size (training pairs).
      digits, ops: built-in task operand digit counts and operators.
      max_offset: built-in task: rejected answers are the correct one ± 1 … ``max_offset``.
    """

    task: str = "arithmetic"
    train_path: str | None = None
    eval_path: str | None = None
    eval_size: int = 64
    unpaired: bool = False
    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    completion_field: str = "completion"
    label_field: str = "label"
    margin_field: str | None = None
    chat_template: bool = False
    system_prompt: str | None = None
    max_prompt_tokens: int = 512
    max_completion_tokens: int = 512
    truncate: bool = False
    num_train: int = 2000
    digits: tuple[int, ...] = (1, 2)
    ops: tuple[str, ...] = ("+", "-")
    max_offset: int = 9


@dataclasses.dataclass(frozen=True)
class LossTerm:
    """One DPO loss type of a weighted mixture (MPO): ``{type: bco_pair, weight: 0.2}``."""

    type: str = "sigmoid"
    weight: float = 1.0


@dataclasses.dataclass(frozen=True)
class PreferenceLossSection:
    """Which preference loss, and its hyper-parameters (see ``jaxrl_llm.preference``).

    Attributes:
      name: ``dpo`` | ``kto`` | ``orpo`` | ``simpo`` | ``cpo`` | ``alphapo``
        (``job: preference``), or ``bradley_terry`` (``job: reward_model``).
      loss_type: DPO only: one of ``jaxrl_llm.preference.LOSS_TYPES``, or a list of
        ``{type, weight}`` (a weighted mixture).
      beta: ``β``.
      label_smoothing: ``ε`` of the smoothed DPO types (sigmoid, robust, exo_pair), SimPO, CPO.
      discopop_tau: DPO ``discopop``'s ``τ`` (null: 0.05).
      gamma: SimPO / CPO / AlphaPO target margin (null: the loss's default, 0.5 SimPO and
        AlphaPO, 0 CPO).
      cpo_alpha: SimPO / CPO weight of the NLL term (null: 0 SimPO, 1 CPO).
      alpha: AlphaPO's reward shape ``α`` (``r = (1 − exp(−α·lp̄))/α``; 0 is the log reward):
        required by ``alphapo``, optional for ``simpo`` / ``cpo`` (null: 0).
      orpo_nll: ORPO's SFT term: ``completion`` (the paper's NLL of the chosen completion) or
        ``prompt_and_completion`` (TRL ORPOTrainer's: the chosen prompt tokens count too).
      desirable_weight, undesirable_weight: KTO's ``λ_D``, ``λ_U``.
      reference: ``precompute`` (reference log-probs computed once over the data, before
        training, as TRL's ``precompute_ref_log_probs``) or ``on_the_fly`` (a frozen copy of
        the initial policy scores each batch). Unused by the reference-free losses.
      center_rewards_coefficient: Bradley-Terry: adds ``c·mean((r_w + r_l)²)``, which keeps
        rewards centred on 0 (Eisenstein et al. 2023, as TRL's RewardTrainer).
    """

    name: str = "dpo"
    loss_type: str | tuple[LossTerm, ...] = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    discopop_tau: float | None = None
    gamma: float | None = None
    cpo_alpha: float | None = None
    alpha: float | None = None
    orpo_nll: str = "completion"
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    reference: str = "precompute"
    center_rewards_coefficient: float = 0.0


@dataclasses.dataclass(frozen=True)
class PreferenceTrainerSection(OptimizerSection):
    """The optimisation: the optimizer's fields (``OptimizerSection``; learning rate 3e-4) and
    these.

    Attributes:
      max_steps: optimizer steps.
      batch_size: pairs (KTO: examples) per optimizer step.
      micro_batches: gradient accumulation: the step averages the losses of K micro-batches of
        ``batch_size / K`` rows, as TRL's gradient accumulation does.
      eval_every: evaluate on the held-out set every N steps (0 = only before / after).
      eval_batch_size: rows per evaluation batch (0 = ``batch_size``).
      packing: sequence packing of the update's and the reference's forwards
        (``train.preference.packing``): the chosen and rejected (KTO: the completions and the
        mismatched ones) rows of a batch share packed rows, attention within each sequence,
        so no FLOPs go to padding and every loss is the padded one. ``on``: every batch;
        ``auto``: a batch whose packed rows are at most 3/4 of its padded rows; ``off`` (the
        default): padded rows. Evaluation runs padded.
    """

    max_steps: int = 300
    batch_size: int = 32
    micro_batches: int = 1
    learning_rate: float = 3e-4
    eval_every: int = 0
    eval_batch_size: int = 0
    packing: bool | str = False


@dataclasses.dataclass(frozen=True)
class PreferenceConfig:
    """A whole offline preference or reward-model run.

    Keys other code relies on: ``job``, ``run_dir``, ``seed``, ``resume``,
    ``trainer.max_steps``, ``checkpoint.every_steps``, ``mesh.data|fsdp|tensor``.
    ``sft_warmup`` trains the policy on the chosen completions first (the reference policy is
    the warmed-up one); a reward model then starts from that backbone.
    """

    job: str = "preference"
    run_dir: str = "runs/preference"
    seed: int = 0
    resume: bool = False
    resume_force: bool = False
    model: ModelSection = ModelSection()
    data: PreferenceDataSection = PreferenceDataSection()
    loss: PreferenceLossSection = PreferenceLossSection()
    trainer: PreferenceTrainerSection = PreferenceTrainerSection()
    sft_warmup: SFTWarmupSection = SFTWarmupSection(batch_size=64)
    checkpoint: CheckpointSection = CheckpointSection()
    mesh: MeshSection = MeshSection()
    logging: LoggingSection = LoggingSection()


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{key} must be one of {choices}, got {value!r}")


def _positive(key: str, value: int | float) -> None:
    if not value > 0:
        raise ValueError(f"{key} must be > 0, got {value!r}")


def dpo_loss_types(loss: PreferenceLossSection) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """``(types, weights)`` of ``loss.loss_type`` (a single type has weight 1)."""
    if isinstance(loss.loss_type, str):
        return (loss.loss_type,), (1.0,)
    return tuple(t.type for t in loss.loss_type), tuple(t.weight for t in loss.loss_type)


def check_config(cfg: PreferenceConfig) -> None:
    """Raises ValueError naming the key(s) of an invalid or inconsistent setting."""
    _choice("job", cfg.job, JOBS)
    loss, data, trainer = cfg.loss, cfg.data, cfg.trainer
    _choice("loss.name", loss.name, LOSS_NAMES)
    if cfg.job == "reward_model" and loss.name != "bradley_terry":
        raise ValueError(
            f"job 'reward_model' trains with loss.name=bradley_terry, got {loss.name!r}"
        )
    if cfg.job == "preference" and loss.name == "bradley_terry":
        raise ValueError("loss.name=bradley_terry trains a reward model: set job=reward_model")
    _choice("loss.reference", loss.reference, REFERENCE_MODES)
    if cfg.mesh.rollout_devices:
        raise ValueError("mesh.rollout_devices: sampler devices are for RL jobs; set it to 0")
    _choice("data.task", data.task, DATA_TASKS)
    if data.task == "jsonl" and data.train_path is None:
        raise ValueError("data.task=jsonl needs data.train_path")
    if data.unpaired and loss.name != "kto":
        raise ValueError(
            f"data.unpaired=true holds labelled single completions, which only loss.name=kto "
            f"trains on (got {loss.name!r})"
        )
    if data.unpaired and data.task != "jsonl":
        raise ValueError("data.unpaired=true needs data.task=jsonl")
    if data.margin_field is not None and loss.name != "bradley_terry":
        raise ValueError("data.margin_field is a Bradley-Terry margin: it needs bradley_terry")
    if loss.name != "dpo" and loss.loss_type != "sigmoid":
        raise ValueError(f"loss.loss_type selects a DPO variant; loss.name is {loss.name!r}")
    if loss.name == "dpo":
        types, weights = dpo_loss_types(loss)
        if not types:
            raise ValueError("loss.loss_type must name at least one loss type")
        for t in types:
            _choice("loss.loss_type", t, LOSS_TYPES)
        if any(w < 0 for w in weights):
            raise ValueError(f"loss.loss_type weights must be >= 0, got {weights}")
        try:
            check_dpo_settings(
                types, label_smoothing=loss.label_smoothing, discopop_tau=loss.discopop_tau
            )
        except ValueError as err:
            raise ValueError(f"loss.label_smoothing / loss.discopop_tau: {err}") from None
    if loss.name in ALPHA_LOSSES:
        try:
            check_label_smoothing(loss.label_smoothing)
        except ValueError as err:
            raise ValueError(f"loss.label_smoothing: {err}") from None
    if loss.name not in ALPHA_LOSSES and loss.gamma is not None:
        raise ValueError("loss.gamma applies to simpo, cpo and alphapo only")
    if loss.name not in ("simpo", "cpo") and loss.cpo_alpha is not None:
        raise ValueError("loss.cpo_alpha applies to simpo and cpo only")
    if loss.name not in ALPHA_LOSSES and loss.alpha is not None:
        raise ValueError("loss.alpha (AlphaPO's reward shape) applies to simpo, cpo and alphapo")
    if loss.name == "alphapo" and loss.alpha is None:
        raise ValueError("loss.name=alphapo needs loss.alpha (the reward shape; 0 is SimPO)")
    if loss.alpha is not None and not math.isfinite(loss.alpha):
        raise ValueError(f"loss.alpha must be finite, got {loss.alpha!r}")
    _choice("loss.orpo_nll", loss.orpo_nll, ORPO_NLL_MODES)
    if loss.orpo_nll != "completion" and loss.name != "orpo":
        raise ValueError("loss.orpo_nll chooses ORPO's NLL tokens: it applies to orpo only")
    if loss.label_smoothing and loss.name not in ("dpo", *ALPHA_LOSSES):
        raise ValueError("loss.label_smoothing applies to dpo, simpo, cpo and alphapo only")
    if loss.discopop_tau is not None and loss.name != "dpo":
        raise ValueError("loss.discopop_tau applies to dpo's discopop loss type only")
    if loss.name != "bradley_terry" and loss.center_rewards_coefficient:
        raise ValueError("loss.center_rewards_coefficient applies to bradley_terry only")
    _positive("loss.beta", loss.beta)
    for key in ("max_steps", "batch_size", "micro_batches"):
        _positive(f"trainer.{key}", getattr(trainer, key))
    if trainer.batch_size % trainer.micro_batches:
        raise ValueError(
            f"trainer.micro_batches={trainer.micro_batches} must divide "
            f"trainer.batch_size={trainer.batch_size}"
        )
    for key in ("eval_every", "eval_batch_size"):
        if getattr(trainer, key) < 0:
            raise ValueError(f"trainer.{key} must be >= 0, got {getattr(trainer, key)}")
    packing_mode(trainer.packing)  # refuses an unknown mode
    _positive("data.eval_size", data.eval_size)
    _positive("checkpoint.every_steps", cfg.checkpoint.every_steps)
    if cfg.sft_warmup.steps is not None and cfg.sft_warmup.steps < 0:
        raise ValueError(f"sft_warmup.steps must be >= 0, got {cfg.sft_warmup.steps}")
