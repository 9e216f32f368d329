"""The Gemma family (Gemma 1, Gemma 2, Gemma 3 text) against transformers on tiny random
checkpoints: config parsing, prefill logits past the sliding window, cached decode, the
sampler, save -> reload, bf16, training gradients, and the attention backends with soft caps and
sliding windows against a float64 reference.

The tiny configs (``hf_utils.GEMMA_VARIANTS``) have 4 layers, a window of 6 slots, soft caps
that bind (most scores and logits lie past them), ``query_pre_attn_scalar != head_dim`` and, for
Gemma 3, a RoPE base of its own on the sliding layers; every sequence here is longer than the
window.
"""

import copy
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from jaxrl_llm.logprobs import completion_logprobs
from jaxrl_llm.models import (
    ModelConfig,
    forward,
    init_params,
    load_pretrained,
    logits,
    param_count,
    param_shapes,
    save_pretrained,
    unembed,
)
from jaxrl_llm.models import attention as attn_lib
from jaxrl_llm.models.config import rope_inv_freq
from tests.models import decode_utils, hf_utils
from tests.sampling.hf_reference import assert_engine_matches_hf, assert_greedy_matches_hf

NAMES = sorted(hf_utils.GEMMA_VARIANTS)
WINDOW = hf_utils.GEMMA_WINDOW
SEQ = 20  # > WINDOW: the sliding layers drop keys

jit_logits = jax.jit(logits, static_argnums=1)
jit_forward = jax.jit(forward, static_argnums=1, static_argnames="remat")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (torch model, config, f32 params, checkpoint dir) per Gemma variant."""
    return hf_utils.load_variants(tmp_path_factory, NAMES, first_seed=60)


# --- config ---------------------------------------------------------------------------------


def test_config_reads_the_gemma_features():
    gemma = ModelConfig.from_hf_dict(hf_utils.hf_dict("gemma"))
    assert gemma.hidden_act == "gelu_pytorch_tanh" and gemma.tie_word_embeddings
    assert (gemma.qkv_bias, gemma.o_bias, gemma.qk_norm, gemma.sandwich_norms) == (
        True,
        True,
        False,
        False,
    )
    assert gemma.attention_scale == 32**-0.5 and gemma.layer_types is None
    assert gemma.embed_scale == 8.0

    gemma2 = ModelConfig.from_hf_dict(hf_utils.hf_dict("gemma2"))
    assert gemma2.sliding_layers == (True, False, True, False)  # every other layer, from 0
    assert (gemma2.sliding_window, gemma2.query_pre_attn_scalar) == (WINDOW, 20)
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (4.0, 8.0)
    assert gemma2.sandwich_norms and not gemma2.qk_norm and gemma2.attention_scale == 20**-0.5

    gemma3 = ModelConfig.from_hf_dict(hf_utils.hf_dict("gemma3"))
    assert gemma3.sliding_layers == (True, True, False, True) and gemma3.qk_norm
    assert (gemma3.rope_type, gemma3.rope_factor, gemma3.rope_theta) == ("linear", 4.0, 1e4)
    assert gemma3.rope_local_theta == 100.0
    assert gemma3.final_logit_softcapping is None and gemma3.attn_logit_softcapping is None
    for config in (gemma, gemma2, gemma3):
        hash(config)


def test_transformers4_layouts_give_the_same_config():
    """Gemma 3 written the transformers-4 way (flat RoPE keys, a sliding-window pattern
    instead of layer_types) and a Gemma 1 release's ``hidden_act: gelu`` (the tanh GELU)."""
    hf5 = hf_utils.hf_dict("gemma3", layer_types=None, sliding_window_pattern=3)
    hf4 = {k: v for k, v in hf5.items() if k not in ("rope_parameters", "layer_types")}
    hf4.update(
        rope_theta=1e4,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        rope_local_base_freq=100.0,
        sliding_window_pattern=3,
    )
    config = ModelConfig.from_hf_dict(hf4)
    assert config == ModelConfig.from_hf_dict(hf5)
    assert config.sliding_layers == (True, True, False, True)
    # The defaults: Gemma 3 slides 5 layers in 6, with bases 1e6 (global) and 1e4 (local).
    plain = {k: v for k, v in hf4.items() if k not in ("rope_theta", "rope_local_base_freq")}
    plain.pop("sliding_window_pattern")
    plain.pop("_sliding_window_pattern")  # transformers 5 writes it beside layer_types
    plain.update(num_hidden_layers=7, rope_scaling=None)
    config = ModelConfig.from_hf_dict(plain)
    assert config.sliding_layers == (True,) * 5 + (False, True)
    assert (config.rope_theta, config.rope_local_theta) == (1e6, 1e4)
    gemma = ModelConfig.from_hf_dict({**hf_utils.hf_dict("gemma"), "hidden_act": "gelu"})
    assert gemma.hidden_act == "gelu_pytorch_tanh"


