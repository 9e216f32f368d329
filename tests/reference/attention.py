"""Float64 NumPy reference for attention over a head-major KV cache (written from the formula)."""

import numpy as np


def cache_attention(q, k, v, mask, scale):
    """``o_i = sum_j softmax_j(scale * q_i . k_j) v_j`` over visible slots, one head at a time.

    Args:
      q: ``[B, S, N, H]``; k, v: ``[B, K, T, H]`` (query head n reads kv head n // (N / K));
      mask: ``[B, 1, S, T]`` bool; scale: float.

    Returns:
      ``[B, S, N, H]`` float64.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    mask = np.asarray(mask, bool)[:, 0]
    heads, kv_heads = q.shape[2], k.shape[1]
    group = heads // kv_heads
    out = np.zeros(q.shape)
    for n in range(heads):
        keys, values = k[:, n // group], v[:, n // group]  # [B, T, H]
        scores = np.einsum("bsh,bth->bst", q[:, :, n], keys) * scale
        scores = np.where(mask, scores, -np.inf)
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        out[:, :, n] = np.einsum("bst,bth->bsh", weights, values)
    return out
