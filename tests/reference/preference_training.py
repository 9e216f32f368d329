"""Float64 NumPy references for what the preference trainer computes on top of the losses.

Written from the formulas (Bradley-Terry: TRL's RewardTrainer; KTO's reward metrics: TRL's
KTOTrainer), with plain loops and no code shared with the package.
"""

from __future__ import annotations

import numpy as np


def bradley_terry(chosen, rejected, margins=None, center=0.0):
    """Per pair: ``−log σ(r_w − r_l − m) + c·(r_w + r_l)²``."""
    out = []
    for i in range(len(chosen)):
        rw, rl = float(chosen[i]), float(rejected[i])
        m = 0.0 if margins is None else float(margins[i])
        z = rw - rl - m
        loss = np.logaddexp(0.0, -z)  # −log σ(z)
        out.append(loss + center * (rw + rl) ** 2)
    return np.array(out)


def masked_mean(values, weights):
    total, count = 0.0, 0.0
    for v, w in zip(values, weights):
        if w:
            total += float(v)
            count += 1.0
    return total / max(count, 1.0)


def token_mean_nll(token_logps, mask):
    """``−Σ m·lp / Σ m`` over every token of every row."""
    total, count = 0.0, 0.0
    for row, row_mask in zip(np.asarray(token_logps, np.float64), np.asarray(mask, bool)):
        for lp, m in zip(row, row_mask):
            if m:
                total += lp
                count += 1.0
    return -total / max(count, 1.0)
