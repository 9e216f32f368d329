"""Float64 NumPy reference of the composed objectives, written from shared/SPEC_LOSSES.md.

Independent of ``jaxrl_llm``: the preset table is transcribed from the spec, and every piece
(ratio, surrogate, KL estimator, aggregation, metrics) is re-derived in float64, together with
the analytic gradient of the loss with respect to the current log-probs. Aggregation is linear
in the per-token values, ``agg(v) = Σ w·v`` with weights depending only on the mask, so the
gradient is the weights times the per-token derivative. GMPO's loss is already per sequence
(its tokens are coupled within a row) and is averaged over non-empty rows whatever the mode.
"""

from __future__ import annotations

import numpy as np

# Every field the reference reads, with the Objective defaults stated by the spec.
DEFAULTS: dict = {
    "advantage": "grpo",
    "advantage_scale": "group",
    "dynamic_sampling": False,
    "ratio": "token",
    "ratio_clamp": 20.0,
    "max_log_ratio": 10.0,
    "surrogate": "ppo_clip",
    "clip_low": 0.2,
    "clip_high": 0.2,
    "dual_clip": None,
    "tau_pos": 1.0,
    "tau_neg": 1.05,
    "kl_kind": None,
    "kl_coef": 0.0,
    "kl_placement": "loss",
    "kl_straight_through": False,
    "entropy_coef": 0.0,
    "aggregation": "token-mean",
    "norm_constant": None,
    "value_clip": 0.5,
}

# shared/SPEC_LOSSES.md, "Objective presets", one row per preset (deviations from DEFAULTS).
SPEC_PRESETS: dict[str, dict] = {
    "grpo": {"kl_kind": "k3", "kl_coef": 0.04, "aggregation": "seq-mean-token-mean"},
    "dapo": {"dynamic_sampling": True, "clip_high": 0.28},
    "dr_grpo": {"advantage_scale": "none", "aggregation": "seq-mean-token-sum-norm"},
    "gspo": {
        "ratio": "gspo_token",
        "clip_low": 3e-4,
        "clip_high": 4e-4,
        "aggregation": "seq-mean-token-mean",
    },
    "gspo_token": {
        "ratio": "gspo_token",
        "clip_low": 3e-4,
        "clip_high": 4e-4,
        "aggregation": "seq-mean-token-mean",
    },
    "cispo": {"surrogate": "cispo", "clip_low": None, "clip_high": 4.0},
    "gmpo": {
        "surrogate": "gmpo",
        "clip_low": 0.4,
        "clip_high": 0.4,
        "aggregation": "seq-mean-token-mean",
    },
    "sapo": {
        "surrogate": "sapo",
        "tau_pos": 1.0,
        "tau_neg": 1.05,
        "aggregation": "seq-mean-token-mean",
    },
    "rloo": {"advantage": "rloo"},
    "reinforce_pp": {
        "advantage": "reinforce_pp",
        "kl_kind": "k1",
        "kl_coef": 0.01,
        "kl_placement": "reward",
    },
    "gpg": {"advantage": "gpg", "surrogate": "reinforce"},
    "ppo": {
        "advantage": "gae",
        "dual_clip": 3.0,
        "kl_kind": "k1",
        "kl_coef": 0.05,
        "kl_placement": "reward",
        "value_clip": 0.5,
    },
    "prime": {"advantage": "prime"},
    "distill": {"advantage": "distill"},
    "distill_gkd": {"advantage": "none"},
}

PRESET_NAMES: tuple[str, ...] = tuple(SPEC_PRESETS)


def config(name: str, **overrides) -> dict:
    """The spec's hyper-parameters of preset ``name`` with ``overrides`` applied."""
    unknown = set(overrides) - set(DEFAULTS)
    if unknown:
        raise KeyError(f"reference does not model fields {sorted(unknown)}")
    return {**DEFAULTS, **SPEC_PRESETS[name], **overrides}


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def normalisers(mask, num_tokens=None, num_seqs=None) -> tuple[float, float]:
    """``(N_tok, N_seq)``: the given global values, else ``max(Σm, 1)`` / ``max(#non-empty, 1)``."""
    m = _f64(mask)
    if num_tokens is None:
        num_tokens = max(m.sum(), 1.0)
    if num_seqs is None:
        num_seqs = max(float((m.sum(axis=1) > 0).sum()), 1.0)
    return float(num_tokens), float(num_seqs)


