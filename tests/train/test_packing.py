"""``train.packing``: the trainers' packing plans, one a micro-batch (issue 44, item 1).

Checked by hand on small masks: micro-batch ``k`` of ``K`` strided micro-batches holds rows
``k, k + K, ...`` (as ``train.step.split_micro_batches`` splits them), each micro-batch's plan
packs exactly its own rows' tokens, per data shard, and the stacked plans share one shape.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.packing import pack, unpack
from jaxrl_llm.train.packing import (
    micro_plan,
    packing_mode,
    plan_by_budget,
    plan_micro_batches,
    worth_packing,
)
from jaxrl_llm.train.step import TokenBudget, packed_micro_batch_count, split_micro_batches


def masks(prompt_lengths, completion_lengths, prompt_width=3, completion_width=5):
    """Left-padded prompt and right-padded completion masks of the given lengths."""
    prompt = np.array(
        [[j >= prompt_width - n for j in range(prompt_width)] for n in prompt_lengths]
    )
    completion = np.array([[j < n for j in range(completion_width)] for n in completion_lengths])
    return prompt, completion


def test_each_micro_batch_packs_its_own_strided_rows():
    # 8 rows of widths 3 + 5: sequence lengths 1+1=2, 2+3=5, 3+5=8, 1+0=1, ...
    prompt, completion = masks([1, 2, 3, 1, 2, 3, 1, 1], [1, 3, 5, 0, 2, 1, 4, 5])
    plan = plan_micro_batches(prompt, completion, micro_batches=2, shards=2)
    assert plan.source.shape[:2] == (2, 2)  # [K, shards, rows, W]
    assert plan.source.shape[3] == 8
    full = np.concatenate([prompt, completion], axis=1)
    tokens = np.arange(8 * 8).reshape(8, 8) + 1  # a distinct id per (row, column)
    split = np.asarray(split_micro_batches(jnp.asarray(tokens), 2))  # [K, 4, 8]
    for k in range(2):
        rows = list(range(k, 8, 2))  # micro-batch k: rows k, k + 2, ...
        want = sorted(tokens[rows][full[rows]].tolist())
        part = micro_plan(plan, k)
        packed = np.asarray(pack(jnp.asarray(split[k]), part))
        assert sorted(packed[np.asarray(part.flat("segment_ids")) > 0].tolist()) == want
        # Per shard: shard d's packed rows hold micro rows [2d, 2d + 2) only.
        per_shard = packed.reshape(2, -1, 8)
        for d in range(2):
            local = split[k][2 * d : 2 * d + 2]
            mine = per_shard[d][np.asarray(part.segment_ids)[d] > 0]
            assert set(mine.tolist()) <= set(local.ravel().tolist())
        back = np.asarray(unpack(jnp.asarray(packed), part, (4, 8)))
        np.testing.assert_array_equal(back, np.where(full[rows], split[k], 0))


def test_micro_batches_are_padded_to_one_row_count():
    # Micro-batch 0 (rows 0, 2) needs 2 rows (8 + 8 tokens); micro-batch 1 (rows 1, 3) one.
    prompt, completion = masks([3, 1, 3, 1], [5, 1, 5, 1])
    plan = plan_micro_batches(prompt, completion, micro_batches=2, shards=1)
    assert plan.source.shape == (2, 1, 2, 8)
    segments = np.asarray(plan.segment_ids)
    assert (segments[0, 0].max(axis=-1) == [1, 1]).all()  # one sequence a row
    assert segments[1, 0, 0].max() == 2 and not segments[1, 0, 1].any()  # both in row 0
    assert (np.asarray(plan.source)[1, 0, 1] == -1).all()


def test_bad_micro_batching_is_named():
    prompt, completion = masks([1] * 6, [1] * 6)
    with pytest.raises(ValueError, match="micro_batches=4 to divide the batch's 6 rows"):
        plan_micro_batches(prompt, completion, micro_batches=4, shards=1)
    with pytest.raises(ValueError, match="that 2 batch shards divide"):
        plan_micro_batches(prompt, completion, micro_batches=2, shards=2)
    plan = plan_micro_batches(prompt, completion, micro_batches=2, shards=1)
    with pytest.raises(ValueError, match="2 micro-batch plans; the step runs 3"):
        packed_micro_batch_count(plan, 3, 3)


def test_the_plan_decides_the_micro_batches_of_a_budget():
    assert packed_micro_batch_count(None, TokenBudget(64), 4) == 4  # padded: its own count
    plan = plan_micro_batches(*masks([1] * 6, [1] * 6), micro_batches=2, shards=1)
    assert packed_micro_batch_count(plan, TokenBudget(64), 6) == 2


def test_a_token_budget_counts_packed_rows():
    # 8 sequences of 5 tokens in rows of 8 slots: one a row whatever K. Padded, a budget of 16
    # positions (2 rows) needs K = 4; packed, the same.
    prompt, completion = masks([2] * 8, [3] * 8)
    assert plan_by_budget(prompt, completion, tokens=16, minimum=1, shards=1).source.shape[:3] == (
        4,
        1,
        2,
    )
    # 8 sequences of 2 tokens: 4 fit a row, so one micro-batch of 2 packed rows fits 16.
    prompt, completion = masks([1] * 8, [1] * 8)
    plan = plan_by_budget(prompt, completion, tokens=16, minimum=1, shards=1)
    assert plan.source.shape[:3] == (1, 1, 2)
    # The floor holds, and a budget no count meets takes the most micro-batches.
    assert plan_by_budget(prompt, completion, tokens=16, minimum=2, shards=1).source.shape[0] == 2
    wide = masks([3] * 8, [5] * 8)
    assert plan_by_budget(*wide, tokens=1, minimum=1, shards=2).source.shape[:2] == (4, 2)


def test_auto_packs_long_tailed_batches_only():
    # 8 rows of 8 slots: four 2-token sequences fit one row -> 2 of 8 rows.
    short = plan_micro_batches(*masks([1] * 8, [1] * 8), micro_batches=1, shards=1)
    full = plan_micro_batches(*masks([3] * 8, [5] * 8), micro_batches=1, shards=1)
    assert short.source.shape[2] == 2 and full.source.shape[2] == 8
    assert worth_packing(short, 8, "auto") and not worth_packing(full, 8, "auto")
    assert worth_packing(full, 8, "on") and not worth_packing(short, 8, "off")


@pytest.mark.parametrize(("value", "mode"), [(True, "on"), (False, "off"), ("auto", "auto")])
def test_yaml_on_and_off_are_modes(value, mode):
    assert packing_mode(value) == mode


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="trainer.packing must be one of auto, on, off"):
        packing_mode("sometimes")
