"""Float64 NumPy references for the sampling strategies and the greedy decode loop.

Written from the definitions (Hugging Face logits-warper order: temperature, top-k, top-p, min-p),
one row at a time with plain loops, independently of jaxrl_llm.sampling.
"""

from __future__ import annotations

import numpy as np


def truncated_probs(
    logits: np.ndarray,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> np.ndarray:
    """Probabilities ``[V]`` of the truncated, renormalised distribution for one row of logits."""
    z = np.asarray(logits, np.float64) / (temperature if temperature > 0 else 1.0)
    vocab = z.shape[0]
    # Descending order, ties broken towards the lower token id.
    order = sorted(range(vocab), key=lambda i: (-z[i], i))
    alive = [i for i in order if np.isfinite(z[i])]
    if top_k:
        alive = alive[:top_k]
    if top_p < 1.0:
        weights = np.exp([z[i] - z[alive[0]] for i in alive])
        probs = weights / weights.sum()
        kept, mass = [], 0.0
        for token, p in zip(alive, probs):
            if kept and mass >= top_p:
                break
            kept.append(token)
            mass += p
        alive = kept
    if min_p > 0.0:
        weights = np.exp([z[i] - z[alive[0]] for i in alive])
        probs = weights / weights.sum()
        alive = [t for t, p in zip(alive, probs) if p >= min_p * probs.max()]
    out = np.zeros(vocab)
    weights = np.exp([z[i] - z[alive[0]] for i in alive])
    out[alive] = weights / weights.sum()
    return out


def log_softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """``log_softmax(z / T_eff)`` along the last axis in float64 (``T_eff = 1`` when ``T <= 0``)."""
    z = np.asarray(logits, np.float64) / (temperature if temperature > 0 else 1.0)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson statistic over the categories with ``probs > 0`` and its degrees of freedom."""
    counts = np.asarray(counts, np.float64)
    support = probs > 0
    expected = counts.sum() * probs[support]
    stat = float(np.sum((counts[support] - expected) ** 2 / expected))
    return stat, int(support.sum()) - 1


def chi_square_critical(dof: int, z: float = 4.0) -> float:
    """Upper critical value by the Wilson-Hilferty cube approximation (z=4: p ~ 3e-5)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * np.sqrt(a)) ** 3


def greedy_by_recomputation(next_logits, prompt: list[int], steps: int, eos: set[int]) -> list[int]:
    """Greedy decoding that recomputes full logits on the growing sequence every step.

    ``next_logits(sequence) -> [V]`` returns the last position's logits of the unpadded sequence.
    Stops after an EOS token (included in the output).
    """
    sequence, out = list(prompt), []
    for _ in range(steps):
        token = int(np.argmax(next_logits(sequence)))
        out.append(token)
        sequence.append(token)
        if token in eos:
            break
    return out
