"""Which tokens a policy loss trains on: 0/1 ``[B, T]`` masks that multiply the per-token loss.

- :func:`top_entropy_mask` — only the highest-entropy ("forking") tokens (Wang et al. 2025,
  "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective Reinforcement Learning
  for LLM Reasoning", arXiv:2506.01939; TRL's ``top_entropy_quantile``).
- :func:`off_policy_sequence_mask` — DeepSeek-V3.2's off-policy sequence masking: drop the
  negative-advantage completions the current policy has drifted far from (DeepSeek-AI 2025,
  "DeepSeek-V3.2", arXiv:2512.02556, Eq. 9; TRL's ``off_policy_mask_threshold``).
- :func:`m2po_mask` — M2PO's second-moment trust region: drop the tokens of largest squared
  log-ratio until the batch's second moment is under a threshold (Zheng et al. 2025,
  "Second-Moment Trust Policy Optimization", arXiv:2510.01161; AReaL's ``m2_threshold``).

The masks carry no gradient and are 0 on padding. A selected-out token contributes 0 to the
loss but still counts in the aggregation's normaliser (TRL multiplies the per-token loss by
them and aggregates with the completion mask), so the loss stays additive over micro-batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm._checks import as_mask, check_advantages, check_batch_time, f32

Array = jax.Array


def masked_quantile(values: Array, mask: Array, q: float) -> Array:
    """The ``q``-quantile of the valid entries of ``values`` (linear interpolation, as
    ``torch.quantile`` / ``numpy.quantile``); 0 when there is none.

    Args:
      values: ``[B, T]``.
      mask: ``[B, T]`` valid entries.
      q: in ``[0, 1]``.

    Returns:
      f32 scalar, no gradient.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q!r}")
    check_batch_time("values", values, mask)
    valid = (as_mask(mask) > 0).reshape(-1)
    flat = jax.lax.stop_gradient(f32(values)).reshape(-1)
    ordered = jnp.sort(jnp.where(valid, flat, jnp.inf))
    n = jnp.sum(valid, dtype=jnp.int32)
    position = q * jnp.maximum(n - 1, 0).astype(jnp.float32)
    below = jnp.floor(position).astype(jnp.int32)
    above = jnp.minimum(below + 1, jnp.maximum(n - 1, 0))
    low, high = ordered[below], ordered[above]
    value = low + (position - below.astype(jnp.float32)) * (high - low)
    return jnp.where(n > 0, jnp.where(high == low, low, value), 0.0)


def top_entropy_mask(entropy: Array, mask: Array, *, quantile: float = 0.2) -> Array:
    """``M_t = [H_t ≥ Q_{1−ρ}(H)]·m_t``: keep the top-``ρ`` fraction of tokens by entropy.

    Wang et al. 2025, "Beyond the 80/20 Rule" (arXiv:2506.01939): the policy gradient of the
    ~20% highest-entropy tokens — the forks of a reasoning path — carries the gains of RLVR.
    ``Q_{1−ρ}`` is the ``(1 − ρ)``-quantile (:func:`masked_quantile`) of the entropies of the
    valid tokens of the batch given (TRL's ``get_high_entropy_mask``: of the micro-batch,
    gathered over processes). ``ρ = 1`` keeps every token, ``ρ = 0`` only the highest (and
    its ties); ties at the threshold are kept. No valid token: all 0.

    Args:
      entropy: ``[B, T]`` per-token entropy of the policy's next-token distribution.
      mask: ``[B, T]`` completion mask.
      quantile: ``ρ`` in ``[0, 1]`` (TRL's ``top_entropy_quantile``; the paper uses 0.2).

    Returns:
      ``[B, T]`` float32 0/1, no gradient.

    Raises:
      ValueError: on mismatched shapes or ``ρ`` outside ``[0, 1]``.
    """
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"top-entropy quantile must be in [0, 1], got {quantile!r}")
    check_batch_time("entropy", entropy, mask)
    valid = as_mask(mask) > 0
    threshold = masked_quantile(entropy, mask, 1.0 - quantile)
    keep = jax.lax.stop_gradient(f32(entropy)) >= threshold
    return (valid & keep).astype(jnp.float32)


def off_policy_sequence_mask(
    logprobs: Array,
    sampling_logprobs: Array,
    advantages: Array,
    mask: Array,
    *,
    threshold: float,
) -> Array:
    """``M_i = 0`` if ``A < 0`` and ``(1/|o_i|)·Σ_t (log π_old − log π_θ) > δ``, else 1.

    DeepSeek-AI 2025, "DeepSeek-V3.2" (arXiv:2512.02556, Eq. 9; TRL's
    ``off_policy_mask_threshold`` and ``get_off_policy_mask``): a negative-advantage
    completion whose sampling policy ``π_old`` (the inference engine's log-probs where
    available) is far from the current one, by the row mean of ``k1``, teaches from mistakes
    the policy no longer makes and destabilises training; it is masked out. Positive
    advantages are always kept. ``[B, T]`` advantages decide per token, as TRL's.

    Args:
      logprobs: ``[B, T]`` current log-probs (no gradient flows).
      sampling_logprobs: ``[B, T]`` log-probs of the policy that sampled the batch.
      advantages: ``[B]`` or ``[B, T]``.
      mask: ``[B, T]`` completion mask.
      threshold: ``δ >= 0`` (TRL's example: 0.5).

    Returns:
      ``[B, T]`` float32 0/1 (0 on padding), no gradient.

    Raises:
      ValueError: on bad shapes or a negative threshold.
    """
    if not threshold >= 0:
        raise ValueError(f"off-policy mask threshold must be >= 0, got {threshold!r}")
    check_batch_time("logprobs", logprobs, mask)
    check_batch_time("sampling_logprobs", sampling_logprobs, mask)
    check_advantages(advantages, mask)
    valid = as_mask(mask) > 0
    drift = jnp.where(valid, f32(sampling_logprobs) - jax.lax.stop_gradient(f32(logprobs)), 0.0)
    count = jnp.maximum(jnp.sum(valid, axis=1, dtype=jnp.float32), 1.0)
    mean_drift = (jnp.sum(drift, axis=1) / count)[:, None]
    adv = f32(advantages)
    adv = adv[:, None] if adv.ndim == 1 else adv
    keep = (adv >= 0) | (mean_drift <= threshold)
    return (valid & keep).astype(jnp.float32)


