"""Shipped model configs (configs/models/*.json), their loader and exact parameter counts.

References: parameter counts published for the checkpoints (Hugging Face safetensors metadata
and model cards), transformers' own models built on the ``meta`` device (no memory), and
hand-counted tiny configs. Nothing here materialises parameters of a big model.
"""

import dataclasses
import json
import shutil

import jax
import pytest
import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from jaxrl_llm.models import (
    ARCHITECTURE_DIR,
    ModelConfig,
    architecture_config,
    available_architectures,
    param_count,
    param_shapes,
)

NAMES = (
    "llama-3.1-70b",
    "llama-3.1-8b",
    "mistral-7b",
    "qwen2.5-0.5b",
    "qwen2.5-1.5b",
    "qwen2.5-32b",
    "qwen2.5-72b",
    "qwen2.5-7b",
    "qwen3-0.6b",
    "qwen3-32b",
    "qwen3-8b",
)

# Published total parameter counts (tied embeddings counted once).
PUBLISHED = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1.54e9,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-32b": 32.8e9,
    "qwen2.5-72b": 72_706_203_648,
    "qwen3-8b": 8.19e9,
    "qwen3-32b": 32.8e9,
    "llama-3.1-8b": 8.03e9,
    "llama-3.1-70b": 70.6e9,
    "mistral-7b": 7.25e9,
}


def _size(config: ModelConfig) -> int:
    return sum(x.size for x in jax.tree.leaves(param_shapes(config)))


def _tiny(**overrides) -> ModelConfig:
    fields = dict(
        architecture="LlamaForCausalLM",
        vocab_size=10,
        hidden_size=4,
        intermediate_size=6,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=2,
    )
    return ModelConfig(**{**fields, **overrides})


def _raw(name: str) -> dict:
    with open(ARCHITECTURE_DIR / f"{name}.json") as f:
        return json.load(f)


def test_available_architectures_are_the_shipped_files():
    # NAMES: the dense Qwen / Llama / Mistral entries these tests check field by field; the
    # mixture-of-experts and Gemma entries are checked in test_catalog.py.
    shipped = tuple(sorted(p.stem for p in ARCHITECTURE_DIR.glob("*.json")))
    assert ARCHITECTURE_DIR.is_dir() and available_architectures() == shipped
    assert set(NAMES) <= set(shipped)


@pytest.mark.parametrize("name", NAMES)
def test_every_shipped_config_parses_and_round_trips(name):
    config = architecture_config(name)
    assert isinstance(config, ModelConfig)
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    raw = _raw(name)
    assert raw["torch_dtype"] == "bfloat16" and raw["hidden_act"] == "silu"
    assert config.architecture == raw["architectures"][0]
    assert config.model_type == raw["model_type"]
    assert not raw.get("use_sliding_window", False)


@pytest.mark.parametrize("name", NAMES)
def test_transformers_reads_each_file_as_the_same_model(name):
    """transformers' own config class, reading the file, describes the model we parse."""
    raw = _raw(name)
    hf = CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
    assert type(hf).__name__ == raw["architectures"][0].replace("ForCausalLM", "Config")
    assert ModelConfig.from_hf_dict(hf.to_dict()) == architecture_config(name)


@pytest.mark.parametrize("name", NAMES)
def test_param_count_equals_param_shapes(name):
    config = architecture_config(name)
    assert param_count(config) == _size(config)


@pytest.mark.parametrize("name", NAMES)
def test_param_count_equals_transformers_model(name):
    """The transformers model of the same file, built on the meta device (no memory)."""
    hf_config = CONFIG_MAPPING[_raw(name)["model_type"]].from_dict(_raw(name))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert param_count(architecture_config(name)) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_param_count_matches_published(name):
    count = param_count(architecture_config(name))
    assert abs(count - PUBLISHED[name]) <= 0.005 * PUBLISHED[name], (name, count)


def test_qwen3_0_6b_matches_its_model_card():
    """Model card: 0.6B parameters, 0.44B non-embedding (both rounded to 2 decimals).

    596M is 0.66% under 0.6B, so a 0.5% bound does not apply; the card's rounding does. Untied,
    it would be 752M: the count HF shows for the checkpoint, which stores lm_head as well.
    """
    config = architecture_config("qwen3-0.6b")
    count = param_count(config)
    embedding = config.vocab_size * config.hidden_size
    assert abs(count - 0.60e9) < 0.005e9
    assert abs(count - embedding - 0.44e9) < 0.005e9
    untied = param_count(dataclasses.replace(config, tie_word_embeddings=False))
    assert untied == count + embedding == 751_632_384


def test_param_count_hand_counted():
    # V=10 D=4 F=6 L=3 N=2 K=1 H=2. Per layer: norms 2*4, q 4*2*2=16, k 4*1*2=8, v 8,
    # o 2*2*4=16, mlp 3*4*6=72 -> 128. Total: embed 40 + 3*128 + final norm 4 + lm_head 40.
    assert param_count(_tiny()) == 40 + 3 * 128 + 4 + 40 == 468
    assert param_count(_tiny(tie_word_embeddings=True)) == 428
    # + q/k/v biases 2*2 + 2*1*2 = 8 and output bias 4 per layer.
    assert param_count(_tiny(qkv_bias=True)) == 468 + 3 * 8
    assert param_count(_tiny(qkv_bias=True, o_bias=True)) == 468 + 3 * 12
    # + q/k norms 2*2 per layer.
    assert param_count(_tiny(qk_norm=True)) == 468 + 3 * 4


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {"qkv_bias": True},
        {"o_bias": True},
        {"qkv_bias": True, "o_bias": True, "qk_norm": True},
        {"architecture": "Qwen3ForCausalLM", "qk_norm": True, "head_dim": 6},
        {"num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1},
        {"architecture": "Qwen2ForCausalLM", "qkv_bias": True, "tie_word_embeddings": True},
    ],
)
def test_param_count_equals_param_shapes_small(overrides):
    config = _tiny(**overrides)
    assert param_count(config) == _size(config)