@pytest.mark.parametrize("name", NAMES)
def test_to_hf_dict_round_trips_through_transformers(name):
    config = ModelConfig.from_hf_dict(hf_utils.hf_dict(name))
    hf_dict = config.to_hf_dict()
    assert ModelConfig.from_hf_dict(hf_dict) == config
    hf = type(hf_utils.hf_config(name)).from_dict(hf_dict)
    assert ModelConfig.from_hf_dict({**hf.to_dict(), "architectures": [config.architecture]}) == (
        config
    )
    if name != "gemma":
        assert tuple(hf.layer_types) == config.layer_types


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_keys_left_out_take_the_transformers_defaults(name):
    """A config.json without the soft caps, window, scalar or layer kinds means what
    transformers' config class makes of it (Gemma 2: caps 50 and 30, every other layer
    sliding; Gemma 3: no caps, 5 sliding layers in 6)."""
    left_out = (
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "query_pre_attn_scalar",
        "sliding_window",
        "layer_types",
        "_sliding_window_pattern",
    )
    hf = hf_utils.hf_dict(name, num_hidden_layers=7, layer_types=None)
    hf = {k: v for k, v in hf.items() if k not in left_out}
    config = ModelConfig.from_hf_dict(hf)
    theirs = type(hf_utils.hf_config(name)).from_dict(hf)
    assert config.attn_logit_softcapping == theirs.attn_logit_softcapping
    assert config.final_logit_softcapping == theirs.final_logit_softcapping
    assert config.query_pre_attn_scalar == theirs.query_pre_attn_scalar == 256
    assert config.sliding_window == theirs.sliding_window == 4096
    assert config.layer_types == tuple(theirs.layer_types)
    want_caps = (50.0, 30.0) if name == "gemma2" else (None, None)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == want_caps


def test_irregular_layer_types_round_trip():
    """Layer kinds that no sliding-window pattern gives are written as layer_types, which
    transformers reads back."""
    types = ("full_attention", "sliding_attention", "sliding_attention", "full_attention")
    config = ModelConfig.from_hf_dict(hf_utils.hf_dict("gemma3", layer_types=list(types)))
    assert config.layer_types == types
    hf_dict = config.to_hf_dict()
    assert "sliding_window_pattern" not in hf_dict
    assert ModelConfig.from_hf_dict(hf_dict) == config
    assert tuple(type(hf_utils.hf_config("gemma3")).from_dict(hf_dict).layer_types) == types


def test_rope_frequencies_match_transformers_per_layer_type():
    hf_config = hf_utils.hf_config("gemma3")
    rotary = transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(hf_config)
    config = ModelConfig.from_hf_dict(hf_utils.hf_dict("gemma3"))
    np.testing.assert_allclose(
        rope_inv_freq(config), rotary.full_attention_inv_freq.numpy(), rtol=1e-6
    )
    np.testing.assert_allclose(
        rope_inv_freq(config, local=True), rotary.sliding_attention_inv_freq.numpy(), rtol=1e-6
    )
    assert (
        rotary.full_attention_attention_scaling == rotary.sliding_attention_attention_scaling == 1
    )


@pytest.mark.parametrize(
    "name, update, match",
    [
        ("gemma2", {"use_bidirectional_attention": True}, "bidirectional"),
        ("gemma2", {"hidden_activation": "relu"}, "hidden_activation"),
        ("gemma2", {"sliding_window": None}, "sliding_window is null"),
        ("gemma2", {"layer_types": ["chunked_attention"] * 4}, "layer_types"),
        ("gemma2", {"layer_types": ["full_attention"] * 3}, "3 entries"),
        ("gemma3", {"quantization_config": {"bits": 4}}, "quantised"),
        (
            "gemma3",
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0},
                }
            },
            "sliding-window layers",
        ),
    ],
)
def test_refuses_what_it_does_not_run(name, update, match):
    hf = {**hf_utils.hf_dict(name), **update}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(hf)


