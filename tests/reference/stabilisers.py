"""Float64 NumPy references of the 2025-26 stabilisers, written from the peers' formulas.

DPPO (verl ``dppo_tv`` / ``dppo_kl``), KL-Cov and Clip-Cov (verl ``kl_cov`` / ``clip_cov``,
Cui et al. 2025), the top-entropy token mask (TRL ``get_high_entropy_mask``), DeepSeek-V3.2's
off-policy sequence mask (TRL ``get_off_policy_mask``) and importance-weighted KL (TRL
``use_bias_correction_kl``), GDPO (TRL ``normalize_then_sum``, verl ``gdpo``). Plain loops
over rows and tokens, with the analytic gradient with respect to the current log-probs;
selections that are random in the peers are passed in.
"""

from __future__ import annotations

import math

import numpy as np


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def _token_adv(adv, shape):
    adv = _f64(adv)
    return np.repeat(adv[:, None], shape[1], axis=1) if adv.ndim == 1 else adv


# ----------------------------------------------------------------------------- DPPO


def dppo_inside(lp, old, adv, divergence, delta_low, delta_high):
    lp, old = _f64(lp), _f64(old)
    adv = _token_adv(adv, lp.shape)
    out = np.zeros(lp.shape)
    for idx in np.ndindex(lp.shape):
        p, q = math.exp(lp[idx]), math.exp(old[idx])
        if divergence == "tv":
            up, down = p - q <= delta_high, p - q >= -delta_low
        else:
            d = q * (old[idx] - lp[idx]) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
            up, down = d <= delta_high or p <= q, d <= delta_low or p >= q
        out[idx] = float(up if adv[idx] > 0 else down)
    return out


def dppo(lp, old, adv, divergence, delta_low, delta_high, ratio_cap=None):
    """``(loss [B, T], d loss / d lp [B, T])`` of ``−A·sg(min(r, C))·lp·M``."""
    lp, old = _f64(lp), _f64(old)
    adv = _token_adv(adv, lp.shape)
    inside = dppo_inside(lp, old, adv, divergence, delta_low, delta_high)
    loss, grad = np.zeros(lp.shape), np.zeros(lp.shape)
    for idx in np.ndindex(lp.shape):
        w = math.exp(min(max(lp[idx] - old[idx], -20.0), 20.0))
        if ratio_cap is not None:
            w = min(w, ratio_cap)
        grad[idx] = -adv[idx] * w * inside[idx]
        loss[idx] = grad[idx] * lp[idx]
    return loss, grad


# ----------------------------------------------------------------------------- KL-Cov, Clip-Cov


def covariance(lp, adv, mask):
    lp, valid = _f64(lp), _f64(mask) > 0
    adv = _token_adv(adv, lp.shape)
    n = valid.sum()
    mean_a = sum(adv[i] for i in zip(*np.nonzero(valid))) / (n + 1e-8)
    mean_lp = sum(lp[i] for i in zip(*np.nonzero(valid))) / (n + 1e-8)
    return np.where(valid, (adv - mean_a) * (lp - mean_lp), -np.inf)


def kl_cov_selection(lp, adv, mask, fraction):
    cov, valid = covariance(lp, adv, mask), _f64(mask) > 0
    n = int(valid.sum())
    out = np.zeros(cov.shape)
    if n == 0:
        return out
    k = max(1, int(n * fraction))
    flat = [(-cov[idx], idx) for idx in np.ndindex(cov.shape) if valid[idx]]
    for _, idx in sorted(flat)[:k]:
        out[idx] = 1.0
    return out


def kl_cov(log_ratio, lp, adv, mask, fraction, coef):
    """``(loss, d loss / d lp)`` of ``−A·r + β·|Δ|·S`` (``Δ`` the log ratio of ``lp``)."""
    x = _f64(log_ratio)
    adv_t = _token_adv(adv, x.shape)
    selected = kl_cov_selection(lp, adv, mask, fraction)
    r = np.exp(x)
    loss = -adv_t * r + coef * np.abs(x) * selected
    grad = -adv_t * r + coef * np.sign(x) * selected
    return loss, grad


