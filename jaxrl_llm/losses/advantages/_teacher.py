"""Token advantages from a teacher's log-probs: on-policy distillation.

The student samples, the teacher scores the student's own tokens, and each token's advantage
is the negative of its reverse-KL sample ``log π_T(y_t) − log π_θ(y_t)``: the student is
pushed towards what the teacher would have written exactly where the student goes (Agarwal et
al. 2024, GKD, arXiv:2306.13649, with the on-policy fraction 1 and the reverse KL; Qwen3,
arXiv:2505.09388; Thinking Machines' "On-Policy Distillation", 2025). With no discount the
policy-gradient step on these advantages is a step down the per-token reverse KL
``E_{y~π_θ}[log π_θ(y) − log π_T(y)]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm._checks import as_mask, check_batch_time, f32

Array = jax.Array


def distillation(
    student_logprobs: Array, teacher_logprobs: Array, mask: Array, *, coef: float = 1.0
) -> Array:
    """``coef * (log π_T(y_t) − log π_θ(y_t))`` on the valid tokens, 0 elsewhere.

    Args:
      student_logprobs: ``[B, T]`` the student's (behaviour) log-probs of its sampled tokens.
      teacher_logprobs: ``[B, T]`` the teacher's log-probs of the same tokens.
      mask: ``[B, T]`` 0/1 completion mask.
      coef: the weight of the term (a static Python float).

    Returns:
      f32 ``[B, T]``; masked positions exactly 0 whatever the log-probs hold there (no
      gradient flows: advantages are constants of the update).

    Raises:
      ValueError: shapes that are not one ``[B, T]``.
    """
    check_batch_time("student_logprobs", student_logprobs, mask)
    check_batch_time("teacher_logprobs", teacher_logprobs, mask)
    valid = as_mask(mask) != 0
    gap = jnp.where(valid, f32(teacher_logprobs) - f32(student_logprobs), 0.0)
    return jax.lax.stop_gradient(coef * gap)