def aggregation_weights(
    mask, mode: str, *, num_tokens=None, num_seqs=None, norm_constant=None
) -> np.ndarray:
    """``w [B, T]`` with ``aggregate(v) = Σ w·v`` for each mode of the spec's table."""
    m = _f64(mask)
    n_tok, n_seq = normalisers(m, num_tokens, num_seqs)
    row_len = m.sum(axis=1, keepdims=True)
    if mode == "token-mean":
        return m / n_tok
    if mode == "token-sum":
        return m
    if mode == "seq-mean-token-mean":
        return m / (row_len + 1e-8) / n_seq
    if mode == "seq-mean-token-sum":
        return m / n_seq
    if mode == "seq-mean-token-sum-norm":
        constant = m.shape[1] if norm_constant is None else norm_constant
        return m / n_seq / constant
    raise ValueError(mode)


def masked_mean(values, mask, num_tokens=None) -> float:
    """``Σ v·m / N_tok`` (the metric normaliser)."""
    n_tok, _ = normalisers(mask, num_tokens, None)
    return float(np.sum(np.where(_f64(mask) > 0, _f64(values), 0.0)) / n_tok)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def kl_value_and_grad(logprobs, ref_logprobs, kind: str, straight_through: bool = False):
    """Per-token KL estimate (``x = ref − lp``) and its derivative with respect to ``lp``."""
    lp, ref = _f64(logprobs), _f64(ref_logprobs)
    x = ref - lp
    if kind == "k1":
        value, grad = lp - ref, np.ones_like(x)
    elif kind == "k2":
        value, grad = 0.5 * x**2, -x
    elif kind == "k3":
        xc = np.clip(x, -20.0, 20.0)
        raw = np.exp(xc) - xc - 1.0
        value = np.clip(raw, -10.0, 10.0)
        # Either clamp binding kills the gradient.
        live = (np.abs(x) < 20.0) & (raw < 10.0)
        grad = np.where(live, 1.0 - np.exp(xc), 0.0)
    elif kind == "abs":
        value, grad = np.abs(x), -np.sign(x)
    else:
        raise ValueError(kind)
    if straight_through:
        grad = -x
    return value, grad


def _log_ratio(cfg, lp, old, m):
    """``(log r [B, T], d log r_t / d lp_t [B, T])`` for the configured ratio kind."""
    delta = lp - old
    if cfg["ratio"] == "token":
        clamp = cfg["ratio_clamp"]
        return np.clip(delta, -clamp, clamp), (np.abs(delta) < clamp).astype(np.float64)
    # GSPO-token: the sequence value on every token, a per-token gradient of 1 unless capped.
    seq = np.sum(np.where(m > 0, delta, 0.0), axis=1) / np.maximum(m.sum(axis=1), 1.0)
    log_ratio = np.broadcast_to(np.minimum(seq, cfg["max_log_ratio"])[:, None], m.shape)
    live = (seq < cfg["max_log_ratio"])[:, None] & (m > 0)
    return log_ratio.copy(), live.astype(np.float64)


def _ppo_clip(cfg, r, adv):
    """Per-token loss, ``d loss / d log r``, clipped and dual-clipped indicators."""
    lo, hi = 1.0 - cfg["clip_low"], 1.0 + cfg["clip_high"]
    loss1 = -adv * r
    loss2 = -adv * np.clip(r, lo, hi)
    clipped_loss = np.maximum(loss1, loss2)
    d1 = -adv * r
    d2 = np.where((r > lo) & (r < hi), -adv * r, 0.0)
    d_clipped = np.where(loss2 > loss1, d2, d1)
    lower = np.zeros_like(r, dtype=bool)
    loss, d_loss = clipped_loss, d_clipped
    if cfg["dual_clip"] is not None:
        bound = -adv * cfg["dual_clip"]
        lower = (adv < 0) & (clipped_loss > bound)
        loss = np.where(lower, bound, clipped_loss)
        d_loss = np.where(lower, 0.0, d_clipped)
    return loss, d_loss, loss2 > loss1, lower