def clip_cov_candidates(log_ratio, lp, adv, mask, cov_low, cov_high, clip_low, clip_high):
    x = _f64(log_ratio)
    adv_t = _token_adv(adv, x.shape)
    cov, valid = covariance(lp, adv, mask), _f64(mask) > 0
    r = np.exp(x)
    clipped = -adv_t * np.clip(r, 1 - clip_low, 1 + clip_high) > -adv_t * r
    return valid & ~clipped & (cov > cov_low) & (cov < cov_high)


def clip_count(mask, fraction):
    return max(int(fraction * float((_f64(mask) > 0).sum())), 1)


# ----------------------------------------------------------------------------- token selection


def top_entropy_mask(entropy, mask, quantile):
    """TRL: ``H >= torch.quantile(H[valid], 1 − ρ)`` (linear), on valid tokens; none valid: 0."""
    entropy, valid = _f64(entropy), _f64(mask) > 0
    if not valid.any():
        return np.zeros(entropy.shape)
    values = sorted(entropy[valid])
    position = (1.0 - quantile) * (len(values) - 1)
    low = int(math.floor(position))
    high = min(low + 1, len(values) - 1)
    threshold = values[low] + (position - low) * (values[high] - values[low])
    return ((entropy >= threshold) & valid).astype(np.float64)


def off_policy_sequence_mask(lp, sampling, adv, mask, threshold):
    lp, sampling, valid = _f64(lp), _f64(sampling), _f64(mask) > 0
    adv = _token_adv(adv, lp.shape)
    out = np.zeros(lp.shape)
    for i in range(lp.shape[0]):
        n = max(int(valid[i].sum()), 1)
        drift = sum(sampling[i, t] - lp[i, t] for t in range(lp.shape[1]) if valid[i, t]) / n
        for t in range(lp.shape[1]):
            out[i, t] = float(valid[i, t] and (adv[i, t] >= 0 or drift <= threshold))
    return out


# ----------------------------------------------------------------------------- KL


def importance_weighted_k3(lp, ref, old):
    """``(r·k3, d/dlp)`` with ``r = exp(lp − old)``, ``k3 = e^x − x − 1``, ``x = ref − lp``
    (unclamped: the inputs stay inside every clamp)."""
    lp, ref, old = _f64(lp), _f64(ref), _f64(old)
    r = np.exp(lp - old)
    x = ref - lp
    k3 = np.exp(x) - x - 1
    return r * k3, r * k3 + r * (1 - np.exp(x))


# ----------------------------------------------------------------------------- GDPO


def _group_norm(values, group_size, eps, ddof=1):
    out = np.zeros(len(values))
    for g in range(0, len(values), group_size):
        group = [float(v) for v in values[g : g + group_size]]
        mean = sum(group) / len(group)
        if len(group) > ddof:
            std = math.sqrt(sum((v - mean) ** 2 for v in group) / (len(group) - ddof))
        else:
            std = 0.0
        for j, v in enumerate(group):
            out[g + j] = 0.0 if max(group) == min(group) else (v - mean) / (std + eps)
    return out


def gdpo_trl(columns, group_size, weights=None, eps=1e-4):
    """TRL's ``normalize_then_sum``: per column ``(r − μ_g)/(σ_g + eps)``, weighted sum, then
    ``(s − mean)/(std + eps)`` over the batch (σ unbiased)."""
    columns = _f64(columns)
    weights = np.ones(columns.shape[1]) if weights is None else _f64(weights)
    total = sum(w * _group_norm(columns[:, k], group_size, eps) for k, w in enumerate(weights))
    return _group_norm(total, len(total), eps)


def gdpo_verl(columns, mask, group_size, weights=None, eps=1e-6):
    """verl's ``gdpo``: per-column GRPO, weighted sum on the tokens, ``masked_whiten``."""
    columns, valid = _f64(columns), _f64(mask) > 0
    weights = np.ones(columns.shape[1]) if weights is None else _f64(weights)
    total = sum(w * _group_norm(columns[:, k], group_size, eps) for k, w in enumerate(weights))
    tokens = [total[i] for i, t in zip(*np.nonzero(valid))]
    mean = sum(tokens) / len(tokens)
    var = sum((v - mean) ** 2 for v in tokens) / (len(tokens) - 1)
    return np.where(valid, (total[:, None] - mean) / math.sqrt(var + 1e-8), 0.0)
