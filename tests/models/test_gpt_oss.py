"""gpt-oss (``GptOssForCausalLM``) against transformers on a tiny random checkpoint: config
parsing and defaults, prefill logits past the sliding window, packed rows, cached decode, the
static sampler and the continuous engine, save -> reload, bf16, training gradients (the sinks'
included), LoRA on the attention with peft as the reference, and the router.

The tiny model (``hf_utils.GPT_OSS``) has 4 layers alternating sliding (window 6) and full
attention, 8 experts top-2, YaRN RoPE; its experts' gate/up weights are scaled so the ±7 clamp
binds and its sinks drawn ``N(0, 1)`` so they hold a fair share of each softmax
(``test_the_gpt_oss_features_bind`` checks that each feature moves the logits). Every
sequence is longer than the window.
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
    LoraSpec,
    ModelConfig,
    forward,
    load_pretrained,
    logits,
    lora,
    param_count,
    param_shapes,
    save_pretrained,
    unembed,
)
from tests.models import decode_utils, hf_utils
from tests.sampling.hf_reference import assert_engine_matches_hf, assert_greedy_matches_hf

WINDOW = hf_utils.GPT_OSS_WINDOW
SEQ = 20  # > WINDOW: the sliding layers drop keys
VOCAB = hf_utils.GPT_OSS["vocab_size"]

jit_logits = jax.jit(logits, static_argnums=1)
jit_forward = jax.jit(forward, static_argnums=1, static_argnames=("remat", "outputs"))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(torch model, config, f32 params, checkpoint dir) of the tiny gpt-oss."""
    path = str(tmp_path_factory.mktemp("gpt_oss"))
    torch_model = hf_utils.build_gpt_oss(seed=70)
    torch_model.save_pretrained(path)
    config, params = load_pretrained(path, dtype=jnp.float32)
    return torch_model, config, params, path


def _hf_dict(**overrides) -> dict:
    config = transformers.GptOssConfig(**{**hf_utils.GPT_OSS, **overrides})
    return {**config.to_dict(), "architectures": ["GptOssForCausalLM"]}


# --- config ---------------------------------------------------------------------------------


def test_config_reads_the_gpt_oss_features():
    config = ModelConfig.from_hf_dict(_hf_dict())
    assert config.model_type == "gpt_oss" and config.is_moe
    assert (config.qkv_bias, config.o_bias, config.qk_norm) == (True, True, False)
    assert config.attention_sinks and config.expert_biases and config.norm_in_f32
    assert config.sliding_layers == (True, False, True, False)
    assert config.sliding_window == WINDOW
    assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
    assert config.moe_intermediate_size == config.intermediate_size and config.norm_topk_prob
    assert (config.swiglu_limit, config.swiglu_alpha) == (7.0, 1.702)
    assert (config.rope_type, config.rope_factor, config.rope_theta) == ("yarn", 4.0, 1000.0)
    assert config.rope_original_max_position_embeddings == 64 and not config.rope_truncate
    assert config.rope_attention_scaling == pytest.approx(0.1 * np.log(4.0) + 1.0)
    assert not config.tie_word_embeddings
    hash(config)


def test_to_hf_dict_round_trips_through_transformers():
    config = ModelConfig.from_hf_dict(_hf_dict(swiglu_limit=5.0, swiglu_alpha=1.5))
    ours = config.to_hf_dict()
    assert ModelConfig.from_hf_dict(ours) == config
    theirs = transformers.GptOssConfig.from_dict(ours)
    read_back = {**theirs.to_dict(), "architectures": ours["architectures"]}
    assert ModelConfig.from_hf_dict(read_back) == config
    assert tuple(theirs.layer_types) == config.layer_types
    assert (theirs.swiglu_limit, theirs.swiglu_alpha, theirs.sliding_window) == (5.0, 1.5, WINDOW)
    assert theirs.rope_parameters["rope_type"] == "yarn"
    assert theirs.rope_parameters["truncate"] is False


