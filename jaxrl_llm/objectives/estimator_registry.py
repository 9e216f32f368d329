"""Registry of advantage estimators, open to user entries.

An estimator is registered as a function ``fn(advantage, inputs) -> (advantages, returns)``:

- ``advantage``: its own piece, an :class:`~jaxrl_llm.objectives.pieces.Advantage` (name,
  scale, discounts, and a user estimator's declared ``params``);
- ``inputs``: an :class:`AdvantageInputs` (rewards, mask, the static group size, the
  KL-in-reward penalty and the optional arrays of one rollout batch);
- ``advantages``: ``[B]`` or ``[B, T]`` float32; ``returns``: ``[B, T]`` value targets or
  ``None``.

The built-ins adapt :mod:`jaxrl_llm.losses.advantages`, whose docstrings carry the formulas and
papers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm import _checks
from jaxrl_llm.losses import advantages
from jaxrl_llm.objectives.pieces import Advantage, check_params_type
from jaxrl_llm.objectives.registry import Registry, check_registration

Array = jax.Array

# The optional arrays of a rollout batch an estimator may ask for, and what they are.
OPTIONAL_INPUTS: dict[str, str] = {
    "old_logprobs": "behaviour log-probs [B, T]",
    "ref_logprobs": "reference log-probs [B, T]",
    "values": "critic values [B, T]",
    "baseline_rewards": "greedy-completion rewards [B]",
    "process_rewards": "dense implicit rewards beta*(lp_prm - lp_ref) [B, T]",
    "reward_columns": "one reward column per reward function [B, K]",
    "teacher_logprobs": "a teacher's log-probs of the sampled tokens [B, T]",
}


def outcome_token_rewards(rewards: Array, mask: Array) -> Array:
    """Places each row's scalar reward on its last valid token: ``[B]`` -> ``[B, T]`` (f32)."""
    _checks.check_rank("mask", mask, 2)
    _checks.check_shape("rewards", rewards, mask.shape[:1])
    mask = _checks.as_mask(mask)
    positions = jnp.arange(mask.shape[1])
    last = jnp.max(jnp.where(mask > 0, positions, -1), axis=1)
    return jnp.where(positions[None, :] == last[:, None], _checks.f32(rewards)[:, None], 0.0)


class AdvantageInputs(NamedTuple):
    """One rollout batch as an estimator sees it; arrays float32.

    Attributes:
      rewards: ``[B]`` outcome reward per completion.
      mask: ``[B, T]`` 0/1 completion mask.
      group_size: completions per prompt (a static Python int; groups contiguous).
      kl_penalty: ``[B, T]`` ``beta*kl(old, ref)*m`` when the objective puts KL in the
        reward, zeros otherwise.
      old_logprobs: ``[B, T]`` behaviour log-probs, or None.
      ref_logprobs: ``[B, T]`` reference log-probs, or None.
      values: ``[B, T]`` critic values, or None.
      baseline_rewards: ``[B]`` greedy-completion rewards, or None.
      process_rewards: ``[B, T]`` dense implicit rewards, or None.
      reward_columns: ``[B, K]`` one column per reward function, or None.
      teacher_logprobs: ``[B, T]`` a teacher's log-probs of the sampled tokens, or None.
    """

    rewards: Array
    mask: Array
    group_size: int
    kl_penalty: Array
    old_logprobs: Array | None = None
    ref_logprobs: Array | None = None
    values: Array | None = None
    baseline_rewards: Array | None = None
    process_rewards: Array | None = None
    reward_columns: Array | None = None
    teacher_logprobs: Array | None = None

    def token_rewards(self) -> Array:
        """``[B, T]``: the reward on the last valid token, minus the per-token KL penalty."""
        return outcome_token_rewards(self.rewards, self.mask) - self.kl_penalty

    def sequence_rewards(self) -> Array:
        """``[B]``: the reward minus the row sum of the KL penalty."""
        return self.rewards - jnp.sum(self.kl_penalty, axis=1)


EstimatorFn = Callable[[Advantage, AdvantageInputs], tuple[Array, Array | None]]


class EstimatorSpec(NamedTuple):
    """A registered advantage estimator.

    Attributes:
      fn: ``fn(advantage, inputs) -> (advantages [B] or [B, T], returns [B, T] or None)``.
      requires: optional inputs (names of :data:`OPTIONAL_INPUTS`) that must not be None;
        ``"values"`` makes the objective need a critic.
      needs_reference: whether the trainer must keep a reference policy (e.g. PRIME's
        implicit process rewards), whatever the KL settings.
      min_group_size: smallest valid group size (RLOO-style baselines need 2).
      params: the frozen dataclass of its own hyper-parameters (``advantage.params``), or
        ``None`` when it takes none beyond the piece's fields.
    """

    fn: EstimatorFn
    requires: tuple[str, ...] = ()
    needs_reference: bool = False
    min_group_size: int = 1
    params: type | None = None


_ESTIMATORS: Registry[EstimatorSpec] = Registry("advantage estimator")
# Live read-only view: name -> EstimatorSpec.
ESTIMATORS: Mapping[str, EstimatorSpec] = _ESTIMATORS.view


