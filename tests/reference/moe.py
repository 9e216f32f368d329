"""Float64 NumPy reference of a mixture-of-experts layer (``jaxrl_llm.models.moe``), written as a
per-token loop, and the random f32 layer weights the MoE tests evaluate it on.

``p_t = softmax(x_t W_r)``, the top-k experts ``e_t1..e_tk`` of ``p_t`` with weights
``w_tj = p_t[e_tj]`` (renormalised to sum 1 when ``normalize``), and
``y_t = sum_j w_tj · W_down[e_tj]^T (silu(x_t W_gate[e_tj]) * x_t W_up[e_tj])``.
"""

import numpy as np


def silu(x):
    """``x · sigmoid(x)``."""
    return x / (1.0 + np.exp(-x))


def route(logits, top_k, normalize):
    """Top-k routing of router logits ``[T, E]``: ``(weights [T, k], experts [T, k])``, the
    experts by descending probability (ties: the lower index first)."""
    logits = np.asarray(logits, np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, experts, axis=-1)
    if normalize:
        weights /= weights.sum(-1, keepdims=True)
    return weights, experts


def experts_mlp(x, weights, experts, w_gate, w_up, w_down):
    """``y_t = sum_j w_tj · SwiGLU_{e_tj}(x_t)`` one token at a time.

    Args:
      x: ``[T, D]``; weights, experts: ``[T, k]``; w_gate, w_up: ``[E, D, F]``;
      w_down: ``[E, F, D]``.

    Returns:
      ``[T, D]`` float64.
    """
    x, w_gate, w_up, w_down = (np.asarray(a, np.float64) for a in (x, w_gate, w_up, w_down))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(experts[t]):
            hidden = silu(x[t] @ w_gate[e]) * (x[t] @ w_up[e])
            out[t] += weights[t, j] * (hidden @ w_down[e])
    return out


def fan_in_weight(rng, *shape, scale=1.0):
    """f32 ``N(0, scale^2 / fan_in)`` of ``shape``, fan_in the next-to-last dim."""
    return (scale * rng.standard_normal(shape) / np.sqrt(shape[-2])).astype(np.float32)


def layer_weights(rng, d, e, f, *, router_scale=1.0):
    """``(router [D, E], w_gate [E, D, F], w_up [E, D, F], w_down [E, F, D])``, drawn in that
    order by :func:`fan_in_weight` (the router's scaled by ``router_scale``)."""
    return (
        fan_in_weight(rng, d, e, scale=router_scale),
        fan_in_weight(rng, e, d, f),
        fan_in_weight(rng, e, d, f),
        fan_in_weight(rng, e, f, d),
    )
