"""The continuous engine's paged KV cache (``sampling.paging``): hand-counted block tables,
prompt blocks shared by a prompt's samples, preemption that recomputes the same tokens, the
same completions as the contiguous cache, and bad sizes refused by name."""

import dataclasses
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import init_params
from jaxrl_llm.sampling import SamplingOptions
from jaxrl_llm.sampling.engine import Engine, EngineSettings, Request, generate_requests
from jaxrl_llm.sampling.paging import BlockAllocator, blocks_for
from tests.sampling.test_engine import CONFIG, PAD


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, jax.random.key(0), dtype=jnp.float32)


def _grouped(rng, lengths, group, budgets):
    """``group`` requests per prompt (one prompt key each), budgets cycled."""
    out = []
    for key, n in enumerate(lengths):
        prompt = rng.integers(3, CONFIG.vocab_size, size=n).astype(np.int32)
        out += [
            Request(prompt, budgets[(key * group + g) % len(budgets)], key) for g in range(group)
        ]
    return out


def test_allocator_tables_by_hand():
    # Pool of 10 blocks of 4; prompts up to 8 and completions up to 6 tokens: 4 blocks a row.
    pager = BlockAllocator(10, 4, slots=3, prompt_width=8, max_new_tokens=6)
    unmapped = 10
    assert blocks_for(5, 4) == 2 and blocks_for(4, 4) == 1 and blocks_for(0, 4) == 0
    assert pager.table.shape == (3, 4)
    # A 6-token prompt, packed from slot 0: one full block (shared) and its partial second
    # block, the slot's own, where the completion goes on.
    assert pager.admission_cost(0, ("key", 0), 6, set()) == 2
    assert pager.admit(0, ("key", 0), 6) == [0, 1, unmapped, unmapped]
    np.testing.assert_array_equal(pager.table[0], [0, 1, unmapped, unmapped])
    # A second sample of the same prompt shares block 0 and writes only its own copy of the
    # partial block.
    assert pager.admission_cost(1, ("key", 0), 6, set()) == 1
    assert pager.admission_cost(1, ("key", 1), 6, {(0, ("key", 1))}) == 1  # pending: shared
    assert pager.admit(1, ("key", 0), 6) == [unmapped, 2, unmapped, unmapped]
    np.testing.assert_array_equal(pager.table[1], [0, 2, unmapped, unmapped])
    # An 8-token prompt fills two blocks: its own third block holds no prompt slot.
    assert pager.admit(2, ("key", 1), 8) == [3, 4, unmapped, unmapped]
    np.testing.assert_array_equal(pager.table[2], [3, 4, 5, unmapped])
    assert pager.used == 6 and pager.peak == 6
    # Growth: slot 0's row holds 6 + 2 = 8 slots in its 2 blocks; a third token needs a third.
    assert pager.growth(0, 2) == 0 and pager.growth(0, 3) == 1
    pager.grow(0, 3)
    np.testing.assert_array_equal(pager.table[0], [0, 1, 6, unmapped])
    # Releasing the first sharer keeps the prompt's block; the second frees it.
    pager.release(0)
    (free,) = pager.free
    assert pager.used == 5 and 0 not in free and {1, 6} <= set(free)
    pager.release(1)
    assert 0 in free and pager.used == 3
    np.testing.assert_array_equal(pager.table[0], [unmapped] * 4)
    assert pager.peak == 7
    # The drain keeps slot 2 as slot 0.
    pager.keep([2, 0])
    np.testing.assert_array_equal(pager.table[0], [3, 4, 5, unmapped])
    assert pager.growth(0, 4) == 0 and pager.growth(0, 5) == 1  # its length moved with it
    # Prefill writes as global ids, a power of two of them (the rest write nothing).
    source, dest = pager.prefill_writes([(1, 0, [unmapped, 7, 8, unmapped])])
    assert source.tolist() == [1] and dest.tolist() == [[10, 7, 8, 10]]
    source, dest = pager.prefill_writes([(1, 0, [7, 8, 9, 1]), (0, 1, [unmapped, 9] + [10] * 2)])
    assert source.tolist() == [1, 0] and dest.tolist() == [[7, 8, 9, 1], [10, 9, 10, 10]]
    source, dest = pager.prefill_writes([(0, 0, [1] * 4)] * 3)
    assert source.tolist() == [0] * 4 and dest.tolist() == [[1] * 4] * 3 + [[10] * 4]


