"""The model catalog (``configs/models/*.json``): every entry loads, and the mixture-of-experts
and Gemma entries have the published sizes.

References: the parameter counts the model cards and technical reports publish (quoted next
to each figure below), and transformers' own model of the same file built on the ``meta``
device (no memory). Counts are read from ``param_shapes`` (the leaves' sizes), not from the
closed form ``param_count``, so a wrong config value and a wrong formula both show.

Active parameters (the mixture-of-experts figures): every parameter except the routed
experts' weights (and gpt-oss's expert biases), plus ``k / E`` of those (the ``k`` experts a
token is sent to, of ``E``, in every layer). The router and Qwen2-MoE's shared expert are always
active.
"""

import json

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
    logical_axes,
    param_count,
    param_shapes,
)

# The entries this file pins (the dense Qwen / Llama / Mistral ones are pinned in
# test_architectures.py).
MOE = ("qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", "qwen1.5-moe-a2.7b")
GEMMA = ("gemma-2-9b", "gemma-2-27b", "gemma-3-1b", "gemma-3-4b", "gemma-3-12b", "gemma-3-27b")
GPT_OSS = ("gpt-oss-20b", "gpt-oss-120b")
NEW = MOE + GEMMA + GPT_OSS

# (total, active) as published. Qwen3 model cards ("Number of Parameters: 30.5B in total and
# 3.3B activated"; "235B in total and 22B activated"), Mistral AI's Mixtral announcement
# ("46.7B total parameters but only uses 12.9B parameters per token"), the Qwen1.5-MoE-A2.7B
# card ("14.3B parameters in total and 2.7B activated parameters during runtime").
PUBLISHED_MOE = {
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "qwen3-235b-a22b": (235e9, 22e9),
    "mixtral-8x7b": (46.7e9, 12.9e9),
    "qwen1.5-moe-a2.7b": (14.3e9, 2.7e9),
}

# gpt-oss (total, active) as published: OpenAI's gpt-oss model card (arXiv 2508.10925), Table 1,
# "Total Params" 20.91B / 116.83B and "Active Params" 3.61B / 5.13B. The card's active count
# leaves out the input embedding table (a lookup, not a matmul) but keeps the unembedding.
PUBLISHED_GPT_OSS = {"gpt-oss-20b": (20.91e9, 3.61e9), "gpt-oss-120b": (116.83e9, 5.13e9)}

# Non-embedding parameters (everything but the vocab x hidden embedding, tied for Gemma).
# Gemma 2 technical report (arXiv 2408.00118), Table 2, exact: 9B 8,324,201,984; 27B
# 26,047,480,320. Gemma 3 technical report (arXiv 2503.19786), Table 1, in millions: 1B 698M,
# 4B 3,209M, 12B 10,759M, 27B 25,600M (the language model; 4B, 12B and 27B ship beside a 417M
# vision encoder that the text-only catalog entries leave out). Qwen3 cards: "Number of Parameters
# (Non-Embedding): 29.9B" (30B-A3B), "234B" (235B-A22B); Qwen counts both the embedding and the
# untied head as embedding parameters.
NON_EMBEDDING = {
    "gemma-2-9b": (8_324_201_984, 0),
    "gemma-2-27b": (26_047_480_320, 0),
    "gemma-3-1b": (698e6, 0.5e6),
    "gemma-3-4b": (3_209e6, 0.5e6),
    "gemma-3-12b": (10_759e6, 0.5e6),
    "gemma-3-27b": (25_600e6, 0.5e6),
    "qwen3-30b-a3b": (29.9e9, 0.05e9),
    "qwen3-235b-a22b": (234e9, 0.5e9),
}

# Total parameters, the Gemma models' published sizes: Gemma 2 Table 2's embedding plus
# non-embedding counts with the 256,128-entry vocabulary (9,242,164,736 and 27,227,718,144;
# the Hugging Face checkpoints keep 256,000 rows of it: 9.24B and 27.2B), Gemma 3
# Table 1's 1B: 302M + 698M = 1.0B, and 4B's language model: 675M + 3,209M = 3.88B (its
# 262,208-row embedding holds 671M; the 417M vision encoder is not counted).
PUBLISHED_TOTAL = {
    "gemma-2-9b": 9.24e9,
    "gemma-2-27b": 27.2e9,
    "gemma-3-1b": 1.0e9,
    "gemma-3-4b": 3.88e9,
}


def _raw(name: str) -> dict:
    with open(ARCHITECTURE_DIR / f"{name}.json") as f:
        return json.load(f)


