"""ModelConfig: parsing HF config dicts (transformers 4 and 5 layouts), refusals, RoPE."""

import dataclasses

import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxrl_llm.models import ModelConfig
from jaxrl_llm.models.config import ALLOWANCES, ARCHITECTURES, rope_inv_freq
from tests.models import hf_utils


def _to_transformers4(hf):
    """The same config written the transformers-4 way: rope_theta + rope_scaling."""
    hf = dict(hf)
    params = dict(hf.pop("rope_parameters"))
    hf["rope_theta"] = params.pop("rope_theta")
    rope_type = params.pop("rope_type")
    hf["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **params}
    return hf


@pytest.mark.parametrize("name", sorted(hf_utils.VARIANTS))
def test_parses_each_variant(name):
    hf = hf_utils.hf_dict(name)
    config = ModelConfig.from_hf_dict(hf)
    assert config.vocab_size == 128 and config.hidden_size == 64
    assert config.num_hidden_layers == 2
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.rms_norm_eps == 1e-5
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1
    hash(config)  # usable as a jit static argument


def test_variant_features():
    qwen2 = ModelConfig.from_hf_dict(hf_utils.hf_dict("qwen2"))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    assert (qwen2.rope_type, qwen2.rope_factor, qwen2.rope_theta) == ("linear", 2.0, 5000.0)
    qwen3 = ModelConfig.from_hf_dict(hf_utils.hf_dict("qwen3"))
    assert (qwen3.qkv_bias, qwen3.o_bias, qwen3.qk_norm, qwen3.head_dim) == (True, True, True, 32)
    llama = ModelConfig.from_hf_dict(hf_utils.hf_dict("llama"))
    assert llama.tie_word_embeddings and llama.rope_type == "llama3"
    assert llama.rope_original_max_position_embeddings == 64 and llama.head_dim == 16
    mistral = ModelConfig.from_hf_dict(hf_utils.hf_dict("mistral"))
    assert (mistral.qkv_bias, mistral.o_bias, mistral.rope_theta) == (False, False, 1e6)


@pytest.mark.parametrize("name", sorted(hf_utils.VARIANTS))
def test_transformers4_layout_gives_same_config(name):
    hf5 = hf_utils.hf_dict(name)
    assert ModelConfig.from_hf_dict(_to_transformers4(hf5)) == ModelConfig.from_hf_dict(hf5)


@pytest.mark.parametrize("name", sorted(hf_utils.VARIANTS))
def test_to_hf_dict_round_trips(name):
    config = ModelConfig.from_hf_dict(hf_utils.hf_dict(name))
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    # transformers itself reads it back with the same RoPE.
    hf = hf_utils.hf_config(name).__class__.from_dict(config.to_hf_dict())
    assert hf.rope_parameters["rope_type"] == config.rope_type
    assert hf.rope_parameters["rope_theta"] == config.rope_theta


@pytest.mark.parametrize("name", sorted(hf_utils.VARIANTS))
def test_rope_inv_freq_matches_transformers(name):
    hf_config = hf_utils.hf_config(name)
    config = ModelConfig.from_hf_dict(hf_utils.hf_dict(name))
    rope_type = hf_config.rope_parameters["rope_type"]
    if rope_type == "default":
        # transformers' default init, written out (it is not in ROPE_INIT_FUNCTIONS).
        dim = config.head_dim
        want = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2).float() / dim))
    else:
        want, _ = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    np.testing.assert_allclose(rope_inv_freq(config), want.numpy(), rtol=1e-6)


def test_llama3_rope_scales_low_frequencies_only():
    config = ModelConfig.from_hf_dict(hf_utils.hf_dict("llama"))
    plain = rope_inv_freq(dataclasses.replace(config, rope_type="default"))
    scaled = rope_inv_freq(config)
    wavelen = 2 * np.pi / plain
    high = wavelen < 64 / 4  # original_max / high_freq_factor
    low = wavelen > 64 / 1
    np.testing.assert_array_equal(scaled[high], plain[high])
    np.testing.assert_allclose(scaled[low], plain[low] / 4.0, rtol=1e-6)
    assert high.any() and low.any() and (~high & ~low).any()


