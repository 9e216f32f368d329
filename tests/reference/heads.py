"""Float64 NumPy references for scalar heads (written from the formulas, with explicit loops).

``V[b, t] = h[b, P - 1 + t] . w`` on real completion tokens, else 0;
``r[b] = h[b, j*] . w`` with ``j*`` the last column whose mask is 1 (0 for an empty row).
"""

import numpy as np


def token_values(hidden, score, prompt_len, completion_mask):
    """``hidden [B, P+T, D]``, ``score [D, 1]`` -> ``[B, T]`` float64."""
    hidden = np.asarray(hidden, np.float64)
    weights = np.asarray(score, np.float64)[:, 0]
    batch, length = completion_mask.shape
    out = np.zeros((batch, length))
    for b in range(batch):
        for t in range(length):
            if completion_mask[b, t]:
                out[b, t] = sum(
                    hidden[b, prompt_len - 1 + t, d] * weights[d] for d in range(len(weights))
                )
    return out


def sequence_scores(hidden, score, mask):
    """``hidden [B, S, D]``, ``score [D, 1]``, ``mask [B, S]`` -> ``[B]`` float64."""
    hidden = np.asarray(hidden, np.float64)
    weights = np.asarray(score, np.float64)[:, 0]
    out = np.zeros(hidden.shape[0])
    for b in range(hidden.shape[0]):
        real = [j for j in range(hidden.shape[1]) if mask[b, j]]
        if real:
            out[b] = float(np.dot(hidden[b, real[-1]], weights))
    return out


def compact_right_padded(prompt_tokens, prompt_mask, completion_tokens, completion_mask, pad_id):
    """Each row's real prompt then real completion tokens, right-padded with ``pad_id``.

    Returns ``(tokens [B, P+T], mask [B, P+T], prompt_lengths [B])`` (int64).
    """
    batch = prompt_tokens.shape[0]
    width = prompt_tokens.shape[1] + completion_tokens.shape[1]
    tokens = np.full((batch, width), pad_id, np.int64)
    mask = np.zeros((batch, width), np.int64)
    lengths = np.zeros(batch, np.int64)
    for b in range(batch):
        prompt = [int(x) for x, m in zip(prompt_tokens[b], prompt_mask[b]) if m]
        completion = [int(x) for x, m in zip(completion_tokens[b], completion_mask[b]) if m]
        row = prompt + completion
        tokens[b, : len(row)] = row
        mask[b, : len(row)] = 1
        lengths[b] = len(prompt)
    return tokens, mask, lengths