def _is_routed_expert(axes: tuple) -> bool:
    # The routed experts' gate / up / down weights and biases: [layers, expert, ...]. The
    # router ([layers, embed, expert]) and its bias ([layers, expert]) are always active.
    return len(axes) > 2 and axes[1] == "expert"


def _counts(config: ModelConfig) -> tuple[int, int]:
    """(total, active) parameters from the parameter shapes and their logical axes."""
    shapes = param_shapes(config)
    axes = logical_axes(config)
    total = active = 0
    leaves = zip(
        jax.tree.leaves(shapes),
        jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)),
        strict=True,
    )
    for leaf, leaf_axes in leaves:
        total += leaf.size
        if _is_routed_expert(leaf_axes):
            assert leaf.shape[leaf_axes.index("expert")] == config.num_experts
            active += leaf.size * config.num_experts_per_tok // config.num_experts
        else:
            active += leaf.size
    return total, active


def _non_embedding(config: ModelConfig, total: int) -> int:
    embeddings = 1 if config.tie_word_embeddings else 2
    return total - embeddings * config.vocab_size * config.hidden_size


@pytest.mark.parametrize("name", available_architectures())
def test_every_catalog_entry_parses_and_round_trips(name):
    config = architecture_config(name)
    assert isinstance(config, ModelConfig)
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    raw = _raw(name)
    assert config.architecture == raw["architectures"][0]
    assert config.model_type == raw["model_type"]


def test_catalog_holds_the_new_entries():
    assert set(NEW) <= set(available_architectures())


@pytest.mark.parametrize("name", NEW)
def test_transformers_reads_each_file_as_the_same_model(name):
    raw = _raw(name)
    hf = CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
    assert ModelConfig.from_hf_dict(hf.to_dict()) == architecture_config(name)


@pytest.mark.parametrize("name", NEW)
def test_param_count_equals_transformers_model(name):
    """The transformers model of the same file, built on the meta device (no memory)."""
    hf_config = CONFIG_MAPPING[_raw(name)["model_type"]].from_dict(_raw(name))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    expected = sum(p.numel() for p in model.parameters())
    config = architecture_config(name)
    assert _counts(config)[0] == param_count(config) == expected


@pytest.mark.parametrize("name", sorted(PUBLISHED_MOE))
def test_moe_total_and_active_match_published(name):
    config = architecture_config(name)
    total, active = _counts(config)
    published_total, published_active = PUBLISHED_MOE[name]
    assert abs(total - published_total) <= 0.01 * published_total, (name, total)
    if name == "qwen3-30b-a3b":
        # 3,353,032,704 active: 1.6% over the card's "3.3B", which cuts to one decimal rather
        # than rounds (the Instruct-2507, Thinking-2507 and Coder cards give the same 3.3B).
        assert 3.3e9 <= active < 3.4e9, active
    else:
        assert abs(active - published_active) <= 0.01 * published_active, (name, active)


@pytest.mark.parametrize("name", GPT_OSS)
def test_gpt_oss_total_and_active_match_published(name):
    config = architecture_config(name)
    total, active = _counts(config)
    published_total, published_active = PUBLISHED_GPT_OSS[name]
    assert abs(total - published_total) <= 0.01 * published_total, (name, total)
    active -= config.vocab_size * config.hidden_size  # the card's count: no embedding table
    assert abs(active - published_active) <= 0.01 * published_active, (name, active)


