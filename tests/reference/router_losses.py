"""Float64 NumPy references of the mixture-of-experts router losses (``models.moe``), values and
gradients with respect to the router logits.

With ``E`` experts, ``N`` real (layer, token) pairs of weight ``w_n`` (1 real, 0 padding) and
``p = softmax(z)``::

    LB = E · sum_e f_e P_e,   f_e = (1/N) sum_n w_n [e in top_k(p_n)],   P_e = (1/N) sum_n w_n p_ne
    dLB/dz_nj = (E/N) · w_n p_nj (f_j - sum_e f_e p_ne)          (f carries no gradient)
    Z = (1/N) sum_n w_n lse(z_n)^2,   dZ/dz_nj = (2/N) · w_n lse(z_n) p_nj

(transformers' ``load_balancing_loss_func``: Switch Transformer eqs. 4-6 with top-k counts;
ST-MoE's router z-loss, eq. 5.)
"""

from __future__ import annotations

import numpy as np


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def router_losses(logits, mask, top_k):
    """``(LB, Z, dLB/dz, dZ/dz)`` in float64 of ``[..., E]`` logits over the real tokens.

    ``mask`` covers the logits' token dims (broadcast over the leading layer dim), None = all
    real. Ties in the top-k: the lower expert index first.
    """
    z = np.asarray(logits, np.float64)
    w = np.ones(z.shape[:-1]) if mask is None else np.asarray(mask, np.float64)
    w = np.broadcast_to(w, z.shape[:-1])
    n, experts = max(w.sum(), 1.0), z.shape[-1]
    p = _softmax(z)
    chosen = np.argsort(-p, axis=-1, kind="stable")[..., :top_k]
    counts = np.zeros_like(p)
    np.put_along_axis(counts, chosen, 1.0, axis=-1)
    axes = tuple(range(z.ndim - 1))
    f = (counts * w[..., None]).sum(axis=axes) / n
    big_p = (p * w[..., None]).sum(axis=axes) / n
    lb = experts * (f * big_p).sum()
    d_lb = experts / n * w[..., None] * p * (f - (p * f).sum(-1, keepdims=True))
    lse = np.log(np.exp(z).sum(-1))
    zl = (w * lse**2).sum() / n
    d_z = 2.0 / n * (w * lse)[..., None] * p
    return lb, zl, d_lb, d_z
