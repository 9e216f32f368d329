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


def smoothed_sigmoid(z, eps):
    return -(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z)


def dpo_batch(loss_type, policy_w, policy_l, ref_w, ref_l, *, beta, eps=0.0, n_w=None, **_):
    """The loss types whose per-pair value depends on the whole batch (AOT sorts, SFT sums)."""
    pw, pl, rw, rl = (np.asarray(a, np.float64) for a in (policy_w, policy_l, ref_w, ref_l))
    if loss_type == "aot":
        delta = np.sort(pw - pl) - np.sort(rw - rl)
        return smoothed_sigmoid(beta * delta, eps)
    if loss_type == "aot_unpaired":
        delta = np.sort(pw - rw) - np.sort(pl - rl)
        return smoothed_sigmoid(beta * delta, eps)
    if loss_type == "sft":
        total_tokens = float(np.sum(np.asarray(n_w, np.float64)))
        return np.full(pw.shape, -float(np.sum(pw)) / max(total_tokens, 1.0))
    raise KeyError(loss_type)


BATCH_TYPES = ("aot", "aot_unpaired", "sft")


def dpo(policy_w, policy_l, ref_w, ref_l, loss_type, weights=None, **kw):
    c = np.asarray(policy_w, np.float64) - np.asarray(ref_w, np.float64)
    r = np.asarray(policy_l, np.float64) - np.asarray(ref_l, np.float64)
    types = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)
    weights = (1.0,) * len(types) if weights is None else weights
    total = 0.0
    for t, w in zip(types, weights):
        if t in BATCH_TYPES:
            total = total + w * dpo_batch(t, policy_w, policy_l, ref_w, ref_l, **kw)
        else:
            total = total + w * dpo_single(t, c, r, **kw)
    return total


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


def alphapo_reward(lp, alpha):
    """AlphaPO: (1 − p^(−α)) / α with p = e^lp; the log reward lp at α = 0."""
    lp = np.asarray(lp, np.float64)
    if alpha == 0:
        return lp
    return (1.0 - np.exp(lp) ** (-alpha)) / alpha


def simpo_cpo(lw, ll, *, beta, gamma, eps=0.0, alpha=0.0, nll=None, loss_type="sigmoid", shape=0.0):
    """CPO family; ``alpha`` weights the NLL term, ``shape`` is AlphaPO's reward α."""
    lw = np.asarray(lw, np.float64)
    ll = np.asarray(ll, np.float64)
    u = alphapo_reward(lw, shape) - alphapo_reward(ll, shape)
    if loss_type == "sigmoid":
        logits = u - gamma / beta
        loss = -(1 - eps) * log_sigmoid(beta * logits) - eps * log_sigmoid(-beta * logits)
    elif loss_type == "hinge":
        loss = np.maximum(0.0, 1.0 - beta * u)
    elif loss_type == "ipo":
        loss = (u - 1.0 / (2.0 * beta)) ** 2
    else:
        raise KeyError(loss_type)
    nll = -lw if nll is None else np.asarray(nll, np.float64)
    return loss + alpha * nll


def batch_token_mean_nll(token_logps, mask, prompt_logps=None, prompt_mask=None):
    """TRL's SFT term: −Σ over every chosen (and given prompt) token of the batch / their count."""
    token_logps = np.asarray(token_logps, np.float64)
    mask = np.asarray(mask, bool)
    total, count = token_logps[mask].sum(), mask.sum()
    if prompt_logps is not None:
        prompt_mask = np.asarray(prompt_mask, bool)
        total += np.asarray(prompt_logps, np.float64)[prompt_mask].sum()
        count += prompt_mask.sum()
    return -total / max(count, 1)


def bradley_terry(rw, rl, *, margins=None, center=0.0):
    """Per pair: −log σ(r_w − r_l − m) + c·(r_w + r_l)²."""
    out = []
    for i in range(len(rw)):
        m = 0.0 if margins is None else float(margins[i])
        diff = float(rw[i]) - float(rl[i]) - m
        out.append(-float(log_sigmoid(diff)) + center * (float(rw[i]) + float(rl[i])) ** 2)
    return np.array(out)
