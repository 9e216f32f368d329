"""What a plan's step does with real tokens, and what it may expect to reach: the length
model, padded / real / packed positions, goodput, MFU over real tokens, and the expected
utilisation from a published matmul efficiency per chip generation (docs/plan.md).

The roofline (``estimate.roofline``) times each program at the chip's peak: a compute-bound
program's "MFU" there is only its model FLOPs over its compiled FLOPs, an **upper bound**
(``roofline_mfu_bound``), and every row counts at its full padded width. This module adds:

* a **length model**: the expected mean completion length is ``f x T``
  (``rollout.expected_length_fraction``, or ``completion_length_mean`` read from an earlier
  run's ``metrics.jsonl``); unknown, ``f = 1`` (every row decodes to ``T``, what the
  programs assume). Prompts are taken as full (``data.max_prompt_tokens`` each, their
  dataset's lengths are not read). With ``B`` rows, ``P`` padded prompt and ``T`` completion
  positions a row and ``p`` real prompt tokens (``p <= P``):

  - padded positions ``B (P + T)`` (what each forward over the batch computes today);
  - real tokens ``B (p + f T)``;
  - packed positions ``ceil(B (p + f T) / (P + T)) x (P + T)``: the real tokens in whole
    rows of today's width, what first-fit packing needs at best (no row left part-empty but
    the last);

* the **expected** time of a program: ``max(compute / e, HBM, ICI)`` with ``e`` the chip
  generation's measured matmul efficiency (``MATMUL_EFFICIENCY``): a compute-bound program
  runs at ``e`` of its roofline rate, a memory- or ICI-bound one keeps its roofline time
  (the bandwidth terms are not derated: still optimistic there) unless derated compute
  overtakes it. ``expected_mfu = model FLOPs / (peak x expected time)``;
* **goodput**: real tokens per RL step over the step time (tokens/s), and **MFU over real
  tokens**: the model FLOPs of the real tokens only (each program's model FLOPs times its
  real share: ``(p + f T) / (P + T)`` for the programs over the rollout batch, ``f`` for the
  decode step, ``p / P`` for the prefill; a program lowered over ``R`` packed rows of a batch
  of ``B_p`` rows, ``trainer.packing``: ``B_p (p + f T) / (R (P + T))``, at most 1) over
  ``peak x step time``. The share scales
  attention's ``L^2`` term linearly, so it overstates the real FLOPs of short rows a little.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

# Measured model-FLOPs utilisation of dense bf16 LLM pre-training with MaxText (JAX/XLA on
# Cloud TPU), per chip generation: the fraction of the bf16 peak a tuned training step
# reaches, applied to a program's roofline compute time. Each value is the 7-8B-class dense
# model's figure where MaxText publishes one (the size of the jobs plan is mostly asked
# about), else its Llama2-70B one. These MFUs include MaxText's own rematerialisation (its
# model FLOPs leave it out), so as a matmul efficiency they are conservative by that share.
# Sources: MaxText getting_started/Run_Gemma.md ("Model Flop utilization for training on v5e
# and v5p TPUs"), getting_started/Run_Llama2.md ("... on v5e and v5p and v4 TPUs with
# MaxText"), and MaxText's docs reference/models/tiering.md (v6e, "Optimized models
# tiering"). No GPU rows: plan compiles for Cloud TPU topologies only.
MATMUL_EFFICIENCY: dict[str, tuple[float, str]] = {
    "v4": (0.57, "MaxText Run_Llama2.md: Llama2-70B on v4-128, bf16: 57% MFU"),
    "v5e": (0.577, "MaxText Run_Gemma.md: Gemma-7B on v5e-256, bf16: 57.70% MFU"),
    "v5p": (0.6016, "MaxText Run_Gemma.md: Gemma-7B on v5p-128, bf16: 60.16% MFU"),
    "v6e": (
        0.4546,
        "MaxText docs, optimized models tiering: Llama 3.1 8B on v6e-256, bf16, sequence "
        "8192: 45.46% MFU",
    ),
}

# Programs that move weights, not tokens (no model FLOPs): every other program of a plan
# runs over the rollout batch (the update, log-prob forwards, critic, PRM, teacher, reward
# model: ``B x (P + T)`` positions) or is the sampler's prefill or decode step.
WEIGHT_PROGRAMS = ("reshard_base", "reshard", "serving_reshard", "merge")


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """A chip generation's matmul efficiency and where it comes from.

    Attributes:
      generation: the chip generation asked about (``v5e``, ...).
      value: the fraction of peak (0, 1], or None when none is published in the table.
      source: the measurement it is (or why there is none).
    """

    generation: str
    value: float | None
    source: str


def matmul_efficiency(generation: str) -> Efficiency:
    """``MATMUL_EFFICIENCY``'s entry for ``generation``; an unknown one gets ``value=None``
    and a reason, never a made-up number."""
    if generation in MATMUL_EFFICIENCY:
        value, source = MATMUL_EFFICIENCY[generation]
        return Efficiency(generation, value, source)
    known = ", ".join(MATMUL_EFFICIENCY)
    return Efficiency(
        generation,
        None,
        f"unknown: no published measured MFU for {generation!r} in plan's table ({known}); "
        "the expected figures are left out",
    )


def expected_seconds(times: Mapping[str, Any], efficiency: float | None) -> float | None:
    """A program's expected time: ``max(compute / e, HBM, ICI)`` (``e`` the matmul
    efficiency; an HBM or ICI time that is unknown counts 0), or None without ``e``."""
    if efficiency is None:
        return None
    terms = (times["compute_s"] / efficiency, times.get("hbm_s") or 0.0, times.get("ici_s") or 0.0)
    return max(terms)


@dataclasses.dataclass(frozen=True)
class StepTokens:
    """The rollout batch's positions and expected real tokens (the module's length model).

    Attributes:
      rows: ``B``.
      prompt_len, completion_len: ``P`` and ``T``, the padded widths.
      prompt_tokens: ``p``, real tokens a prompt (full prompts: ``data.max_prompt_tokens``).
      fraction: ``f``, the expected mean completion length over ``T`` (1: unknown).
      length_source: where ``f`` comes from.
    """

    rows: int
    prompt_len: int
    completion_len: int
    prompt_tokens: int
    fraction: float
    length_source: str

    @property
    def width(self) -> int:
        """``P + T``: a row's positions."""
        return self.prompt_len + self.completion_len

    @property
    def padded_positions(self) -> int:
        """``B (P + T)``: what a forward over the batch computes."""
        return self.rows * self.width

    @property
    def completion_tokens(self) -> float:
        """``B f T``: expected real completion tokens."""
        return self.rows * self.fraction * self.completion_len

    @property
    def real_tokens(self) -> float:
        """``B (p + f T)``: expected real tokens of the batch."""
        return self.rows * self.prompt_tokens + self.completion_tokens

    @property
    def packed_positions(self) -> int:
        """``ceil(B (p + f T) / (P + T)) x (P + T)``: the real tokens in whole rows."""
        return math.ceil(round(self.real_tokens / self.width, 9)) * self.width

    def real_share(self, program: str) -> float:
        """The share of ``program``'s positions that are real tokens: ``f`` a decode step,
        ``p / P`` the prefill, 1 a program that moves weights (``WEIGHT_PROGRAMS``), else
        ``(p + f T) / (P + T)`` (a program over the rollout batch)."""
        if program == "decode_step":
            return self.fraction
        if program == "prefill":
            return self.prompt_tokens / self.prompt_len
        if program in WEIGHT_PROGRAMS:
            return 1.0
        return (self.prompt_tokens + self.fraction * self.completion_len) / self.width