def test_gpt_oss_entries_are_as_released():
    # config.json of openai/gpt-oss-20b and -120b: 24 / 36 layers alternating sliding (128
    # keys, from layer 0) and full attention, 32 / 128 experts top-4 of width 2880, YaRN x32
    # over 4096 tokens at base 150000, the clamp at 7, MXFP4 experts (dequantised at load).
    for name, layers, experts in (("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)):
        config = architecture_config(name)
        assert config.num_hidden_layers == layers and config.num_experts == experts, name
        assert config.num_experts_per_tok == 4 and config.moe_intermediate_size == 2880
        assert config.sliding_window == 128
        assert config.sliding_layers == (True, False) * (layers // 2)
        assert (config.rope_type, config.rope_factor, config.rope_theta) == ("yarn", 32.0, 1.5e5)
        assert config.rope_original_max_position_embeddings == 4096 and not config.rope_truncate
        assert (config.swiglu_limit, config.swiglu_alpha) == (7.0, 1.702)
        assert config.attention_sinks and config.qkv_bias and config.o_bias
        assert _raw(name)["quantization_config"]["quant_method"] == "mxfp4"


@pytest.mark.parametrize("name", sorted(NON_EMBEDDING))
def test_non_embedding_parameters_match_published(name):
    config = architecture_config(name)
    total, _ = _counts(config)
    published, tolerance = NON_EMBEDDING[name]
    assert abs(_non_embedding(config, total) - published) <= tolerance, (name, total)


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOTAL))
def test_gemma_total_matches_published(name):
    total, active = _counts(architecture_config(name))
    assert total == active
    assert abs(total - PUBLISHED_TOTAL[name]) <= 0.01 * PUBLISHED_TOTAL[name], (name, total)


def test_moe_entries_route_as_published():
    # (E experts, k per token, expert width, shared expert width) from the config.json files.
    expected = {
        "qwen3-30b-a3b": (128, 8, 768, 0),
        "qwen3-235b-a22b": (128, 8, 1536, 0),
        "mixtral-8x7b": (8, 2, 14336, 0),
        "qwen1.5-moe-a2.7b": (60, 4, 1408, 5632),
    }
    for name, fields in expected.items():
        config = architecture_config(name)
        got = (
            config.num_experts,
            config.num_experts_per_tok,
            config.moe_intermediate_size,
            config.shared_expert_intermediate_size,
        )
        assert got == fields, name
        # Qwen3-MoE renormalises its top-k, Qwen1.5-MoE does not, Mixtral always does.
        assert config.norm_topk_prob == (name != "qwen1.5-moe-a2.7b"), name


def test_gemma_entries_attend_as_published():
    # Gemma 2: every other layer slides over 4096 keys (layer 0 first); Gemma 3: five sliding
    # layers of 512 (1B) or 1024 (12B, 27B) keys to one global, the global layers' RoPE base
    # 1e6 (linearly scaled by 8 on 12B and 27B), the sliding layers' 1e4.
    for name, window, pattern in (
        ("gemma-2-9b", 4096, 2),
        ("gemma-2-27b", 4096, 2),
        ("gemma-3-1b", 512, 6),
        ("gemma-3-4b", 1024, 6),
        ("gemma-3-12b", 1024, 6),
        ("gemma-3-27b", 1024, 6),
    ):
        config = architecture_config(name)
        assert config.sliding_window == window, name
        expected = tuple(bool((i + 1) % pattern) for i in range(config.num_hidden_layers))
        assert config.sliding_layers == expected, name
        assert config.tie_word_embeddings and config.hidden_act == "gelu_pytorch_tanh", name
    for name in ("gemma-2-9b", "gemma-2-27b"):
        config = architecture_config(name)
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
        assert config.rope_theta == 1e4 and config.rope_local_theta is None
    assert architecture_config("gemma-2-9b").attention_scale == 256**-0.5
    assert architecture_config("gemma-2-27b").attention_scale == 144**-0.5
    assert architecture_config("gemma-3-27b").attention_scale == 168**-0.5
    for name, rope in (
        ("gemma-3-1b", "default"),
        ("gemma-3-4b", "linear"),
        ("gemma-3-12b", "linear"),
        ("gemma-3-27b", "linear"),
    ):
        config = architecture_config(name)
        assert (config.rope_theta, config.rope_local_theta, config.rope_type) == (1e6, 1e4, rope)
        assert config.rope_factor == (8.0 if rope == "linear" else 1.0), name
        assert config.attn_logit_softcapping is None and config.final_logit_softcapping is None


# google/gemma-3-4b-pt's config.json as released (transformers 4.50; its vision_config left
# out): a sparse text_config, the other sizes are Gemma3TextConfig's defaults.
GEMMA3_4B_RELEASED = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
}


def test_multimodal_gemma3_configs_parse_as_their_text_model():
    """Gemma 3 4B / 12B / 27B ship as ``Gemma3ForConditionalGeneration`` (a vision tower beside
    a ``text_config``); the loader takes their language model, which the catalog's gemma-3-4b,
    -12b and -27b entries hold as a ``Gemma3ForCausalLM`` config."""
    assert ModelConfig.from_hf_dict(GEMMA3_4B_RELEASED) == architecture_config("gemma-3-4b")
    # transformers fills the sparse text_config with the same defaults (its eos is the
    # wrapper's).
    text = CONFIG_MAPPING["gemma3"].from_dict(GEMMA3_4B_RELEASED).text_config.to_dict()
    text.update(architectures=["Gemma3ForCausalLM"], eos_token_id=[1, 106])
    assert ModelConfig.from_hf_dict(text) == architecture_config("gemma-3-4b")
    for name in ("gemma-3-12b", "gemma-3-27b"):
        wrapper = {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "text_config": {k: v for k, v in _raw(name).items() if k != "architectures"},
        }
        assert ModelConfig.from_hf_dict(wrapper) == architecture_config(name)