def test_llama_3_1_rope_scaling():
    for name in ("llama-3.1-8b", "llama-3.1-70b"):
        config = architecture_config(name)
        assert config.rope_type == "llama3" and config.rope_theta == 500000.0
        assert (config.rope_factor, config.rope_low_freq_factor) == (8.0, 1.0)
        assert config.rope_high_freq_factor == 4.0
        assert config.rope_original_max_position_embeddings == 8192
        assert config.max_position_embeddings == 131072
        assert config.vocab_size == 128256 and config.num_key_value_heads == 8
        assert (config.bos_token_id, config.eos_token_ids) == (128000, (128001,))
        assert not (config.qkv_bias or config.o_bias or config.qk_norm)
        assert not config.tie_word_embeddings and config.rms_norm_eps == 1e-5


def test_qwen2_5_features():
    for name in ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b"):
        config = architecture_config(name)
        assert (config.qkv_bias, config.o_bias, config.qk_norm) == (True, False, False), name
        assert config.rope_type == "default" and config.rope_theta == 1e6
        assert config.head_dim == config.hidden_size // config.num_attention_heads
        assert config.head_dim == (64 if name == "qwen2.5-0.5b" else 128)
        small = name in ("qwen2.5-0.5b", "qwen2.5-1.5b")
        assert config.tie_word_embeddings == small, name
        assert config.vocab_size == (151936 if small else 152064)
        assert (config.bos_token_id, config.eos_token_ids) == (151643, (151643,))
    raw = _raw("qwen2.5-7b")  # an inactive window must parse
    assert raw["use_sliding_window"] is False and raw["sliding_window"] == 131072


def test_qwen3_features():
    for name, tied in (("qwen3-0.6b", True), ("qwen3-8b", False), ("qwen3-32b", False)):
        config = architecture_config(name)
        assert config.qk_norm and config.head_dim == 128
        assert not (config.qkv_bias or config.o_bias)
        assert config.tie_word_embeddings == tied, name
        assert config.max_position_embeddings == 40960 and config.vocab_size == 151936
        assert (config.bos_token_id, config.eos_token_ids) == (151643, (151645,))
    # The explicit head_dim wins over hidden / heads (1024 / 16 = 64, 5120 / 64 = 80).
    for name in ("qwen3-0.6b", "qwen3-32b"):
        config = architecture_config(name)
        assert config.hidden_size // config.num_attention_heads in (64, 80)


def test_mistral_7b_v0_3():
    config = architecture_config("mistral-7b")
    assert config.vocab_size == 32768 and _raw("mistral-7b")["sliding_window"] is None
    assert (config.rope_theta, config.rope_type, config.head_dim) == (1e6, "default", 128)
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    assert not (config.qkv_bias or config.o_bias or config.qk_norm or config.tie_word_embeddings)


@pytest.mark.parametrize("spelling", ["QWEN2.5-7B", "Qwen2.5-7B", " qwen2.5-7b "])
def test_name_lookup_is_case_insensitive(spelling):
    assert architecture_config(spelling) == architecture_config("qwen2.5-7b")


def test_bare_name_ignores_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "qwen3-8b").mkdir()
    shutil.copy(ARCHITECTURE_DIR / "mistral-7b.json", tmp_path / "qwen3-8b" / "config.json")
    monkeypatch.chdir(tmp_path)
    assert architecture_config("qwen3-8b").architecture == "Qwen3ForCausalLM"
    assert architecture_config("./qwen3-8b").architecture == "MistralForCausalLM"


def test_path_to_file_and_to_directory(tmp_path):
    expected = architecture_config("llama-3.1-8b")
    shutil.copy(ARCHITECTURE_DIR / "llama-3.1-8b.json", tmp_path / "config.json")
    assert architecture_config(str(tmp_path / "config.json")) == expected
    assert architecture_config(str(tmp_path)) == expected
    assert architecture_config(tmp_path) == expected  # os.PathLike
    assert architecture_config(str(ARCHITECTURE_DIR / "llama-3.1-8b.json")) == expected


def test_unknown_name_lists_available():
    with pytest.raises(ValueError, match="unknown architecture 'qwen9-1b'") as err:
        architecture_config("qwen9-1b")
    for name in NAMES:
        assert name in str(err.value)


def test_missing_file_names_it(tmp_path):
    missing = tmp_path / "nope" / "config.json"
    with pytest.raises(FileNotFoundError, match="nope"):
        architecture_config(str(missing))
    with pytest.raises(FileNotFoundError, match="nope.json"):
        architecture_config("nope.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        architecture_config(str(tmp_path))  # a directory without config.json


def test_bad_files_are_refused_naming_them(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json.*not valid JSON"):
        architecture_config(str(bad))
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        architecture_config(str(bad))
    windowed = {**_raw("qwen2.5-7b"), "use_sliding_window": True}
    bad.write_text(json.dumps(windowed))
    with pytest.raises(ValueError, match="broken.json.*sliding-window"):
        architecture_config(str(bad))
