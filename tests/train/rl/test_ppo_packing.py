"""PPO's rollout-time values over packed rows (issue 44, item 1): ``make_value_fn`` with a
one-micro-batch plan gives the padded values (f32, 1e-5), and the trainer hands it one.

The padded values are ``heads.token_values``' (checked against transformers in
tests/models/test_heads.py); the whole PPO run, packed against padded, is in
tests/train/rl/test_packing.py.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxrl_llm.models import heads
from jaxrl_llm.train.packing import plan_micro_batches
from jaxrl_llm.train.rl.ppo import make_value_fn
from jaxrl_llm.types import Sequences
from tests.train.rl.critic_problem import CONFIG, ragged_rows


def _seqs(rng) -> Sequences:
    """Ragged rows with 0 / 1 int32 masks."""
    seqs = ragged_rows(rng)
    return seqs._replace(
        prompt_mask=seqs.prompt_mask.astype(np.int32),
        completion_mask=seqs.completion_mask.astype(np.int32),
    )


def test_packed_values_are_the_padded_values():
    std = 1.0 / np.sqrt(CONFIG.hidden_size)  # O(1) values: a misplaced state shows
    params = heads.init_scalar_params(CONFIG, jax.random.key(0), score_std=std)
    seqs = _seqs(np.random.default_rng(0))
    plan = plan_micro_batches(seqs.prompt_mask, seqs.completion_mask, micro_batches=1, shards=2)
    assert plan.source.shape[:2] == (1, 2) and plan.rows < len(seqs.prompt_mask)  # rows shared
    fn = make_value_fn(CONFIG)
    padded = np.asarray(fn(params, seqs))
    packed = np.asarray(fn(params, seqs, plan))
    assert np.all(padded[seqs.completion_mask > 0] != 0)
    np.testing.assert_allclose(packed, padded, atol=1e-5)
    assert np.all(packed[seqs.completion_mask == 0] == 0)