def _gmpo_per_sequence(cfg, log_ratio, d_log_ratio, adv, m):
    """GMPO's per-sequence loss ``[B]`` and its ``[B, T]`` derivative within each row."""
    cl, ch = cfg["clip_low"], cfg["clip_high"]
    sign = np.sign(adv)
    clipped = np.clip(log_ratio, -cl, ch)
    star = sign * np.minimum(sign * log_ratio, sign * clipped)
    length = m.sum(axis=1)
    rho = np.exp(np.sum(np.where(m > 0, star, 0.0), axis=1) / (length + 1e-8))
    adv_bar = np.sum(np.where(m > 0, adv, 0.0), axis=1) / (length + 1e-8)
    per_seq = -adv_bar * rho
    # d star / d log r: 1 inside the bounds or where the un-clipped branch is the minimum.
    passes = ((log_ratio >= -cl) & (log_ratio <= ch)) | (sign * log_ratio < sign * clipped)
    d_star = np.where(sign != 0, passes.astype(np.float64), 0.0)
    d_per_seq = (
        (-adv_bar * rho / (length + 1e-8))[:, None] * np.where(m > 0, d_star, 0.0) * d_log_ratio
    )
    return per_seq, d_per_seq


def policy_loss(
    cfg: dict,
    logprobs,
    old_logprobs,
    advantages,
    mask,
    *,
    ref_logprobs=None,
    entropy=None,
    num_tokens=None,
    num_seqs=None,
):
    """The composed policy loss of shared/SPEC_LOSSES.md in float64.

    ``loss = agg(surrogate) + kl_coef·agg(kl) [KL in loss] − entropy_coef·agg(H)``.

    Returns:
      ``(loss, metrics, grad)`` where ``grad [B, T]`` is ``d loss / d logprobs``.
    """
    m = _f64(mask)
    valid = m > 0
    lp, old = _f64(logprobs), _f64(old_logprobs)
    adv = _f64(advantages)
    if adv.ndim == 1:
        adv = np.broadcast_to(adv[:, None], m.shape)
    n_tok, n_seq = normalisers(m, num_tokens, num_seqs)
    n_seq = max(n_seq, 1.0)
    weights = aggregation_weights(
        m, cfg["aggregation"], num_tokens=n_tok, num_seqs=n_seq, norm_constant=cfg["norm_constant"]
    )

    def agg(values):
        return float(np.sum(np.where(valid, values, 0.0) * weights))

    def mmean(values):
        return float(np.sum(np.where(valid, values, 0.0)) / n_tok)

    log_ratio, d_log_ratio = _log_ratio(cfg, lp, old, m)
    r = np.exp(log_ratio)
    metrics: dict[str, float] = {}
    surrogate = cfg["surrogate"]
    if surrogate == "ppo_clip":
        per_token, d_per_token, clipped, lower = _ppo_clip(cfg, r, adv)
        grad = weights * d_per_token * d_log_ratio
        metrics["clip_frac"] = mmean(clipped)
        metrics["clip_frac_lower"] = mmean(lower)
    elif surrogate == "cispo":
        lo = -np.inf if cfg["clip_low"] is None else 1.0 - cfg["clip_low"]
        hi = 1.0 + cfg["clip_high"]
        weight = np.clip(r, lo, hi)
        per_token = -weight * adv * lp
        grad = weights * (-weight * adv)
        metrics["clip_frac"] = mmean((r > hi) | (r < lo))
    elif surrogate == "sapo":
        tau = np.where(adv > 0, cfg["tau_pos"], cfg["tau_neg"])
        gate = _sigmoid(tau * (r - 1.0))
        per_token = -gate * (4.0 / tau) * adv
        grad = weights * (-4.0 * adv * gate * (1.0 - gate) * r) * d_log_ratio
    elif surrogate == "gmpo":
        per_seq, d_per_seq = _gmpo_per_sequence(cfg, log_ratio, d_log_ratio, adv, m)
        # Already a per-sequence loss: the mean over non-empty rows, whatever the mode.
        non_empty = (m.sum(axis=1) > 0)[:, None]
        seq_weights = np.where(non_empty, 1.0 / n_seq, 0.0)
        per_token = None
        pg_loss = float(np.sum(np.where(non_empty[:, 0], per_seq, 0.0)) / n_seq)
        grad = seq_weights * d_per_seq
        cl, ch = cfg["clip_low"], cfg["clip_high"]
        binds = ((adv > 0) & (log_ratio > ch)) | ((adv < 0) & (log_ratio < -cl))
        metrics["clip_frac"] = mmean(binds)
    elif surrogate == "reinforce":
        per_token = -adv * lp
        grad = weights * -adv
    elif callable(surrogate):
        # A user surrogate of the registry tests, e.g. soft_clip below:
        # (per_token, d per_token / d log r, {metric: per-token indicator}).
        per_token, d_per_token, indicators = surrogate(log_ratio, adv)
        grad = weights * d_per_token * d_log_ratio
        metrics.update({key: mmean(value) for key, value in indicators.items()})
    else:
        raise ValueError(surrogate)

    if per_token is not None:
        pg_loss = agg(per_token)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss
    metrics["approx_kl"] = mmean(old - lp)
    metrics["ratio_mean"] = mmean(r)
    metrics["ratio_min"] = float(r[valid].min()) if valid.any() else 0.0
    metrics["ratio_max"] = float(r[valid].max()) if valid.any() else 0.0

    if ref_logprobs is not None and cfg["kl_kind"] is not None:
        kl, d_kl = kl_value_and_grad(lp, ref_logprobs, cfg["kl_kind"], cfg["kl_straight_through"])
        metrics["kl"] = mmean(kl)
        if cfg["kl_placement"] == "loss":
            metrics["kl_loss"] = agg(kl)
            loss += cfg["kl_coef"] * metrics["kl_loss"]
            grad = grad + cfg["kl_coef"] * weights * d_kl

    if entropy is not None:
        metrics["entropy"] = mmean(_f64(entropy))
        if cfg["entropy_coef"] > 0:
            metrics["entropy_loss"] = agg(_f64(entropy))
            loss -= cfg["entropy_coef"] * metrics["entropy_loss"]

    metrics["loss"] = loss
    return loss, metrics, np.where(valid, grad, 0.0)