def test_keys_left_out_take_the_transformers_defaults():
    """A config.json without RoPE, layer kinds, window, biases, clamp or eps keys means what
    transformers' ``GptOssConfig`` makes of it (YaRN x32 over 4096 tokens at base 150000, every
    other layer sliding over 128 keys from layer 0, attention biases on)."""
    left_out = (
        "rope_parameters",
        "layer_types",
        "sliding_window",
        "attention_bias",
        "swiglu_limit",
        "swiglu_alpha",
        "rms_norm_eps",
        "max_position_embeddings",
    )
    hf = {k: v for k, v in _hf_dict(num_hidden_layers=5).items() if k not in left_out}
    config = ModelConfig.from_hf_dict(hf)
    theirs = transformers.GptOssConfig.from_dict(hf)
    assert config.layer_types == tuple(theirs.layer_types)
    assert config.sliding_layers == (True, False, True, False, True)
    assert config.sliding_window == theirs.sliding_window == 128
    assert config.qkv_bias == config.o_bias == theirs.attention_bias is True
    assert (config.swiglu_limit, config.swiglu_alpha) == (theirs.swiglu_limit, theirs.swiglu_alpha)
    assert config.rms_norm_eps == theirs.rms_norm_eps == 1e-5
    assert config.max_position_embeddings == theirs.max_position_embeddings == 131072
    params = theirs.rope_parameters
    assert (config.rope_type, config.rope_theta) == (params["rope_type"], params["rope_theta"])
    assert config.rope_factor == params["factor"] == 32.0
    assert config.rope_original_max_position_embeddings == 4096
    assert config.rope_truncate is params["truncate"] is False


