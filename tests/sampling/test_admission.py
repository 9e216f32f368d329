"""The engine's admissions, host side (``sampling.admission``): which prompts are prefilled and
which are taken from a live slot, by hand — padding, weight versions, and a paged cache's
batch shards (a prompt is reused only in the shard that holds its blocks)."""

import numpy as np

from jaxrl_llm.sampling.admission import admission, holders
from jaxrl_llm.sampling.paging import BlockAllocator
from jaxrl_llm.sampling.requests import Request

P6, P5, P3 = [5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15], [16, 17, 18]


def test_contiguous_admission_by_hand():
    requests = [Request(P6, 4, "a"), Request(P5, 2, "b"), Request(P6, 3, "a"), Request(P3, 1)]
    # Slot 2 holds request 0 (prompt "a", version 0); slots 0, 1, 3 are free.
    occupant = [None, None, 0, None]
    held = holders(requests, occupant, [0, 0, 0, 0])
    arrays, counts = admission(
        requests, [1, 2, 3], [0, 1, 3], held=held, version=0, engine_slots=4, shards=1, pad_id=0
    )
    assert counts == {"prefill_rows": 2, "reused_prompts": 1}
    # Prompts "b" and request 3's prefilled (rows: a power of two), left-
    # padded to the 8-token bucket; request 2 from slot 2.
    assert arrays.prompt_tokens.shape == (2, 8)
    np.testing.assert_array_equal(arrays.prompt_tokens[0], [0, 0, 0, *P5])
    np.testing.assert_array_equal(arrays.prompt_tokens[1], [0] * 5 + P3)
    np.testing.assert_array_equal(arrays.prompt_mask.sum(1), [5, 3])
    # Four entries (3 admitted, one padding to slot 4: dropped).
    np.testing.assert_array_equal(arrays.slot, [0, 1, 3, 4])
    np.testing.assert_array_equal(arrays.source, [4, 2, 4, 4])
    np.testing.assert_array_equal(arrays.owner[[0, 2]], [0, 1])
    np.testing.assert_array_equal(arrays.length[:3], [5, 6, 3])
    np.testing.assert_array_equal(arrays.limit[:3], [2, 3, 1])
    np.testing.assert_array_equal(arrays.request[:3], [1, 2, 3])
    # The holder admitted under version 0; after an update (version 1) "a" is prefilled.
    _, counts = admission(
        requests, [2], [0], held=held, version=1, engine_slots=4, shards=1, pad_id=0
    )
    assert counts == {"prefill_rows": 1, "reused_prompts": 0}
    # Over 4 batch shards the prefill has 4 rows (padding repeats the first prompt).
    arrays, _ = admission(
        requests, [1], [0], held={}, version=0, engine_slots=4, shards=4, pad_id=0
    )
    np.testing.assert_array_equal(arrays.prompt_tokens, [[0, 0, 0, *P5]] * 4)
    # Every request from live slots: nothing to prefill.
    arrays, counts = admission(
        requests, [2], [0], held=held, version=0, engine_slots=4, shards=1, pad_id=0
    )
    assert arrays.prompt_tokens is None and counts == {"prefill_rows": 0, "reused_prompts": 1}


def test_paged_admission_reuses_a_prompt_only_in_its_shard():
    # 2 shards of 2 slots and 8 blocks of 4 slots (local ids 0-7, global = shard * 8 + local).
    pager = BlockAllocator(16, 4, slots=4, prompt_width=8, max_new_tokens=4, shards=2)
    requests = [Request(P6, 4, "a"), Request(P6, 4, "a"), Request(P6, 4, "a")]
    # Request 0 in slot 2 (shard 1): its full block local 0, its partial block local 1.
    first, _ = admission(
        requests, [0], [2], held={}, version=0, engine_slots=4, shards=2, pad_id=0, pager=pager
    )
    np.testing.assert_array_equal(first.dest[1][0], [8, 9, 16])  # global ids; 16: none
    assert first.copies is None
    held = holders(requests, [None, None, 0, None], [0] * 4)
    # Request 1 into slot 3 (shard 1): shares the full block, copies the partial one (global
    # 9) into its own (local 2, global 10); nothing prefilled. Request 2 into slot 0 (shard 0,
    # where "a" has no blocks): prefilled, writing its own two blocks there.
    arrays, counts = admission(
        requests,
        [1, 2],
        [3, 0],
        held=held,
        version=0,
        engine_slots=4,
        shards=2,
        pad_id=0,
        pager=pager,
    )
    assert counts == {"prefill_rows": 1, "reused_prompts": 1}
    np.testing.assert_array_equal(arrays.source, [2, 4])
    np.testing.assert_array_equal(pager.table[3, :2], [0, 2])
    np.testing.assert_array_equal(arrays.copies[0], [9])
    np.testing.assert_array_equal(arrays.copies[1], [10])
    source, dest = arrays.dest
    np.testing.assert_array_equal(source[:1], [0])
    np.testing.assert_array_equal(dest[0], [0, 1, 16])
    np.testing.assert_array_equal(arrays.table, pager.table)