def register_estimator(
    name: str,
    fn: EstimatorFn | None = None,
    *,
    override: bool = False,
    requires: tuple[str, ...] = (),
    needs_reference: bool = False,
    min_group_size: int = 1,
    params: type | None = None,
) -> Any:
    """Registers an advantage estimator under ``name``; a decorator or a plain call.

    ``@register_estimator("mine")`` above ``def mine(advantage, inputs): ...``, or
    ``register_estimator("mine", mine)``; then ``make("grpo", advantage="mine")``.

    Args:
      name: the value of ``Objective.advantage.name`` that selects it.
      fn: ``fn(advantage: Advantage, inputs: AdvantageInputs) -> (advantages, returns | None)``;
        ``None`` returns a decorator.
      override: replace an already registered name (built-ins included).
      requires: names of :data:`OPTIONAL_INPUTS` it cannot do without.
      needs_reference: whether it needs a reference policy.
      min_group_size: smallest group size it accepts.
      params: a frozen dataclass type of its own hyper-parameters (defaults for every field);
        the objective converts ``advantage_params`` to it.

    Returns:
      ``fn`` unchanged (or a decorator when ``fn`` is None).

    Raises:
      ValueError: ``name`` is taken and ``override`` is False, ``fn`` is not callable, or
        ``requires`` / ``min_group_size`` is invalid.
    """
    check_registration("estimator", name, fn)
    check_params_type("estimator", params)
    requires = (requires,) if isinstance(requires, str) else tuple(requires)
    unknown = sorted(set(requires) - set(OPTIONAL_INPUTS))
    if unknown:
        raise ValueError(
            f"requires names unknown inputs {unknown}; known: {tuple(OPTIONAL_INPUTS)}"
        )
    if not isinstance(min_group_size, int) or isinstance(min_group_size, bool):
        raise ValueError(f"min_group_size must be an int, got {min_group_size!r}")
    _checks.check_positive("min_group_size", min_group_size)
    if fn is None:
        return functools.partial(
            register_estimator,
            name,
            override=override,
            requires=requires,
            needs_reference=needs_reference,
            min_group_size=min_group_size,
            params=params,
        )
    spec = EstimatorSpec(fn, requires, bool(needs_reference), min_group_size, params)
    _ESTIMATORS.add(name, spec, override=override)
    return fn


def unregister_estimator(name: str) -> None:
    """Removes a user estimator (built-ins cannot be removed)."""
    _ESTIMATORS.remove(name)


def estimators_available() -> tuple[str, ...]:
    """Registered estimator names, built-ins first."""
    return _ESTIMATORS.names()


def estimator_spec(name: str) -> EstimatorSpec:
    """The registered :class:`EstimatorSpec` of ``name`` (ValueError listing the names)."""
    return _ESTIMATORS.get(name)


# ------------------------------------------------------------------------------------------
# Built-ins, in the order of shared/SPEC_LOSSES.md. Sequence-level estimators take the KL
# penalty as its row sum off the scalar reward, token-level ones per token.
# ------------------------------------------------------------------------------------------


@register_estimator("grpo")
def _grpo(advantage: Advantage, inputs: AdvantageInputs):
    """``(r − μ_g) / (σ_g + eps)`` (GRPO), ``/ σ_batch`` or unscaled (Dr.GRPO)."""
    adv = advantages.grpo(
        inputs.sequence_rewards(),
        group_size=inputs.group_size,
        scale=advantage.scale,
        std_ddof=advantage.std_ddof,
    )
    return adv, None


@register_estimator("rloo")
def _rloo(advantage: Advantage, inputs: AdvantageInputs):
    """``r_i − mean_{j≠i} r_j`` (RLOO)."""
    del advantage
    return advantages.rloo(inputs.sequence_rewards(), group_size=inputs.group_size), None


@register_estimator("reinforce_pp")
def _reinforce_pp(advantage: Advantage, inputs: AdvantageInputs):
    """Whitened reward-to-go of the token rewards (REINFORCE++)."""
    return advantages.reinforce_pp(inputs.token_rewards(), inputs.mask, gamma=advantage.gamma), None


@register_estimator("reinforce_pp_baseline")
def _reinforce_pp_baseline(advantage: Advantage, inputs: AdvantageInputs):
    """Whitened ``r − μ_g`` broadcast over tokens (REINFORCE++-baseline)."""
    del advantage
    adv = advantages.reinforce_pp_baseline(
        inputs.sequence_rewards(), inputs.mask, group_size=inputs.group_size
    )
    return adv, None


@register_estimator("remax", requires=("baseline_rewards",))
def _remax(advantage: Advantage, inputs: AdvantageInputs):
    """``r − b``, ``b`` the greedy completion's reward (ReMax)."""
    del advantage
    return advantages.remax(inputs.sequence_rewards(), inputs.baseline_rewards), None