def test_burst_mapping_preempts_the_newest_request():
    # 5 blocks of 4; rows of up to 4 + 8 slots (3 blocks).
    pager = BlockAllocator(5, 4, slots=2, prompt_width=4, max_new_tokens=8)
    requests = [Request([5, 6], 8, 0), Request([7, 8, 9], 8, 1), Request([3], 8, 2)]
    queue = deque([0, 1, 2])
    empty = ([None, None], [0, 0], 4)
    assert pager.admissible(requests, queue, [0, 1], empty) == [(0, 0), (1, 1)]  # a block each
    pager.admit(0, (0, ("key", 0)), 2)
    pager.admit(1, (0, ("key", 1)), 3)
    occupant = [0, 1]
    # 3 blocks free, request 2 needs 1, but slot 0's next burst needs 2 and slot 1's 1.
    assert (
        list(queue) == [2] and pager.admissible(requests, queue, [0], (occupant, [3, 0], 4)) == []
    )
    # 4 more tokens: slot 0 (2 + 3 + 4 slots) needs 2 more blocks, slot 1 (3 + 4) one.
    assert pager.map_burst(requests, queue, occupant, [3, 0], steps=4) == []
    assert pager.used == 5
    pager.release(0)  # request 0 finished: its 3 blocks are free
    occupant[0] = None
    assert pager.admissible(requests, queue, [0], (occupant, [0, 4], 4)) == [(2, 0)]
    pager.admit(0, (0, ("key", 2)), 1)
    occupant[0] = 2
    # 8 more tokens: slot 0 (1 + 8 slots) needs 2 more blocks and slot 1 (3 + 8) one, 2 are
    # free: the newest request (request 2, slot 0) goes back to the queue's head and slot 1
    # gets its block.
    evicted = pager.map_burst(requests, queue, occupant, [0, 4], steps=8)
    assert evicted == [0] and list(queue) == [2] and occupant == [None, 1]
    assert pager.used == 3
    np.testing.assert_array_equal(pager.table[0], [5, 5, 5])


def test_admission_keeps_the_live_slots_next_burst_free():
    # 5 blocks; two live requests hold 1 each: request 2 (1 block) fits the 3 free ones unless
    # the live slots' next burst of 4 tokens needs them (slot 0: 2 + 7 slots, 2 more blocks;
    # slot 1: 3 + 4 slots, 1 more); a burst of 1 needs 1 (slot 0's 2 + 4 slots).
    pager = BlockAllocator(5, 4, slots=3, prompt_width=4, max_new_tokens=8)
    requests = [Request([5, 6], 8, 0), Request([7, 8, 9], 8, 1), Request([3], 8, 2)]
    pager.admit(0, "a", 2)
    pager.admit(1, "b", 3)
    occupant = [0, 1, None]
    assert pager.admissible(requests, deque([2]), [2], (occupant, [3, 0], 1)) == [(2, 2)]
    assert pager.admissible(requests, deque([2]), [2], (occupant, [3, 0], 4)) == []


def test_an_admission_provides_for_its_first_burst():
    """A 7-token prompt's own blocks for a burst of 4 are 2 (slots 4..10 of its row), not 1:
    with 2 blocks to spare after the live slot's next burst it waits instead of being admitted
    and preempted by that burst; with bursts of 1 it fits and nothing is preempted."""
    pager = BlockAllocator(5, 4, slots=2, prompt_width=8, max_new_tokens=8)
    requests = [Request([5, 6], 8, 0), Request(list(range(3, 10)), 8, 1)]
    assert pager.admission_cost(1, "b", 7, set(), tokens=4) == 1 + 2
    assert pager.admission_cost(1, "b", 7, set(), tokens=1) == 1 + 1
    pager.admit(0, "a", 2)
    occupant, queue = [0, None], deque()
    assert pager.map_burst(requests, queue, occupant, [0, 0], steps=4) == []  # 2 blocks
    queue.append(1)
    assert pager.admissible(requests, queue, [1], (occupant, [4, 0], 4)) == []
    assert pager.admissible(requests, queue, [1], (occupant, [4, 0], 1)) == [(1, 1)]
    pager.admit(1, "b", 7)
    occupant[1] = 1
    assert pager.map_burst(requests, queue, occupant, [4, 0], steps=1) == []