def step_tokens(
    rows: int,
    prompt_len: int,
    completion_len: int,
    prompt_tokens: int,
    fraction: float | None,
    length_source: str | None = None,
) -> StepTokens:
    """``StepTokens`` of a batch; ``fraction`` None: unknown, full-length completions.

    Raises:
      ValueError: a fraction outside (0, 1], or prompt tokens outside [1, P].
    """
    if fraction is not None and not 0 < fraction <= 1:
        raise ValueError(f"expected_length_fraction must be in (0, 1], got {fraction!r}")
    if not 1 <= prompt_tokens <= prompt_len:
        raise ValueError(f"prompt tokens must be in [1, {prompt_len}], got {prompt_tokens}")
    if fraction is None:
        source = "length unknown: every completion counted at rollout.max_new_tokens"
        return StepTokens(rows, prompt_len, completion_len, prompt_tokens, 1.0, source)
    source = length_source or "rollout.expected_length_fraction"
    return StepTokens(rows, prompt_len, completion_len, prompt_tokens, float(fraction), source)


def lengths_from_run(run_dir: str, max_new_tokens: int, last: int = 10) -> tuple[float, str]:
    """``(f, source)`` from an earlier run: the mean of ``completion_length_mean`` over the
    last ``last`` rows of ``run_dir/metrics.jsonl`` that have it, over ``max_new_tokens``
    (at most 1).

    Raises:
      ValueError: no metrics.jsonl, or no row with ``completion_length_mean`` (naming the file).
    """
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"--lengths-from: {path} does not exist (an RL run directory has one)")
    lengths = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            row = json.loads(line) if line else {}
            if isinstance(row.get("completion_length_mean"), int | float):
                lengths.append(float(row["completion_length_mean"]))
    if not lengths or not any(lengths):
        raise ValueError(f"--lengths-from: {path} has no positive completion_length_mean")
    recent = lengths[-last:]
    mean = sum(recent) / len(recent)
    fraction = min(mean / max_new_tokens, 1.0)
    source = (
        f"{path}: completion_length_mean {mean:.1f} tokens (mean of the last {len(recent)} "
        f"steps) over rollout.max_new_tokens={max_new_tokens}"
    )
    return fraction, source


