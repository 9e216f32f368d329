"""Float64 NumPy references for ``jaxrl_llm.losses.advantages``, plain loops from the spec.

Deliberately naive (explicit Python loops over groups, rows and time steps) so that they
share no structure with the vectorised JAX code they check.
"""

from __future__ import annotations

import math

import numpy as np


def _std(values: list[float], ddof: int) -> float:
    n = len(values)
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / max(n - ddof, 1))


def _groups(rewards: np.ndarray, group_size: int) -> list[list[float]]:
    flat = [float(v) for v in np.asarray(rewards, dtype=np.float64)]
    return [flat[i : i + group_size] for i in range(0, len(flat), group_size)]


def grpo(rewards, group_size, scale="group", std_ddof=1, eps=1e-6):
    out = []
    batch_std = _std([v for g in _groups(rewards, group_size) for v in g], std_ddof)
    for group in _groups(rewards, group_size):
        mean = sum(group) / len(group)
        for r in group:
            if max(group) == min(group):
                out.append(0.0)
            elif scale == "group":
                out.append((r - mean) / (_std(group, std_ddof) + eps))
            elif scale == "batch":
                out.append((r - mean) / (batch_std + eps))
            else:
                out.append(r - mean)
    return np.array(out)


def rloo(rewards, group_size):
    out = []
    for group in _groups(rewards, group_size):
        for i, r in enumerate(group):
            if len(group) == 1:
                out.append(0.0)
                continue
            others = [v for j, v in enumerate(group) if j != i]
            out.append(r - sum(others) / len(others))
    return np.array(out)


def whiten(x, mask, shift_mean=True):
    x = np.asarray(x, dtype=np.float64)
    mask = np.asarray(mask).astype(bool)
    valid = [float(v) for v, m in zip(x.ravel(), mask.ravel()) if m]
    n = len(valid)
    mean = sum(valid) / max(n, 1)
    if n >= 2:
        var = sum((v - mean) ** 2 for v in valid) / (n - 1)
        scale = 1.0 / math.sqrt(var + 1e-8)
    else:
        scale = 1.0
    out = np.zeros(x.shape)
    for idx in np.ndindex(x.shape):
        if mask[idx]:
            out[idx] = (x[idx] - mean) * scale + (0.0 if shift_mean else mean)
    return out


def reinforce_pp(token_rewards, mask, gamma=1.0):
    token_rewards = np.asarray(token_rewards, dtype=np.float64)
    mask = np.asarray(mask).astype(bool)
    batch, time = mask.shape
    to_go = np.zeros((batch, time))
    for b in range(batch):
        running = 0.0
        for t in reversed(range(time)):
            if mask[b, t]:
                running = token_rewards[b, t] + gamma * running
                to_go[b, t] = running
    return whiten(to_go, mask)


def reinforce_pp_baseline(rewards, mask, group_size):
    mask = np.asarray(mask).astype(bool)
    batch, time = mask.shape
    per_row = []
    for group in _groups(rewards, group_size):
        mean = sum(group) / len(group)
        for r in group:
            if len(group) == 1:
                per_row.append(r)
            elif max(group) == min(group):
                per_row.append(0.0)
            else:
                per_row.append(r - mean)
    tiled = np.array([[per_row[b]] * time for b in range(batch)])
    return whiten(tiled, mask)


def remax(rewards, baseline_rewards):
    return np.array(
        [float(r) - float(b) for r, b in zip(np.asarray(rewards), np.asarray(baseline_rewards))],
        dtype=np.float64,
    )


def opo(rewards, mask, group_size):
    mask = np.asarray(mask, dtype=np.float64)
    lengths = [float(sum(row)) for row in mask]
    out = []
    for g, group in enumerate(_groups(rewards, group_size)):
        lens = lengths[g * group_size : (g + 1) * group_size]
        if sum(lens) == 0:
            lens = [1.0] * len(group)
        baseline = sum(length * r for length, r in zip(lens, group)) / sum(lens)
        for r in group:
            out.append(0.0 if max(group) == min(group) else r - baseline)
    return np.array(out)


def gpg(rewards, group_size):
    groups = _groups(rewards, group_size)
    batch = sum(len(g) for g in groups)
    informative = sum(len(g) for g in groups if max(g) != min(g))
    alpha = batch / max(informative, 1)
    out = []
    for group in groups:
        mean = sum(group) / len(group)
        for r in group:
            out.append(0.0 if max(group) == min(group) else alpha * (r - mean))
    return np.array(out)


def pass_at_k(rewards, group_size, scale="group", eps=1e-6):
    groups = _groups(rewards, group_size)
    batch_std = _std([v for g in groups for v in g], 1)
    out = []
    for group in groups:
        best = group.index(max(group))
        second = sorted(group, reverse=True)[1]
        gap = group[best] - second
        if gap == 0.0:
            pass  # a shared maximum: nothing to scale
        elif scale == "group":
            gap = gap / (_std(group, 1) + eps)
        elif scale == "batch":
            gap = gap / (batch_std + eps)
        out.extend(gap if i == best else 0.0 for i in range(len(group)))
    return np.array(out)


def gae(token_rewards, values, mask, gamma=1.0, lam=1.0):
    token_rewards = np.asarray(token_rewards, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    mask = np.asarray(mask).astype(bool)
    batch, time = mask.shape
    raw = np.zeros((batch, time))
    returns = np.zeros((batch, time))
    for b in range(batch):
        valid_steps = [t for t in range(time) if mask[b, t]]
        next_value, next_gae = 0.0, 0.0
        for t in reversed(valid_steps):
            delta = token_rewards[b, t] + gamma * next_value - values[b, t]
            next_gae = delta + gamma * lam * next_gae
            next_value = values[b, t]
            raw[b, t] = next_gae
            returns[b, t] = next_gae + values[b, t]
    return whiten(raw, mask), returns