@pytest.mark.parametrize(
    "update, match",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"architectures": [], "model_type": "gpt2"}, "unsupported model_type"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "unknown rope type"),
        ({"rope_parameters": {"rope_type": "fancy"}}, "unknown rope type"),
        ({"rope_parameters": {"rope_type": "linear"}}, "needs a 'factor'"),
        ({"num_experts": 8}, "mixture-of-experts"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"quantization_config": {"bits": 4}}, "quantised"),
        ({"num_key_value_heads": 3}, "must divide"),
    ],
)
def test_refuses_unsupported(update, match):
    hf = hf_utils.hf_dict("llama")
    hf.update(update)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(hf)


def test_refuses_sliding_windows_in_use():
    mistral = hf_utils.hf_dict("mistral")
    mistral["sliding_window"] = 64
    with pytest.raises(ValueError, match="sliding_window=64"):
        ModelConfig.from_hf_dict(mistral)
    # A window at least as long as the context is never active.
    mistral["sliding_window"] = mistral["max_position_embeddings"]
    ModelConfig.from_hf_dict(mistral)
    qwen = hf_utils.hf_dict("qwen2")
    qwen["use_sliding_window"] = True
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf_dict(qwen)
    qwen = hf_utils.hf_dict("qwen3")
    qwen["layer_types"] = ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="sliding_attention"):
        ModelConfig.from_hf_dict(qwen)


def test_direct_construction_is_validated():
    base = ModelConfig.from_hf_dict(hf_utils.hf_dict("mistral"))
    with pytest.raises(ValueError, match="unknown rope type"):
        dataclasses.replace(base, rope_type="dynamic")
    with pytest.raises(ValueError, match="head_dim"):
        dataclasses.replace(base, head_dim=0)
    with pytest.raises(ValueError, match="unsupported architecture"):
        dataclasses.replace(base, architecture="Phi3ForCausalLM")


# Values each refusal of the allowance table is tried with (one of them trips every row).
_REFUSED_VALUES = {
    "num_experts": (8, 0),
    "num_local_experts": (8, 0),
    "n_routed_experts": (8,),
    "moe_intermediate_size": (48,),
    "quantization_config": ({"quant_method": "fp8"},),
    "hidden_act": ("gelu",),
    "mlp_bias": (True,),
    "partial_rotary_factor": (0.5,),
    "use_sliding_window": (True,),
    "layer_types": (["sliding_attention", "chunked_attention"],),
    "sliding_window": (16,),
    "decoder_sparse_step": (2,),
    "mlp_only_layers": ([1],),
    "router_jitter_noise": (0.1,),
    "use_bidirectional_attention": (True,),
}


def _base_configs():
    bases = {}
    for name in [*hf_utils.VARIANTS, *hf_utils.GEMMA_VARIANTS]:
        hf = hf_utils.hf_dict(name)
        bases[hf["model_type"]] = hf
    gpt_oss = transformers.GptOssConfig(**hf_utils.GPT_OSS).to_dict()
    bases["gpt_oss"] = {**gpt_oss, "architectures": ["GptOssForCausalLM"]}
    return bases


def test_allowance_table_covers_every_model_type():
    assert set(ALLOWANCES) == set(ARCHITECTURES.values())
    assert set(_base_configs()) == set(ALLOWANCES)


def test_every_refusal_names_its_key_and_value():
    """Each row of the allowance table, tripped alone on a supported config of its model type,
    refuses it with one line naming the key (and the value where it is one)."""
    tripped = set()
    for model_type, base in _base_configs().items():
        ModelConfig.from_hf_dict(base)
        for row in ALLOWANCES[model_type]:
            for value in _REFUSED_VALUES[row.key]:
                hf = {**base, row.key: value}
                if not row.refused(value, hf, model_type):
                    continue
                with pytest.raises(ValueError) as err:
                    ModelConfig.from_hf_dict(hf)
                message = str(err.value)
                assert row.key in message and "\n" not in message, (model_type, message)
                if isinstance(value, (int, float, str)) and not isinstance(value, bool):
                    assert str(value) in message, (model_type, message)
                tripped.add((model_type, row))
    # Mixtral's experts are counted from num_local_experts (its num_experts row reads there).
    untripped = {
        (t, r.key) for t, rows in ALLOWANCES.items() for r in rows if (t, r) not in tripped
    }
    assert untripped == {("mixtral", "num_experts")}
