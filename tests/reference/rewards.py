"""Float64 NumPy references for ``jaxrl_llm.rewards`` (length shaping and weighted sums).

Written from the DAPO paper's equation as a clipped linear ramp over a whole array of lengths,
not as the piecewise branches of the library code.
"""

from __future__ import annotations

import numpy as np


def overlong_penalty(lengths, max_length, buffer):
    """DAPO eq. 13 for an array of completion lengths, float64."""
    lengths = np.asarray(lengths, dtype=np.float64)
    start = max_length - buffer
    if buffer == 0:
        ramp = np.zeros_like(lengths)
    else:
        ramp = -np.clip((lengths - start) / buffer, 0.0, 1.0)
    return np.where(lengths > max_length, -1.0, ramp)


def weighted_sum(component_values, weights):
    """``sum_k w_k r_k`` over a ``[K, B]`` table of component values, float64."""
    table = np.asarray(component_values, dtype=np.float64)
    return np.asarray(weights, dtype=np.float64) @ table