def program_real_share(tokens: StepTokens, name: str, program: Mapping[str, Any]) -> float:
    """``tokens.real_share(name)``, or for a program lowered over packed rows (its report's
    ``packing``: ``R`` packed rows of a batch of ``B_p`` padded ones) the real share of its
    packed positions: ``min(1, B_p (p + f T) / (R (P + T)))``."""
    share = tokens.real_share(name)
    packing = program.get("packing")
    if packing and packing.get("packed"):
        share = min(1.0, share * packing["padded_rows"] / packing["packed_rows"])
    return share


def goodput_report(
    programs: Mapping[str, dict],
    tokens: StepTokens,
    efficiency: Efficiency,
    peak_flops: float,
    step_s: float,
    expected_step_s: float | None,
) -> dict[str, Any]:
    """The report's real-token and expected figures (see the module).

    Args:
      programs: per-program reports (``calls_per_step``, ``model_flops``, ``times``).
      tokens: the batch's length model.
      efficiency: the chip generation's matmul efficiency.
      peak_flops: the slice's bf16 peak, FLOP/s.
      step_s: the roofline RL step (seconds).
      expected_step_s: the RL step at the expected program times, or None (unknown chip).

    Returns:
      ``goodput_tokens_per_s``, ``mfu_real_tokens`` (None without an expected step),
      their ``..._roofline_bound`` twins, ``expected_step_mfu`` and ``tokens`` (the length
      model's counts).
    """
    model_flops = sum(p["calls_per_step"] * p["model_flops"] for p in programs.values())
    real_flops = sum(
        p["calls_per_step"] * p["model_flops"] * program_real_share(tokens, name, p)
        for name, p in programs.items()
    )

    def per_second(amount: float, seconds: float | None) -> float | None:
        return amount / seconds if seconds else None

    def utilisation(flops: float, seconds: float | None) -> float | None:
        return flops / (peak_flops * seconds) if seconds else None

    return {
        "goodput_tokens_per_s": per_second(tokens.real_tokens, expected_step_s),
        "goodput_tokens_per_s_roofline_bound": per_second(tokens.real_tokens, step_s),
        "mfu_real_tokens": utilisation(real_flops, expected_step_s),
        "mfu_real_tokens_roofline_bound": utilisation(real_flops, step_s),
        "expected_step_mfu": utilisation(model_flops, expected_step_s),
        "matmul_efficiency": dataclasses.asdict(efficiency),
        "tokens": {
            "padded_positions": tokens.padded_positions,
            "real_tokens": tokens.real_tokens,
            "real_completion_tokens": tokens.completion_tokens,
            "packed_positions": tokens.packed_positions,
            "expected_length_fraction": tokens.fraction,
            "length_source": tokens.length_source,
            "prompt_tokens": tokens.prompt_tokens,
            "prompt_source": "full prompts assumed (data.max_prompt_tokens each; the "
            "dataset's lengths are not read)",
            "model_flops": model_flops,
            "real_token_model_flops": real_flops,
        },
    }


__all__ = [
    "MATMUL_EFFICIENCY",
    "WEIGHT_PROGRAMS",
    "Efficiency",
    "StepTokens",
    "expected_seconds",
    "goodput_report",
    "lengths_from_run",
    "matmul_efficiency",
    "program_real_share",
    "step_tokens",
]
