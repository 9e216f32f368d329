"""Policy-gradient surrogates: per-token losses to MINIMISE.

Each takes a log importance ratio ``Δ`` (from :mod:`jaxrl_llm.losses.ratios`, so
``r = exp(Δ)``) and advantages ``A`` of shape ``[B]`` (one per completion, broadcast over
tokens) or ``[B, T]``, and returns an unreduced ``[B, T]`` loss (GMPO: ``[B]``) for
:func:`jaxrl_llm.losses.aggregation.aggregate`.
All math is float32 whatever the input dtype.

The ``*_metrics`` helpers return per-token float 0/1 indicators (no gradient) whose masked
mean is the usual diagnostic, e.g. ``clip_frac``.

``r`` is computed as ``exp(min(Δ, 80))``: :func:`jaxrl_llm.losses.ratios.token_log_ratio` already
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
    check_choice,
    check_clip_bounds,
    check_non_negative,
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
      :func:`jaxrl_llm.losses.aggregation.sequence_mean`).

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


# ----------------------------------------------------------------------------- DPPO

DIVERGENCES = ("tv", "kl")
# verl's guard inside the binary KL's logarithm of 1 − p.
_BINARY_KL_EPS = 1e-8


def binary_divergence(logprobs: Array, old_logprobs: Array, *, kind: str = "tv") -> Array:
    """Divergence of the sampled token's Bernoulli ``(p, 1 − p)`` from ``(p_old, 1 − p_old)``.

    DPPO's cheap stand-in for a divergence between the full next-token distributions
    ("Rethinking the Trust Region in LLM Reinforcement Learning", 2026, arXiv:2602.04879),
    with ``p = exp(lp)``, ``p_old = exp(old)``:

    - ``"tv"``: the signed change ``p − p_old`` (its absolute value is the binary total
      variation; the sign tells which side of the trust region a token is on);
    - ``"kl"``: ``KL(Ber(p_old) ‖ Ber(p)) = p_old·(old − lp) + (1 − p_old)·log((1 − p_old +
      1e-8) / (1 − p + 1e-8))`` (``1 − p`` as ``−expm1(lp)``, exact near ``p = 1``).

    Args:
      logprobs: ``[B, T]`` current log-probs of the sampled tokens.
      old_logprobs: ``[B, T]`` behaviour log-probs.
      kind: ``"tv"`` or ``"kl"``.

    Returns:
      ``[B, T]`` float32, no gradient.

    Raises:
      ValueError: on an unknown kind or mismatched shapes.
    """
    check_choice("DPPO divergence", kind, DIVERGENCES)
    check_rank("logprobs", logprobs, 2)
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs)
    lp = jax.lax.stop_gradient(jnp.minimum(f32(logprobs), 0.0))
    old = jax.lax.stop_gradient(jnp.minimum(f32(old_logprobs), 0.0))
    prob, old_prob = jnp.exp(lp), jnp.exp(old)
    if kind == "tv":
        return prob - old_prob
    tail = jnp.log(-jnp.expm1(old) + _BINARY_KL_EPS) - jnp.log(-jnp.expm1(lp) + _BINARY_KL_EPS)
    return old_prob * (old - lp) + (1.0 - old_prob) * tail


def dppo_trust_region(
    logprobs: Array,
    old_logprobs: Array,
    advantages: Array,
    *,
    divergence: str = "tv",
    delta_low: float = 0.15,
    delta_high: float = 0.15,
) -> Array:
    """DPPO's trust-region mask: 1 where a token may still move in its advantage's direction.

    With ``d`` from :func:`binary_divergence` (DPPO, arXiv:2602.04879; verl's
    ``dppo_tv`` / ``dppo_kl``): for ``"tv"``, ``A > 0`` keeps ``p − p_old ≤ δ_high`` and
    ``A ≤ 0`` keeps ``p − p_old ≥ −δ_low``; for ``"kl"``, ``A > 0`` keeps ``d ≤ δ_high or
    p ≤ p_old`` and ``A ≤ 0`` keeps ``d ≤ δ_low or p ≥ p_old``. Unlike PPO's ratio clip, the
    bound is on the probability mass moved, so a rare token may grow by a large ratio and a
    likely one is stopped after a small one.

    Args:
      logprobs: ``[B, T]`` current log-probs.
      old_logprobs: ``[B, T]`` behaviour log-probs.
      advantages: ``[B]`` or ``[B, T]``.
      divergence: ``"tv"`` or ``"kl"``.
      delta_low: bound for ``A ≤ 0`` (``≥ 0``).
      delta_high: bound for ``A > 0`` (``≥ 0``).

    Returns:
      ``[B, T]`` float32 0/1, no gradient.

    Raises:
      ValueError: on bad shapes, kind or bounds.
    """
    check_non_negative("delta_low", delta_low)
    check_non_negative("delta_high", delta_high)
    adv = _token_advantages(advantages, logprobs, "logprobs")
    d = binary_divergence(logprobs, old_logprobs, kind=divergence)
    if divergence == "tv":
        up, down = d <= delta_high, d >= -delta_low
    else:
        change = binary_divergence(logprobs, old_logprobs, kind="tv")
        up, down = (d <= delta_high) | (change <= 0), (d <= delta_low) | (change >= 0)
    return jnp.where(adv > 0, up, down).astype(jnp.float32)


def dppo(
    log_ratio: Array,
    logprobs: Array,
    old_logprobs: Array,
    advantages: Array,
    *,
    divergence: str = "tv",
    delta_low: float = 0.15,
    delta_high: float = 0.15,
    ratio_cap: float | None = None,
) -> Array:
    """Divergence-trust-region policy gradient ``L = −A·sg(min(r, C))·lp·M``.

    DPPO ("Rethinking the Trust Region in LLM Reinforcement Learning", 2026,
    arXiv:2602.04879; verl's ``dppo_tv`` / ``dppo_kl``, prime-rl's default loss): ``M`` is
    :func:`dppo_trust_region` (no gradient) and the detached IS weight ``r`` is truncated at
    ``C = ratio_cap`` (TIS; ``None``: no cap — the paper recommends a large one, verl's
    recipe sets 10⁴). Inside the region the gradient is the on-policy-corrected
    ``−A·r·∇lp``, PPO's unclipped gradient; outside it is 0.

    Args:
      log_ratio: ``[B, T]`` log importance ratio (its weight carries no gradient).
      logprobs: ``[B, T]`` current log-probs (carry the gradient).
      old_logprobs: ``[B, T]`` behaviour log-probs.
      advantages: ``[B]`` or ``[B, T]``.
      divergence, delta_low, delta_high: as in :func:`dppo_trust_region`.
      ratio_cap: ``C > 0`` or None.

    Returns:
      ``[B, T]`` float32 per-token loss.

    Raises:
      ValueError: on bad shapes, kind or bounds.
    """
    check_positive("ratio_cap", ratio_cap)
    adv = _token_advantages(advantages, log_ratio)
    check_same_shape(log_ratio=log_ratio, logprobs=logprobs, old_logprobs=old_logprobs)
    inside = dppo_trust_region(
        logprobs,
        old_logprobs,
        advantages,
        divergence=divergence,
        delta_low=delta_low,
        delta_high=delta_high,
    )
    weight = _ratio(f32(log_ratio))
    if ratio_cap is not None:
        weight = jnp.minimum(weight, ratio_cap)
    return -adv * jax.lax.stop_gradient(weight) * f32(logprobs) * inside


def dppo_metrics(
    log_ratio: Array,
    logprobs: Array,
    old_logprobs: Array,
    advantages: Array,
    *,
    divergence: str = "tv",
    delta_low: float = 0.15,
    delta_high: float = 0.15,
    ratio_cap: float | None = None,
) -> dict[str, Array]:
    """Per-token indicators of :func:`dppo` (verl's ``pg_clipfrac`` / ``pg_clipfrac_lower``):
    ``"clipped"`` outside the trust region, ``"clipped_lower"`` inside it with the weight
    truncated (``r > C``; zeros without a cap).

    Returns:
      dict of ``[B, T]`` float32 0/1 arrays, no gradient.
    """
    inside = dppo_trust_region(
        logprobs,
        old_logprobs,
        advantages,
        divergence=divergence,
        delta_low=delta_low,
        delta_high=delta_high,
    )
    capped = jnp.zeros_like(inside)
    if ratio_cap is not None:
        ratio = jax.lax.stop_gradient(_ratio(f32(log_ratio)))
        capped = (ratio > ratio_cap).astype(jnp.float32) * inside
    return {"clipped": 1.0 - inside, "clipped_lower": capped}


# ----------------------------------------------------------------------------- KL-Cov, Clip-Cov


def _check_fraction(name: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")


def token_covariance(logprobs: Array, advantages: Array, mask: Array) -> Array:
    """``cov_t = (A_t − mean(A))·(lp_t − mean(lp))``, means over the valid tokens.

    The per-token covariance between log-probability and advantage that drives the change of
    the policy's entropy (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning
    for Reasoning Language Models", arXiv:2505.22617, Theorem 2); the means divide by
    ``Σ m + 1e-8`` (verl's ``masked_mean``). Masked positions hold ``−inf``, so a selection
    by the largest covariance never takes one.

    Args:
      logprobs: ``[B, T]`` current log-probs (no gradient flows).
      advantages: ``[B]`` or ``[B, T]``.
      mask: ``[B, T]`` completion mask.

    Returns:
      ``[B, T]`` float32, no gradient.
    """
    check_batch_time("logprobs", logprobs, mask)
    adv = jnp.broadcast_to(_token_advantages(advantages, logprobs, "logprobs"), mask.shape)
    valid = as_mask(mask) > 0
    lp = jax.lax.stop_gradient(jnp.where(valid, f32(logprobs), 0.0))
    adv = jnp.where(valid, adv, 0.0)
    count = jnp.sum(valid, dtype=jnp.float32) + _SEQ_EPS
    cov = (adv - jnp.sum(adv) / count) * (lp - jnp.sum(lp) / count)
    return jnp.where(valid, cov, -jnp.inf)


# ⌊fraction·N⌋ is taken in f32: a relative nudge keeps e.g. 0.7·10 at 7 (f32(0.7) < 0.7).
_COUNT_NUDGE = 1.0 + 1e-6


def _top_tokens(priority: Array, eligible: Array, valid: Array, fraction: float) -> Array:
    """The ``eligible`` tokens among the ``max(⌊fraction·N⌋, 1)`` of largest ``priority`` (ties
    by index; ``N``: the ``valid`` tokens, verl's count), as ``[B, T]`` float32 0/1."""
    flat = priority.reshape(-1)
    order = jnp.argsort(-flat, stable=True)
    ranks = jnp.zeros(flat.shape, jnp.int32).at[order].set(jnp.arange(flat.size, dtype=jnp.int32))
    n = jnp.sum(valid, dtype=jnp.int32).astype(jnp.float32)
    count = jnp.maximum(jnp.floor(fraction * n * _COUNT_NUDGE).astype(jnp.int32), 1)
    return (eligible & (ranks.reshape(priority.shape) < count)).astype(jnp.float32)


def kl_cov_selection(
    logprobs: Array, advantages: Array, mask: Array, *, fraction: float = 2e-4
) -> Array:
    """KL-Cov's tokens: the ``max(⌊fraction·N⌋, 1)`` valid tokens of largest
    :func:`token_covariance` (none when there is no valid token).

    Returns:
      ``[B, T]`` float32 0/1, no gradient.
    """
    _check_fraction("fraction", fraction)
    valid = as_mask(mask) > 0
    return _top_tokens(token_covariance(logprobs, advantages, mask), valid, valid, fraction)


def kl_cov(
    log_ratio: Array,
    logprobs: Array,
    advantages: Array,
    mask: Array,
    *,
    fraction: float = 2e-4,
    coef: float = 0.1,
) -> Array:
    """KL-Cov: ``L = −A·r + β·|Δ|·S`` with no ratio clip.

    Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models" (arXiv:2505.22617; verl's ``kl_cov``): the entropy collapses through the few
    tokens whose log-probability and advantage covary most, so only those — the selection
    ``S`` of :func:`kl_cov_selection`, a ``fraction`` of the valid tokens of the batch — get a
    KL penalty ``β·|log r|`` towards the behaviour policy; every other token has the plain
    importance-sampled surrogate ``−A·r``.

    Args:
      log_ratio: ``[B, T]`` log importance ratio ``Δ``.
      logprobs: ``[B, T]`` current log-probs (for the covariance; no gradient through it).
      advantages: ``[B]`` or ``[B, T]``.
      mask: ``[B, T]`` completion mask (the selection is over its valid tokens).
      fraction: ``k`` of the paper, in ``(0, 1]`` (verl's ``kl_cov_ratio``).
      coef: ``β >= 0`` (verl's ``ppo_kl_coef``).

    Returns:
      ``[B, T]`` float32 per-token loss.

    Raises:
      ValueError: on bad shapes or hyper-parameters.
    """
    check_non_negative("coef", coef)
    adv = _token_advantages(advantages, log_ratio)
    check_batch_time("log_ratio", log_ratio, mask)
    selected = kl_cov_selection(logprobs, advantages, mask, fraction=fraction)
    delta = f32(log_ratio)
    return -adv * _ratio(delta) + coef * jnp.abs(delta) * selected


def clip_cov_selection(
    log_ratio: Array,
    logprobs: Array,
    advantages: Array,
    mask: Array,
    *,
    key: Array,
    fraction: float = 2e-4,
    cov_low: float = 1.0,
    cov_high: float = 5.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> Array:
    """Clip-Cov's tokens: at most ``max(⌊fraction·N⌋, 1)`` drawn uniformly (``key``) among the
    valid tokens with ``cov_low < cov < cov_high`` (:func:`token_covariance`) that PPO's clip
    does not already hold.

    Returns:
      ``[B, T]`` float32 0/1, no gradient.
    """
    _check_fraction("fraction", fraction)
    if not cov_low < cov_high:
        raise ValueError(f"need cov_low < cov_high, got {cov_low!r}, {cov_high!r}")
    cov = token_covariance(logprobs, advantages, mask)
    valid = as_mask(mask) > 0
    clipped = ppo_clip_metrics(log_ratio, advantages, clip_low=clip_low, clip_high=clip_high)
    candidate = valid & (clipped["clipped"] == 0) & (cov > cov_low) & (cov < cov_high)
    priority = jnp.where(candidate, jax.random.uniform(key, cov.shape), -1.0)
    return _top_tokens(priority, candidate, valid, fraction)


def clip_cov(
    log_ratio: Array,
    logprobs: Array,
    advantages: Array,
    mask: Array,
    *,
    key: Array,
    fraction: float = 2e-4,
    cov_low: float = 1.0,
    cov_high: float = 5.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> Array:
    """Clip-Cov: PPO's clipped surrogate with a few high-covariance tokens left out,
    ``L = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))·(1 − S)``.

    Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models" (arXiv:2505.22617; verl's ``clip_cov``): ``S`` (:func:`clip_cov_selection`) is a
    random ``fraction`` of the valid tokens whose :func:`token_covariance` lies in
    ``(cov_low, cov_high)``, among those PPO's clip does not already hold; their loss and
    gradient are 0. No dual clip.

    Args:
      log_ratio: ``[B, T]`` log importance ratio.
      logprobs: ``[B, T]`` current log-probs (for the covariance; no gradient through it).
      advantages: ``[B]`` or ``[B, T]``.
      mask: ``[B, T]`` completion mask.
      key: a ``jax.random`` key for the draw.
      fraction: ``r`` of the paper, in ``(0, 1]`` (verl's ``clip_cov_ratio``).
      cov_low, cov_high: the covariance window (verl's ``clip_cov_lb`` / ``clip_cov_ub``).
      clip_low, clip_high: PPO's clip range.

    Returns:
      ``[B, T]`` float32 per-token loss.

    Raises:
      ValueError: on bad shapes or hyper-parameters.
    """
    selected = clip_cov_selection(
        log_ratio,
        logprobs,
        advantages,
        mask,
        key=key,
        fraction=fraction,
        cov_low=cov_low,
        cov_high=cov_high,
        clip_low=clip_low,
        clip_high=clip_high,
    )
    loss = ppo_clip(log_ratio, advantages, clip_low=clip_low, clip_high=clip_high)
    return loss * (1.0 - selected)