def second_moment(log_ratio: Array, mask: Array) -> Array:
    """``M̂₂ = Σ_t m_t·(log r_t)² / max(Σ_t m_t, 1)``: the mean squared log-ratio of the valid
    tokens (0 when there is none); no gradient.

    Args:
      log_ratio: ``[B, T]`` log importance ratios.
      mask: ``[B, T]`` valid tokens.

    Returns:
      f32 scalar.
    """
    check_batch_time("log_ratio", log_ratio, mask)
    valid = as_mask(mask) > 0
    delta = jnp.where(valid, jax.lax.stop_gradient(f32(log_ratio)), 0.0)
    return jnp.sum(delta * delta) / jnp.maximum(jnp.sum(valid, dtype=jnp.float32), 1.0)


def m2po_mask(log_ratio: Array, mask: Array, *, threshold: float = 0.04) -> Array:
    """M2PO's mask: without the ``k`` tokens of largest ``(log r)²``, ``M̂₂ < τ``; ``k`` least.

    Zheng et al. 2025, "Second-Moment Trust Policy Optimization" (arXiv:2510.01161; AReaL's
    ``actor.m2_threshold``, ``_apply_m2po_masking``): instead of clipping each token's ratio,
    constrain the second moment ``M̂₂ = (1/N)·Σ_i (log r_i)²`` of the log importance ratios of
    the batch. With the ``N`` valid tokens sorted by ``M₂,i = (log r_i)²`` in decreasing order
    (``s_1 ≥ … ≥ s_N``), the suffix means are ``A_j = Σ_{i≥j} s_i / (N − j + 1)``; the first
    ``k = min{j − 1 : A_j < τ}`` tokens are masked (``k = 0`` when ``M̂₂ < τ`` already), and
    when no suffix mean is under ``τ`` all but the smallest one (``k = N − 1``, AReaL's
    fallback: a batch never loses every token). ``A_j`` is non-increasing in ``j``, so ``k``
    is the fewest tokens whose removal brings the kept tokens' ``M̂₂`` under ``τ``.

    Static shapes under jit: one sort of the ``B·T`` entries (padding last), a reverse cumsum
    for the suffix sums, and a scatter back. Ties of ``(log r)²`` at the cut are broken by
    position (the earlier flat index ``b·T + t`` is masked first; AReaL's order among ties
    is the unspecified one of ``torch.sort``); the count ``k`` does not depend on it.

    Args:
      log_ratio: ``[B, T]`` log importance ratios ``log π_θ − log π_behav`` (no gradient flows).
      mask: ``[B, T]`` valid tokens (the policy loss's mask).
      threshold: ``τ > 0`` (AReaL's default 0.04).

    Returns:
      ``[B, T]`` float32 0/1 (0 on padding), no gradient. No valid token: all 0.

    Raises:
      ValueError: on mismatched shapes or ``τ <= 0``.
    """
    if not threshold > 0:
        raise ValueError(f"m2_threshold must be > 0, got {threshold!r}")
    check_batch_time("log_ratio", log_ratio, mask)
    valid = as_mask(mask) > 0
    delta = jnp.where(valid, jax.lax.stop_gradient(f32(log_ratio)), 0.0)
    m2 = (delta * delta).reshape(-1)
    flat_valid = valid.reshape(-1)
    # Decreasing (log r)², ties by position, padding (key 1 > every -(log r)²) last.
    order = jnp.argsort(jnp.where(flat_valid, -m2, 1.0), stable=True)
    ordered = jnp.where(flat_valid[order], m2[order], 0.0)
    suffix = jnp.cumsum(ordered[::-1])[::-1]  # Σ_{i ≥ j} s_i, summed from the smallest
    n = jnp.sum(flat_valid, dtype=jnp.int32)
    index = jnp.arange(m2.shape[0], dtype=jnp.int32)
    below = (index < n) & (suffix / jnp.maximum(n - index, 1).astype(jnp.float32) < threshold)
    masked = jnp.where(jnp.any(below), jnp.argmax(below), jnp.maximum(n - 1, 0))
    dropped = jnp.zeros_like(flat_valid).at[order].set(index < masked).reshape(valid.shape)
    return (valid & ~dropped).astype(jnp.float32)
