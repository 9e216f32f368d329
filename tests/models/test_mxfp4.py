"""MXFP4 expert weights (gpt-oss checkpoints' ``*_blocks`` / ``*_scales``): our NumPy
dequantiser against a hand-packed example and transformers' own (``convert_moe_packed_tensors``),
the lazy ``Mxfp4Tensor`` view, and a tiny gpt-oss checkpoint stored in MXFP4 loaded (whole and
sharded over 8 devices) to the weights and logits transformers itself loads from it."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from jaxrl_llm.models import load_pretrained, logits, mxfp4, param_shapes
from tests.models import hf_utils

FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _pack(codes: np.ndarray) -> np.ndarray:
    """E2M1 codes ``[..., G, 32]`` -> bytes ``[..., G, 16]``: value ``2i`` in the low nibble."""
    codes = np.asarray(codes, np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def test_hand_packed_block_dequantises_to_its_floats():
    """Two blocks of known values: block 0 every code once (twice) at scale 2^0, block 1 the
    codes reversed at scale 2^-3 (byte 124); one byte spelled out by hand."""
    codes = np.array([list(range(16)) * 2, list(range(15, -1, -1)) * 2])  # [G=2, 32]
    blocks = _pack(codes)
    assert blocks[0, 0] == 0x10 and blocks[0, 1] == 0x32  # codes (0, 1) and (2, 3)
    scales = np.array([127, 124], np.uint8)
    want = np.concatenate([np.array(FP4 * 2), np.array(FP4[::-1] * 2) / 8.0])
    got = mxfp4.dequantize(blocks, scales)
    np.testing.assert_array_equal(got, want.astype(np.float32))
    assert np.signbit(got[8]) and got.dtype == np.float32
    assert mxfp4.dequantize(blocks, scales, dtype=jnp.bfloat16).dtype == jnp.bfloat16


def test_matches_transformers_dequantiser(rng):
    """Random blocks and scales (exponents 2^-10 .. 2^5) through both dequantisers, in
    transformers' ``[E, in, out]`` layout (our lazy view, read whole and in a block)."""
    blocks = rng.integers(0, 256, size=(3, 40, 4, 16), dtype=np.uint8)  # E, out, G, 16
    scales = rng.integers(117, 133, size=(3, 40, 4), dtype=np.uint8)
    want = convert_moe_packed_tensors(
        torch.as_tensor(blocks), torch.as_tensor(scales), dtype=torch.float32
    ).numpy()
    view = mxfp4.Mxfp4Tensor(blocks, scales, "w")
    assert view.shape == want.shape == (3, 128, 40)
    np.testing.assert_array_equal(view[:, :, :], want)
    part = (slice(1, 3), slice(32, 96), slice(6, 17))
    np.testing.assert_array_equal(view[part], want[part])


@pytest.mark.parametrize(
    "blocks, scales, match",
    [
        (np.zeros((2, 16), np.int8), np.zeros((2,), np.uint8), "must be uint8"),
        (np.zeros((2, 8), np.uint8), np.zeros((2,), np.uint8), r"\[\.\.\., G, 16\]"),
        (np.zeros((2, 16), np.uint8), np.zeros((3,), np.uint8), r"\[\.\.\., G, 16\]"),
    ],
)
def test_bad_blocks_are_named(blocks, scales, match):
    with pytest.raises(ValueError, match=match):
        mxfp4.dequantize(blocks, scales)


def test_bad_pairs_are_named():
    with pytest.raises(ValueError, match="w_blocks must be"):
        mxfp4.Mxfp4Tensor(np.zeros((2, 4, 1, 16), np.uint8), np.zeros((2, 4, 2), np.uint8), "w")
    with pytest.raises(ValueError, match="w_scales must be uint8"):
        mxfp4.Mxfp4Tensor(np.zeros((2, 4, 1, 16), np.uint8), np.zeros((2, 4, 1), np.int32), "w")


@pytest.fixture(scope="module")
def quantised(tmp_path_factory):
    """A tiny gpt-oss checkpoint whose experts are stored in MXFP4 as released ones are, and
    the model transformers loads from it (dequantising on CPU)."""
    path = str(tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    model = hf_utils.build_gpt_oss(seed=90)
    rng = np.random.default_rng(91)
    tensors = {}
    for name, value in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, columns, rows = value.shape  # [E, in, out]
            shape = (experts, rows, columns // 32)
            tensors[name + "_blocks"] = torch.as_tensor(
                rng.integers(0, 256, size=(*shape, 16), dtype=np.uint8)
            )
            tensors[name + "_scales"] = torch.as_tensor(
                rng.integers(122, 126, size=shape, dtype=np.uint8)
            )
        else:
            tensors[name] = value.contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["architectures"] = ["GptOssForCausalLM"]
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    return path, reference, tensors


def test_mxfp4_checkpoint_loads_as_transformers_loads_it(quantised, rng):
    path, reference, tensors = quantised
    config, params = load_pretrained(path, dtype=jnp.float32)
    state = {k: v.numpy() for k, v in reference.state_dict().items()}
    layers = params["layers"]
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}.mlp.experts."
        gate_up, down = state[prefix + "gate_up_proj"], state[prefix + "down_proj"]
        np.testing.assert_array_equal(np.asarray(layers["expert_w_gate"][i]), gate_up[..., ::2])
        np.testing.assert_array_equal(np.asarray(layers["expert_w_up"][i]), gate_up[..., 1::2])
        np.testing.assert_array_equal(np.asarray(layers["expert_w_down"][i]), down)
        # transformers' dequantiser, called directly, gives the same tensor.
        direct = convert_moe_packed_tensors(
            tensors[prefix + "gate_up_proj_blocks"],
            tensors[prefix + "gate_up_proj_scales"],
            dtype=torch.float32,
        ).numpy()
        np.testing.assert_array_equal(direct, gate_up)
    tokens, mask = hf_utils.padded_batch(rng, [14, 9], 14, vocab=128, side="left")
    want = hf_utils.hf_logits(reference, tokens, mask)
    got = np.asarray(jax.jit(logits, static_argnums=1)(params, config, tokens, attention_mask=mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=1e-4)


@pytest.mark.needs_devices(8)
def test_sharded_load_reads_each_shard_of_the_pairs(quantised):
    """Experts split 2 ways and their width 4 ways (each device dequantises only its experts'
    rows of the interleaved gate_up pair), bf16: the same values as the whole load."""
    path, _, _ = quantised
    config, whole = load_pretrained(path, dtype=jnp.bfloat16)
    mesh = jax.make_mesh((2, 4), ("e", "f"))
    split = {
        "expert_w_gate": PartitionSpec(None, "e", None, "f"),
        "expert_w_up": PartitionSpec(None, "e", None, "f"),
        "expert_w_down": PartitionSpec(None, "e", "f", None),
    }

    def sharding(path_keys, _):
        return NamedSharding(mesh, split.get(path_keys[-1].key, PartitionSpec()))

    shardings = jax.tree_util.tree_map_with_path(sharding, param_shapes(config))
    _, sharded = load_pretrained(path, dtype=jnp.bfloat16, shardings=shardings)
    assert len(sharded["layers"]["expert_w_up"].addressable_shards) == 8
    for name in split:
        np.testing.assert_array_equal(
            np.asarray(sharded["layers"][name], np.float32),
            np.asarray(whole["layers"][name], np.float32),
        )
