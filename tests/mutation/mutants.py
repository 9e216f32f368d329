"""The mutants: one planted bug each, described by behaviour, and the tests that must fail.

A mutant's ``apply(patch)`` receives a ``pytest.MonkeyPatch`` and patches module attributes that
the library looks up at call time (or, for names other modules import with ``from ... import``,
before those modules are imported: the plugin applies the mutant when pytest loads it, ahead of
every conftest and test module). The tests named are node ids relative to the project root;
every one of them must FAIL under the mutant.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import pytest


@dataclasses.dataclass(frozen=True)
class Mutant:
    """A planted bug: ``name``, the ``behaviour`` it breaks, how to plant it, who catches it."""

    name: str
    behaviour: str
    apply: Callable[[pytest.MonkeyPatch], None]
    tests: tuple[str, ...]


def _critic_values_zero(patch: pytest.MonkeyPatch) -> None:
    import jax.numpy as jnp

    from jaxrl_llm.train.rl import ppo

    real = ppo.make_value_fn

    def make_value_fn(*args, **kwargs):
        fn = real(*args, **kwargs)
        return lambda params, seqs, *packing: jnp.zeros_like(fn(params, seqs, *packing))

    patch.setattr(ppo, "make_value_fn", make_value_fn)


def _process_rewards_zero(patch: pytest.MonkeyPatch) -> None:
    import jax.numpy as jnp

    from jaxrl_llm.losses import implicit_prm

    real = implicit_prm.process_rewards
    patch.setattr(implicit_prm, "process_rewards", lambda *a, **k: jnp.zeros_like(real(*a, **k)))


def _learning_rate_x2(patch: pytest.MonkeyPatch) -> None:
    from jaxrl_llm.train import optim

    real = optim.make_schedule

    def make_schedule(learning_rate, **kwargs):
        schedule = real(learning_rate, **kwargs)
        return lambda count: 2.0 * schedule(count)

    patch.setattr(optim, "make_schedule", make_schedule)


def _bf16_loss_math(patch: pytest.MonkeyPatch) -> None:
    # Before any loss module does ``from jaxrl_llm._checks import f32``: the "upcast" keeps
    # the input dtype, so bf16 inputs run the loss math in bf16 (outputs still cast at the end
    # where a module casts them explicitly).
    import jax.numpy as jnp

    from jaxrl_llm import _checks

    patch.setattr(_checks, "f32", lambda x: jnp.asarray(x))


def _compute_dtype_ignored(patch: pytest.MonkeyPatch) -> None:
    from jaxrl_llm.models import transformer

    patch.setattr(transformer, "cast_params", lambda params, config: params)


def _activation_constraints_dropped(patch: pytest.MonkeyPatch) -> None:
    from jaxrl_llm.models import layers

    patch.setattr(layers, "with_logical_constraint", lambda x, axes, rules: x)


def _drop_temperature(real, *args, **kwargs):
    kwargs.pop("temperature", None)
    return real(*args, **kwargs)


def _temperature_ignored_in_logprobs(patch: pytest.MonkeyPatch) -> None:
    from jaxrl_llm.train.rl import programs  # where the trainer's programs are built

    real = programs.make_logprob_fn
    patch.setattr(programs, "make_logprob_fn", functools.partial(_drop_temperature, real))


def _temperature_ignored_in_step(patch: pytest.MonkeyPatch) -> None:
    from jaxrl_llm.train.rl import programs

    real = programs.make_policy_step
    patch.setattr(programs, "make_policy_step", functools.partial(_drop_temperature, real))


def _old_logprobs_refreshed(patch: pytest.MonkeyPatch) -> None:
    # Every update recomputes the "behaviour" log-probs from the current policy: the ratio is
    # always 1 and clipping never acts (the bug of re-scoring inside the epoch loop).
    from jaxrl_llm.train.rl import trainer
    from jaxrl_llm.types import sequences_of

    real = trainer.RLTrainer.update

    def update(self, step, minibatch):
        fresh = self.logprob_fn(self.policy_params, sequences_of(minibatch))
        return real(self, step, minibatch._replace(old_logprobs=fresh))

    patch.setattr(trainer.RLTrainer, "update", update)


def _grad_clip_removed(patch: pytest.MonkeyPatch) -> None:
    import optax

    patch.setattr(optax, "clip_by_global_norm", lambda max_norm: optax.identity())


def _weight_decay_ignored(patch: pytest.MonkeyPatch) -> None:
    import optax

    real = optax.adamw

    def adamw(*args, **kwargs):
        kwargs["weight_decay"] = 0.0
        return real(*args, **kwargs)

    patch.setattr(optax, "adamw", adamw)


def _sft_warmup_inert(patch: pytest.MonkeyPatch) -> None:
    # The warm-up draws its batches and reports its NLLs but never moves the parameters.
    # Planted before the trainers bind the name with ``from jaxrl_llm.train.sft import``.
    from jaxrl_llm.train import sft

    real = sft.sft_warmup

    def sft_warmup(*args, **kwargs):
        kwargs["learning_rate"] = 0.0
        return real(*args, **kwargs)

    patch.setattr(sft, "sft_warmup", sft_warmup)


def _reward_model_scores_raw(patch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from jaxrl_llm.train.rl import context

    patch.setattr(context, "normalize_scores", lambda scores, mode: np.asarray(scores, np.float32))


def _on_policy_always(patch: pytest.MonkeyPatch) -> None:
    from jaxrl_llm.train.rl import programs

    patch.setattr(programs, "on_policy_update", lambda run: True)


WIRING = "tests/train/rl/test_wiring.py"
SFT = "tests/train/test_sft.py"
NORMALIZE = "tests/train/rl/test_reward_normalize.py"
UPDATE = "tests/train/test_update_reference.py::test_policy_update_matches_float64_reference"
OPTIM = "tests/train/test_optim.py"
LOGPROB_WIRING = "tests/train/rl/test_logprob_wiring.py"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "learning_rate_x2",
        "the optimizer steps at twice the configured learning rate",
        _learning_rate_x2,
        (
            f"{UPDATE}[full]",
            f"{OPTIM}::test_schedule_values[cosine-0.1]",
            f"{OPTIM}::test_optimizer_moves_by_the_scheduled_learning_rate[linear]",
            f"{SFT}::test_warmup_params_are_clipped_adamw_on_the_nll[2steps]",
        ),
    ),
    Mutant(
        "grad_clip_removed",
        "no global-norm gradient clipping before AdamW",
        _grad_clip_removed,
        (
            f"{UPDATE}[full]",
            f"{OPTIM}::test_adamw_on_a_quadratic_matches_float64_reference[cosine-wd-clip]",
        ),
    ),
    Mutant(
        "weight_decay_ignored",
        "AdamW's decoupled weight decay dropped",
        _weight_decay_ignored,
        (f"{UPDATE}[full]",),
    ),
    Mutant(
        "critic_values_zero",
        "PPO's critic values replaced by zeros before GAE",
        _critic_values_zero,
        (f"{WIRING}::test_ppo_update_gets_gae_of_the_rewards_kl_and_critic_values",),
    ),
    Mutant(
        "process_rewards_zero",
        "PRIME's implicit process rewards zeroed (outcome-only RLOO)",
        _process_rewards_zero,
        (f"{WIRING}::test_prime_update_gets_advantages_of_the_implicit_process_rewards",),
    ),
    Mutant(
        "temperature_ignored_in_logprobs",
        "behaviour / reference log-probs computed at temperature 1, not the rollout's",
        _temperature_ignored_in_logprobs,
        (f"{LOGPROB_WIRING}::test_logprobs_use_the_rollout_temperature[T0.7]",),
    ),
    Mutant(
        "temperature_ignored_in_step",
        "the policy step's log-probs computed at temperature 1, not the rollout's",
        _temperature_ignored_in_step,
        (
            f"{LOGPROB_WIRING}::test_logprobs_use_the_rollout_temperature[T0.7]",
            f"{LOGPROB_WIRING}::test_logprobs_use_the_rollout_temperature[T0.7-on-policy]",
        ),
    ),
    Mutant(
        "on_policy_always",
        "the behaviour forward skipped even when several updates move the policy (epochs > 1)",
        _on_policy_always,
        (
            f"{LOGPROB_WIRING}::test_old_logprobs_stay_fixed_across_epochs",
            f"{LOGPROB_WIRING}::test_on_policy_rule[epochs2]",
        ),
    ),
    Mutant(
        "old_logprobs_refreshed",
        "behaviour log-probs recomputed from the current policy at every update (epochs > 1)",
        _old_logprobs_refreshed,
        (f"{LOGPROB_WIRING}::test_old_logprobs_stay_fixed_across_epochs",),
    ),
    Mutant(
        "sft_warmup_inert",
        "the SFT warm-up runs but leaves the parameters where they were",
        _sft_warmup_inert,
        (
            f"{SFT}::test_warmup_params_are_clipped_adamw_on_the_nll[2steps]",
            f"{SFT}::test_dpo_starts_from_and_is_referenced_to_the_warmed_up_policy",
        ),
    ),
    Mutant(
        "reward_model_scores_raw",
        "reward_model.normalize=batch ignored: raw reward-model scores reach the advantages",
        _reward_model_scores_raw,
        (
            f"{NORMALIZE}::test_batch_is_the_z_score_over_the_batch[16]",
            f"{NORMALIZE}::test_an_rl_step_feeds_z_scored_reward_model_scores_into_its_batch",
        ),
    ),
    Mutant(
        "bf16_loss_math",
        "loss math runs in the inputs' bf16 instead of upcasting to f32 first",
        _bf16_loss_math,
        (
            "tests/losses/test_ratios.py::test_bf16_inputs_are_upcast_before_any_math",
            "tests/losses/test_kl.py::test_bf16_inputs_are_upcast_before_any_math[False]",
            "tests/losses/test_value.py::test_bf16_inputs_are_upcast_before_any_math[0.2]",
            "tests/losses/test_advantages.py::test_bf16_inputs_are_upcast_before_any_math",
        ),
    ),
    Mutant(
        "compute_dtype_ignored",
        "model.compute_dtype=bfloat16 still computes in the f32 master weights' dtype",
        _compute_dtype_ignored,
        (
            "tests/models/test_precision.py::test_bf16_compute_runs_every_weight_matmul_in_bf16",
            "tests/models/test_precision.py::test_bf16_compute_agrees_with_f32_at_bf16_tolerance",
        ),
    ),
    Mutant(
        "activation_constraints_dropped",
        "the model no longer pins activation shardings: an fsdp mesh all-reduces activations",
        _activation_constraints_dropped,
        (
            "tests/parallel/test_fsdp_sharding.py::test_fsdp_step_moves_weights_never_activations[gathered]",
        ),
    ),
)
