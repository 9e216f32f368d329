"""Float64 NumPy reference for the global step of ``tests/parallel/two_process_worker.py``.

hidden = tanh(x @ w);  loss = scale * sum_i mask_i * sum_j hidden_ij / max(sum_i mask_i, 1).
"""

from __future__ import annotations

import numpy as np


def step_reference(x, mask, scale, w):
    """Returns ``(x_sum, loss, hidden)`` in float64."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    keep = np.asarray(mask, np.float64)
    hidden = np.tanh(x @ w)
    loss = float(scale) * float((hidden * keep[:, None]).sum()) / max(float(keep.sum()), 1.0)
    return float(x.sum()), loss, hidden