def value_loss(cfg: dict, values, old_values, returns, mask, *, num_tokens=None, num_seqs=None):
    """``agg(½·max((v − R)², (clip(v, v_old ± c) − R)²))``, its metrics and ``d loss / d v``."""
    m = _f64(mask)
    v, v_old, target = _f64(values), _f64(old_values), _f64(returns)
    c = cfg["value_clip"]
    v_clipped = np.clip(v, v_old - c, v_old + c)
    unclipped_sq, clipped_sq = (v - target) ** 2, (v_clipped - target) ** 2
    per_token = 0.5 * np.maximum(unclipped_sq, clipped_sq)
    inside = (v > v_old - c) & (v < v_old + c)
    d_per_token = np.where(
        clipped_sq > unclipped_sq, np.where(inside, v_clipped - target, 0.0), v - target
    )
    n_tok, n_seq = normalisers(m, num_tokens, num_seqs)
    weights = aggregation_weights(
        m, cfg["aggregation"], num_tokens=n_tok, num_seqs=n_seq, norm_constant=cfg["norm_constant"]
    )
    loss = float(np.sum(np.where(m > 0, per_token, 0.0) * weights))
    metrics = {
        "vf_loss": loss,
        "vf_clipfrac": masked_mean(clipped_sq > unclipped_sq, m, n_tok),
        "value_mean": masked_mean(v, m, n_tok),
    }
    return loss, metrics, np.where(m > 0, weights * d_per_token, 0.0)


def sft_loss(logprobs, mask) -> float:
    """``−Σ m·lp / max(Σ m, 1)``."""
    m = _f64(mask)
    return float(-np.sum(np.where(m > 0, _f64(logprobs), 0.0)) / max(m.sum(), 1.0))


def outcome_token_rewards(rewards, mask) -> np.ndarray:
    """Each row's reward on its last valid token, 0 elsewhere (all-masked rows: all 0)."""
    m = _f64(mask)
    out = np.zeros_like(m)
    for i, row in enumerate(m):
        valid = np.flatnonzero(row > 0)
        if valid.size:
            out[i, valid[-1]] = float(rewards[i])
    return out


