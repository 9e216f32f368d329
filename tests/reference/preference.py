"""Float64 NumPy references for the preference losses, written from shared/SPEC_LOSSES.md.

Deliberately plain: loops over rows, textbook formulas, no shared code with the package.
"""

from __future__ import annotations

import numpy as np


def log_sigmoid(x):
    """log σ(x) = −log(1 + e^{−x}), via logaddexp (exact in float64 for any finite x)."""
    return -np.logaddexp(0.0, -np.asarray(x, np.float64))


def sigmoid(x):
    return np.exp(log_sigmoid(x))


def seq_sum(token_logps, mask):
    token_logps = np.asarray(token_logps, np.float64)
    mask = np.asarray(mask, bool)
    out = np.zeros(token_logps.shape[0])
    for i in range(token_logps.shape[0]):
        for t in range(token_logps.shape[1]):
            if mask[i, t]:
                out[i] += token_logps[i, t]
    return out


def seq_len(mask):
    return np.asarray(mask, bool).sum(axis=1).astype(np.float64)


def seq_avg(token_logps, mask):
    return seq_sum(token_logps, mask) / np.maximum(seq_len(mask), 1.0)


def dpo_single(loss_type, c, r, *, beta, eps=0.0, n_w=None, n_l=None, tau=0.05):
    """One row of the SPEC_LOSSES.md table; c, r are the chosen / rejected log ratios."""
    c = np.asarray(c, np.float64)
    r = np.asarray(r, np.float64)
    z = beta * (c - r)
    if n_w is not None:
        n_w = np.maximum(np.asarray(n_w, np.float64), 1.0)
        n_l = np.maximum(np.asarray(n_l, np.float64), 1.0)
    if loss_type == "sigmoid":
        return -(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z)
    if loss_type == "hinge":
        return np.maximum(0.0, 1.0 - z)
    if loss_type == "ipo":
        return (c / n_w - r / n_l - 1.0 / (2.0 * beta)) ** 2
    if loss_type == "robust":
        return (-(1 - eps) * log_sigmoid(z) + eps * log_sigmoid(-z)) / (1 - 2 * eps)
    if loss_type == "exo_pair":
        return sigmoid(z) * (log_sigmoid(z) - np.log(1 - eps)) + sigmoid(-z) * (
            log_sigmoid(-z) - np.log(eps)
        )
    if loss_type == "nca_pair":
        return -log_sigmoid(beta * c) - 0.5 * log_sigmoid(-beta * c) - 0.5 * log_sigmoid(-beta * r)
    if loss_type == "bco_pair":
        return -log_sigmoid(beta * c) - log_sigmoid(-beta * r)
    if loss_type == "sppo_hard":
        return (c - 1 / (2 * beta)) ** 2 + (r + 1 / (2 * beta)) ** 2
    if loss_type == "apo_zero":
        return (1 - sigmoid(beta * c)) + sigmoid(beta * r)
    if loss_type == "apo_down":
        return sigmoid(beta * c) + (1 - sigmoid(z))
    if loss_type == "discopop":
        mu = sigmoid(z / tau)
        # mu * exp(-z) in log space: the plain product is 0 * inf for z << 0 even in float64.
        with np.errstate(over="ignore"):
            exp_term = np.exp(log_sigmoid(z / tau) - z)
        return (1 - mu) * (-log_sigmoid(z)) + exp_term
    if loss_type == "sigmoid_norm":
        return -log_sigmoid(beta * (c / n_w - r / n_l))
    raise KeyError(loss_type)


def dpo(policy_w, policy_l, ref_w, ref_l, loss_type, weights=None, **kw):
    c = np.asarray(policy_w, np.float64) - np.asarray(ref_w, np.float64)
    r = np.asarray(policy_l, np.float64) - np.asarray(ref_l, np.float64)
    types = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)
    weights = (1.0,) * len(types) if weights is None else weights
    return sum(w * dpo_single(t, c, r, **kw) for t, w in zip(types, weights))


def kto(policy, ref, labels, kl_policy, kl_ref, *, beta, w_d=1.0, w_u=1.0):
    if kl_policy is None:
        z0 = 0.0
    else:
        diffs = [float(p) - float(q) for p, q in zip(kl_policy, kl_ref)]
        z0 = max(sum(diffs) / len(diffs), 0.0)
    out = []
    for p, q, lab in zip(policy, ref, labels):
        r = float(p) - float(q)
        if lab:
            out.append(w_d * (1.0 - float(sigmoid(beta * (r - z0)))))
        else:
            out.append(w_u * (1.0 - float(sigmoid(beta * (z0 - r)))))
    return np.array(out)


def log1mexp(x):
    """log(1 − e^x) in float64; direct formula (accurate enough in float64 for x < 0)."""
    return np.log(-np.expm1(np.asarray(x, np.float64)))


def orpo(lw, ll, *, beta, nll=None):
    lw = np.asarray(lw, np.float64)
    ll = np.asarray(ll, np.float64)
    log_odds = (lw - ll) - (log1mexp(lw) - log1mexp(ll))
    nll = -lw if nll is None else np.asarray(nll, np.float64)
    return nll - beta * log_sigmoid(log_odds), log_odds


def simpo_cpo(lw, ll, *, beta, gamma, eps=0.0, alpha=0.0, nll=None):
    lw = np.asarray(lw, np.float64)
    ll = np.asarray(ll, np.float64)
    logits = lw - ll - gamma / beta
    loss = -(1 - eps) * log_sigmoid(beta * logits) - eps * log_sigmoid(-beta * logits)
    nll = -lw if nll is None else np.asarray(nll, np.float64)
    return loss + alpha * nll


def batch_token_mean_nll(token_logps, mask):
    """TRL's SFT term: −Σ over every chosen token of the batch / number of those tokens."""
    token_logps = np.asarray(token_logps, np.float64)
    mask = np.asarray(mask, bool)
    return -token_logps[mask].sum() / max(mask.sum(), 1)