def test_gemma_features_are_refused_on_other_families():
    llama = ModelConfig.from_hf_dict(hf_utils.hf_config("llama").to_dict())
    for field, value in [
        ("attn_logit_softcapping", 50.0),
        ("final_logit_softcapping", 30.0),
        ("hidden_act", "gelu_pytorch_tanh"),
        ("query_pre_attn_scalar", 256.0),
    ]:
        with pytest.raises(ValueError, match="only supported on Gemma"):
            dataclasses.replace(llama, **{field: value})
    with pytest.raises(ValueError, match="only supported on Gemma"):
        dataclasses.replace(
            llama, sliding_window=4, layer_types=("sliding_attention", "full_attention")
        )


# Real checkpoints' config.json (transformers-4 layout, as published): Gemma 2 2B and Gemma 3 1B,
# with their published parameter counts.
GEMMA2_2B = {
    "architectures": ["Gemma2ForCausalLM"],
    "attn_logit_softcapping": 50.0,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": [1, 107],
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "max_position_embeddings": 8192,
    "model_type": "gemma2",
    "num_attention_heads": 8,
    "num_hidden_layers": 26,
    "num_key_value_heads": 4,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "torch_dtype": "bfloat16",
    "vocab_size": 256000,
}
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"],
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "vocab_size": 262144,
}


@pytest.mark.parametrize(
    "hf, params", [(GEMMA2_2B, 2_614_341_888), (GEMMA3_1B, 999_885_952)], ids=["2-2b", "3-1b"]
)
def test_published_configs_parse_and_count(hf, params):
    config = ModelConfig.from_hf_dict(hf)
    assert param_count(config) == params
    assert config.attention_scale == 1 / 16
    assert config.eos_token_ids == tuple(hf["eos_token_id"]) and config.tie_word_embeddings
    sliding = config.sliding_layers
    if config.model_type == "gemma2":
        assert sliding == (True, False) * 13 and config.sliding_window == 4096
    else:
        assert sliding == ((True,) * 5 + (False,)) * 4 + (True, True)
        assert (config.rope_theta, config.rope_local_theta) == (1e6, 1e4)
    # transformers reads our config.json as the same model.
    ours = config.to_hf_dict()
    hf_config = transformers.AutoConfig.for_model(ours.pop("model_type"), **ours)
    assert tuple(hf_config.layer_types) == config.layer_types
    assert hf_config.sliding_window == config.sliding_window


@pytest.mark.parametrize("name", NAMES)
def test_param_count_and_init(models, name):
    torch_model, config, _, _ = models[name]
    assert param_count(config) == sum(p.numel() for p in torch_model.parameters())
    assert param_count(config) == sum(x.size for x in jax.tree.leaves(param_shapes(config)))
    init = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    # Gemma's norms scale by 1 + w: they start at w = 0 (the identity), as transformers'.
    norms = [init["final_norm"]] + [v for k, v in init["layers"].items() if k.endswith("norm")]
    assert len(norms) == 1 + 2 + 2 * config.sandwich_norms + 2 * config.qk_norm
    assert all(np.all(np.asarray(n) == 0) for n in norms)


# --- forward and decode ---------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("side", ["left", "right", "none"])
def test_logits_match_transformers_past_the_window(models, name, side, rng):
    """Prefill logits of 20-token rows (and shorter padded ones) against transformers: in
    float64 for unpadded rows (its float64 run turns left-padded rows into NaN), else float32."""
    torch_model, config, params, _ = models[name]
    lengths = [SEQ, SEQ] if side == "none" else [SEQ, 15, 3]
    tokens, mask = hf_utils.padded_batch(rng, lengths, SEQ, vocab=128, side=side)
    want = hf_utils.hf_logits(torch_model, tokens, mask, double=side == "none")
    got = np.asarray(jit_logits(params, config, tokens, attention_mask=mask))
    real = mask.astype(bool)
    assert np.abs(want[real]).max() > 3.0
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=1e-4)


