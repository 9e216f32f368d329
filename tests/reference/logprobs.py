"""Float64 NumPy references for per-token log-probs and entropies (written from the formulas).

``z = logits / tau``; ``log p_v = z_v - log sum_u exp(z_u)``; ``H = -sum_v p_v log p_v``.
"""

import numpy as np


def log_softmax(z):
    """Stable ``log softmax`` over the last axis, float64."""
    z = np.asarray(z, np.float64)
    shifted = z - z.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def token_logprobs(logits, targets, mask, *, temperature=1.0):
    """``logits [B, T, V]`` -> (log-prob of ``targets``, entropy), both ``[B, T]``, 0 if masked."""
    logp = log_softmax(np.asarray(logits, np.float64) / temperature)
    batch, length = targets.shape
    out = np.zeros((batch, length))
    entropy = np.zeros((batch, length))
    for b in range(batch):
        for t in range(length):
            if mask[b, t]:
                out[b, t] = logp[b, t, targets[b, t]]
                entropy[b, t] = -np.sum(np.exp(logp[b, t]) * logp[b, t])
    return out, entropy


def completion_logprobs(
    full_logits, prompt_len, completion_tokens, completion_mask, *, temperature=1.0
):
    """From logits over ``[prompt ; completion]``: the logits at column ``P - 1 + t`` score
    completion token ``t``."""
    length = completion_tokens.shape[1]
    scoring = np.asarray(full_logits)[:, prompt_len - 1 : prompt_len - 1 + length]
    return token_logprobs(scoring, completion_tokens, completion_mask, temperature=temperature)
