"""Optimizers and learning-rate schedules, as optax chains."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxrl_llm import _checks

SCHEDULES = ("constant", "linear", "cosine")
STATE_DTYPES = ("float32", "bfloat16")


def make_schedule(
    learning_rate: float,
    *,
    schedule: str = "constant",
    warmup_steps: int = 0,
    total_steps: int | None = None,
    final_fraction: float = 0.0,
) -> optax.Schedule:
    """Linear warm-up to ``learning_rate`` then constant, linear or cosine decay.

    Args:
      learning_rate: peak learning rate.
      schedule: ``"constant" | "linear" | "cosine"``.
      warmup_steps: steps of linear warm-up from 0.
      total_steps: total optimizer steps (required for the decaying schedules).
      final_fraction: the decayed learning rate at ``total_steps``, as a fraction of the peak.
    """
    _checks.check_choice("schedule", schedule, SCHEDULES)
    _checks.check_non_negative("learning_rate", learning_rate)
    _checks.check_non_negative("warmup_steps", warmup_steps)
    if not 0.0 <= final_fraction <= 1.0:
        raise ValueError(f"final_fraction must be in [0, 1], got {final_fraction!r}")
    if schedule == "constant":
        decay = optax.constant_schedule(learning_rate)
    else:
        if total_steps is None or total_steps <= warmup_steps:
            raise ValueError(
                f"schedule {schedule!r} needs total_steps > warmup_steps, got "
                f"total_steps={total_steps}, warmup_steps={warmup_steps}"
            )
        decay_steps = total_steps - warmup_steps
        end = learning_rate * final_fraction
        if schedule == "linear":
            decay = optax.linear_schedule(learning_rate, end, decay_steps)
        else:
            decay = optax.cosine_decay_schedule(learning_rate, decay_steps, alpha=final_fraction)
    if warmup_steps == 0:
        return decay
    warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps)
    return optax.join_schedules([warmup, decay], [warmup_steps])


def make_optimizer(
    learning_rate: float = 1e-6,
    *,
    schedule: str = "constant",
    warmup_steps: int = 0,
    total_steps: int | None = None,
    final_fraction: float = 0.0,
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    max_grad_norm: float | None = 1.0,
    state_dtype: str = "float32",
) -> optax.GradientTransformation:
    """AdamW after global-norm gradient clipping (the verl / TRL default), on the learning
    rate :func:`make_schedule` gives (``final_fraction``: where a decaying schedule ends).

    ``state_dtype``: the dtype AdamW's moments are stored in between steps (see
    :func:`store_state_in`), whatever the parameters' dtype; the update itself is computed
    in f32.
    """
    lr = make_schedule(
        learning_rate,
        schedule=schedule,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        final_fraction=final_fraction,
    )
    _checks.check_choice("state_dtype", state_dtype, STATE_DTYPES)
    adamw = optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    # Always wrapped: bf16 parameters still get f32 moments by default.
    adamw = store_state_in(adamw, jnp.dtype(state_dtype))
    if max_grad_norm is None:
        return adamw
    _checks.check_positive("max_grad_norm", max_grad_norm)
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw)


def store_state_in(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """``inner`` with its floating state stored in ``dtype`` between steps.

    ``update`` casts the stored state up to f32, runs ``inner`` in f32 (so ``m``, ``v`` and the
    update are computed at full precision from the rounded moments), and rounds the new state
    back to ``dtype``; integer leaves (step counts) are untouched.
    """

    def cast(tree, to):
        return jax.tree.map(
            lambda x: x.astype(to) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
        )

    def init(params):
        return cast(inner.init(params), dtype)

    def update(updates, state, params=None):
        updates_out, new_state = inner.update(updates, cast(state, jnp.float32), params)
        return updates_out, cast(new_state, dtype)

    return optax.GradientTransformation(init, update)


def make_model_optimizer(section) -> optax.GradientTransformation:
    """The constant-rate AdamW of an auxiliary model's section (``critic``, ``prime``: its
    ``learning_rate`` and ``max_grad_norm``); the trainer and ``plan`` both build it here."""
    return make_optimizer(section.learning_rate, max_grad_norm=section.max_grad_norm)


def make_trainer_optimizer(section, total_steps: int) -> optax.GradientTransformation:
    """:func:`make_optimizer` from a job's ``trainer`` section (``learning_rate``,
    ``schedule``, ``warmup_steps``, ``final_lr_fraction``, ``weight_decay``,
    ``max_grad_norm``, ``optimizer_state_dtype``) over ``total_steps`` optimizer steps."""
    return make_optimizer(
        section.learning_rate,
        schedule=section.schedule,
        warmup_steps=section.warmup_steps,
        total_steps=total_steps,
        final_fraction=section.final_lr_fraction,
        weight_decay=section.weight_decay,
        max_grad_norm=section.max_grad_norm,
        state_dtype=section.optimizer_state_dtype,
    )
