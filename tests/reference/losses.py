"""Float64 NumPy references for ratios, KL, aggregation, surrogates and the value loss.

Written from shared/SPEC_LOSSES.md as plain loops over rows and tokens, without looking at the
JAX code, so that a shared misreading is unlikely. Masks are 0/1; a position is valid where
``mask > 0``. Advantages may be ``[B]`` (broadcast over tokens) or ``[B, T]``.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def _token_adv(adv, shape):
    adv = _f64(adv)
    if adv.ndim == 1:
        return np.repeat(adv[:, None], shape[1], axis=1)
    return adv


def _valid(mask):
    return np.asarray(mask, dtype=np.float64) > 0


# ----------------------------------------------------------------------------- ratios


def token_log_ratio(lp, old, clamp=20.0):
    lp, old = _f64(lp), _f64(old)
    out = np.empty_like(lp)
    for idx in np.ndindex(lp.shape):
        out[idx] = min(max(lp[idx] - old[idx], -clamp), clamp)
    return out


def sequence_log_ratio(lp, old, mask):
    lp, old, valid = _f64(lp), _f64(old), _valid(mask)
    out = np.zeros(lp.shape[0])
    for i in range(lp.shape[0]):
        total, count = 0.0, 0
        for t in range(lp.shape[1]):
            if valid[i, t]:
                total += lp[i, t] - old[i, t]
                count += 1
        out[i] = total / max(count, 1)
    return out


def gspo_token_log_ratio(lp, old, mask, max_log_ratio=10.0):
    seq = sequence_log_ratio(lp, old, mask)
    return np.repeat(np.minimum(seq, max_log_ratio)[:, None], np.shape(lp)[1], axis=1)


# ----------------------------------------------------------------------------- KL


def kl(lp, ref, kind):
    lp, ref = _f64(lp), _f64(ref)
    out = np.empty_like(lp)
    for idx in np.ndindex(lp.shape):
        x = ref[idx] - lp[idx]
        if kind == "k1":
            out[idx] = lp[idx] - ref[idx]
        elif kind == "k2":
            out[idx] = 0.5 * x * x
        elif kind == "k3":
            xc = min(max(x, -20.0), 20.0)
            out[idx] = min(max(math.exp(xc) - xc - 1.0, -10.0), 10.0)
        elif kind == "abs":
            out[idx] = abs(x)
        else:
            raise ValueError(kind)
    return out


def k2_grad_wrt_lp(lp, ref):
    """d/dlp of ½(ref − lp)² = lp − ref."""
    return _f64(lp) - _f64(ref)


# ----------------------------------------------------------------------------- aggregation


def normalisers(mask):
    valid = _valid(mask)
    num_tokens = 0
    num_seqs = 0
    for i in range(valid.shape[0]):
        row = int(valid[i].sum())
        num_tokens += row
        num_seqs += row > 0
    return float(num_tokens), float(num_seqs)


def aggregate(values, mask, mode, num_tokens=None, num_seqs=None, norm_constant=None):
    v, valid = _f64(values), _valid(mask)
    B, T = v.shape
    row_sums, row_counts = [], []
    for i in range(B):
        s, c = 0.0, 0
        for t in range(T):
            if valid[i, t]:
                s += v[i, t]
                c += 1
        row_sums.append(s)
        row_counts.append(c)
    total = sum(row_sums)
    if mode == "token-sum":
        return total
    if mode == "token-mean":
        n = sum(row_counts) if num_tokens is None else num_tokens
        return total / max(n, 1)
    n_seq = sum(c > 0 for c in row_counts) if num_seqs is None else num_seqs
    n_seq = max(n_seq, 1)
    if mode == "seq-mean-token-mean":
        return sum(s / (c + 1e-8) for s, c in zip(row_sums, row_counts) if c > 0) / n_seq
    if mode == "seq-mean-token-sum":
        return sum(s for s, c in zip(row_sums, row_counts) if c > 0) / n_seq
    if mode == "seq-mean-token-sum-norm":
        const = T if norm_constant is None else norm_constant
        return sum(s for s, c in zip(row_sums, row_counts) if c > 0) / n_seq / const
    raise ValueError(mode)


def sequence_mean(seq_values, mask, num_seqs=None):
    valid = _valid(mask)
    total, count = 0.0, 0
    for i in range(valid.shape[0]):
        if valid[i].any():
            total += float(seq_values[i])
            count += 1
    n = count if num_seqs is None else num_seqs
    return total / max(n, 1)


# ----------------------------------------------------------------------------- surrogates


def ppo_clip(log_ratio, adv, clip_low=0.2, clip_high=0.2, dual_clip=None):
    d = _f64(log_ratio)
    a = _token_adv(adv, d.shape)
    out = np.empty_like(d)
    for idx in np.ndindex(d.shape):
        r = math.exp(d[idx])
        l1 = -a[idx] * r
        l2 = -a[idx] * min(max(r, 1.0 - clip_low), 1.0 + clip_high)
        loss = max(l1, l2)
        if dual_clip is not None and a[idx] < 0:
            loss = min(loss, -a[idx] * dual_clip)
        out[idx] = loss
    return out


def ppo_clip_grad(log_ratio, adv, clip_low=0.2, clip_high=0.2, dual_clip=None):
    """d loss / d log_ratio, per token, away from the kinks: ``−A·r`` where the unclipped
    branch is the active one, else 0."""
    d = _f64(log_ratio)
    a = _token_adv(adv, d.shape)
    out = np.zeros_like(d)
    for idx in np.ndindex(d.shape):
        r = math.exp(d[idx])
        l1 = -a[idx] * r
        l2 = -a[idx] * min(max(r, 1.0 - clip_low), 1.0 + clip_high)
        if l1 >= l2:
            if dual_clip is not None and a[idx] < 0 and l1 > -a[idx] * dual_clip:
                continue
            out[idx] = -a[idx] * r
    return out


def ppo_clip_metrics(log_ratio, adv, clip_low=0.2, clip_high=0.2, dual_clip=None):
    d = _f64(log_ratio)
    a = _token_adv(adv, d.shape)
    clipped = np.zeros_like(d)
    lower = np.zeros_like(d)
    for idx in np.ndindex(d.shape):
        r = math.exp(d[idx])
        l1 = -a[idx] * r
        l2 = -a[idx] * min(max(r, 1.0 - clip_low), 1.0 + clip_high)
        clipped[idx] = float(l2 > l1)
        if dual_clip is not None and a[idx] < 0:
            lower[idx] = float(max(l1, l2) > -a[idx] * dual_clip)
    return {"clipped": clipped, "clipped_lower": lower}


def cispo_weight(log_ratio, clip_low, clip_high):
    d = _f64(log_ratio)
    w = np.empty_like(d)
    for idx in np.ndindex(d.shape):
        r = math.exp(d[idx])
        if clip_low is not None:
            r = max(r, 1.0 - clip_low)
        w[idx] = min(r, 1.0 + clip_high)
    return w


def cispo(log_ratio, lp, adv, clip_low, clip_high):
    w = cispo_weight(log_ratio, clip_low, clip_high)
    return -w * _token_adv(adv, w.shape) * _f64(lp)


def cispo_grad_wrt_lp(log_ratio, adv, clip_low, clip_high):
    w = cispo_weight(log_ratio, clip_low, clip_high)
    return -w * _token_adv(adv, w.shape)


def sapo(log_ratio, adv, tau_pos=1.0, tau_neg=1.05):
    d = _f64(log_ratio)
    a = _token_adv(adv, d.shape)
    out = np.empty_like(d)
    for idx in np.ndindex(d.shape):
        tau = tau_pos if a[idx] > 0 else tau_neg
        gate = 1.0 / (1.0 + math.exp(-tau * (math.exp(d[idx]) - 1.0)))
        out[idx] = -gate * (4.0 / tau) * a[idx]
    return out


def gmpo(log_ratio, adv, mask, clip_low=0.4, clip_high=0.4):
    d = _f64(log_ratio)
    a = _token_adv(adv, d.shape)
    valid = _valid(mask)
    out = np.zeros(d.shape[0])
    for i in range(d.shape[0]):
        log_sum, adv_sum, n = 0.0, 0.0, 0
        for t in range(d.shape[1]):
            if not valid[i, t]:
                continue
            s = float(np.sign(a[i, t]))
            dc = min(max(d[i, t], -clip_low), clip_high)
            log_sum += s * min(s * d[i, t], s * dc)
            adv_sum += a[i, t]
            n += 1
        out[i] = -(adv_sum / (n + 1e-8)) * math.exp(log_sum / (n + 1e-8))
    return out


def gmpo_clipped(log_ratio, adv, mask, clip_low=0.4, clip_high=0.4):
    d = _f64(log_ratio)
    a = _token_adv(adv, d.shape)
    valid = _valid(mask)
    out = np.zeros_like(d)
    for idx in np.ndindex(d.shape):
        if not valid[idx]:
            continue
        # The pessimistic clip binds when the clipped value is the smaller one for A > 0
        # (Δ > ε_high) or the larger one for A < 0 (Δ < −ε_low).
        if a[idx] > 0 and d[idx] > clip_high:
            out[idx] = 1.0
        elif a[idx] < 0 and d[idx] < -clip_low:
            out[idx] = 1.0
    return out


def reinforce(lp, adv):
    lp = _f64(lp)
    return -_token_adv(adv, lp.shape) * lp


# ----------------------------------------------------------------------------- value


def clipped_value_loss(values, old_values, returns, clip=0.5):
    v, vo, ret = _f64(values), _f64(old_values), _f64(returns)
    out = np.empty_like(v)
    for idx in np.ndindex(v.shape):
        vc = min(max(v[idx], vo[idx] - clip), vo[idx] + clip)
        out[idx] = 0.5 * max((v[idx] - ret[idx]) ** 2, (vc - ret[idx]) ** 2)
    return out


def value_clip_fraction(values, old_values, returns, clip=0.5):
    v, vo, ret = _f64(values), _f64(old_values), _f64(returns)
    out = np.zeros_like(v)
    for idx in np.ndindex(v.shape):
        vc = min(max(v[idx], vo[idx] - clip), vo[idx] + clip)
        out[idx] = float((vc - ret[idx]) ** 2 > (v[idx] - ret[idx]) ** 2)
    return out


def clipped_value_loss_grad(values, old_values, returns, clip=0.5):
    """d loss / d values away from kinks: ``v − R`` where the unclipped error is the larger,
    else 0 (v̂ does not move with v outside the band, and inside the band v̂ = v)."""
    v, vo, ret = _f64(values), _f64(old_values), _f64(returns)
    out = np.zeros_like(v)
    for idx in np.ndindex(v.shape):
        vc = min(max(v[idx], vo[idx] - clip), vo[idx] + clip)
        if (v[idx] - ret[idx]) ** 2 >= (vc - ret[idx]) ** 2:
            out[idx] = v[idx] - ret[idx]
    return out


# ----------------------------------------------------------------------------- test data


def ragged_mask(rng, batch, time, *, empty_rows=(), full_rows=()):
    """Right-padded 0/1 mask with random lengths in ``[1, time]``; chosen rows forced empty
    or full."""
    lengths = rng.integers(1, time + 1, size=batch)
    lengths[list(empty_rows)] = 0
    lengths[list(full_rows)] = time
    return (np.arange(time)[None, :] < lengths[:, None]).astype(np.float32)


def bf16(x):
    """``x`` rounded to bfloat16 (nearest even, as JAX's cast), as a NumPy ``bfloat16`` array.

    ``np.float64(bf16(x))`` holds exactly the values a bf16 input carries, so a reference fed
    with it differs from correct f32 loss math by f32 rounding only (~1e-7 relative), while
    loss math done in bf16 is off by up to 2^-9 relative per operation.
    """
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)


def bf16_batch(rng, batch=6, time=9):
    """Realistic bf16 loss inputs as NumPy ``bfloat16`` arrays, plus an f32 0/1 ``mask``.

    Log-probs lie in ``[-8, -0.01]``. Even rows of ``old`` / ``ref`` are near the current
    policy (``|Δ|`` of a few tenths, the usual PPO regime), odd rows independent of it (``|Δ|``
    up to 8, where a difference of two bf16 numbers is rarely a bf16 number); advantages,
    values and returns are Gaussian. Row 1 of the mask is empty, row 0 full.
    """
    shape = (batch, time)
    lp = rng.uniform(-8.0, -0.01, shape)
    near = np.arange(batch)[:, None] % 2 == 0

    def other():
        return np.where(
            near,
            np.clip(lp + rng.normal(0.0, 0.3, shape), -8.0, -0.01),
            rng.uniform(-8, -0.01, shape),
        )

    old_values = rng.normal(0.0, 2.0, shape)
    arrays = {
        "logprobs": lp,
        "old_logprobs": other(),
        "ref_logprobs": other(),
        "advantages": rng.normal(0.0, 1.5, batch),
        "token_advantages": rng.normal(0.0, 1.5, shape),
        "values": old_values + rng.normal(0.0, 0.7, shape),
        "old_values": old_values,
        "returns": rng.normal(0.0, 2.0, shape),
    }
    out = {k: bf16(v) for k, v in arrays.items()}
    out["mask"] = ragged_mask(rng, batch, time, empty_rows=(1,), full_rows=(0,))
    return out
