"""Sequence packing: the first-fit-decreasing planner (hand-checked and brute-force optimal
bins), the per-shard layout, bucketing, ``pack`` / ``unpack`` against NumPy, the balanced row
layout (hand-checked, its longest-first bound), and errors."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.packing import (
    PackingPlan,
    balance_rows,
    bucket_rows,
    first_fit_decreasing,
    pack,
    plan_packing,
    plan_sequences,
    sequence_mask,
    unpack,
)


def _masks(prompt_lengths, completion_lengths, prompt_width, completion_width):
    prompt_lengths, completion_lengths = np.asarray(prompt_lengths), np.asarray(completion_lengths)
    prompt = np.arange(prompt_width)[None] >= prompt_width - prompt_lengths[:, None]
    completion = np.arange(completion_width)[None] < completion_lengths[:, None]
    return prompt, completion


def test_first_fit_decreasing_hand_checked():
    # Sorted: 5(0) 4(1) 3(2) 3(3) 2(4) 2(5) 1(6), capacity 8. 5 -> bin0; 4 does not fit bin0
    # (9) -> bin1; 3 -> bin0 (8, full); 3 -> bin1 (7); 2 -> bin2; 2 -> bin2 (4); 1 -> bin1 (8).
    bins = first_fit_decreasing([5, 4, 3, 3, 2, 2, 1], 8)
    assert bins == [[0, 2], [1, 3, 6], [4, 5]]
    # Ties keep the lower index first; zero-length items take no bin.
    assert first_fit_decreasing([2, 0, 2, 3], 4) == [[3], [0, 2]]
    assert first_fit_decreasing([0, 0], 4) == []


def _optimal_bins(lengths, capacity):
    """The fewest bins of ``capacity`` holding ``lengths``: brute force over assignments."""
    items = [n for n in lengths if n > 0]
    for count in range(1, len(items) + 1):
        for assignment in itertools.product(range(count), repeat=len(items)):
            loads = np.zeros(count, int)
            np.add.at(loads, list(assignment), items)
            if loads.max() <= capacity:
                return count
    return 0


def test_first_fit_decreasing_against_brute_force(rng):
    for _ in range(40):
        capacity = int(rng.integers(4, 12))
        lengths = rng.integers(0, capacity + 1, int(rng.integers(1, 7))).tolist()
        bins = first_fit_decreasing(lengths, capacity)
        placed = sorted(i for b in bins for i in b)
        assert placed == [i for i, n in enumerate(lengths) if n > 0]  # each item exactly once
        assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
        optimal = _optimal_bins(lengths, capacity)
        # FFD's bound (Dosa 2007): FFD <= 11/9 OPT + 6/9.
        assert optimal <= len(bins) <= 11 / 9 * optimal + 6 / 9
        # First fit: no item could have gone in an earlier bin when it was placed (items are
        # placed by decreasing length, so replay the loads in that order).
        order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (-lengths[i], i))
        where = {i: k for k, b in enumerate(bins) for i in b}
        loads = [0] * len(bins)
        for i in order:
            assert all(loads[k] + lengths[i] > capacity for k in range(where[i]))
            loads[where[i]] += lengths[i]


def test_plan_layout_hand_checked():
    # B=4, S=6, two shards of two rows. Shard 0: lengths 4 (row 0, slots 1..4) and 2 (row 1,
    # slots 0..1) -> one packed row [row0 x4, row1 x2]. Shard 1: 6 (row 2) and 3 (row 3)
    # -> two packed rows.
    mask = np.array(
        [
            [0, 1, 1, 1, 1, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 1],
            [0, 0, 0, 1, 1, 1],
        ],
        bool,
    )
    plan = plan_packing(mask, shards=2)
    assert isinstance(plan, PackingPlan)
    assert plan.source.shape == (2, 2, 6) and (plan.shards, plan.rows) == (2, 4)
    np.testing.assert_array_equal(plan.source[0, 0], [1, 2, 3, 4, 6, 7])
    np.testing.assert_array_equal(plan.segment_ids[0, 0], [1, 1, 1, 1, 2, 2])
    np.testing.assert_array_equal(plan.positions[0, 0], [0, 1, 2, 3, 0, 1])
    np.testing.assert_array_equal(plan.segment_ids[0, 1], [0] * 6)  # bucket padding row
    np.testing.assert_array_equal(plan.source[0, 1], [-1] * 6)
    np.testing.assert_array_equal(plan.source[1, 0], np.arange(12, 18))
    np.testing.assert_array_equal(plan.source[1, 1], [21, 22, 23, -1, -1, -1])
    np.testing.assert_array_equal(plan.positions[1, 1], [0, 1, 2, 0, 0, 0])
    np.testing.assert_array_equal(plan.flat("segment_ids")[3], [1, 1, 1, 0, 0, 0])


def test_plan_properties_random(rng):
    batch, width, shards = 16, 20, 4
    lengths = rng.integers(0, width + 1, batch)
    first = rng.integers(0, width - lengths + 1)
    slots = np.arange(width)[None]
    mask = (slots >= first[:, None]) & (slots < (first + lengths)[:, None])
    plan = plan_packing(mask, shards=shards)
    per_shard = batch // shards
    seen = []
    for d in range(shards):
        src = plan.source[d][plan.segment_ids[d] > 0]
        rows = src // width
        # Per shard: a shard's packed rows hold only its own padded rows' tokens.
        assert ((rows >= d * per_shard) & (rows < (d + 1) * per_shard)).all()
        seen.extend(src.tolist())
        for r in range(plan.source.shape[1]):
            seg = plan.segment_ids[d, r]
            real = seg > 0
            # Segments are contiguous, numbered 1.. from the row start, padding at the end.
            assert (np.diff(seg[real]) >= 0).all() and (seg[real][:1] <= 1).all()
            assert not (real[1:] & ~real[:-1]).any()
            for k in np.unique(seg[real]):
                idx = np.flatnonzero(seg == k)
                np.testing.assert_array_equal(plan.positions[d, r, idx], np.arange(len(idx)))
                # One padded row per segment, its tokens in order.
                s = plan.source[d, r, idx]
                assert len(np.unique(s // width)) == 1 and (np.diff(s) == 1).all()
    # Every real token appears exactly once.
    assert sorted(seen) == sorted(np.flatnonzero(mask.reshape(-1)).tolist())


def test_bucketing():
    got = [bucket_rows(n, 64) for n in (0, 1, 2, 3, 4, 5, 7, 8, 9, 11, 13, 16, 17, 33, 50)]
    assert got == [1, 1, 2, 3, 4, 5, 7, 8, 10, 12, 14, 16, 20, 40, 56]
    assert bucket_rows(9, 9) == 9  # capped at the shard's rows
    assert bucket_rows(3, 16, buckets=(2, 6, 12)) == 6
    assert bucket_rows(13, 16, buckets=(2, 6, 12)) == 16
    # Rows per shard: the largest shard's bins, bucketed. Shard 0 needs 3 rows, shard 1 one.
    mask = np.zeros((8, 4), bool)
    mask[:3, :3] = True
    mask[4:, :1] = True
    plan = plan_packing(mask, shards=2)
    assert plan.source.shape == (2, 3, 4)
    assert plan_packing(mask, shards=2, buckets=(2, 4)).source.shape == (2, 4, 4)
    # Many short rows: fewer packed rows than padded ones (16 x 5 tokens, 6 per 32-wide row).
    short = np.zeros((16, 32), bool)
    short[:, :5] = True
    assert plan_packing(short).source.shape == (1, 3, 32)


def test_pack_unpack_against_numpy(rng):
    prompt, completion = _masks([3, 1, 4, 2, 4, 1], [5, 0, 2, 6, 1, 3], 4, 6)
    mask = sequence_mask(prompt, completion)
    plan = plan_sequences(prompt, completion, shards=2)
    x = rng.normal(size=(6, 10, 3)).astype(np.float32)
    packed = np.asarray(jax.jit(pack)(x, plan))
    want = np.zeros((plan.rows, 10, 3), np.float32)
    for r, row in enumerate(plan.flat("source")):
        for w, s in enumerate(row):
            if s >= 0:
                want[r, w] = x.reshape(60, 3)[s]
    np.testing.assert_array_equal(packed, want)
    back = np.asarray(jax.jit(unpack, static_argnums=2)(packed, plan, (6, 10)))
    np.testing.assert_array_equal(back, np.where(mask[..., None], x, 0.0))
    # Gradients: d sum(w * pack(x)) / dx = unpack(w), and the other way round.
    w = rng.normal(size=packed.shape).astype(np.float32)
    grad = jax.grad(lambda x: jnp.sum(pack(x, plan) * w))(x)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(unpack(w, plan, (6, 10))))
    grad = jax.grad(lambda y: jnp.sum(unpack(y, plan, (6, 10)) * x))(jnp.asarray(packed))
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(pack(x, plan)))
    # Integer arrays and [B, S] arrays too.
    tokens = rng.integers(1, 100, (6, 10))
    np.testing.assert_array_equal(
        np.asarray(unpack(pack(tokens, plan), plan, (6, 10))), np.where(mask, tokens, 0)
    )


@pytest.mark.needs_devices(2)
def test_pack_under_a_mesh_stays_per_shard(rng):
    """With the batch sharded, pack / unpack are per-shard gathers: no collective."""
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    prompt, completion = _masks([3, 1, 4, 2], [5, 0, 2, 6], 4, 6)
    plan = plan_sequences(prompt, completion, shards=2)
    x = rng.normal(size=(4, 10, 8)).astype(np.float32)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    plan_sharded = PackingPlan(*(jax.device_put(a, rows) for a in plan))
    fn = jax.jit(lambda x, p: unpack(pack(x, p) * 2.0, p, (4, 10)))
    text = fn.lower(jax.device_put(x, rows), plan_sharded).compile().as_text()
    for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute"):
        assert op not in text, op
    got = fn(jax.device_put(x, rows), plan_sharded)
    mask = sequence_mask(prompt, completion)
    np.testing.assert_array_equal(np.asarray(got), np.where(mask[..., None], 2 * x, 0.0))


def test_errors():
    prompt, completion = _masks([2, 1], [1, 2], 3, 3)
    bad_prompt = prompt.copy()
    bad_prompt[0] = [True, False, True]
    with pytest.raises(ValueError, match="prompt_mask row 0 is not left-padded"):
        sequence_mask(bad_prompt, completion)
    bad_completion = completion.copy()
    bad_completion[1] = [True, False, True]
    with pytest.raises(ValueError, match="completion_mask row 1 is not right-padded"):
        plan_sequences(prompt, bad_completion)
    with pytest.raises(ValueError, match="differ in B"):
        sequence_mask(prompt, completion[:1])
    with pytest.raises(ValueError, match="mask row 1 is not one contiguous run"):
        plan_packing(np.array([[1, 1, 0], [1, 0, 1]], bool))
    with pytest.raises(ValueError, match="shards must be a positive int dividing B=2"):
        plan_packing(np.ones((2, 3), bool), shards=3)
    with pytest.raises(ValueError, match=r"mask must be \[B, S\]"):
        plan_packing(np.ones(3, bool))
    with pytest.raises(ValueError, match="exceeds the capacity"):
        first_fit_decreasing([3, 5], 4)
    plan = plan_packing(np.ones((2, 3), bool), shards=2)
    with pytest.raises(ValueError, match="do not divide B=3"):
        pack(np.zeros((3, 3)), plan)
    with pytest.raises(ValueError, match="width 3 is not the batch's S=4"):
        pack(np.zeros((2, 4)), plan)
    with pytest.raises(ValueError, match=r"must be \[R, W, ...\]"):
        unpack(np.zeros((1, 3)), plan, (2, 3))


def _cell_loads(order, lengths, shards, micro):
    """``[shards, micro]`` tokens of each (shard, strided micro-batch) cell of ``order``."""
    lengths = np.asarray(lengths)[np.asarray(order)]
    block = lengths.size // shards
    return np.stack(
        [
            [lengths[d * block + k : (d + 1) * block : micro].sum() for k in range(micro)]
            for d in range(shards)
        ]
    )


def test_balance_rows_hand_checked():
    # Two shards of two rows: 10 and 9 first, each into the emptier shard; 2 joins 9, 1 joins 10
    # (drawn in another order: longest first is the planner's, not the caller's).
    np.testing.assert_array_equal(balance_rows([2, 9, 1, 10], shards=2), [3, 2, 1, 0])
    # Two shards x two strided micro-batches of two rows: cells (0,0) (0,1) (1,0) (1,1) take
    # rows 0..3, then 4..7 in reverse; cell (d, k) sits at positions 4d + k, 4d + k + 2.
    order = balance_rows([8, 7, 6, 5, 4, 3, 2, 1], shards=2, micro_batches=2)
    np.testing.assert_array_equal(order, [0, 1, 7, 6, 2, 3, 5, 4])
    np.testing.assert_array_equal(
        _cell_loads(order, [8, 7, 6, 5, 4, 3, 2, 1], 2, 2), [[9, 9], [9, 9]]
    )


def test_balance_rows_properties_random(rng):
    """A permutation; every cell within one row's length of every other (the longest-first
    bound); a cell's rows longest first."""
    for _ in range(200):
        shards, micro = int(rng.choice([1, 2, 4, 8])), int(rng.choice([1, 2, 4]))
        rows = shards * micro * int(rng.integers(1, 5))
        lengths = (rng.pareto(1.5, size=rows) * 50).astype(int) + 1
        order = balance_rows(lengths, shards=shards, micro_batches=micro)
        assert sorted(order.tolist()) == list(range(rows))
        loads = _cell_loads(order, lengths, shards, micro)
        assert loads.max() - loads.min() <= lengths.max()
        block = rows // shards
        for d in range(shards):
            for k in range(micro):
                cell = lengths[order[d * block + k : (d + 1) * block : micro]]
                assert (np.diff(cell) <= 0).all()


def test_a_balanced_layout_packs_into_fewer_rows():
    """Rows of 6, 6, 3, 3 tokens in rows of 10 on two shards: as drawn, shard 0 holds both 6s
    (two packed rows, so both shards get two); balanced, each shard packs 6 + 3 into one."""
    mask = np.arange(10)[None] < np.array([6, 6, 3, 3])[:, None]
    assert plan_packing(mask, shards=2).source.shape == (2, 2, 10)
    order = balance_rows(mask.sum(axis=1), shards=2)
    assert plan_packing(mask[order], shards=2).source.shape == (2, 1, 10)


def test_balance_rows_errors():
    with pytest.raises(ValueError, match="2 shards x 2 micro-batches do not divide the batch's 6"):
        balance_rows(np.ones(6), shards=2, micro_batches=2)
    with pytest.raises(ValueError, match="shards must be a positive int"):
        balance_rows(np.ones(4), shards=0)
    with pytest.raises(ValueError, match="micro_batches must be a positive int"):
        balance_rows(np.ones(4), micro_batches=True)
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        balance_rows([3, -1])
