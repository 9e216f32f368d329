"""``train.rl.policy.sampler_mismatch``: the sampler-vs-trainer log-prob gap metrics."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.train.rl.policy import sampler_mismatch


def _reference(train, rollout, mask, num_tokens):
    """float64 NumPy: mean |d|, max |d| and k3 = e^d - 1 - d over the valid tokens."""
    d = np.asarray(train, np.float64) - np.asarray(rollout, np.float64)
    m = np.asarray(mask, bool)
    k3 = np.expm1(np.clip(d, -20, 20)) - np.clip(d, -20, 20)
    return (
        np.abs(d)[m].sum() / max(num_tokens, 1),
        np.abs(d)[m].max() if m.any() else 0.0,
        k3[m].sum() / max(num_tokens, 1),
    )


def test_matches_a_float64_reference(rng):
    train = rng.normal(-3, 1, size=(4, 7)).astype(np.float32)
    rollout = (train + rng.normal(0, 0.3, size=(4, 7))).astype(np.float32)
    mask = rng.random((4, 7)) < 0.6
    # Padding holds junk that must not count.
    train[~mask], rollout[~mask] = 50.0, -50.0
    got = sampler_mismatch(jnp.asarray(train), jnp.asarray(rollout), jnp.asarray(mask), mask.sum())
    want = _reference(train, rollout, mask, mask.sum())
    for key, value in zip(("logprob_diff_mean", "logprob_diff_max", "k3"), want):
        assert float(got[f"rollout/{key}"]) == pytest.approx(value, rel=1e-5, abs=1e-7)


def test_edge_cases():
    same = jnp.full((2, 3), -1.5)
    mask = jnp.ones((2, 3), bool)
    got = sampler_mismatch(same, same, mask, 6)
    assert all(float(v) == 0.0 for v in got.values())
    # k3 of d = ln 2 on every token: e^d - 1 - d = 1 - ln 2; a huge gap stays finite.
    got = sampler_mismatch(same + np.log(2.0), same, mask, 6)
    assert float(got["rollout/k3"]) == pytest.approx(1 - np.log(2.0), rel=1e-6)
    far = sampler_mismatch(same + 1e4, same, mask, 6)
    assert all(np.isfinite(float(v)) for v in far.values())
    # No valid token: zeros, not NaN; a whole-batch normaliser larger than this micro-batch's.
    empty = sampler_mismatch(same + 1.0, same, jnp.zeros((2, 3), bool), 0)
    assert all(float(v) == 0.0 for v in empty.values())
    part = sampler_mismatch(same + 1.0, same, mask, 12)
    assert float(part["rollout/logprob_diff_mean"]) == pytest.approx(0.5)
