"""The sampler's serving layout (issue 13, item 1) on the 8 fake CPU devices (tests/conftest.py).

Hand-checked: which tensor sizes a model admits and which one ``auto`` picks for a memory
budget. On the mesh: the reshard is one on-device program (it runs with every host transfer
disallowed), gives the compute-dtype weights on the serving mesh, the serving layout's decode
gathers no weights (the trainer layout's gathers them all), and greedy decoding on it gives
the same tokens as on the trainer's layout. Deviceless TPU (with libtpu): the decode program
holds a second KV cache, which ``auto`` budgets there.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm.models import ModelConfig, logical_axes, param_shapes
from jaxrl_llm.parallel import PARAM_RULES, logical_to_sharding, make_mesh
from jaxrl_llm.plan import hlo as hlo_lib
from jaxrl_llm.plan.topology import get_devices, libtpu_available, resolve_topology
from jaxrl_llm.sampling import SamplingOptions, SamplingParams, generate, serving
from tests.sampling import SHARDED_QWEN2, random_params

gen = importlib.import_module("jaxrl_llm.sampling.generate")

MODELS = pathlib.Path(__file__).resolve().parents[2] / "configs" / "models"
GiB = 2**30

CONFIG = SHARDED_QWEN2


def _qwen7b() -> ModelConfig:
    raw = json.loads((MODELS / "qwen2.5-7b.json").read_text())
    return dataclasses.replace(ModelConfig.from_hf_dict(raw), compute_dtype="bfloat16")


def test_tensor_sizes_divide_devices_and_every_split_dim():
    config = _qwen7b()  # 28 heads, 4 kv-heads, MLP 18944, vocab 152064
    assert serving.tensor_sizes(config, 16) == [1, 2, 4]
    assert serving.tensor_sizes(config, 8) == [1, 2, 4]
    assert serving.tensor_sizes(CONFIG, 8) == [1, 2]
    assert serving.tensor_sizes(CONFIG, 3) == [1]
    # A mixture of experts splits each expert's width (and the shared expert's), not the
    # dense width it does not have.
    moe = dataclasses.replace(
        config,
        architecture="Qwen2MoeForCausalLM",
        intermediate_size=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=12,
    )
    assert serving.tensor_sizes(moe, 16) == [1, 2, 4]
    odd = dataclasses.replace(moe, moe_intermediate_size=6)
    assert serving.tensor_sizes(odd, 16) == [1, 2]


def test_weight_and_cache_bytes_by_hand():
    # CONFIG: embed 64x32, lm_head 32x64 (untied), final norm 32; per layer: wq/wk/wv/wo
    # 32*4*8 + 2*32*2*8 + 4*8*32 = 3072, biases 32 + 2*16 = 64, norms 2*32, MLP 3*32*64.
    per_layer = 1024 + 512 + 512 + 1024 + 32 + 16 + 16 + 64 + 3 * 2048
    total = 64 * 32 + (0 if CONFIG.tie_word_embeddings else 32 * 64) + 32 + 2 * per_layer
    assert serving.weight_bytes(CONFIG, jnp.bfloat16) == 2 * total
    # 2 (k, v) x 2 layers x 2 kv-heads x 8 dims x 2 bytes per token.
    assert serving.cache_bytes(CONFIG, rows=3, slots=5, dtype=jnp.bfloat16) == 15 * 128


def test_auto_picks_the_largest_tensor_size_in_a_host_that_fits():
    config = _qwen7b()
    weights = serving.weight_bytes(config, jnp.bfloat16)
    assert 14 * GiB < weights < 15 * GiB  # 7.6B parameters in bf16
    cache = serving.cache_bytes(config, 256, 1536, jnp.bfloat16) / 16
    args = dict(devices=16, rows=(32, 256), kv_rows=256, kv_slots=1536, dtype=jnp.bfloat16)

    def choose(local, budget, **kw):
        return serving.choose_tensor(
            config, local_devices=local, budget_bytes=budget, **{**args, **kw}
        )

    assert choose(4, None) == 4  # 4 chips a host (v5litepod-16): 28 heads allow 1, 2, 4
    assert choose(16, None) == 4
    assert choose(2, None) == 2
    assert choose(1, None) == 1
    assert choose(2, weights / 2 + cache) == 2
    assert choose(2, weights / 2 + cache - 1) == 4  # across hosts when a host's is too big
    assert choose(1, weights + cache - 1) == 2
    assert choose(4, weights / 4 + cache - 1) is None
    # A decode program holding the cache twice (XLA:TPU's relayout) needs room for both.
    assert choose(2, weights / 2 + cache, cache_copies=2) == 4
    assert choose(4, weights / 4 + 2 * cache, cache_copies=2) == 4
    assert choose(4, weights / 4 + 2 * cache - 1, cache_copies=2) is None
    # 16 batch shards do not divide 8 prompts: t = 1 does not qualify.
    assert choose(1, None, rows=(8, 64)) == 2


@pytest.fixture(scope="module")
def meshes():
    if jax.device_count() < 8:
        pytest.skip("needs the 8 fake CPU devices set up by tests/conftest.py")
    params = random_params(CONFIG)
    mesh = make_mesh(data=1, fsdp=8, tensor=1)
    shardings = logical_to_sharding(logical_axes(CONFIG), mesh, PARAM_RULES, shapes=params)
    return CONFIG, params, jax.device_put(params, shardings), mesh


def test_serving_mesh_keeps_the_devices_and_their_order(meshes):
    _, _, _, mesh = meshes
    smesh = serving.serving_mesh(mesh, 2)
    assert dict(smesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    assert list(smesh.devices.flat) == list(mesh.devices.flat)
    with pytest.raises(ValueError, match="does not divide 8 devices"):
        serving.serving_mesh(mesh, 3)


def test_bad_choices_are_refused_by_name(meshes):
    config, _, _, mesh = meshes
    with pytest.raises(ValueError, match="'auto', 'trainer' or a positive int"):
        serving.serving_layout(config, mesh, tensor="tp")
    with pytest.raises(
        ValueError, match=r"tensor_parallel=4 must divide .* sizes that do: \[1, 2\]"
    ):
        serving.serving_layout(config, mesh, tensor=4)
    with pytest.raises(
        ValueError, match="8 batch shards, which do not divide the rollout's 4 rows"
    ):
        serving.serving_layout(config, mesh, tensor=1, rows=(4, 16))


@pytest.mark.skipif(not libtpu_available(), reason="needs libtpu (pip install 'jax[tpu]')")
def test_tpu_decode_holds_the_cache_twice_and_auto_budgets_both():
    """XLA:TPU relays the stacked cache out slot-major inside the decode loop, so the decode
    program's temporaries hold a second cache (``DECODE_CACHE_COPIES``); ``auto`` on TPU
    chips budgets both copies where the same budget on CPU devices budgets one."""
    config = dataclasses.replace(
        ModelConfig.from_hf_dict(json.loads((MODELS / "qwen3-0.6b.json").read_text())),
        num_hidden_layers=2,
        vocab_size=1024,
        tie_word_embeddings=True,
        compute_dtype="bfloat16",
    )
    devices = get_devices(resolve_topology("v5p-16"))  # 8 chips, 4 a host
    one = Mesh(np.array(devices[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    rep = NamedSharding(one, PartitionSpec())
    params = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=rep), param_shapes(config)
    )
    rows, prompt, new = 32, 64, 2048  # a 277 MB cache against 62 MB of bf16 weights
    kw = dict(config=config, max_new_tokens=new, num_samples=1, cache_dtype=jnp.bfloat16, mesh=one)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)  # noqa: E731
    with jax.set_mesh(one):
        state = jax.eval_shape(
            lambda *a: gen.prefill_program(*a, **kw),
            params,
            spec((rows, prompt), jnp.int32),
            spec((rows, prompt), bool),
            spec((), jnp.int32),
        )
        state = jax.tree.map(lambda s: spec(s.shape, s.dtype), state)
        sampling = SamplingParams(
            temperature=spec((), jnp.float32),
            top_p=spec((), jnp.float32),
            min_p=spec((), jnp.float32),
            eos_ids=spec((4,), jnp.int32),
            pad_id=spec((), jnp.int32),
        )
        decode = gen.decode_program.lower(
            params,
            state,
            spec((2,), jnp.uint32),
            sampling,
            config=config,
            top_k=0,
            mesh=one,
            unroll=False,
        ).compile()
    cache = serving.cache_bytes(config, rows, prompt + new, jnp.bfloat16)
    assert cache == sum(x.size * x.dtype.itemsize for x in (state.cache.k, state.cache.v))
    copies = serving.DECODE_CACHE_COPIES["tpu"]
    temp = decode.memory_analysis().temp_size_in_bytes
    assert (copies - 1) * cache <= temp < copies * cache, (temp, cache)

    # On 8 chips (fsdp) a budget for one cache copy at t = 4 fits t = 4 on CPU, not on TPU.
    big = _qwen7b()
    weights = serving.weight_bytes(big, jnp.bfloat16)
    kv = serving.cache_bytes(big, 64, 2048, jnp.bfloat16) / 8
    budget = weights / 4 + kv
    args = dict(tensor="auto", rows=(64,), kv_rows=64, kv_slots=2048, budget_bytes=budget)
    tpu = Mesh(np.array(devices).reshape(1, 8, 1), ("data", "fsdp", "tensor"))
    cpu = make_mesh(data=1, fsdp=8, tensor=1)
    assert serving.serving_layout(big, cpu, **args).tensor == 4
    assert serving.serving_layout(big, tpu, **args).is_trainer_layout  # nothing fits twice


def test_a_mesh_already_shaped_for_serving_is_used_as_it_is(meshes):
    config, _, _, mesh = meshes
    dp = make_mesh(data=4, fsdp=1, tensor=2)
    assert serving.serving_layout(config, dp, tensor="auto", rows=(8,)).mesh is dp
    layout = serving.serving_layout(config, mesh, tensor="trainer")
    assert layout.is_trainer_layout and layout.mesh is mesh


def test_a_context_parallel_mesh_is_not_a_serving_layout(meshes):
    """``mesh.fsdp=1 mesh.sequence=4``: the weights are split over the sequence axis (one
    more FSDP axis), so ``auto`` serves on a layout of its own rather than gathering them
    every token."""
    config, _, _, _ = meshes
    mesh = make_mesh(data=1, fsdp=1, sequence=4, tensor=2)
    layout = serving.serving_layout(config, mesh, tensor="auto", rows=(8,))
    assert not layout.is_trainer_layout
    assert "sequence" not in layout.mesh.axis_names


def test_reshard_runs_on_device_into_the_serving_layout(meshes):
    config, params, sharded, mesh = meshes
    config = dataclasses.replace(config, compute_dtype="bfloat16")
    layout = serving.serving_layout(config, mesh, tensor=2, rows=(4, 8))
    assert not layout.is_trainer_layout
    reshard = serving.make_reshard(config, layout)
    reshard(sharded)  # compile outside the guard
    with jax.transfer_guard("disallow_explicit"):  # any host round trip raises
        out = reshard(sharded)
    for got, want, shard in zip(
        jax.tree.leaves(out), jax.tree.leaves(params), jax.tree.leaves(layout.shardings)
    ):
        assert got.dtype == jnp.bfloat16
        assert got.sharding.is_equivalent_to(shard, got.ndim)
        np.testing.assert_array_equal(
            np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.bfloat16), np.float32)
        )
    wq = out["layers"]["wq"]  # [L, embed, heads, head_dim]: heads over tensor, embed whole
    assert wq.sharding.shard_shape(wq.shape) == (2, 32, 2, 8)


def test_reshard_moves_one_layer_at_a_time(meshes):
    """The stacked layers move a layer per scan step: the program's temporaries hold about one
    layer gathered, not the stack (the 7B fsdp=16 plan's reshard was 4.2 GiB of them)."""
    config, _, _, mesh = meshes
    config = dataclasses.replace(
        config, compute_dtype="bfloat16", num_hidden_layers=32, vocab_size=16
    )
    params = random_params(config)
    sharded = jax.device_put(
        params, logical_to_sharding(logical_axes(config), mesh, PARAM_RULES, shapes=params)
    )
    layout = serving.serving_layout(config, mesh, tensor=2, rows=(4, 8))
    compiled = serving.make_reshard(config, layout).lower(sharded).compile()
    whole = (
        jax.jit(lambda tree: serving.cast_params(tree, config), out_shardings=layout.shardings)
        .lower(sharded)
        .compile()
    )  # the same move as one stacked reshard
    temps, stacked = compiled.memory_analysis(), whole.memory_analysis()
    # ... moving no more bytes than the stacked move (an all-to-all within each data group,
    # then a gather over data: not the whole layer gathered on every device first).
    moved = sum(hlo_lib.collective_bytes(compiled.as_text()).values())
    assert moved <= 1.05 * sum(hlo_lib.collective_bytes(whole.as_text()).values())
    layer_bytes = sum(
        int(np.prod(x.shape[1:])) * 2 for x in jax.tree.leaves(params["layers"])
    )  # one layer in bf16, gathered whole
    # Whole-stack gathers would need L = 32 layers' bytes; one in flight (plus the source's
    # bf16 copy, split 8 ways) stays far below. XLA:CPU's stacked move gathers most of it.
    stack = config.num_hidden_layers * layer_bytes
    assert temps.temp_size_in_bytes < stack / 2, (temps.temp_size_in_bytes, stack)
    assert stacked.temp_size_in_bytes > 2 * temps.temp_size_in_bytes


def _decode_collectives(config, params, mesh, prompts, mask):
    with jax.set_mesh(mesh):
        state = gen.prefill(params, config, prompts, mask, max_new_tokens=4, pad_id=0, mesh=mesh)
        sampling = gen.sampling_params(temperature=1.0, eos_ids=(), pad_id=0)
        key = jax.random.key(0)
        lowered = gen.decode_program.lower(
            params, state, key, sampling, config=config, top_k=0, mesh=mesh, unroll=False
        )
    # The whole call: XLA:CPU hoists the trainer layout's gathers out of the loop (once per
    # call, a full gathered copy); on TPU they stay in it (once per token: see tests/plan).
    return hlo_lib.collective_ops(hlo_lib.parse_hlo_module(lowered.compile().as_text()))


def test_serving_decode_gathers_no_weights_per_token(meshes):
    config, params, sharded, mesh = meshes
    prompts = np.arange(1, 33, dtype=np.int32).reshape(8, 4)
    mask = np.ones((8, 4), bool)
    layer_weights = sum(x.nbytes for x in jax.tree.leaves(params["layers"]))

    trainer_ops = _decode_collectives(config, sharded, mesh, prompts, mask)
    gathered = sum(op.total_bytes for op in trainer_ops if op.kind == "all-gather")
    assert gathered >= layer_weights  # the trainer layout gathers every layer

    layout = serving.serving_layout(config, mesh, tensor=2, rows=(8,))
    served = serving.make_reshard(config, layout)(sharded)
    ops = _decode_collectives(config, served, layout.mesh, prompts, mask)
    gathered = sum(op.total_bytes for op in ops if op.kind == "all-gather")
    assert gathered < layer_weights / 20, [(op.kind, op.bytes) for op in ops]


def test_greedy_tokens_on_the_serving_layout_equal_the_trainer_layout(meshes):
    config, _, sharded, mesh = meshes
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, 64, size=(8, 6)).astype(np.int32)
    mask = np.ones((8, 6), bool)
    mask[1, :3] = False
    greedy = SamplingOptions(eos_ids=(), pad_id=0, temperature=0.0)
    kwargs = dict(key=jax.random.key(1), max_new_tokens=6, sampling=greedy)
    want = generate(sharded, config, prompts, mask, mesh=mesh, **kwargs)
    layout = serving.serving_layout(config, mesh, tensor=2, rows=(8,))
    served = serving.make_reshard(config, layout)(sharded)
    got = generate(served, config, prompts, mask, mesh=layout.mesh, **kwargs)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5)