def test_soft_caps_and_windows_bind_in_the_tiny_configs(models, rng):
    """Dropping either cap or the window changes the logits: the parity tests see them."""
    _, config, params, _ = models["gemma2"]
    tokens, mask = hf_utils.padded_batch(rng, [SEQ, 11], SEQ, vocab=128, side="left")
    base = np.asarray(jit_logits(params, config, tokens, attention_mask=mask))
    real = mask.astype(bool)
    assert np.abs(base).max() <= 8.0 and (np.abs(base[real]) > 4.0).mean() > 0.2
    for change in (
        {"attn_logit_softcapping": None},
        {"final_logit_softcapping": None},
        {"layer_types": None, "sliding_window": None},
    ):
        other = np.asarray(
            jit_logits(params, dataclasses.replace(config, **change), tokens, attention_mask=mask)
        )
        assert np.abs(other - base)[real].max() > 0.5, change


@pytest.mark.parametrize(
    "name, unstacked", [("gemma", False), ("gemma2", False), ("gemma3", False), ("gemma3", True)]
)
def test_cached_decode_past_the_window_equals_the_full_forward(models, name, unstacked, rng):
    """Token by token through the KV cache (layers scanned, or unrolled as the CPU sampler runs
    them) from a left-padded 5-slot prompt to 18 slots: each step's hidden state and logits are
    the full forward's, and transformers'."""
    torch_model, config, params, _ = models[name]
    prompt_width, seq = 5, 18
    prompt, prompt_mask = hf_utils.padded_batch(rng, [5, 2], prompt_width, vocab=128, side="left")
    new = rng.integers(3, 128, size=(2, seq - prompt_width)).astype(np.int32)
    tokens = np.concatenate([prompt, new], axis=1)
    mask = np.concatenate([prompt_mask, np.ones_like(new)], axis=1)
    want, _ = jit_forward(params, config, tokens, attention_mask=mask)
    got = decode_utils.decode_all(params, config, tokens, mask, prompt_width, unstacked=unstacked)
    np.testing.assert_allclose(got, np.asarray(want)[:, prompt_width:], atol=2e-5, rtol=1e-5)
    hf = hf_utils.hf_logits(torch_model, tokens, mask)[:, prompt_width:]
    ours = np.asarray(jax.jit(unembed, static_argnums=1)(params, config, got))
    np.testing.assert_allclose(ours, hf, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name, decode_layers", [("gemma2", "stacked"), ("gemma3", "per_layer")])
def test_greedy_generate_matches_transformers(models, name, decode_layers, rng):
    """The native sampler (prefill + cached decode in one jitted loop) against transformers'
    ``generate`` (its sliding-window cache), 14 new tokens after prompts of up to 9: every row
    runs past the window."""
    torch_model, config, params, _ = models[name]
    tokens, mask = hf_utils.padded_batch(rng, [9, 3, 6], 9, vocab=128, side="left")
    assert_greedy_matches_hf(
        torch_model, params, config, tokens, mask, 14, decode_layers=decode_layers
    )


def test_continuous_engine_with_a_paged_cache_matches_transformers(models):
    """The continuous-batching engine on 2 slots (refilled) over a paged cache (blocks of 4
    slots; a sliding layer attends through the block-table gather, whose mask holds the
    window)."""
    torch_model, config, params, _ = models["gemma2"]
    assert_engine_matches_hf(
        torch_model, params, config, [7, 2, 9], [9, 11, 4], seed=3, kv_block_size=4
    )


# --- checkpoints and precision --------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_save_reload_round_trip(models, name, tmp_path, rng):
    """Our save of a loaded checkpoint holds transformers' own tensors, bit for bit, and
    transformers loads it as the same model."""
    torch_model, config, params, _ = models[name]
    out = str(tmp_path / "saved")
    save_pretrained(out, config, params)
    saved = load_file(os.path.join(out, "model.safetensors"))
    state = {k: v.numpy() for k, v in torch_model.state_dict().items() if k != "lm_head.weight"}
    assert set(saved) == set(state)
    for key, value in state.items():
        np.testing.assert_array_equal(saved[key], value, err_msg=key)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == [config.architecture]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32
    ).eval()
    assert type(reloaded) is type(torch_model)
    tokens, mask = hf_utils.padded_batch(rng, [12, 9], 12, vocab=128, side="left")
    np.testing.assert_allclose(
        hf_utils.hf_logits(reloaded, tokens, mask),
        hf_utils.hf_logits(torch_model, tokens, mask),
        atol=1e-5,
    )
    assert load_pretrained(out, dtype=jnp.float32)[0] == config


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_bf16_forward_close_to_f32(models, name, rng):
    """``compute_dtype=bfloat16`` (f32 master weights, bf16 matmuls; norms, softmax and caps in
    f32) stays close to the f32 forward: no further from it than transformers' own bf16 run
    (probabilities and log-probs)."""
    torch_model, config, params, _ = models[name]
    tokens, mask = hf_utils.padded_batch(rng, [SEQ, 13], SEQ, vocab=128, side="left")
    real = mask.astype(bool)
    want = np.asarray(jax.nn.log_softmax(jit_logits(params, config, tokens, attention_mask=mask)))
    bf16 = dataclasses.replace(config, compute_dtype="bfloat16")
    hidden, _ = jit_forward(params, bf16, tokens, attention_mask=mask)
    assert hidden.dtype == jnp.bfloat16
    got_logits = jit_logits(params, bf16, tokens, attention_mask=mask)
    assert got_logits.dtype == jnp.float32
    got = np.asarray(jax.nn.log_softmax(got_logits))
    hf_bf16 = copy.deepcopy(torch_model).to(torch.bfloat16)
    theirs = hf_utils.hf_logits(hf_bf16, tokens, mask).astype(np.float64)
    theirs = theirs - np.log(np.exp(theirs).sum(-1, keepdims=True))
    ours_error = np.abs(got[real] - want[real]).mean()
    # transformers' own bf16 run moves single probabilities by up to 0.04 here (Gemma 3).
    prob_error = np.abs(np.exp(got[real]) - np.exp(want[real])).max()
    assert prob_error <= 2 * np.abs(np.exp(theirs[real]) - np.exp(want[real])).max() + 1e-2
    assert 0 < ours_error <= 1.5 * np.abs(theirs[real] - want[real]).mean()