def whiten(x, mask) -> np.ndarray:
    """Masked whitening with the unbiased variance; fewer than two entries: ``x − μ``."""
    m = _f64(mask) > 0
    x = _f64(x)
    values = x[m]
    if values.size == 0:
        return np.zeros_like(x)
    mu = values.mean()
    if values.size < 2:
        return np.where(m, x - mu, 0.0)
    var = values.var(ddof=1)
    return np.where(m, (x - mu) / np.sqrt(var + 1e-8), 0.0)


def prime_advantages(rewards, process_rewards, mask, *, group_size: int):
    """PRIME (Cui et al. 2025) as verl's ``compute_rloo_advantage_return``.

    Dense rewards get an RLOO baseline built from each row's mean process reward,
    ``r_t·G/(G−1) − Σ_{j∈g} mean_j / (G−1)``; the outcome reward gets plain RLOO on the last
    valid token; returns are the undiscounted reward-to-go and advantages their masked whitening.

    Returns:
      ``(advantages [B, T], returns [B, T])``, 0 at masked positions.
    """
    m = _f64(mask)
    dense_in = np.where(m > 0, _f64(process_rewards), 0.0)
    rewards = _f64(rewards)
    g = group_size
    dense = np.zeros_like(m)
    outcome = np.zeros_like(rewards)
    for start in range(0, m.shape[0], g):
        rows = slice(start, start + g)
        means = dense_in[rows].sum(axis=1) / np.maximum(m[rows].sum(axis=1), 1.0)
        dense[rows] = (dense_in[rows] * g / (g - 1) - means.sum() / (g - 1)) * m[rows]
        outcome[rows] = rewards[rows] - (rewards[rows].sum() - rewards[rows]) / (g - 1)
    total = (dense + outcome_token_rewards(outcome, m)) * m
    returns = np.flip(np.cumsum(np.flip(total, axis=1), axis=1), axis=1) * m
    return whiten(returns, m), returns


# --------------------------------------------------------------------------------------------
# User-registered pieces of the registry tests (not part of the spec)
# --------------------------------------------------------------------------------------------


def soft_clip(log_ratio, advantages, *, eps: float):
    """A smooth clip: ``−A·(1 + ε·tanh((r − 1)/ε))`` per token.

    Returns ``(loss, d loss / d log r = −A·(1 − tanh²(u))·r, {"soft_clip_frac": |r − 1| > ε})``
    with ``u = (r − 1)/ε``; usable as ``cfg["surrogate"]`` of :func:`policy_loss`.
    """
    r = np.exp(_f64(log_ratio))
    adv = _f64(advantages)
    u = np.tanh((r - 1.0) / eps)
    return -adv * (1.0 + eps * u), -adv * (1.0 - u**2) * r, {"soft_clip_frac": np.abs(r - 1) > eps}


def sequence_reinforce(logprobs, advantages, mask):
    """``mean_i(−A_i·Σ_t m·lp / max(L_i, 1))`` over non-empty rows, and ``d / d lp [B, T]``."""
    m = _f64(mask)
    lp = np.where(m > 0, _f64(logprobs), 0.0)
    adv = _f64(advantages)
    lengths = np.maximum(m.sum(axis=1), 1.0)
    _, n_seq = normalisers(m)
    loss = float(np.sum(-adv * lp.sum(axis=1) / lengths) / n_seq)
    return loss, (-adv / lengths)[:, None] * m / n_seq


def min_baseline_advantages(rewards, *, group_size: int, scale: float) -> np.ndarray:
    """``scale·(r_i − min_{j∈g} r_j)``: a user sequence-level estimator."""
    groups = _f64(rewards).reshape(-1, group_size)
    return (scale * (groups - groups.min(axis=1, keepdims=True))).reshape(-1)


def discounted_returns(token_rewards, mask, *, gamma: float) -> np.ndarray:
    """``R_t = Σ_{u≥t} γ^(u−t)·r_u`` over the valid tokens of right-padded rows."""
    m = _f64(mask)
    rewards = np.where(m > 0, _f64(token_rewards), 0.0)
    out = np.zeros_like(rewards)
    running = np.zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        out[:, t] = running
    return out * m
