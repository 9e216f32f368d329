"""Advantages of an objective from one rollout batch: the registered estimator, KL in reward."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrl_llm import _checks
from jaxrl_llm.losses import kl
from jaxrl_llm.objectives import estimator_registry
from jaxrl_llm.objectives.objective import Objective

Array = jax.Array


def _check_group_size(objective: Objective, group_size: int) -> estimator_registry.EstimatorSpec:
    """The objective's estimator, after checking that it accepts ``group_size``."""
    spec = estimator_registry.estimator_spec(objective.advantage.name)
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size must be a positive Python int, got {group_size!r}")
    if group_size < spec.min_group_size:
        raise ValueError(
            f"the {objective.advantage.name} estimator needs group_size >= {spec.min_group_size} "
            f"(e.g. for its leave-one-out baselines), got group_size={group_size}"
        )
    return spec


def _kl_penalty(objective: Objective, mask: Array, old_logprobs, ref_logprobs) -> Array:
    """``[B, T]`` ``beta*kl(old, ref)*m`` for KL in the reward, else zeros."""
    if objective.kl.placement == "reward" and objective.kl.kind is not None and objective.kl.coef:
        if old_logprobs is None or ref_logprobs is None:
            raise ValueError(
                f"objective {objective.name!r} puts KL in the reward: "
                "old_logprobs and ref_logprobs are required"
            )
        return (
            objective.kl.coef
            * kl.estimate(old_logprobs, ref_logprobs, kind=objective.kl.kind)
            * mask
        )
    return jnp.zeros_like(mask)


def compute_advantages(
    objective: Objective,
    rewards: Array,
    mask: Array,
    *,
    group_size: int,
    old_logprobs: Array | None = None,
    ref_logprobs: Array | None = None,
    values: Array | None = None,
    baseline_rewards: Array | None = None,
    process_rewards: Array | None = None,
    reward_columns: Array | None = None,
    teacher_logprobs: Array | None = None,
) -> tuple[Array, Array | None]:
    """Advantages (and value targets) for an objective, from one rollout batch.

    Calls the estimator registered under ``objective.advantage.name`` (see
    :func:`~jaxrl_llm.objectives.register_estimator`). With ``kl_placement="reward"`` the
    per-token KL ``beta*kl(old, ref)`` is subtracted from the token rewards (token-level
    estimators) or its row sum from the scalar reward (sequence-level estimators).

    Args:
      objective: selects the estimator and its hyper-parameters.
      rewards: ``[B]`` outcome reward per completion.
      mask: ``[B, T]`` completion mask.
      group_size: completions per prompt (groups contiguous).
      old_logprobs: ``[B, T]`` behaviour log-probs (KL in the reward).
      ref_logprobs: ``[B, T]`` reference log-probs (KL in the reward).
      values: ``[B, T]`` critic values (``gae``).
      baseline_rewards: ``[B]`` greedy-completion rewards (``remax``).
      process_rewards: ``[B, T]`` dense implicit rewards ``beta*(lp_prm - lp_ref)`` (``prime``).
      reward_columns: ``[B, K]`` one column per reward function (``gdpo``; ``rewards`` is then
        only reported, e.g. their weighted sum).
      teacher_logprobs: ``[B, T]`` a teacher's log-probs of the sampled tokens (``distill``,
        ``grpo_distill``).

    Returns:
      ``(advantages, returns)``: advantages ``[B]`` or ``[B, T]``; returns ``[B, T]`` for
      ``gae`` / ``prime`` and ``None`` otherwise.

    Raises:
      ValueError: on bad shapes or group size, or a missing input the estimator requires.
    """
    mask = _checks.as_mask(mask)
    rewards = _checks.f32(rewards)
    _checks.check_shape("rewards", rewards, mask.shape[:1])
    _checks.check_group_size(mask.shape[0], group_size)
    spec = _check_group_size(objective, group_size)
    kl_penalty = _kl_penalty(objective, mask, old_logprobs, ref_logprobs)
    optional = {
        "old_logprobs": old_logprobs,
        "ref_logprobs": ref_logprobs,
        "values": values,
        "baseline_rewards": baseline_rewards,
        "process_rewards": process_rewards,
        "reward_columns": reward_columns,
        "teacher_logprobs": teacher_logprobs,
    }
    for name in spec.requires:
        if optional[name] is None:
            raise ValueError(
                f"the {objective.advantage.name} estimator needs {name} "
                f"({estimator_registry.OPTIONAL_INPUTS[name]})"
            )
    inputs = estimator_registry.AdvantageInputs(rewards, mask, group_size, kl_penalty, **optional)
    out = spec.fn(objective.advantage, inputs)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError(
            f"estimator {objective.advantage.name!r} must return (advantages, returns | None), "
            f"got {type(out)}"
        )
    advantages, returns = out
    _checks.check_advantages(advantages, mask)
    if returns is not None:
        _checks.check_batch_time("returns", returns, mask)
    return advantages, returns


def _bound_advantages(
    objective: Objective, group_size: int, rewards: Array, mask: Array, **arrays: Array | None
) -> tuple[Array, Array | None]:
    unknown = sorted(set(arrays) - set(estimator_registry.OPTIONAL_INPUTS))
    if unknown:
        raise ValueError(
            f"unknown advantage input(s) {unknown}; "
            f"known: {tuple(estimator_registry.OPTIONAL_INPUTS)}"
        )
    return compute_advantages(objective, rewards, mask, group_size=group_size, **arrays)


def advantage_fn(
    objective: Objective, *, group_size: int
) -> Callable[..., tuple[Array, Array | None]]:
    """A jitted ``(rewards, mask, **arrays) -> (advantages, returns | None)`` for one run.

    Binds the (hashable) objective and the static group size once, outside jit, and checks
    at build time that the estimator is registered and accepts ``group_size`` (PRIME and
    pass@k need >= 2); the batch size is checked against it when the function is traced.
    ``arrays`` are the keyword inputs of :func:`compute_advantages` (``old_logprobs``,
    ``ref_logprobs``, ``values``, ``baseline_rewards``, ``process_rewards``,
    ``reward_columns``).

    Args:
      objective: selects the estimator and its hyper-parameters.
      group_size: completions per prompt (a positive Python int).

    Returns:
      The jitted function; one compile per set of input shapes.

    Raises:
      ValueError: ``objective`` is not an ``Objective``, its estimator is not registered,
        or ``group_size`` is invalid for it.
    """
    if not isinstance(objective, Objective):
        raise ValueError(f"advantage_fn needs an Objective, got {type(objective).__name__}")
    _check_group_size(objective, group_size)
    return jax.jit(functools.partial(_bound_advantages, objective, group_size))
