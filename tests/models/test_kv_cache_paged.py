"""The paged KV cache (``models.kv_cache.PagedKVCache``): a prefill and decode steps through a
block table, with rows sharing blocks and blocks out of order, give the contiguous cache's
hidden states; writes land in the table's blocks only; bad shapes are refused by name."""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import (
    ModelConfig,
    PagedKVCache,
    forward,
    init_cache,
    init_paged_cache,
    init_params,
)
from jaxrl_llm.models.kv_cache import read_pages, write_pages
from jaxrl_llm.sampling.layout import unstack_cache, unstack_layers

CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=61,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)


def test_write_then_read_pages_is_a_numpy_block_table():
    rng = np.random.default_rng(0)
    pool = np.zeros((2, 5, 4, 3), np.float32)  # K=2, N=5 blocks of P=4 slots, H=3
    table = np.array([[3, 0, 5], [1, 5, 2]], np.int32)  # 5 = unmapped
    new = rng.normal(size=(2, 6, 2, 3)).astype(np.float32)  # [B, S, K, H]
    start = np.array([-2, 2], np.int32)  # row 0: its first two tokens fall before slot 0
    got = np.asarray(write_pages(jnp.asarray(pool), jnp.asarray(new), None, start, table))
    want = pool.copy()
    for b in range(2):
        for s in range(6):
            slot = start[b] + s
            block = table[b, slot // 4] if 0 <= slot and slot // 4 < 3 else 5
            if block < 5:
                want[:, block, slot % 4] = new[b, s]
    np.testing.assert_array_equal(got, want)
    # Stacked over layers: layer 1 gets the same writes, layer 0 none.
    stacked = np.zeros((2, *pool.shape), np.float32)
    layered = write_pages(jnp.asarray(stacked), jnp.asarray(new), jnp.int32(1), start, table)
    np.testing.assert_array_equal(np.asarray(layered), np.stack([pool, want]))
    read = np.asarray(read_pages(jnp.asarray(got), jnp.asarray(table)))
    assert read.shape == (2, 2, 12, 3)  # [K, B, S_max, H]
    for b in range(2):
        for s in range(12):
            block = table[b, s // 4]
            if block < 5:
                np.testing.assert_array_equal(read[:, b, s], got[:, block, s % 4])


@pytest.mark.parametrize("per_layer", [False, True])
def test_paged_prefill_and_decode_match_the_contiguous_cache(per_layer):
    params = init_params(CONFIG, jax.random.key(1), dtype=jnp.float32)
    rng = np.random.default_rng(1)
    batch, prompt, steps, block = 3, 8, 5, 4
    width = prompt + 12  # 5 blocks a row; 13 slots used
    tokens = rng.integers(1, CONFIG.vocab_size, size=(batch, prompt + steps)).astype(np.int32)
    tokens[2, :prompt] = tokens[0, :prompt]  # rows 0 and 2 share a prompt ...
    mask = np.ones((batch, prompt), bool)
    mask[1, :3] = False  # left padding
    dense = init_cache(CONFIG, batch, width, dtype=jnp.float32)
    paged = init_paged_cache(CONFIG, batch, width, blocks=12, block_size=block, dtype=jnp.float32)
    # ... and its two blocks; blocks out of order; each row's unused last block unmapped (12).
    table = np.array([[7, 2, 5, 8, 12], [4, 0, 1, 9, 12], [7, 2, 10, 11, 12]], np.int32)
    paged = paged._replace(table=jnp.asarray(table))
    if per_layer:
        params_used = unstack_layers(params)
        dense, paged = unstack_cache(dense), unstack_cache(paged)
    else:
        params_used = params
    want, dense = forward(
        params_used, CONFIG, tokens[:, :prompt], attention_mask=mask, cache=dense, cache_index=0
    )
    got, paged = forward(
        params_used, CONFIG, tokens[:, :prompt], attention_mask=mask, cache=paged, cache_index=0
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    index = jnp.full((batch,), prompt, jnp.int32)
    position = jnp.asarray(mask.sum(1), jnp.int32)
    for i in range(steps):
        token = jnp.asarray(tokens[:, prompt + i : prompt + i + 1])
        args = dict(positions=(position + i)[:, None], cache_index=index + i)
        want, dense = forward(params_used, CONFIG, token, cache=dense, **args)
        got, paged = forward(params_used, CONFIG, token, cache=paged, **args)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    assert isinstance(paged, PagedKVCache)


def _bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)


def test_the_paged_kernel_attends_over_each_rows_first_slots(monkeypatch):
    """JAX's Pallas TPU paged-attention kernel (its TPU interpreter here), as the model calls
    it: grouped-query heads (4 query heads on 2 key/value heads), rows of 1, 5, 11 and 16 slots
    packed from slot 0 through out-of-order blocks (the last asked for 17: a finished slot's
    stale length, clamped to its table), unmapped entries past a row's length, compute blocks
    of 3 blocks over a table of 4 (padded). The kernel loads the pool as bf16 and computes in
    f32: equal to a float64 softmax over the bf16 keys and values of each row's slots
    [0, min(length, 16))."""
    from jaxrl_llm.models import attention_backends

    # Compute blocks of 3 blocks of 4: the 4-block table is padded to 6.
    monkeypatch.setattr(attention_backends, "_PAGED_COMPUTE_SLOTS", 12)
    rng = np.random.default_rng(3)
    batch, heads, kv_heads, head_dim, size, blocks = 4, 4, 2, 16, 4, 13
    q = rng.normal(size=(batch, heads, head_dim)).astype(np.float32)
    k = rng.normal(size=(kv_heads, blocks, size, head_dim)).astype(np.float32)
    v = rng.normal(size=(kv_heads, blocks, size, head_dim)).astype(np.float32)
    lengths = np.array([1, 5, 11, 17], np.int32)  # 17: a dead row one past its table (16)
    table = np.array([[6, 13, 13, 13], [2, 9, 13, 13], [12, 0, 4, 13], [1, 3, 5, 7]], np.int32)
    scale = 0.3
    got = attention_backends._paged_kernel_attention(
        jnp.asarray(q),
        jnp.asarray(k, jnp.bfloat16),
        jnp.asarray(v, jnp.bfloat16),
        jnp.asarray(lengths),
        jnp.asarray(table),
        scale=scale,
    )
    assert got.shape == (batch, heads, head_dim) and got.dtype == jnp.float32
    kb, vb = _bf16(k), _bf16(v)
    want = np.zeros((batch, heads, head_dim))
    for b in range(batch):
        slots = np.arange(min(lengths[b], 16))
        keys = kb[:, table[b, slots // size], slots % size]  # [K, len, H]
        values = vb[:, table[b, slots // size], slots % size]
        for n in range(heads):
            scores = scale * keys[n // 2] @ q[b, n].astype(np.float64)
            probs = np.exp(scores - scores.max())
            want[b, n] = probs @ values[n // 2] / probs.sum()
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_decode_through_the_paged_kernel_matches_the_gather(monkeypatch):
    """Rows packed from slot 0 (prompts of 8, 3 and 6 tokens, two rows sharing a block), a bf16
    pool stacked over layers (the engine's test runs per-layer pools): 3 decode steps through
    the kernel give the gather's hidden states to bf16 rounding
    (the gather's scores are bf16 products, the kernel's f32: 3e-3 apart here; a length off by
    one is 0.7 apart)."""
    from jaxrl_llm.models import kv_cache

    params = init_params(CONFIG, jax.random.key(1), dtype=jnp.float32)
    rng = np.random.default_rng(1)
    batch, steps = 3, 3
    lengths = np.array([8, 3, 6])
    tokens = rng.integers(1, CONFIG.vocab_size, size=(batch, 8 + steps)).astype(np.int32)
    tokens[2, :4] = tokens[0, :4]  # rows 0 and 2 share their first block (7)
    table = np.array([[7, 2, 5, 8, 12], [4, 0, 1, 9, 12], [7, 10, 11, 3, 12]], np.int32)
    mask = np.arange(8)[None] < lengths[:, None]  # right padding: rows start at slot 0

    def decode(implementation):
        monkeypatch.setattr(
            kv_cache,
            "paged_attention_implementation",
            lambda seq, *_: implementation if seq == 1 else "gather",
        )
        cache = init_paged_cache(CONFIG, batch, 20, blocks=12, block_size=4, dtype=jnp.bfloat16)
        cache = cache._replace(table=jnp.asarray(table))

        def run(cache):
            _, cache = forward(
                params,
                CONFIG,
                jnp.asarray(np.where(mask, tokens[:, :8], 0)),
                positions=jnp.asarray(np.broadcast_to(np.arange(8), (batch, 8))),
                attention_mask=jnp.asarray(mask),
                cache=cache,
                cache_index=0,
            )
            index, out = jnp.asarray(lengths, jnp.int32), []
            for i in range(steps):
                token = jnp.asarray(tokens[:, 8 + i][:, None])
                hidden, cache = forward(
                    params,
                    CONFIG,
                    token,
                    positions=(index + i)[:, None],
                    cache=cache,
                    cache_index=index + i,
                )
                out.append(hidden)
            return jnp.stack(out)

        return np.asarray(jax.jit(run)(cache))  # a new function: the choice is made in tracing

    gathered, kernel = decode("gather"), decode("kernel")
    np.testing.assert_allclose(kernel, gathered, atol=1e-2)
    assert np.abs(gathered).max() > 1  # not vanishing states


def test_a_row_whose_new_token_is_masked_reaches_the_kernel_with_length_0(monkeypatch):
    """Through ``forward`` (the engine's decode step): a row fed a masked token (a finished or
    empty slot) attends over nothing in the kernel, the live row over its slots."""
    from jaxrl_llm.models import attention_backends, kv_cache

    params = init_params(CONFIG, jax.random.key(2), dtype=jnp.float32)
    batch, prompt = 2, 5
    tokens = np.random.default_rng(2).integers(1, CONFIG.vocab_size, (batch, prompt + 1))
    seen = []
    kernel_attention = attention_backends._paged_kernel_attention

    def spy(q, k, v, lengths, table, *, scale):  # under the layer scan: a callback
        jax.debug.callback(lambda x: seen.append(np.asarray(x)), lengths)
        return kernel_attention(q, k, v, lengths, table, scale=scale)

    monkeypatch.setattr(attention_backends, "_paged_kernel_attention", spy)
    monkeypatch.setattr(
        kv_cache,
        "paged_attention_implementation",
        lambda seq, *_: "kernel" if seq == 1 else "gather",
    )
    cache = init_paged_cache(CONFIG, batch, 8, blocks=4, block_size=4, dtype=jnp.bfloat16)
    cache = cache._replace(table=jnp.asarray([[0, 1], [2, 3]], jnp.int32))
    _, cache = forward(params, CONFIG, jnp.asarray(tokens[:, :prompt]), cache=cache, cache_index=0)
    forward(
        params,
        CONFIG,
        jnp.asarray(tokens[:, prompt:]),
        positions=jnp.full((batch, 1), prompt),
        attention_mask=jnp.asarray([[True], [False]]),
        cache=cache,
        cache_index=prompt,
    )
    jax.effects_barrier()
    assert len(seen) == CONFIG.num_hidden_layers
    assert all(list(lengths) == [prompt + 1, 0] for lengths in seen)


def test_a_dead_row_reads_nothing_through_the_kernel(monkeypatch):
    """An engine's finished or empty slot (its newest slot masked out, its blocks released:
    table unmapped) goes to the kernel with length 0, which skips it, also one whose next slot
    lies past its table; a live row's output is the gather's (to bf16 rounding)."""
    from jaxrl_llm.models import attention_backends, kv_cache

    rng = np.random.default_rng(4)
    batch, heads, kv_heads, head_dim, size, blocks, width = 3, 4, 2, 16, 4, 6, 12
    pools = tuple(
        jnp.asarray(rng.normal(size=(kv_heads, blocks, size, head_dim)), jnp.bfloat16)
        for _ in range(2)
    )
    new = tuple(
        jnp.asarray(rng.normal(size=(batch, 1, kv_heads, head_dim)), jnp.float32) for _ in range(2)
    )
    q = jnp.asarray(rng.normal(size=(batch, 1, heads, head_dim)), jnp.float32)
    # Row 0 live at slot 5 (blocks 3, 1); row 1 dead at slot 9 (released: unmapped); row 2
    # dead one past its table (slot 12).
    cache_index = jnp.asarray([5, 9, 12], jnp.int32)
    table = jnp.asarray([[3, 1, 6], [6, 6, 6], [0, 2, 4]], jnp.int32)
    valid = np.zeros((batch, width), bool)
    valid[0, :6] = True  # its prompt and completion so far, and the new token
    valid[2, :12] = True  # a full row
    # The mask the layer builds lets every query see its own slot (dead rows included).
    mask = attention_backends.attention_mask(jnp.asarray(valid), cache_index[:, None])
    seen = []
    kernel_attention = attention_backends._paged_kernel_attention

    def spy(q, k, v, lengths, table, *, scale):
        seen.append(np.asarray(lengths))
        return kernel_attention(q, k, v, lengths, table, scale=scale)

    monkeypatch.setattr(attention_backends, "_paged_kernel_attention", spy)
    out = {}
    for implementation in ("kernel", "gather"):
        monkeypatch.setattr(
            kv_cache, "paged_attention_implementation", lambda *_, i=implementation: i
        )
        _, out[implementation] = kv_cache.paged_cache_attention(
            pools,
            new,
            q,
            mask,
            layer_index=None,
            cache_index=cache_index,
            table=table,
            scale=0.25,
            key_valid=jnp.asarray(valid),
        )
    np.testing.assert_array_equal(seen[0], [6, 0, 0])
    np.testing.assert_allclose(
        np.asarray(out["kernel"][0]), np.asarray(out["gather"][0]), atol=2e-2
    )
    assert np.abs(np.asarray(out["gather"][0])).max() > 0.1


def test_the_kernel_runs_on_both_cores_of_a_megacore_chip():
    """``megacore_mode`` by hand: two-core TPU devices (v4, v5p) split the kernel over the
    key/value heads when they are even, else over the rows, else not; single-core chips and
    other platforms never (the kernel may hang when told of a second core that is not there)."""
    from types import SimpleNamespace

    from jaxrl_llm.models.attention_backends import megacore_mode

    v5p = SimpleNamespace(platform="tpu", device_kind="TPU v5", num_cores=2)
    v5e = SimpleNamespace(platform="tpu", device_kind="TPU v5 lite", num_cores=1)
    assert megacore_mode(v5p, kv_heads=2, batch=3) == "kv_head"
    assert megacore_mode(v5p, kv_heads=1, batch=4) == "batch"
    assert megacore_mode(v5p, kv_heads=3, batch=5) is None
    assert megacore_mode(v5e, kv_heads=2, batch=4) is None
    assert megacore_mode(SimpleNamespace(platform="tpu", num_cores=None), 2, 4) is None
    assert megacore_mode(SimpleNamespace(platform="cpu", num_cores=2), 2, 4) is None


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed")
def test_the_kernel_compiles_for_both_cores_of_a_v5p_chip(monkeypatch):
    """Deviceless AOT compile of the paged kernel on a v5p chip (two TensorCores): it is told
    of the megacore (``kv_head``: 2 key/value heads) and Mosaic compiles it so."""
    from jax.experimental.pallas.ops.tpu import paged_attention as module
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxrl_llm.models import attention_backends
    from tests.models.tpu_mesh import tpu_mesh

    mesh = tpu_mesh(monkeypatch, "v5p:2x2x1", (1, 1, 4))
    modes = []
    kernel = module.paged_attention

    def spy(*args, **kwargs):
        modes.append(kwargs.get("megacore_mode"))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(module, "paged_attention", spy)
    chip = jax.sharding.Mesh(mesh.devices.flat[:1], ("x",))
    one = NamedSharding(chip, PartitionSpec())

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=one)

    args = (
        spec((8, 4, 128), jnp.float32),  # [B, N, H]
        spec((2, 64, 16, 128), jnp.bfloat16),  # [K, blocks, P, H]
        spec((2, 64, 16, 128), jnp.bfloat16),
        spec((8,), jnp.int32),
        spec((8, 8), jnp.int32),
    )
    with jax.set_mesh(chip):
        fn = functools.partial(attention_backends._paged_kernel_attention, scale=0.1)
        compiled = jax.jit(fn).lower(*args).compile()
    assert modes == ["kv_head"] and "tpu_custom_call" in compiled.as_text()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed")
def test_paged_decode_compiles_to_the_kernel_for_tpu(monkeypatch):
    """Deviceless AOT compile for a v5e 2x2 slice (2 batch shards x 2 tensor): one decode step
    of a bf16 paged cache (head_dim 128, blocks of 16) runs the Pallas kernel per device on its
    rows and heads, with no all-gather of the pool and no copy of the rows' blocks (which the
    XLA gather makes)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxrl_llm.models import kv_cache
    from tests.models.tpu_mesh import v5e_2x2_mesh

    mesh = v5e_2x2_mesh(monkeypatch, (1, 2, 2))
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=256,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
    )
    batch, width, size, blocks = 8, 2048, 16, 512
    replicated = NamedSharding(mesh, PartitionSpec())
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0), dtype=jnp.float32))
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), params
    )
    cache = jax.eval_shape(
        lambda: init_paged_cache(
            config, batch, width, blocks=blocks, block_size=size, dtype=jnp.bfloat16
        )
    )
    pool = NamedSharding(mesh, PartitionSpec(None, "tensor", "fsdp"))
    rows = NamedSharding(mesh, PartitionSpec("fsdp"))
    cache = PagedKVCache(
        *(
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
            for x, s in zip(cache, (pool, pool, rows, rows))
        )
    )
    token = jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=rows)
    index = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows)

    def compiled():
        def step(params, token, cache, index):  # a new function: the choice is made in tracing
            return forward(
                params, config, token, positions=index[:, None], cache=cache, cache_index=index
            )

        with jax.set_mesh(mesh):
            return jax.jit(step).lower(params, token, cache, index).compile()

    kernel = compiled()  # the mesh's devices are TPUs: the kernel
    text = kernel.as_text()
    assert "tpu_custom_call" in text
    gathers = [line for line in text.splitlines() if "all-gather(" in line]
    assert not [line for line in gathers if f",{size},128]" in line]  # no pool gathered
    monkeypatch.setattr(kv_cache, "paged_attention_implementation", lambda *_: "gather")
    gather = compiled()
    assert "tpu_custom_call" not in gather.as_text()
    # The gather copies each row's blocks (a chip's 4 rows x 128 blocks of 16 x 128 slots).
    blocks_of_rows = f"bf16[{batch // 2},{width // size},{size},128]"
    assert any(
        blocks_of_rows in line for line in gather.as_text().splitlines() if " gather(" in line
    )
    assert not any(blocks_of_rows in line for line in text.splitlines() if " gather(" in line)