def test_bf16_norm_rounds_as_transformers(rng):
    """In bf16 Gemma's RMSNorm scales by ``1 + w`` in f32 and rounds once at the end (unlike
    Llama's, which rounds before the scale): transformers' ``Gemma2RMSNorm`` run in bf16 agrees
    but for rare one-ulp ties."""
    from jaxrl_llm.models.layers import rms_norm

    x = rng.normal(size=(64, 256)).astype(np.float32) * 3
    w = rng.normal(size=(256,)).astype(np.float32)
    norm = transformers.models.gemma2.modeling_gemma2.Gemma2RMSNorm(256, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.as_tensor(w))
        want = norm.to(torch.bfloat16)(torch.as_tensor(x).to(torch.bfloat16)).float().numpy()
    got = rms_norm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), 1e-6, plus_one=True)
    assert got.dtype == jnp.bfloat16
    assert np.mean(np.asarray(got, np.float32) != want) < 0.01


@pytest.mark.parametrize("name, remat", [("gemma2", "layer"), ("gemma3", "none")])
def test_logprob_gradients_match_torch(models, name, remat, rng):
    """The trainer's log-probs and their gradient w.r.t. every weight equal torch autograd on
    transformers' model (the einsum attention's hand-written backward through the soft cap and
    the window, under the layer scan, remat on or off)."""
    torch_model, config, params, _ = models[name]
    prompt, prompt_mask = hf_utils.padded_batch(rng, [6, 4], 6, vocab=128, side="left")
    completion, completion_mask = hf_utils.padded_batch(rng, [12, 9], 12, vocab=128, side="right")

    def loss(p):
        lp = completion_logprobs(
            p, config, prompt, prompt_mask, completion, completion_mask, remat=remat
        )
        return jnp.sum(lp * completion_mask), lp

    (value, lp), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    tokens = np.concatenate([prompt, completion], axis=1)
    mask = np.concatenate([prompt_mask, completion_mask], axis=1)
    torch_model.zero_grad()
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    out = torch_model(
        input_ids=torch.as_tensor(tokens, dtype=torch.long),
        attention_mask=torch.as_tensor(mask, dtype=torch.long),
        position_ids=torch.as_tensor(positions, dtype=torch.long),
    ).logits
    log_probs = torch.log_softmax(out[:, 5:-1].float(), dim=-1)
    picked = torch.gather(log_probs, -1, torch.as_tensor(completion, dtype=torch.long)[..., None])
    want_lp = picked[..., 0] * torch.as_tensor(completion_mask)
    want_lp.sum().backward()
    np.testing.assert_allclose(
        np.asarray(lp) * completion_mask, want_lp.detach().numpy(), atol=1e-4
    )
    torch_grads = dict(torch_model.named_parameters())
    pairs = {
        "embed": "model.embed_tokens.weight",
        "final_norm": "model.norm.weight",
    }
    for key, name_hf in pairs.items():
        got, want = np.asarray(grads[key]), torch_grads[name_hf].grad.numpy()
        np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(want).max(), err_msg=key)
    layer = 2
    wq = torch_grads[f"model.layers.{layer}.self_attn.q_proj.weight"].grad.numpy()
    got = np.asarray(grads["layers"]["wq"][layer]).reshape(config.hidden_size, -1).T
    np.testing.assert_allclose(got, wq, atol=2e-4 * np.abs(wq).max())
    for ours, theirs in (("attn_norm", "input_layernorm"), ("w_down", "mlp.down_proj")):
        want = torch_grads[f"model.layers.0.{theirs}.weight"].grad.numpy()
        got = np.asarray(grads["layers"][ours][0])
        got = got.T if got.ndim == 2 else got
        np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(want).max(), err_msg=ours)