@register_estimator("opo")
def _opo(advantage: Advantage, inputs: AdvantageInputs):
    """``r − Σ L_j r_j / Σ L_j``, a length-weighted group baseline (OPO)."""
    del advantage
    adv = advantages.opo(inputs.sequence_rewards(), inputs.mask, group_size=inputs.group_size)
    return adv, None


@register_estimator("gpg")
def _gpg(advantage: Advantage, inputs: AdvantageInputs):
    """``α·(r − μ_g)`` with GPG's correction for zero-advantage rows."""
    del advantage
    return advantages.gpg(inputs.sequence_rewards(), group_size=inputs.group_size), None


@register_estimator("pass_at_k", min_group_size=2)
def _pass_at_k(advantage: Advantage, inputs: AdvantageInputs):
    """The best row of each group gets ``r_max − r_second`` (Pass@k training)."""
    adv = advantages.pass_at_k(
        inputs.sequence_rewards(), group_size=inputs.group_size, scale=advantage.scale
    )
    return adv, None


@register_estimator("gae", requires=("values",))
def _gae(advantage: Advantage, inputs: AdvantageInputs):
    """GAE over the token rewards and critic values (PPO)."""
    return advantages.gae(
        inputs.token_rewards(), inputs.values, inputs.mask, gamma=advantage.gamma, lam=advantage.lam
    )


def _group_loo_token_rewards(token_rewards: Array, mask: Array, group_size: int) -> Array:
    # PRIME's RLOO on dense rewards: r_t - mean_{j != i} (per-sequence mean of r over row j).
    seq_mean = jnp.sum(token_rewards * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
    group_sum = jnp.repeat(
        seq_mean.reshape(-1, group_size).sum(axis=1), group_size, total_repeat_length=mask.shape[0]
    )
    scale = group_size / (group_size - 1)
    return (token_rewards * scale - group_sum[:, None] / (group_size - 1)) * mask


@register_estimator("prime", requires=("process_rewards",), needs_reference=True, min_group_size=2)
def _prime(advantage: Advantage, inputs: AdvantageInputs):
    """PRIME (Cui et al. 2025): RLOO over dense implicit rewards plus RLOO outcome rewards.

    ``returns_t = Σ_{u≥t} (loo(p)_u + [u = last]·rloo(r) − kl_u)``; advantages are their
    masked whitening.
    """
    del advantage
    mask = inputs.mask
    _checks.check_batch_time("process_rewards", inputs.process_rewards, mask)
    dense = _group_loo_token_rewards(_checks.f32(inputs.process_rewards), mask, inputs.group_size)
    outcome = outcome_token_rewards(
        advantages.rloo(inputs.rewards, group_size=inputs.group_size), mask
    )
    total = (dense + outcome - inputs.kl_penalty) * mask
    returns = jnp.flip(jnp.cumsum(jnp.flip(total, 1), 1), 1)
    return advantages.whiten(returns, mask) * mask, returns * mask


@register_estimator("gdpo", requires=("reward_columns",))
def _gdpo(advantage: Advantage, inputs: AdvantageInputs):
    """Each reward column normalised in its group, weighted sum, normalised over the batch
    (GDPO; TRL's ``normalize_then_sum``)."""
    columns = inputs.reward_columns
    _checks.check_rank("reward_columns", columns, 2)
    _checks.check_shape("reward_columns", columns, (inputs.mask.shape[0], columns.shape[1]))
    adv = advantages.gdpo(
        columns,
        group_size=inputs.group_size,
        weights=advantage.reward_weights,
        std_ddof=advantage.std_ddof,
    )
    return adv, None


@register_estimator("distill", requires=("old_logprobs", "teacher_logprobs"))
def _distill(advantage: Advantage, inputs: AdvantageInputs):
    """On-policy distillation: ``distill_coef * (log π_T − log π_old)`` per token, the
    negative reverse-KL sample to the teacher (GKD's on-policy reverse KL, Qwen3, Thinking
    Machines); the reward is not used."""
    adv = advantages.distillation(
        inputs.old_logprobs, inputs.teacher_logprobs, inputs.mask, coef=advantage.distill_coef
    )
    return adv, None


@register_estimator("grpo_distill", requires=("old_logprobs", "teacher_logprobs"))
def _grpo_distill(advantage: Advantage, inputs: AdvantageInputs):
    """GRPO's group advantage on every token plus the teacher term
    ``distill_coef * (log π_T − log π_old)``: the task's reward and the teacher together."""
    outcome, _ = _grpo(advantage, inputs)
    teacher = advantages.distillation(
        inputs.old_logprobs, inputs.teacher_logprobs, inputs.mask, coef=advantage.distill_coef
    )
    return outcome[:, None] * inputs.mask + teacher, None


@register_estimator("none")
def _none(advantage: Advantage, inputs: AdvantageInputs):
    """No advantage: 0 for every row. A run trained by the loss terms beside the surrogate
    alone (GKD's distillation loss, ``Objective.distill_loss``); the reward only reports."""
    del advantage
    return jnp.zeros(inputs.mask.shape[:1], jnp.float32), None


_ESTIMATORS.mark_builtins()
