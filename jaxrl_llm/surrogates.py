"""Policy-gradient surrogates: per-token losses to MINIMISE.

Each takes a log importance ratio ``Δ`` (from :mod:`jaxrl_llm.ratios`, so ``r = exp(Δ)``) and
advantages ``A`` of shape ``[B]`` (one per completion, broadcast over tokens) or ``[B, T]``, and
returns an unreduced ``[B, T]`` loss (GMPO: ``[B]``) for :func:`jaxrl_llm.aggregation.aggregate`.
All math is float32 whatever the input dtype.

The ``*_metrics`` helpers return per-token float 0/1 indicators (no gradient) whose masked
mean is the usual diagnostic, e.g. ``clip_frac``.

``r`` is computed as ``exp(min(Δ, 80))``: :func:`jaxrl_llm.ratios.token_log_ratio` already
clamps at 20 so the cap never binds in normal use, but it keeps unclamped garbage at padding
positions finite, so that the masked aggregation gives those positions an exact 0 gradient
instead of ``0·inf = NaN``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm._checks import (
    as_mask,
    check_advantages,
    check_batch_time,
    check_clip_bounds,
    check_positive,
    check_rank,
    check_same_shape,
    f32,
)

Array = jax.Array

# exp(80) ≈ 5.5e34 leaves f32 headroom (max ≈ 3.4e38) for the product with an advantage.
_MAX_EXP_LOG_RATIO = 80.0
# GMPO's per-sequence epsilon (as in the paper's code); only matters for empty rows.
_SEQ_EPS = 1e-8


def _ratio(log_ratio: Array) -> Array:
    return jnp.exp(jnp.minimum(log_ratio, _MAX_EXP_LOG_RATIO))


def _token_advantages(advantages: Array, x: Array, name: str = "log_ratio") -> Array:
    """Validates ``[B]`` or ``[B, T]`` advantages against the ``[B, T]`` input ``x``; returns
    a float32 array broadcastable to ``[B, T]``."""
    check_rank(name, x, 2)
    check_advantages(advantages, x)
    adv = f32(advantages)
    return adv[:, None] if adv.ndim == 1 else adv


def _check_ppo_bounds(clip_low: float, clip_high: float, dual_clip: float | None) -> None:
    if clip_low is None or clip_high is None:
        raise ValueError(
            f"clip_low and clip_high must be numbers, got clip_low={clip_low!r}, "
            f"clip_high={clip_high!r}"
        )
    check_clip_bounds(clip_low, clip_high)
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip!r}")


def _ppo_terms(
    log_ratio: Array, adv: Array, clip_low: float, clip_high: float
) -> tuple[Array, Array, Array]:
    ratio = _ratio(f32(log_ratio))
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return unclipped, clipped, jnp.maximum(unclipped, clipped)


def ppo_clip(
    log_ratio: Array,
    advantages: Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> Array:
    """Clipped surrogate ``L = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))``.

    PPO (Schulman et al. 2017, "Proximal Policy Optimization Algorithms"). Clip-higher
    (DAPO, Yu et al. 2025) is ``clip_high > clip_low``. With ``dual_clip = c > 1``
    (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL") the loss of
    tokens with ``A < 0`` is further bounded: ``where(A < 0, min(L, −A·c), L)``; positive
    advantages are never dual-clipped. Where a bound is active the gradient is 0.

    Args:
      log_ratio: ``[B, T]`` log importance ratio ``Δ``.
      advantages: ``[B]`` or ``[B, T]``.
      clip_low: ``ε_low`` in ``[0, 1)``.
      clip_high: ``ε_high >= 0``.
      dual_clip: ``c > 1`` or None.

    Returns:
      ``[B, T]`` float32 per-token loss.

    Raises:
      ValueError: on bad shapes or bounds, or ``dual_clip <= 1``.
    """
    _check_ppo_bounds(clip_low, clip_high, dual_clip)
    adv = _token_advantages(advantages, log_ratio)
    _, _, loss = _ppo_terms(log_ratio, adv, clip_low, clip_high)
    if dual_clip is not None:
        loss = jnp.where(adv < 0, jnp.minimum(loss, -adv * dual_clip), loss)
    return loss


def ppo_clip_metrics(
    log_ratio: Array,
    advantages: Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> dict[str, Array]:
    """Per-token clipping indicators of :func:`ppo_clip` (verl's ``pg_clipfrac*``).

    - ``"clipped"``: ``L2 > L1``, i.e. the ratio clip is active (``A > 0`` and
      ``r > 1 + ε_high``, or ``A < 0`` and ``r < 1 − ε_low``);
    - ``"clipped_lower"``: the dual clip is active, ``A < 0`` and ``max(L1, L2) > −A·c``
      (all zeros when ``dual_clip`` is None).

    Args:
      log_ratio: ``[B, T]``.
      advantages: ``[B]`` or ``[B, T]``.
      clip_low, clip_high, dual_clip: as in :func:`ppo_clip`.

    Returns:
      dict of ``[B, T]`` float32 0/1 arrays without gradient; their masked mean is the
      fraction of clipped tokens.

    Raises:
      ValueError: as :func:`ppo_clip`.
    """
    _check_ppo_bounds(clip_low, clip_high, dual_clip)
    adv = _token_advantages(advantages, log_ratio)
    unclipped, clipped, loss = jax.lax.stop_gradient(
        _ppo_terms(log_ratio, adv, clip_low, clip_high)
    )
    lower = jnp.zeros_like(loss, dtype=bool)
    if dual_clip is not None:
        lower = (adv < 0) & (loss > -adv * dual_clip)
    return {
        "clipped": (clipped > unclipped).astype(jnp.float32),
        "clipped_lower": jnp.broadcast_to(lower, loss.shape).astype(jnp.float32),
    }


def _cispo_weight(log_ratio: Array, clip_low: float | None, clip_high: float) -> Array:
    if clip_high is None:
        raise ValueError("cispo needs clip_high (upper bound 1 + clip_high), got None")
    check_clip_bounds(clip_low, clip_high)
    lower = None if clip_low is None else 1.0 - clip_low
    return jnp.clip(_ratio(f32(log_ratio)), lower, 1.0 + clip_high)


def cispo(
    log_ratio: Array,
    logprobs: Array,
    advantages: Array,
    *,
    clip_low: float | None,
    clip_high: float,
) -> Array:
    """Clipped IS-weight policy gradient ``L = −sg(clip(r, 1 − ε_low, 1 + ε_high))·A·lp``.

    CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention"): the importance weight is clipped and detached instead of the update, so every
    token keeps the gradient ``−w·A·∇lp``, including tokens whose ratio is out of range. The
    upper bound is ``1 + clip_high`` (not an absolute ``clip_high``); ``clip_low=None`` leaves
    the weight unbounded below (it is ≥ 0 anyway).

    Args:
      log_ratio: ``[B, T]`` log importance ratio (no gradient flows through it).
      logprobs: ``[B, T]`` current log-probs (carry the gradient).
      advantages: ``[B]`` or ``[B, T]``.
      clip_low: ``ε_low`` in ``[0, 1)`` or None.
      clip_high: ``ε_high >= 0``.

    Returns:
      ``[B, T]`` float32 per-token loss.

    Raises:
      ValueError: on bad shapes or bounds.
    """
    adv = _token_advantages(advantages, log_ratio)
    check_same_shape(log_ratio=log_ratio, logprobs=logprobs)
    weight = jax.lax.stop_gradient(_cispo_weight(log_ratio, clip_low, clip_high))
    return -weight * adv * f32(logprobs)


def cispo_metrics(
    log_ratio: Array, *, clip_low: float | None, clip_high: float
) -> dict[str, Array]:
    """Per-token indicator ``"clipped"``: the CISPO weight is truncated,
    ``r > 1 + ε_high`` or (with a lower bound) ``r < 1 − ε_low``.

    Args:
      log_ratio: ``[B, T]``.
      clip_low, clip_high: as in :func:`cispo`.

    Returns:
      dict with one ``[B, T]`` float32 0/1 array, no gradient.

    Raises:
      ValueError: on a rank other than 2 or bad bounds.
    """
    check_rank("log_ratio", log_ratio, 2)
    ratio = jax.lax.stop_gradient(_ratio(f32(log_ratio)))
    weight = jax.lax.stop_gradient(_cispo_weight(log_ratio, clip_low, clip_high))
    return {"clipped": (weight != ratio).astype(jnp.float32)}


def sapo(
    log_ratio: Array, advantages: Array, *, tau_pos: float = 1.0, tau_neg: float = 1.05
) -> Array:
    """Soft-gated surrogate ``L = −σ(τ·(r − 1))·(4/τ)·A``, ``τ = τ_pos if A > 0 else τ_neg``.

    SAPO (Qwen team 2025, "Soft Adaptive Policy Optimization"): a smooth gate replaces the hard
    clip, so the gradient ``−A·4·σ(1 − σ)·r`` decays smoothly as ``r`` leaves 1 and equals the
    on-policy ``−A`` at ``r = 1``. ``τ_neg > τ_pos`` damps negative-advantage tokens faster.

    Args:
      log_ratio: ``[B, T]`` log importance ratio.
      advantages: ``[B]`` or ``[B, T]``.
      tau_pos: temperature for ``A > 0``, > 0.
      tau_neg: temperature for ``A <= 0``, > 0.

    Returns:
      ``[B, T]`` float32 per-token loss.

    Raises:
      ValueError: on bad shapes or non-positive temperatures.
    """
    check_positive("tau_pos", tau_pos)
    check_positive("tau_neg", tau_neg)
    adv = _token_advantages(advantages, log_ratio)
    tau = jnp.where(adv > 0, tau_pos, tau_neg)
    gate = jax.nn.sigmoid(tau * (_ratio(f32(log_ratio)) - 1.0))
    return -gate * (4.0 / tau) * adv


def _gmpo_clipped_log_ratio(
    log_ratio: Array, adv: Array, valid: Array, clip_low: float, clip_high: float
) -> Array:
    delta = jnp.where(valid, f32(log_ratio), 0.0)
    sign = jnp.sign(adv)
    delta_c = jnp.clip(delta, -clip_low, clip_high)
    return sign * jnp.minimum(sign * delta, sign * delta_c)


def _check_gmpo(log_ratio, advantages, mask, clip_low, clip_high):
    _check_ppo_bounds(clip_low, clip_high, None)
    check_batch_time("log_ratio", log_ratio, mask)
    adv = jnp.broadcast_to(_token_advantages(advantages, log_ratio), jnp.shape(log_ratio))
    return adv, as_mask(mask) > 0


def gmpo(
    log_ratio: Array,
    advantages: Array,
    mask: Array,
    *,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
) -> Array:
    """Geometric-mean surrogate ``L_i = −Ā_i·exp(Σ_t m·Δ*_t / (Σ_t m + 1e-8))`` per sequence.

    GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization"): the token ratios of a
    sequence are combined by their geometric mean, clipped token-wise in log space:
    ``s = sign(A)``, ``Δc = clip(Δ, −ε_low, ε_high)``, ``Δ* = s·min(s·Δ, s·Δc)`` (the
    pessimistic side, as PPO's max of losses), and ``Ā_i = Σ_t m·A / (Σ_t m + 1e-8)``.
    An empty row gives 0.

    Args:
      log_ratio: ``[B, T]`` per-token log ratio ``Δ`` (unclamped is fine).
      advantages: ``[B]`` or ``[B, T]``.
      mask: ``[B, T]`` bool or 0/1 completion mask.
      clip_low: ``ε_low`` in ``[0, 1)`` (log space).
      clip_high: ``ε_high >= 0`` (log space).

    Returns:
      ``[B]`` float32 per-sequence loss (reduce with
      :func:`jaxrl_llm.aggregation.sequence_mean`).

    Raises:
      ValueError: on bad shapes or bounds.
    """
    adv, valid = _check_gmpo(log_ratio, advantages, mask, clip_low, clip_high)
    delta_star = _gmpo_clipped_log_ratio(log_ratio, adv, valid, clip_low, clip_high)
    denom = jnp.sum(valid, axis=-1, dtype=jnp.int32).astype(jnp.float32) + _SEQ_EPS
    seq_log_ratio = jnp.sum(jnp.where(valid, delta_star, 0.0), axis=-1) / denom
    seq_adv = jnp.sum(jnp.where(valid, adv, 0.0), axis=-1) / denom
    return -seq_adv * _ratio(seq_log_ratio)


def gmpo_metrics(
    log_ratio: Array,
    advantages: Array,
    mask: Array,
    *,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
) -> dict[str, Array]:
    """Per-token indicator ``"clipped"``: GMPO's log-space clip binds on a valid token,
    ``A > 0`` and ``Δ > ε_high``, or ``A < 0`` and ``Δ < −ε_low`` (tokens with ``A = 0``
    are never counted).

    Args:
      log_ratio, advantages, mask, clip_low, clip_high: as in :func:`gmpo`.

    Returns:
      dict with one ``[B, T]`` float32 0/1 array, no gradient.

    Raises:
      ValueError: as :func:`gmpo`.
    """
    adv, valid = _check_gmpo(log_ratio, advantages, mask, clip_low, clip_high)
    delta = jax.lax.stop_gradient(f32(log_ratio))
    binds = ((adv > 0) & (delta > clip_high)) | ((adv < 0) & (delta < -clip_low))
    return {"clipped": (valid & binds).astype(jnp.float32)}


def reinforce(logprobs: Array, advantages: Array) -> Array:
    """Vanilla policy gradient ``L = −A·lp`` (no ratio, no clip).

    REINFORCE (Williams 1992) as used by GPG (Chu et al. 2025, "GPG: A Simple and Strong
    Reinforcement Learning Baseline for Model Reasoning"). Its gradient equals that of
    :func:`ppo_clip` at ``old = sg(lp)``.

    Args:
      logprobs: ``[B, T]`` current log-probs (carry the gradient).
      advantages: ``[B]`` or ``[B, T]``.

    Returns:
      ``[B, T]`` float32 per-token loss.

    Raises:
      ValueError: on bad shapes.
    """
    adv = _token_advantages(advantages, logprobs, "logprobs")
    return -adv * f32(logprobs)
