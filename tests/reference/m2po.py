"""Float64 NumPy references of M2PO's second-moment mask (AReaL's ``_apply_m2po_masking`` /
``_get_m2po_loss_mask``) and of the adaptive entropy coefficient (TRL's ``GRPOTrainer``
``use_adaptive_entropy``, Skywork-OR1), written as plain loops from the peers' formulas."""

from __future__ import annotations

import numpy as np


def m2po_mask(log_ratio, mask, threshold):
    """AReaL: the valid ``(log r)²`` sorted in decreasing order, suffix means ``A_j``; mask
    the first ``k = min{j : A_j < τ}`` (0-based), else ``n − 1``. Ties: earlier flat index
    first (AReaL's order among ties is unspecified)."""
    log_ratio, valid = np.asarray(log_ratio, np.float64), np.asarray(mask) > 0
    flat = [(i, float(log_ratio.flat[i]) ** 2) for i in range(log_ratio.size) if valid.flat[i]]
    out = valid.astype(np.float64)
    n = len(flat)
    if n == 0:
        return out
    ordered = sorted(flat, key=lambda item: (-item[1], item[0]))
    k = n - 1
    for j in range(n):
        rest = [m2 for _, m2 in ordered[j:]]
        if sum(rest) / len(rest) < threshold:
            k = j
            break
    for index, _ in ordered[:k]:
        out.flat[index] = 0.0
    return out


def second_moment(log_ratio, mask):
    log_ratio, valid = np.asarray(log_ratio, np.float64), np.asarray(mask) > 0
    return float(np.sum(np.where(valid, log_ratio, 0.0) ** 2) / max(valid.sum(), 1))


def adaptive_entropy(coef, entropies, *, target, delta, low, high):
    """TRL's controller over a run: ``entropies[k]`` measured at optimizer step ``k``.

    Returns ``(applied, coefs)``: the coefficient step ``k`` applies (``α_k`` gated by
    ``H_{k−1} ≤ target``; ``H_{−1} = inf``) and ``α_{k+1}`` after it.
    """
    last, applied, coefs = float("inf"), [], []
    for entropy in entropies:
        applied.append(coef if last <= target else 0.0)
        if entropy <= target:
            coef = min(coef + delta, high)
        else:
            coef = max(coef - delta, low)
        coefs.append(coef)
        last = entropy
    return np.array(applied), np.array(coefs)
