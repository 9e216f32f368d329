"""YaRN RoPE (``rope_type: yarn``, Peng et al. 2023): inverse frequencies and the attention
factor against transformers' ``_compute_yarn_parameters`` over its options, the config's
round trips (transformers 4 and 5 layouts, save -> ``from_pretrained``), and the logits of a
tiny Qwen3 with YaRN against transformers (gpt-oss's YaRN runs in test_gpt_oss.py)."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxrl_llm.models import ROPE_TYPES, ModelConfig, load_pretrained, logits, save_pretrained
from jaxrl_llm.models.attention import rope_angles
from jaxrl_llm.models.config import rope_inv_freq, yarn_mscale
from tests.models import hf_utils

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
jit_logits = jax.jit(logits, static_argnums=1)


def _qwen3(**rope) -> dict:
    """A ``rope_parameters`` override of the tiny Qwen3 (base 1e4 unless given)."""
    return {"rope_parameters": {"rope_theta": 10000.0, **YARN, **rope}}


@pytest.mark.parametrize(
    "rope",
    [
        {},  # transformers' defaults: betas 32 / 1, truncate, mscale 0.1 ln 4 + 1
        {"truncate": False, "beta_fast": 16.0, "beta_slow": 2.0},
        {"attention_factor": 0.8},
        {"mscale": 0.9, "mscale_all_dim": 0.5},
        {"factor": None, "rope_theta": 5e5},  # factor from the context ratio (256 / 64)
        {"factor": 40.0, "original_max_position_embeddings": 8},  # ramp clipped at both ends
    ],
    ids=["defaults", "no_truncate", "attention_factor", "mscale", "context_ratio", "clipped"],
)
def test_frequencies_and_attention_factor_match_transformers(rope):
    hf = hf_utils.hf_config("qwen3", **_qwen3(**rope))
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    config = ModelConfig.from_hf_dict(hf_utils.hf_dict("qwen3", **_qwen3(**rope)))
    assert config.rope_type == "yarn"
    np.testing.assert_allclose(rope_inv_freq(config), want.numpy(), rtol=1e-6)
    assert config.rope_attention_scaling == pytest.approx(want_factor, rel=1e-12)
    # The config round-trips, and transformers reads ours as the same RoPE.
    hf_dict = config.to_hf_dict()
    assert ModelConfig.from_hf_dict(hf_dict) == config
    theirs = type(hf).from_dict(hf_dict)
    again, again_factor = ROPE_INIT_FUNCTIONS["yarn"](theirs, "cpu")
    np.testing.assert_array_equal(again.numpy(), want.numpy())
    assert again_factor == pytest.approx(want_factor, rel=1e-12)


def test_yarn_blends_interpolation_and_extrapolation():
    """High frequencies (many turns in the pre-training context) are kept, low ones divided by
    the factor, the band between interpolated (the ramp)."""
    rope = _qwen3(truncate=False, original_max_position_embeddings=1024)
    config = ModelConfig.from_hf_dict(hf_utils.hf_dict("qwen3", **rope))
    plain = rope_inv_freq(dataclasses.replace(config, **_defaults()))
    scaled = rope_inv_freq(config)
    turns = 1024 * plain / (2 * np.pi)  # rotations over the pre-training context
    kept, divided = turns > 32, turns < 1
    np.testing.assert_allclose(scaled[kept], plain[kept], rtol=1e-6)
    np.testing.assert_allclose(scaled[divided], plain[divided] / 4.0, rtol=1e-6)
    middle = ~kept & ~divided
    assert kept.any() and divided.any() and middle.any()
    assert np.all((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 4.0))


def _defaults() -> dict:
    return dict(
        rope_type="default",
        rope_factor=1.0,
        rope_original_max_position_embeddings=None,
        rope_truncate=True,
    )


def test_rope_angles_carry_the_attention_factor():
    config = ModelConfig.from_hf_dict(hf_utils.hf_dict("qwen3", **_qwen3()))
    positions = jnp.arange(5)[None]
    cos, sin = rope_angles(config, positions)
    angles = np.arange(5)[:, None] * rope_inv_freq(config)
    m = yarn_mscale(4.0)
    assert m == pytest.approx(0.1 * np.log(4.0) + 1)
    np.testing.assert_allclose(np.asarray(cos)[0], m * np.cos(angles), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(sin)[0], m * np.sin(angles), rtol=1e-6, atol=1e-7)
    assert yarn_mscale(1.0) == yarn_mscale(0.5) == 1.0


def test_transformers4_layout_gives_the_same_config():
    hf5 = hf_utils.hf_dict("qwen3", **_qwen3(beta_fast=24.0))
    hf4 = {k: v for k, v in hf5.items() if k != "rope_parameters"}
    hf4.update(
        rope_theta=10000.0,
        rope_scaling={
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 24.0,
        },
    )
    assert ModelConfig.from_hf_dict(hf4) == ModelConfig.from_hf_dict(hf5)
    assert "yarn" in ROPE_TYPES


def test_yarn_fields_need_rope_type_yarn():
    config = ModelConfig.from_hf_dict(hf_utils.hf_dict("qwen3"))
    with pytest.raises(ValueError, match="yarn RoPE fields"):
        dataclasses.replace(config, rope_attention_factor=1.2)
    yarn = ModelConfig.from_hf_dict(hf_utils.hf_dict("qwen3", **_qwen3()))
    with pytest.raises(ValueError, match="rope_beta_fast must be a number > 0"):
        dataclasses.replace(yarn, rope_beta_fast=0.0)
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        dataclasses.replace(yarn, rope_original_max_position_embeddings=None)
    with pytest.raises(ValueError, match="truncate must be true or false"):
        ModelConfig.from_hf_dict(hf_utils.hf_dict("qwen3", **_qwen3(truncate="no")))


def test_qwen3_yarn_logits_match_transformers_and_round_trip(tmp_path, rng):
    """A tiny Qwen3 with YaRN (factor 4 over a 64-token context, mscale applied to q and k):
    logits at positions up to 100 (past the pre-training context) against transformers, and
    save -> transformers' ``from_pretrained`` -> our load give the same model."""
    path = str(tmp_path / "qwen3_yarn")
    torch_model = hf_utils.build_checkpoint("qwen3", path, seed=80, **_qwen3(truncate=False))
    config, params = load_pretrained(path, dtype=jnp.float32)
    assert config.rope_type == "yarn" and not config.rope_truncate
    tokens, mask = hf_utils.padded_batch(rng, [100, 60], 100, vocab=128, side="left")
    want = hf_utils.hf_logits(torch_model, tokens, mask)
    got = np.asarray(jit_logits(params, config, tokens, attention_mask=mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=1e-4)
    # Without the attention factor the logits move: the parity above sees it.
    plain = dataclasses.replace(config, rope_attention_factor=1.0)
    moved = np.asarray(jit_logits(params, plain, tokens, attention_mask=mask))
    assert np.abs(moved - got)[real].max() > 1e-2

    out = str(tmp_path / "saved")
    save_pretrained(out, config, params)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["rope_scaling"]["rope_type"] == "yarn"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32
    ).eval()
    np.testing.assert_allclose(
        hf_utils.hf_logits(reloaded, tokens[:, -30:], mask[:, -30:]),
        hf_utils.hf_logits(torch_model, tokens[:, -30:], mask[:, -30:]),
        atol=1e-5,
    )
    assert load_pretrained(out, dtype=jnp.float32)[0] == config