def test_admission_picks_a_shard_with_room_and_keeps_a_prompts_samples_together():
    """2 batch shards of 5 blocks (4 slots each), blocks of 4 slots, bursts of 1 token."""
    pager = BlockAllocator(10, 4, slots=8, prompt_width=8, max_new_tokens=8, shards=2)
    assert [pager.shard(s) for s in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    # Slots 0, 1 live in shard 0 with 5-token prompts: 2 blocks each, 1 left there (their
    # next token needs none).
    requests = [Request([1] * 5, 8, "a"), Request([2] * 5, 8, "b")]
    pager.admit(0, "a", 5)
    pager.admit(1, "b", 5)
    live = ([0, 1, None, None, None, None, None, None], [0] * 8, 1)
    # Three samples of a 6-token prompt (1 full block shared, 1 of each sample's own), an
    # 8-token prompt (2 full + 1 own) and a 1-token one (1 own).
    requests += [Request(list(range(3, 9)), 4, "p") for _ in range(3)]  # requests 2, 3, 4
    requests += [Request(list(range(1, 9)), 8, "q"), Request([1], 1, "r")]  # 5, 6
    queue = deque([2, 3, 4, 5, 6])
    # Request 2 costs 2: not in shard 0 (1 free) though slot 2 comes first, slot 4 in shard 1
    # (5 free); its samples 3, 4 cost 1 there (the prompt's block is being admitted with them)
    # and 2 in shard 0. Request 5 costs 3: shard 0 has 1 left, shard 1 5 - 2 - 1 - 1 = 1; the
    # admission stops, and request 6 (cost 1) waits behind it: first come, first served.
    got = pager.admissible(requests, queue, [2, 3, 4, 5, 6, 7], live)
    assert got == [(2, 4), (3, 5), (4, 6)]
    assert list(queue) == [5, 6]
    # With room in both shards the cheaper one wins, the earlier free slot on a tie: the
    # second sample joins its prompt in shard 0 though shard 1's slot 4 is listed before it.
    pager = BlockAllocator(10, 4, slots=8, prompt_width=8, max_new_tokens=8, shards=2)
    samples = [Request(list(range(3, 9)), 4, "p") for _ in range(3)]
    got = pager.admissible(samples, deque([0, 1, 2]), [0, 4, 1, 5], ([None] * 8, [0] * 8, 1))
    assert got == [(0, 0), (1, 1), (2, 4)]


def test_batch_shards_have_their_own_blocks():
    """2 batch shards: slots 0-1 use blocks 0-4, slots 2-3 blocks 5-9 (local ids 0-4 in the
    tables); a prompt is shared within a shard only; the drain keeps slots in their shard."""
    pager = BlockAllocator(10, 4, slots=4, prompt_width=4, max_new_tokens=8, shards=2)
    unmapped = 5
    assert [pager.shard(s) for s in range(4)] == [0, 0, 1, 1]
    assert pager.admit(0, "p", 5) == [0, 1, unmapped]
    assert pager.admit(1, "p", 5) == [unmapped, 2, unmapped]  # block 0 shared in shard 0
    assert pager.admit(2, "p", 5) == [0, 1, unmapped]  # shard 1's own copy (local ids)
    np.testing.assert_array_equal(
        pager.table[:3], [[0, 1, unmapped], [0, 2, unmapped], [0, 1, unmapped]]
    )
    assert [len(f) for f in pager.free] == [2, 3] and pager.used == 5
    # Global ids: shard 1's local blocks 0, 1 are blocks 5, 6; unmapped stays dropped (10).
    writes = [(0, 0, [0, 1, unmapped]), (0, 2, [0, 1, unmapped]), (1, 3, [unmapped] * 3)]
    source, dest = pager.prefill_writes(writes)
    assert source.tolist() == [0, 0, 1, 0]
    assert dest.tolist() == [[0, 1, 10], [5, 6, 10], [10, 10, 10], [10, 10, 10]]
    with pytest.raises(ValueError, match="multiples of the mesh's 2 batch shards"):
        BlockAllocator(9, 4, slots=4, prompt_width=4, max_new_tokens=8, shards=2)
    with pytest.raises(ValueError, match=r"kv_blocks=4 \(2 a batch shard\) cannot hold one"):
        BlockAllocator(4, 4, slots=4, prompt_width=4, max_new_tokens=8, shards=2)
    # Shard 0 busy in slots 0, 1 and shard 1 in slot 2: no shrink (2 of 2 a shard busy); with
    # slot 1 done, each shard keeps one slot.
    assert pager.drain([7, 8, 9, None]) is None
    pager.release(1)
    assert pager.drain([7, None, 9, None]) == [0, 2]
    pager.keep([0, 2])
    np.testing.assert_array_equal(pager.table, [[0, 1, unmapped], [0, 1, unmapped]])
    with pytest.raises(ValueError, match="cannot move between batch shards"):
        pager.keep([1, 0])


def test_a_pool_too_small_for_one_request_is_refused(params):
    kw = dict(max_new_tokens=9, max_prompt_len=5, sampling=SamplingOptions(eos_ids=(), pad_id=PAD))

    def engine(**paged):
        return Engine(params, CONFIG, settings=EngineSettings(slots=2, **paged), **kw)

    with pytest.raises(ValueError, match="kv_blocks must be a positive int, got 0"):
        engine(kv_block_size=4, kv_blocks=0)
    # Prompt bucket 8 -> 2 blocks of 4, 9 new tokens -> 3 blocks: 5 needed.
    with pytest.raises(ValueError, match=r"kv_blocks=4 cannot hold one request.*need 5 blocks"):
        engine(kv_block_size=4, kv_blocks=4)
    engine(kv_block_size=4, kv_blocks=5)
    with pytest.raises(ValueError, match="kv_blocks needs kv_block_size"):
        engine(kv_blocks=5)
    with pytest.raises(ValueError, match="kv_block_size must be a positive int"):
        engine(kv_block_size=0)


def test_samples_of_a_prompt_share_its_blocks_and_match_the_contiguous_cache(params, rng):
    """One 5-token prompt, 4 samples of 8 tokens in 4 slots, blocks of 4: the prompt's full
    block once and 3 blocks of its own a sample (the partial prompt block and the completion:
    13 slots a row) = 13 blocks at the peak (16 unshared); the tokens and log-probs are the
    contiguous cache's. The bursts' layers are stacked here (the layout no other test of this
    file decodes); the per-layer layout (the CPU default) is matched against the contiguous
    cache, shared prompt blocks included, by
    ``test_a_small_pool_preempts_and_recomputes_the_same_tokens``."""
    requests = _grouped(rng, [5], 4, [8])
    kw = dict(max_new_tokens=8, sampling=SamplingOptions(eos_ids=(), pad_id=PAD), seed=4)
    settings = EngineSettings(slots=4, decode_layers="stacked")
    want, _ = generate_requests(params, CONFIG, requests, settings=settings, **kw)
    paged = dataclasses.replace(settings, kv_block_size=4)
    got, stats = generate_requests(params, CONFIG, requests, settings=paged, **kw)
    assert stats.peak_blocks == 1 + 4 * 3 and stats.preemptions == 0
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
    assert len({tuple(r.tokens) for r in got}) > 1  # the samples differ


def test_a_small_pool_preempts_and_recomputes_the_same_tokens(params, rng):
    """Refills, EOS, shared prompts and a pool of 7 blocks of 4 for 4 slots (a contiguous
    cache would hold 4 x 7 = 28; one request takes up to 7: a 16-token prompt bucket and 12
    new tokens): requests are preempted and recomputed, and every request's tokens and
    log-probs equal the contiguous cache's."""
    requests = _grouped(rng, [3, 12, 6, 9], 3, [12, 7, 10, 3, 11])
    kw = dict(max_new_tokens=12, sampling=SamplingOptions(eos_ids=(5, 6), pad_id=PAD), seed=9)
    settings = EngineSettings(slots=4, burst=4)
    want, base = generate_requests(params, CONFIG, requests, settings=settings, **kw)
    paged = dataclasses.replace(settings, kv_block_size=4, kv_blocks=7)
    got, stats = generate_requests(params, CONFIG, requests, settings=paged, **kw)
    assert stats.preemptions > 0 and stats.peak_blocks <= 7
    assert stats.tokens == base.tokens
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
        assert a.finish_reason == b.finish_reason


def test_a_static_batch_is_admitted_for_its_whole_run(params, rng):
    """The static engine runs a batch to its end, so an admission provides blocks for every
    request's whole budget: with 12 blocks of 4 for 4 slots (room for the first bursts of
    4 requests, not for their 12 tokens each), a smaller batch is admitted and nothing is
    preempted; the tokens are the contiguous cache's."""
    requests = _grouped(rng, [3, 6, 5, 4, 7, 2], 1, [12])
    kw = dict(max_new_tokens=12, sampling=SamplingOptions(eos_ids=(), pad_id=PAD), seed=3)
    settings = EngineSettings(slots=4, burst=2, engine="static")
    want, _ = generate_requests(params, CONFIG, requests, settings=settings, **kw)
    paged = dataclasses.replace(settings, kv_block_size=4, kv_blocks=12)
    got, stats = generate_requests(params, CONFIG, requests, settings=paged, **kw)
    assert stats.preemptions == 0 and stats.admissions > 2 and stats.peak_blocks <= 12
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)


