"""Watching an RL run's steps for a run that cannot learn: no learning signal, cut completions.

A policy-gradient step learns from its advantages; when every trained token's advantage is
exactly 0 the update moves the policy by its regularisers only (KL, entropy), never towards
reward. That happens when every group's completions got the same reward (a reward that
cannot tell them apart, a task solved or too hard for the policy), or when a group
estimator (GRPO, RLOO, ...) sees groups of one completion.

``group_size_gives_signal`` probes the objective's estimator once, before training;
:class:`StepWatch` reads each step's metrics: the first step of a run of steps without
signal is warned at once, and ``trainer.stop_without_signal`` such steps in a row stop the
run with advice (``NoLearningSignal``). A step that cuts most completions at
``rollout.max_new_tokens`` is warned once too: they end without an answer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from jaxrl_llm import objectives

log = logging.getLogger("jaxrl_llm")


class NoLearningSignal(ValueError):
    """The run stopped after ``trainer.stop_without_signal`` steps without learning signal.

    A ``ValueError``: the CLI prints it as one ``error:`` line (a user's setup, not a bug).
    """


def group_size_gives_signal(objective: objectives.Objective, group_size: int) -> bool:
    """Whether the objective's estimator gives any non-zero advantage with ``group_size``.

    Estimated on 8 groups of distinct rewards; an estimator that needs more than the rewards
    (values, process rewards, reward columns) is assumed to (it is not probed).
    """
    spec = objectives.ESTIMATORS[objective.advantage.name]
    if spec.requires or group_size < spec.min_group_size:
        return True
    rows = 8 * group_size
    rewards = jnp.arange(rows, dtype=jnp.float32) / rows
    mask = jnp.ones((rows, 2), jnp.float32)
    old = jnp.zeros((rows, 2), jnp.float32)
    advantages, _ = objectives.compute_advantages(
        objective, rewards, mask, group_size=group_size, old_logprobs=old, ref_logprobs=old
    )
    return bool(np.any(np.asarray(advantages) != 0))


def no_signal(metrics: Mapping[str, float]) -> bool:
    """Whether a step's trained advantages were all exactly 0 (``advantage_min`` and
    ``advantage_max`` both 0)."""
    return metrics.get("advantage_min") == 0.0 and metrics.get("advantage_max") == 0.0


def diagnosis(metrics: Mapping[str, float], group_size: int) -> str:
    """Why a step had no signal, from its metrics."""
    if group_size == 1:
        return "rollout.group_size=1: a group estimator compares a completion only with itself"
    if metrics.get("zero_variance_frac") == 1.0:
        return (
            "every group's completions got the same reward "
            f"(reward_mean {metrics.get('reward_mean', float('nan')):.3g}, accuracy "
            f"{metrics.get('accuracy', float('nan')):.3g})"
        )
    return "every trained token's advantage is 0"


ADVICE = (
    "check that the reward can tell completions apart (its values on a few samples), that the "
    "task is neither solved nor out of reach (accuracy near 1 or 0; a warm-up, a harder or "
    "easier task), and rollout.group_size >= 2 with rollout.temperature > 0"
)


#: The share of a step's completions cut at ``rollout.max_new_tokens`` that is warned.
CLIPPED_WARNING = 0.5


class StepWatch:
    """Counts steps without learning signal in a row (``observe``), warns at the first and
    stops the run (``NoLearningSignal``) at ``patience`` of them (0: never stops); warns the
    first step that cuts more than ``CLIPPED_WARNING`` of its completions at the limit."""

    def __init__(self, patience: int, group_size: int, max_new_tokens: int):
        self.patience = patience
        self.group_size = group_size
        self.max_new_tokens = max_new_tokens
        self.streak = 0
        self.clipped_warned = False

    def observe(self, step: int, metrics: Mapping[str, float]) -> None:
        """Reads step ``step``'s metrics (numbered as ``metrics.jsonl`` numbers them, from 1).

        Raises:
          NoLearningSignal: the ``patience``-th step in a row without signal.
        """
        clipped = metrics.get("completion_clipped_frac", 0.0)
        if clipped > CLIPPED_WARNING and not self.clipped_warned:
            self.clipped_warned = True
            log.warning(
                "step %d cut %.0f%% of its completions at rollout.max_new_tokens=%d (they end "
                "without the stop token): raise rollout.max_new_tokens",
                step,
                100 * clipped,
                self.max_new_tokens,
            )
        if not no_signal(metrics):
            self.streak = 0
            return
        self.streak += 1
        why = diagnosis(metrics, self.group_size)
        if self.patience and self.streak >= self.patience:
            raise NoLearningSignal(
                f"no learning signal for {self.streak} steps in a row (steps "
                f"{step - self.streak + 1}-{step}): {why}; {ADVICE} "
                "(trainer.stop_without_signal=0 trains on regardless)"
            )
        if self.streak == 1:
            stop = (
                f"; the run stops after {self.patience} such steps in a row"
                if self.patience
                else ""
            )
            log.warning("step %d has no learning signal: %s%s", step, why, stop)