@pytest.mark.parametrize(
    "update, match",
    [
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quant_method"),
        ({"layer_types": ["chunked_attention"] * 4}, "layer_types"),
        ({"layer_types": ["full_attention"] * 3}, "3 entries"),
        ({"sliding_window": None}, "sliding_window is null"),
        ({"num_local_experts": 0}, "without experts"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_refuses_what_it_does_not_run(update, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({**_hf_dict(), **update})


def test_mxfp4_quantization_config_is_accepted():
    """Released checkpoints name their MXFP4 experts; the loader dequantises them (see
    test_mxfp4.py), so the config parses as the same model."""
    quantised = {**_hf_dict(), "quantization_config": {"quant_method": "mxfp4"}}
    assert ModelConfig.from_hf_dict(quantised) == ModelConfig.from_hf_dict(_hf_dict())


def test_gpt_oss_fields_are_its_own():
    config = ModelConfig.from_hf_dict(_hf_dict())
    with pytest.raises(ValueError, match="swiglu_limit must be set exactly"):
        dataclasses.replace(config, swiglu_limit=None)
    with pytest.raises(ValueError, match="qkv_bias and o_bias must agree"):
        dataclasses.replace(config, o_bias=False)
    with pytest.raises(ValueError, match="moe_intermediate_size must equal"):
        dataclasses.replace(config, moe_intermediate_size=32)
    with pytest.raises(ValueError, match="adapt the expert weights"):
        dataclasses.replace(config, lora=LoraSpec(4, 8.0, ("q", "gate")))
    llama = ModelConfig.from_hf_dict(hf_utils.hf_dict("llama"))
    with pytest.raises(ValueError, match="swiglu_limit must be set exactly"):
        dataclasses.replace(llama, swiglu_limit=7.0)
    with pytest.raises(ValueError, match="only supported on Gemma and gpt-oss"):
        dataclasses.replace(
            llama, sliding_window=4, layer_types=("sliding_attention", "full_attention")
        )


def test_param_count_and_init(model):
    torch_model, config, _, _ = model
    assert param_count(config) == sum(p.numel() for p in torch_model.parameters())
    assert param_count(config) == sum(x.size for x in jax.tree.leaves(param_shapes(config)))
    shapes = param_shapes(config)["layers"]
    assert shapes["sinks"].shape == (4, 4) and shapes["router_bias"].shape == (4, 8)
    assert shapes["expert_b_gate"].shape == shapes["expert_b_up"].shape == (4, 8, 64)
    assert shapes["expert_b_down"].shape == (4, 8, 64)


# --- forward, packed rows and decode --------------------------------------------------------


@pytest.mark.parametrize("side", ["left", "right", "none"])
def test_logits_match_transformers_past_the_window(model, side, rng):
    """Prefill logits of 20-token rows (and shorter padded ones) against transformers (eager
    attention with sinks, in float32)."""
    torch_model, config, params, _ = model
    lengths = [SEQ, SEQ] if side == "none" else [SEQ, 15, 3]
    tokens, mask = hf_utils.padded_batch(rng, lengths, SEQ, vocab=VOCAB, side=side)
    want = hf_utils.hf_logits(torch_model, tokens, mask)
    got = np.asarray(jit_logits(params, config, tokens, attention_mask=mask))
    real = mask.astype(bool)
    assert np.abs(want[real]).max() > 3.0
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=1e-4)


def test_the_gpt_oss_features_bind(model, rng):
    """Dropping the sinks, the clamp, the router bias, the expert biases, YaRN's attention
    factor or the window changes the logits: the parity tests see each of them."""
    _, config, params, _ = model
    tokens, mask = hf_utils.padded_batch(rng, [SEQ, 11], SEQ, vocab=VOCAB, side="left")
    real = mask.astype(bool)
    base = np.asarray(jit_logits(params, config, tokens, attention_mask=mask))
    layers = params["layers"]

    def changed(new_config=config, **new_layers):
        new_params = {**params, "layers": {**layers, **new_layers}}
        out = np.asarray(jit_logits(new_params, new_config, tokens, attention_mask=mask))
        return np.abs(out - base)[real].max()

    assert changed(sinks=jnp.full_like(layers["sinks"], -1e9)) > 0.5
    assert changed(dataclasses.replace(config, swiglu_limit=1e9)) > 0.5
    assert changed(router_bias=jnp.zeros_like(layers["router_bias"])) > 0.1
    assert changed(expert_b_down=jnp.zeros_like(layers["expert_b_down"])) > 0.1
    assert changed(dataclasses.replace(config, rope_attention_factor=1.0)) > 0.1
    assert changed(dataclasses.replace(config, layer_types=None, sliding_window=None)) > 0.5


def test_router_logits_match_transformers(model, rng):
    """Every layer's router logits (``h W_r + b_r``, f32), as transformers records them."""
    torch_model, config, params, _ = model
    tokens = rng.integers(3, VOCAB, size=(2, 12))
    _, _, router = jit_forward(params, config, tokens, outputs=("router_logits",))
    with torch.no_grad():
        out = torch_model(input_ids=torch.as_tensor(tokens), output_router_logits=True)
    want = np.stack([x.numpy() for x in out.router_logits]).reshape(router.shape)
    np.testing.assert_allclose(np.asarray(router), want, atol=1e-4, rtol=1e-4)


def test_packed_forward_equals_each_sequence_padded(model, rng):
    """Two sequences packed in one row (``segment_ids``) give each token the hidden state it has
    in its own padded row: the sinks, the window and the segment mask compose."""
    _, config, params, _ = model
    first, second = rng.integers(3, VOCAB, size=9), rng.integers(3, VOCAB, size=13)
    packed = np.zeros((1, 24), np.int32)
    packed[0, :9], packed[0, 9:22] = first, second
    segments = np.zeros((1, 24), np.int32)
    segments[0, :9], segments[0, 9:22] = 1, 2
    got, _ = jit_forward(params, config, jnp.asarray(packed), segment_ids=jnp.asarray(segments))
    alone = np.zeros((2, 13), np.int32)
    alone[0, :9], alone[1] = first, second
    mask = np.zeros((2, 13), np.int32)
    mask[0, :9], mask[1] = 1, 1
    want, _ = jit_forward(params, config, jnp.asarray(alone), attention_mask=jnp.asarray(mask))
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_allclose(got[0, :9], want[0, :9], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(got[0, 9:22], want[1], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("unstacked", [False, True])
def test_cached_decode_past_the_window_equals_the_full_forward(model, unstacked, rng):
    """Token by token through the KV cache (layers scanned, or unrolled as the CPU sampler runs
    them; the one-query decode path with sinks) from a left-padded 5-slot prompt to 16 slots:
    each step's hidden state is the full forward's, its logits transformers'."""
    torch_model, config, params, _ = model
    prompt_width, seq = 5, 16
    prompt, prompt_mask = hf_utils.padded_batch(rng, [5, 2], prompt_width, vocab=VOCAB, side="left")
    new = rng.integers(3, VOCAB, size=(2, seq - prompt_width)).astype(np.int32)
    tokens = np.concatenate([prompt, new], axis=1)
    mask = np.concatenate([prompt_mask, np.ones_like(new)], axis=1)
    want, _ = jit_forward(params, config, tokens, attention_mask=mask)
    got = decode_utils.decode_all(params, config, tokens, mask, prompt_width, unstacked=unstacked)
    np.testing.assert_allclose(got, np.asarray(want)[:, prompt_width:], atol=2e-5, rtol=1e-5)
    hf = hf_utils.hf_logits(torch_model, tokens, mask)[:, prompt_width:]
    ours = np.asarray(jax.jit(unembed, static_argnums=1)(params, config, got))
    np.testing.assert_allclose(ours, hf, atol=1e-4, rtol=1e-4)


def test_greedy_generate_matches_transformers(model, rng):
    """The native sampler (prefill + cached decode in one jitted loop) against transformers'
    ``generate``: 12 new tokens after prompts of up to 9, every row past the window."""
    torch_model, config, params, _ = model
    tokens, mask = hf_utils.padded_batch(rng, [9, 3, 6], 9, vocab=VOCAB, side="left")
    assert_greedy_matches_hf(torch_model, params, config, tokens, mask, 12)


def test_continuous_engine_with_a_paged_cache_matches_transformers(model):
    """The continuous-batching engine on 2 slots (refilled) over a paged cache (blocks of 4
    slots): every layer attends through the block-table gather, which takes the sinks."""
    torch_model, config, params, _ = model
    assert_engine_matches_hf(
        torch_model, params, config, [7, 2, 9], [9, 11, 4], seed=3, kv_block_size=4
    )


# --- checkpoints, precision, gradients ------------------------------------------------------


def test_save_reload_round_trip(model, tmp_path, rng):
    """Our save of a loaded checkpoint holds transformers' own tensors bit for bit (the
    interleaved gate_up_proj re-interleaved), and transformers loads it as the same model."""
    torch_model, config, params, _ = model
    out = str(tmp_path / "saved")
    save_pretrained(out, config, params)
    saved = load_file(os.path.join(out, "model.safetensors"))
    state = {k: v.numpy() for k, v in torch_model.state_dict().items()}
    assert set(saved) == set(state)
    for key, value in state.items():
        np.testing.assert_array_equal(saved[key], value, err_msg=key)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == ["GptOssForCausalLM"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32
    ).eval()
    assert type(reloaded) is type(torch_model)
    tokens, mask = hf_utils.padded_batch(rng, [12, 9], 12, vocab=VOCAB, side="left")
    np.testing.assert_allclose(
        hf_utils.hf_logits(reloaded, tokens, mask),
        hf_utils.hf_logits(torch_model, tokens, mask),
        atol=1e-5,
    )
    assert load_pretrained(out, dtype=jnp.float32)[0] == config


def test_bf16_forward_close_to_f32(model, rng):
    """``compute_dtype=bfloat16`` (f32 master weights, bf16 matmuls; norms, router, sinks and
    softmax in f32) is finite and stays close to the f32 forward: log-probs within 0.25 on
    average and no further than 1.5x transformers' own bf16 run is from the same f32 model
    (0.11 here: the clamp-crossing expert weights of the tiny model make it bf16-sensitive)."""
    torch_model, config, params, _ = model
    tokens, mask = hf_utils.padded_batch(rng, [SEQ, 13], SEQ, vocab=VOCAB, side="left")
    real = mask.astype(bool)
    want = np.asarray(jax.nn.log_softmax(jit_logits(params, config, tokens, attention_mask=mask)))
    bf16 = dataclasses.replace(config, compute_dtype="bfloat16")
    hidden, _ = jit_forward(params, bf16, tokens, attention_mask=mask)
    assert hidden.dtype == jnp.bfloat16
    got = np.asarray(jax.nn.log_softmax(jit_logits(params, bf16, tokens, attention_mask=mask)))
    assert np.isfinite(got).all()
    theirs = hf_utils.hf_logits(copy.deepcopy(torch_model).to(torch.bfloat16), tokens, mask)
    theirs = theirs.astype(np.float64)
    theirs = theirs - np.log(np.exp(theirs).sum(-1, keepdims=True))
    ours_error = np.abs(got[real] - want[real]).mean()
    assert 0 < ours_error <= min(0.25, 1.5 * np.abs(theirs[real] - want[real]).mean())


def test_logprob_gradients_match_torch(model, rng):
    """The trainer's log-probs and their gradients (the sinks', through the einsum attention's
    hand-written backward pass, the expert weights' and biases', the router's) equal torch
    autograd on transformers' model."""
    torch_model, config, params, _ = model
    prompt, prompt_mask = hf_utils.padded_batch(rng, [6, 4], 6, vocab=VOCAB, side="left")
    completion, completion_mask = hf_utils.padded_batch(rng, [12, 9], 12, vocab=VOCAB, side="right")

    def loss(p):
        lp = completion_logprobs(p, config, prompt, prompt_mask, completion, completion_mask)
        return jnp.sum(lp * completion_mask), lp

    (_, lp), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

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
    theirs = {n: p.grad.numpy() for n, p in torch_model.named_parameters()}
    layers = grads["layers"]
    # ours -> (transformers' name in layer i, how its gradient maps onto ours)
    pairs = {
        "sinks": ("self_attn.sinks", lambda g: g),
        "bq": ("self_attn.q_proj.bias", lambda g: g.reshape(4, 16)),
        "router": ("mlp.router.weight", lambda g: g.T),
        "router_bias": ("mlp.router.bias", lambda g: g),
        "expert_w_gate": ("mlp.experts.gate_up_proj", lambda g: g[..., ::2]),
        "expert_w_up": ("mlp.experts.gate_up_proj", lambda g: g[..., 1::2]),
        "expert_b_up": ("mlp.experts.gate_up_proj_bias", lambda g: g[..., 1::2]),
        "expert_b_down": ("mlp.experts.down_proj_bias", lambda g: g),
    }
    for ours, (name, to_ours) in pairs.items():
        for i in range(config.num_hidden_layers):
            want = to_ours(theirs[f"model.layers.{i}.{name}"])
            np.testing.assert_allclose(
                np.asarray(layers[ours][i]),
                want,
                atol=2e-4 * np.abs(want).max() + 1e-7,
                err_msg=f"{ours}[{i}]",
            )
    assert np.abs(np.asarray(layers["sinks"])).max() > 1e-3


# --- LoRA ------------------------------------------------------------------------------------


def test_lora_on_the_biased_attention_matches_peft(model, tmp_path, rng):
    """Adapters on q/k/v/o (the projections carry biases: the low-rank path adds to ``x W``,
    the bias after, as peft's ``Linear`` does): peft loads our adapter with our logits."""
    peft = pytest.importorskip("peft")
    torch_model, config, base, path = model
    config = dataclasses.replace(config, lora=LoraSpec(4, 8.0, ("q", "k", "v", "o")))
    adapters = lora.init_adapters(config, jax.random.key(0))
    keys = iter(jax.random.split(jax.random.key(1), 16))
    adapters = jax.tree.map(
        lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), adapters
    )
    params = lora.combine(base, adapters)
    lora.save_peft_adapter(tmp_path / "adapter", config, params, base_model=path)
    peft_model = peft.PeftModel.from_pretrained(
        copy.deepcopy(torch_model), str(tmp_path / "adapter")
    ).eval()
    tokens, mask = hf_utils.padded_batch(rng, [9, 4], 9, vocab=VOCAB, side="left")
    want = hf_utils.hf_logits(peft_model, tokens, mask)
    got = np.asarray(jit_logits(params, config, tokens, attention_mask=mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=1e-4)
    plain = np.asarray(jit_logits(base, lora.base_config(config), tokens, attention_mask=mask))
    assert np.abs(plain[real] - want[real]).max() > 1e-2
    merged = lora.merge_weights(params, config)
    merged_logits = jit_logits(merged, lora.base_config(config), tokens, attention_mask=mask)
    np.testing.assert_allclose(np.asarray(merged_logits)[real], got[real], atol=1e-4)