def test_block_sizes_that_are_not_powers_of_two(params, rng):
    """Blocks of 6 (the prompt bucket is 8): prompts of a full block and a partial one, of a
    partial one only, and of exactly the bucket sample the contiguous cache's tokens."""
    requests = [Request(rng.integers(3, CONFIG.vocab_size, size=n), 6) for n in (7, 3, 8)]
    kw = dict(max_new_tokens=6, sampling=SamplingOptions(eos_ids=(), pad_id=PAD))
    want, _ = generate_requests(
        params, CONFIG, requests, settings=EngineSettings(slots=2), seed=1, **kw
    )
    paged = EngineSettings(slots=2, kv_block_size=6)
    engine = Engine(params, CONFIG, settings=paged, max_prompt_len=5, **kw)
    assert engine.prompt_width == 8 and engine.paged == (2 * 3, 6)  # 8 + 6 slots: 3 blocks
    got, _ = engine.run(requests, seed=1)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)


class _NewWeightsAfter:
    """``WeightUpdates`` stand-in: version 1's weights from the second poll on."""

    def __init__(self, params):
        self.params, self.calls = params, 0

    def newer(self, version):
        self.calls += 1
        return (1, self.params) if self.calls > 1 and version < 1 else None


def test_prompt_blocks_are_shared_within_a_weight_version(params):
    """Partial rollouts: a sample admitted after a weight update attends to its prompt's keys
    and values computed by the new weights, not to a live sharer's old ones (3 samples of one
    prompt in 2 slots, greedy: the third's tokens are the contiguous cache's)."""
    other = init_params(CONFIG, jax.random.key(7), dtype=jnp.float32)
    prompt = np.arange(3, 10, dtype=np.int32)
    requests = [Request(prompt, 2, 0), Request(prompt, 8, 0), Request(prompt, 4, 0)]
    greedy = SamplingOptions(eos_ids=(), pad_id=PAD, temperature=0.0)
    kw = dict(max_new_tokens=8, max_prompt_len=7, sampling=greedy)
    runs = []
    for size in (None, 4):
        settings = EngineSettings(slots=2, burst=2, kv_block_size=size)
        engine = Engine(params, CONFIG, settings=settings, **kw)
        runs.append(engine.run(requests, updates=_NewWeightsAfter(other))[0])
    assert runs[0][2].versions.tolist() == [1] * 4  # admitted after the update
    for a, b in zip(*runs, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)


