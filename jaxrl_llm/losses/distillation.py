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

``top_k_generalized_jsd`` is the same divergence from log-probs already gathered at the teacher's
``k`` tokens (``[..., k]``: the teacher's top-k log-probs and the student's log-probs of the same
token ids, as ``logprobs.completion_logprobs(top_k=..., gather_ids=...)`` give them without a
``[B, T, V]`` array): both renormalised over the ``k`` tokens, then ``JSD_β``. With ``k = V``
(every token) it is the full-vocabulary divergence. It is the training loss of GKD in the RL
update (``objectives.policy_loss`` with ``Objective.distill_loss="jsd"``).

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


def _divergence(student: Array, teacher: Array, beta: float) -> Array:
    """``JSD_β(P ‖ Q)`` over the last axis of two normalised log-distributions (``β`` static:
    the ends are the KLs TRL takes, not Eq. 1's limit 0)."""
    if beta == 0.0:
        return _kl(teacher, student)
    if beta == 1.0:
        return _kl(student, teacher)
    mixture = jnp.logaddexp(teacher + jnp.log(beta), student + jnp.log1p(-beta))
    return beta * _kl(teacher, mixture) + (1.0 - beta) * _kl(student, mixture)


def _check_beta(beta: float) -> None:
    """``β`` a static number in ``[0, 1]`` (it picks the branch of ``_divergence``)."""
    try:
        valid = not isinstance(beta, bool) and 0.0 <= float(beta) <= 1.0
    except (TypeError, ValueError, jax.errors.ConcretizationTypeError):
        valid = False
    if not valid:
        raise ValueError(f"beta must be in [0, 1] (a static number), got {beta!r}")


def _check_mask(mask: Array | None, values: Array) -> None:
    if mask is not None and tuple(jnp.shape(mask)) != tuple(jnp.shape(values)[:-1]):
        raise ValueError(
            f"mask shape {tuple(jnp.shape(mask))} must be the distributions' shape without "
            f"their last axis, {tuple(jnp.shape(values)[:-1])}"
        )


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
    _check_beta(beta)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    vocab = jnp.shape(student_logits)[-1]
    if top_k is not None and not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must be in [1, {vocab}] (the vocabulary), got {top_k!r}")
    _check_mask(mask, student_logits)
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
    divergence = _divergence(student, teacher, beta)
    return divergence if valid is None else jnp.where(valid, divergence, 0.0)


def top_k_generalized_jsd(
    student_logprobs: Array,
    teacher_logprobs: Array,
    mask: Array | None = None,
    *,
    beta: float = 0.5,
) -> Array:
    """``JSD_β(P_k ‖ Q_k)`` per position over ``k`` gathered tokens, unreduced.

    ``P_k = softmax(teacher_logprobs)`` and ``Q_k = softmax(student_logprobs)`` over the last
    axis: the teacher's and the student's distributions restricted to the same ``k`` tokens
    (the teacher's most likely) and renormalised there; then, with ``M = β P_k + (1 − β) Q_k``,
    ``JSD_β = β KL(P_k ‖ M) + (1 − β) KL(Q_k ‖ M)`` (``β = 0``: ``KL(P_k ‖ Q_k)``; ``β = 1``:
    ``KL(Q_k ‖ P_k)``), GKD's Eq. 1 (arXiv:2306.13649) as TRL's
    ``GKDTrainer.generalized_jsd_loss`` computes it, on the restricted distributions. Equals
    ``generalized_jsd(student_logits, teacher_logits, top_k=k)`` when the inputs are the two
    log-softmaxes (at one temperature) gathered at the teacher's top-``k`` ids; with ``k = V``
    the full-vocabulary divergence. The renormalisation makes any per-position constant in the
    inputs irrelevant: log-probs under the full vocabulary and raw logits give the same value.

    Args:
      student_logprobs: ``[..., k]`` the student's log-probs of the ``k`` tokens (carry the
        gradient; any float dtype, computed in float32).
      teacher_logprobs: ``[..., k]`` the teacher's log-probs of the same tokens (constants:
        no gradient flows into them).
      mask: optional ``[...]`` 0/1 mask; masked positions are exactly 0 with no gradient
        (whatever, NaN included, the inputs hold there).
      beta: the interpolation ``β`` in ``[0, 1]`` (a static Python float).

    Returns:
      float32 ``[...]``, >= 0; 0 where ``k = 1`` (one token renormalised is certain on both
      sides).

    Raises:
      ValueError: shapes that differ, no token axis, a mask of another shape or ``beta``
        outside ``[0, 1]``.
    """
    check_same_shape(student_logprobs=student_logprobs, teacher_logprobs=teacher_logprobs)
    if jnp.ndim(student_logprobs) < 1 or jnp.shape(student_logprobs)[-1] < 1:
        raise ValueError(
            f"the log-probs need a token axis (the last, k >= 1), got shape "
            f"{tuple(jnp.shape(student_logprobs))}"
        )
    _check_beta(beta)
    _check_mask(mask, student_logprobs)
    student = f32(student_logprobs)
    teacher = jax.lax.stop_gradient(f32(teacher_logprobs))
    valid = None
    if mask is not None:
        valid = jnp.asarray(mask) != 0
        student = jnp.where(valid[..., None], student, 0.0)
        teacher = jnp.where(valid[..., None], teacher, 0.0)
    student = jax.nn.log_softmax(student, axis=-1)
    teacher = jax.nn.log_softmax(teacher, axis=-1)
    divergence = _divergence(student, teacher, beta)
    return divergence if valid is None else jnp.where(valid, divergence, 0.0)
