"""Per-token divergences between a student's and a teacher's full next-token distributions.

GKD (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes", arXiv:2306.13649, Eq. 1) trains on the generalised Jensen-Shannon
divergence between the teacher ``P`` and the student ``Q_θ`` at every position of a sequence
(sampled by the student for on-policy distillation), with ``M = β P + (1 − β) Q_θ``:

``JSD_β(P ‖ Q_θ) = β KL(P ‖ M) + (1 − β) KL(Q_θ ‖ M)``

``β = 0`` is the forward ``KL(P ‖ Q_θ)`` (supervised distillation's), ``β = 1`` the reverse
``KL(Q_θ ‖ P)`` (mode seeking), as TRL's ``GKDTrainer.generalized_jsd_loss`` defines the two
ends. The logits are divided by ``temperature`` before the softmax. ``top_k`` restricts both
distributions to the teacher's ``k`` most likely tokens, renormalised there (the form a
teacher's stored top-k log-probs allow when the full vocabulary does not fit).

The sampled-token form of the reverse KL (the advantage of on-policy distillation) is
``advantages.distillation``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm._checks import check_same_shape, f32

Array = jax.Array


def _restrict(student: Array, teacher: Array, top_k: int) -> tuple[Array, Array]:
    """Both log-distributions over the teacher's ``top_k`` tokens, renormalised there."""
    teacher_top, ids = jax.lax.top_k(teacher, top_k)
    student_top = jnp.take_along_axis(student, ids, axis=-1)
    return (
        jax.nn.log_softmax(student_top, axis=-1),
        jax.nn.log_softmax(teacher_top, axis=-1),
    )


def _kl(log_p: Array, log_q: Array) -> Array:
    """``Σ_v p (log p − log q)`` over the last axis (0 where ``p`` is 0)."""
    p = jnp.exp(log_p)
    return jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), axis=-1)


def generalized_jsd(
    student_logits: Array,
    teacher_logits: Array,
    mask: Array | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    top_k: int | None = None,
) -> Array:
    """``JSD_β(P_teacher ‖ Q_student)`` per position (see the module), unreduced.

    Args:
      student_logits: ``[..., V]`` the student's next-token logits (any float dtype; the
        softmax and divergence run in float32).
      teacher_logits: ``[..., V]`` the teacher's, same shape.
      mask: optional ``[...]`` 0/1 mask; masked positions are exactly 0 with no gradient.
      beta: the interpolation ``β`` in ``[0, 1]`` (a static Python float).
      temperature: divides both logits before the softmax (> 0).
      top_k: restrict to the teacher's ``k`` most likely tokens (None: the full vocabulary).

    Returns:
      float32 ``[...]``: the divergence at each position (aggregate it with
      ``aggregation.aggregate`` as any per-token loss).

    Raises:
      ValueError: shapes that differ, a mask of another shape, ``beta`` outside ``[0, 1]``, a
        non-positive temperature or ``top_k`` outside ``[1, V]``.
    """
    check_same_shape(student_logits=student_logits, teacher_logits=teacher_logits)
    if jnp.ndim(student_logits) < 1:
        raise ValueError("the logits need a vocabulary axis (the last)")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    vocab = jnp.shape(student_logits)[-1]
    if top_k is not None and not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must be in [1, {vocab}] (the vocabulary), got {top_k!r}")
    if mask is not None and tuple(jnp.shape(mask)) != tuple(jnp.shape(student_logits)[:-1]):
        raise ValueError(
            f"mask shape {tuple(jnp.shape(mask))} must be the logits' shape without the "
            f"vocabulary, {tuple(jnp.shape(student_logits)[:-1])}"
        )
    student_logits, teacher_logits = f32(student_logits), f32(teacher_logits)
    valid = None
    if mask is not None:  # padding's logits (NaN included) reach neither value nor gradient
        valid = jnp.asarray(mask) != 0
        student_logits = jnp.where(valid[..., None], student_logits, 0.0)
        teacher_logits = jnp.where(valid[..., None], teacher_logits, 0.0)
    student = jax.nn.log_softmax(student_logits / temperature, axis=-1)
    teacher = jax.nn.log_softmax(teacher_logits / temperature, axis=-1)
    if top_k is not None:
        student, teacher = _restrict(student, teacher, top_k)
    if beta == 0.0:
        divergence = _kl(teacher, student)
    elif beta == 1.0:
        divergence = _kl(student, teacher)
    else:
        mixture = jnp.logaddexp(teacher + jnp.log(beta), student + jnp.log1p(-beta))
        divergence = beta * _kl(teacher, mixture) + (1.0 - beta) * _kl(student, mixture)
    return divergence if valid is None else jnp.where(valid, divergence, 0.0)