def test_the_engine_decodes_through_the_paged_kernel(params, rng, monkeypatch):
    """The engine's rows are packed from slot 0, what JAX's TPU paged-attention kernel reads
    (its interpreter here, with a bf16 pool): shared prompt blocks, partial blocks of their own,
    refills and a preemption give the gather's greedy tokens and its log-probs to 1e-3 (2e-4
    apart here; a row with a masked hole, which the gather skips and the kernel reads, is
    3e-3 to 2e-2 apart)."""
    from jaxrl_llm.models import kv_cache

    # An 8-token prompt (its bucket) whose samples run to their limit of 8: a row ends at slot
    # 16 = the table's 4 blocks of 4 (a finished row's length past its table is clamped: see
    # test_the_paged_kernel_attends_over_each_rows_first_slots); two such rows need 2 + 2 x 2
    # blocks: one is preempted.
    requests = _grouped(rng, [8, 3], 2, [8])
    kw = dict(
        settings=EngineSettings(
            slots=2, burst=2, decode_layers="per_layer", kv_block_size=4, kv_blocks=4
        ),
        max_new_tokens=8,
        sampling=SamplingOptions(eos_ids=(), pad_id=PAD, temperature=0.0),
        cache_dtype=jnp.bfloat16,
    )
    runs = []
    # The choice is made while tracing: the kernel's run gets programs of its own through a
    # config that differs in a field the model does not read.
    configs = {"gather": CONFIG, "kernel": dataclasses.replace(CONFIG, eos_token_ids=(1,))}
    for implementation, config in configs.items():
        monkeypatch.setattr(
            kv_cache,
            "paged_attention_implementation",
            lambda seq, *_, name=implementation: name if seq == 1 else "gather",
        )
        runs.append(generate_requests(params, config, requests, **kw))
    (want, base), (got, stats) = runs
    assert stats.preemptions == base.preemptions > 0
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-3)
