"""Per-token estimators of KL(π_θ ‖ π_ref) from sampled-token log-probs.

Schulman (2020), "Approximating KL divergence" (http://joschu.net/blog/kl-approx.html):
with tokens sampled from π_θ and ``x = ref − lp``,

- ``k1 = −x = lp − ref`` (unbiased, high variance, can be negative);
- ``k2 = ½·x²`` (biased, low variance; its gradient is the score-function KL gradient);
- ``k3 = exp(x) − x − 1`` (unbiased and non-negative);
- ``abs = |x|``.

:func:`importance_weighted_estimate` reweights them for tokens sampled from an older policy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm._checks import check_choice, check_rank, check_same_shape, f32

Array = jax.Array

KINDS: tuple[str, ...] = ("k1", "k2", "k3", "abs")

# verl's low_var_kl bounds: the log ratio before exp, and the estimate itself.
_K3_LOG_RATIO_CLAMP = 20.0
_K3_VALUE_CLAMP = 10.0
# exp(80) stays finite in f32: padding garbage must not turn a masked 0 into 0·inf.
_MAX_LOG_WEIGHT = 80.0


def _k2(x: Array) -> Array:
    return 0.5 * jnp.square(x)


def _value(x: Array, kind: str) -> Array:
    if kind == "k1":
        return -x
    if kind == "k2":
        return _k2(x)
    if kind == "k3":
        xc = jnp.clip(x, -_K3_LOG_RATIO_CLAMP, _K3_LOG_RATIO_CLAMP)
        return jnp.clip(jnp.exp(xc) - xc - 1.0, -_K3_VALUE_CLAMP, _K3_VALUE_CLAMP)
    return jnp.abs(x)


def estimate(
    logprobs: Array,
    ref_logprobs: Array,
    *,
    kind: str = "k3",
    straight_through: bool = False,
) -> Array:
    """Per-token KL estimate; with ``x = ref − lp``:

    ``k1 = lp − ref``; ``k2 = ½·x²``; ``k3 = clip(exp(x') − x' − 1, −10, 10)``,
    ``x' = clip(x, −20, 20)``; ``abs = |x|``.

    Schulman (2020), "Approximating KL divergence". ``k3`` is the GRPO paper's KL term
    (Shao et al. 2024) with verl's ``low_var_kl`` clamps, so it stays finite for any input.

    ``straight_through=True`` returns the value of ``kind`` with the gradient of ``k2``:
    ``k2 − sg(k2) + sg(value)`` (verl's ``"k3+"``-style estimators). On tokens sampled from
    π_θ, ``E[∇ k2] = E[(lp − ref)·∇lp] = ∇ KL(π_θ ‖ π_ref)``, whereas e.g. ``E[∇ k1] = 0``.

    Args:
      logprobs: ``[B, T]`` current log-probs (carry the gradient).
      ref_logprobs: ``[B, T]`` reference-policy log-probs (data).
      kind: one of :data:`KINDS`.
      straight_through: value of ``kind``, gradient of ``k2``.

    Returns:
      ``[B, T]`` float32 estimates (padding positions are not masked; aggregate with the mask).

    Raises:
      ValueError: on an unknown ``kind``, ranks other than 2 or mismatched shapes.
    """
    check_choice("kind", kind, KINDS)
    check_rank("logprobs", logprobs, 2)
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    x = f32(ref_logprobs) - f32(logprobs)
    value = _value(x, kind)
    if not straight_through or kind == "k2":
        return value
    k2 = _k2(x)
    return k2 - jax.lax.stop_gradient(k2) + jax.lax.stop_gradient(value)


def importance_weighted_estimate(
    logprobs: Array,
    ref_logprobs: Array,
    log_ratio: Array,
    *,
    kind: str = "k3",
    straight_through: bool = False,
) -> Array:
    """Per-token KL estimate of tokens sampled from ``π_old``: ``r·kl``, ``r = exp(log_ratio)``.

    DeepSeek-AI 2025, "DeepSeek-V3.2" (arXiv:2512.02556, the unbiased KL estimate; TRL's
    ``use_bias_correction_kl``): the estimators of :func:`estimate` are unbiased for tokens
    drawn from ``π_θ``, but an off-policy step draws them from ``π_old``; weighting by
    ``r = π_θ / π_old`` makes ``E_{π_old}[r·k3] = KL(π_θ ‖ π_ref)`` again. ``r`` keeps its
    gradient (TRL's), so even on-policy (``r = 1``) the gradient is
    ``∇k3 + k3·∇lp``, the score-function gradient of the reverse KL.

    Args:
      logprobs: ``[B, T]`` current log-probs (carry the gradient).
      ref_logprobs: ``[B, T]`` reference-policy log-probs.
      log_ratio: ``[B, T]`` ``log π_θ − log π_old`` (carries the gradient; already clamped,
        e.g. :func:`jaxrl_llm.losses.ratios.token_log_ratio`).
      kind, straight_through: as in :func:`estimate`.

    Returns:
      ``[B, T]`` float32 (padding not masked).

    Raises:
      ValueError: as :func:`estimate`, or a ``log_ratio`` of another shape.
    """
    check_same_shape(logprobs=logprobs, log_ratio=log_ratio)
    value = estimate(logprobs, ref_logprobs, kind=kind, straight_through=straight_through)
    return jnp.exp(jnp.minimum(f32(log_ratio), _MAX_LOG_WEIGHT)) * value