# --- attention backends with soft caps and sliding windows ----------------------------------


def _reference(q, k, v, valid, scale, cap, window, d_out):
    """Float64 forward and VJP of causal attention with a soft cap and a sliding window.

    ``S = scale q k^T``, ``C = cap tanh(S / cap)``, ``P = softmax(C)`` over ``i - W < j <= i``
    with ``j`` real (plus the own slot), ``O = P V``; ``dC = P * (dP - rowsum(dP P))``,
    ``dS = dC (1 - tanh(S / cap)^2)``.
    """
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    seq, heads, kv_heads = q.shape[1], q.shape[2], k.shape[2]
    group = heads // kv_heads
    i, j = np.arange(seq)[:, None], np.arange(seq)[None]
    inside = (j <= i) & (i - j < (window or seq + 1))
    mask = (inside[None] & valid[:, None, :]) | np.eye(seq, dtype=bool)[None]
    out, dq, dk, dv = np.zeros(q.shape), np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for n in range(heads):
        kv = n // group
        s = np.einsum("bih,bjh->bij", q[:, :, n], k[:, :, kv]) * scale
        t = np.tanh(s / cap) if cap else None
        c = cap * t if cap else s
        c = np.where(mask, c, -np.inf)
        p = np.exp(c - c.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[:, :, n] = np.einsum("bij,bjh->bih", p, v[:, :, kv])
        dv[:, :, kv] += np.einsum("bij,bih->bjh", p, d_out[:, :, n])
        dp = np.einsum("bih,bjh->bij", d_out[:, :, n], v[:, :, kv])
        ds = p * (dp - np.sum(dp * p, -1, keepdims=True))
        if cap:
            ds = ds * (1 - t * t)
        dq[:, :, n] = scale * np.einsum("bij,bjh->bih", ds, k[:, :, kv])
        dk[:, :, kv] += scale * np.einsum("bij,bih->bjh", ds, q[:, :, n])
    return out, (dq, dk, dv)


_BACKENDS = {
    "xla": ("xla", {}),
    "einsum": ("einsum", {}),
    "einsum_blocks": (
        "einsum",
        {"kernel": attn_lib.KernelOptions(block_q=8)},
    ),  # blocks skip the keys before their window
    "splash": ("splash", {"kernel": attn_lib.KernelOptions(interpret=True)}),
}


def _attention_case(rng, seq=40):
    q, k, v = (rng.normal(size=(2, seq, heads, 64)).astype(np.float32) * 2 for heads in (4, 2, 2))
    valid = np.ones((2, seq), bool)
    valid[0, :7] = False  # left padding
    valid[0, 33:] = False  # right padding
    valid[1, 20:24] = False  # a gap (the window counts slots, as transformers does)
    d_out = rng.normal(size=q.shape).astype(np.float32) * valid[:, :, None, None]
    return q, k, v, valid, d_out


def _grads(name, options, q, k, v, valid, scale, cap, window, active, traced, d_out):
    """``(q/k/v gradients of sum(d_out * out), out)`` under jit; a ``traced`` ``active`` flag
    is a jit argument."""

    def loss(q, k, v, active):
        out = attn_lib.dot_product_attention(
            q,
            k,
            v,
            key_valid=jnp.asarray(valid),
            scale=scale,
            implementation=name,
            logit_softcap=cap,
            sliding_window=window,
            window_active=active,
            **options,
        )
        return jnp.sum(out * d_out), out

    if traced:
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
        return grad(q, k, v, jnp.asarray(active))
    grad = jax.jit(jax.grad(lambda q, k, v: loss(q, k, v, active), argnums=(0, 1, 2), has_aux=True))
    return grad(q, k, v)


@pytest.mark.parametrize("backend", list(_BACKENDS))
@pytest.mark.parametrize(
    "cap, window, traced", [(3.0, 5, False), (3.0, None, False), (None, 5, True)]
)
def test_attention_backends_with_soft_cap_and_window(rng, backend, cap, window, traced):
    """Each backend's output and q/k/v gradients against the float64 reference. ``traced``: the
    window's flag is a traced bool (a layer inside the scan over sliding and global layers),
    on (the window applies) and off (it does not)."""
    name, options = _BACKENDS[backend]
    q, k, v, valid, d_out = _attention_case(rng)
    for active in (True, False) if traced else (True,):
        grads, out = _grads(
            name, options, q, k, v, valid, 0.125, cap, window, active, traced, d_out
        )
        want, want_grads = _reference(q, k, v, valid, 0.125, cap, window if active else None, d_out)
        np.testing.assert_allclose(np.asarray(out)[valid], want[valid], atol=2e-5, rtol=1e-5)
        for label, got, ref_grad in zip("qkv", grads, want_grads):
            np.testing.assert_allclose(np.asarray(got), ref_grad, atol=2e-4, err_msg=label)


@pytest.mark.parametrize("seq", [1, 3])  # 1: the CPU decode path without the query axis
def test_cache_attention_with_soft_cap_and_window(rng, seq):
    """Attention over a cache: queries at slots 9.. of 12, a window of 4, a soft cap."""
    slots, window, cap = 12, 4, 2.0
    q = rng.normal(size=(2, seq, 4, 16)).astype(np.float32) * 2
    k, v = (rng.normal(size=(2, 2, slots, 16)).astype(np.float32) * 2 for _ in range(2))
    key_valid = np.ones((2, slots), bool)
    key_valid[0, :3] = False
    query_slots = jnp.arange(9, 9 + seq)
    mask = attn_lib.attention_mask(jnp.asarray(key_valid), query_slots, window=window)
    got = attn_lib.cache_attention(q, k, v, mask, scale=0.25, logit_softcap=cap)
    # float64: each query head against its kv head, keys 9 + s - 3 .. 9 + s.
    for b in range(2):
        for s in range(seq):
            keys = [j for j in range(slots) if 0 <= 9 + s - j < window and key_valid[b, j]]
            for n in range(4):
                scores = k[b, n // 2, keys].astype(np.float64) @ q[b, s, n] * 0.25
                scores = cap * np.tanh(scores / cap)
                p = np.exp(scores - scores.max())
                p /= p.sum()
                want = p @ v[b, n // 2, keys]
                np.testing.assert_allclose(np.asarray(got)[b, s, n], want, atol=1e-5)


def test_backend_choice_never_drops_a_cap_or_a_window(monkeypatch):
    """On an NVIDIA GPU ``auto`` picks cuDNN only without a soft cap or a window (it takes
    neither), and asking for cuDNN with one is an error, not a silent drop."""
    import jaxrl_llm.models.attention as attention_module

    monkeypatch.setattr(attention_module, "current_platform", lambda: ("gpu", "NVIDIA H100"))
    resolve = attn_lib.resolve_attention_implementation
    assert resolve("auto", dtype=jnp.bfloat16, head_dim=64) == "cudnn"
    assert resolve("auto", dtype=jnp.bfloat16, head_dim=64, logit_softcap=50.0) == "xla"
    assert resolve("auto", dtype=jnp.bfloat16, head_dim=64, sliding_window=4096) == "xla"
    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    for extra in ({"logit_softcap": 50.0}, {"sliding_window": 4}):
        with pytest.raises(ValueError, match="soft cap or sliding window"):
            attn_lib.dot_product_attention(
                q,
                q,
                q,
                key_valid=jnp.ones((1, 8), bool),
                scale=0.1,
                implementation="cudnn",
                **extra,
            )


def test_paged_kernel_takes_the_soft_cap():
    """JAX's TPU paged-attention kernel (its interpreter here), as a global Gemma 2 layer's
    decode calls it on TPU: the scaled scores capped by ``attn_logits_soft_cap``, equal to a
    float64 capped softmax over each row's slots (sliding layers never take the kernel: it has
    no window, so they gather)."""
    from jaxrl_llm.models import attention_backends

    rng = np.random.default_rng(5)
    batch, heads, kv_heads, head_dim, size, blocks = 2, 4, 2, 16, 4, 5
    q = rng.normal(size=(batch, heads, head_dim)).astype(np.float32) * 3
    k, v = (rng.normal(size=(kv_heads, blocks, size, head_dim)).astype(np.float32) for _ in "kv")
    lengths = np.array([3, 7], np.int32)
    table = np.array([[4, 5], [1, 2]], np.int32)
    scale, cap = 0.3, 1.5
    got = attention_backends._paged_kernel_attention(
        jnp.asarray(q),
        jnp.asarray(k, jnp.bfloat16),
        jnp.asarray(v, jnp.bfloat16),
        jnp.asarray(lengths),
        jnp.asarray(table),
        scale=scale,
        logit_softcap=cap,
    )
    kb, vb = (
        np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64) for x in (k, v)
    )
    for b in range(batch):
        slots = np.arange(lengths[b])
        keys = kb[:, table[b, slots // size], slots % size]
        values = vb[:, table[b, slots // size], slots % size]
        for n in range(heads):
            scores = cap * np.tanh(scale * keys[n // 2] @ q[b, n].astype(np.float64) / cap)
            probs = np.exp(scores - scores.max())
            want = probs @ values[n // 2] / probs.sum()
            np.testing.assert_allclose(np.asarray(got)[b, n], want, rtol=1e-5, atol=1e-5)


def test_reward_head_round_trips_through_transformers(models, tmp_path, rng):
    """A scalar head on Gemma 3 saves as transformers' text-only
    ``Gemma3TextForSequenceClassification`` (``Gemma3ForSequenceClassification`` is the
    vision-language one), which scores as ``sequence_scores`` does, and transformers' own save
    of it reads back."""
    from jaxrl_llm.models import (
        init_scalar_params,
        load_scalar_model,
        save_scalar_model,
        sequence_scores,
    )

    _, config, params, _ = models["gemma3"]
    scalar = init_scalar_params(config, jax.random.key(0), backbone=params, score_std=0.5)
    save_scalar_model(str(tmp_path), config, scalar)
    classifier = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(tmp_path), attn_implementation="eager", dtype=torch.float32
    ).eval()
    assert type(classifier).__name__ == "Gemma3TextForSequenceClassification"
    # What transformers itself writes (its class name in architectures) reads back too.
    classifier.save_pretrained(str(tmp_path / "hf"))
    loaded_config, loaded = load_scalar_model(str(tmp_path / "hf"), dtype=jnp.float32)
    assert loaded_config == config
    tokens = rng.integers(3, 128, size=(2, SEQ))  # no pad id inside: HF pools the last token
    with torch.no_grad():
        want = classifier(input_ids=torch.as_tensor(tokens)).logits[:, 0].numpy()
    real = np.ones((2, SEQ // 2), bool)
    got = sequence_scores(loaded, config, tokens[:, : SEQ // 2], real, tokens[:, SEQ // 2 :], real)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)
