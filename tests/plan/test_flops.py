"""Analytic FLOPs: hand counts on a tiny config, and XLA's own count of the project's model.

XLA's ``cost_analysis()["flops"]`` counts a ``while`` body once, so the compiled comparisons use
one layer (the layer scan then runs once and is the whole program). XLA also counts elementwise
work (norms, softmax, RoPE), so its figure may only exceed the matmul count, by a little.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jaxrl_llm.models import ModelConfig, forward, init_cache, param_shapes, unembed
from jaxrl_llm.plan import flops

# V=10, D=8, F=16, L=2, N=2 query heads, K=1 key/value head, H=4.
TINY = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=10,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
)
# Per token and layer: q 2*8*2*4 = 128, k 2*8*1*4 = 64, v 64, o 2*2*4*8 = 128 -> 384;
# MLP 3 * 2*8*16 = 768; per (query, key) pair 4*2*4 = 32; unembed 2*8*10 = 160 per position.


def test_forward_flops_by_hand():
    # B=1, S=3, causal: 3*4/2 = 6 pairs. 2 layers x 3 tokens.
    assert flops.forward_flops_breakdown(TINY, 1, 3) == {
        "projections": 2 * 3 * 384,
        "attention": 2 * 6 * 32,
        "mlp": 2 * 3 * 768,
        "unembed": 3 * 160,
    }
    assert flops.forward_flops(TINY, 1, 3) == 2304 + 384 + 4608 + 480  # 7776
    assert flops.forward_flops(TINY, 1, 3, causal=False) == 7776 + 2 * (9 - 6) * 32
    assert flops.forward_flops(TINY, 1, 3, logits_positions=2) == 7776 - 160
    assert flops.forward_flops(TINY, 1, 3, logits_positions=0) == 7776 - 480
    assert flops.forward_flops(TINY, 2, 3) == 2 * 7776


def test_decode_flops_by_hand():
    # B=2 rows, one token each over 5 cache slots: 2 x 5 pairs a layer, one logits row each.
    want = 2 * 2 * 384 + 2 * 10 * 32 + 2 * 2 * 768 + 2 * 160
    assert flops.decode_flops(TINY, 2, 5) == want == 5568
    assert flops.forward_flops(TINY, 2, 1, kv_len=5, logits_positions=1) == want


def test_train_flops_by_hand():
    assert flops.train_flops(TINY, 1, 3) == 3 * 7776
    # remat="layer": the layers' forward again (7776 - 480) less the down projections
    # (2*8*16 = 256 a token and layer, 6 of them).
    assert flops.train_flops(TINY, 1, 3, remat="layer") == 3 * 7776 + (7776 - 480) - 6 * 256
    # remat="offload" recomputes as "layer" does (its layer inputs wait on the host).
    assert flops.train_flops(TINY, 1, 3, remat="offload") == 3 * 7776 + (7776 - 480) - 6 * 256


def test_params_and_6n():
    per_layer = 8 * (2 * 4 + 2 * 1 * 4) + 2 * 4 * 8 + 3 * 8 * 16  # 576
    assert flops.matmul_params_per_layer(TINY) == per_layer
    assert flops.matmul_params(TINY) == 2 * per_layer + 8 * 10
    assert flops.model_flops_per_token(TINY) == 6 * (2 * 576 + 80)
    # Attention term: 12 L N H (S + 1) / 2 = 12 * 2 * 8 * 2 with S = 3.
    assert flops.model_flops_per_token(TINY, 3) == 6 * 1232 + 384
    assert flops.model_flops_per_token(TINY, 3, causal=False) == 6 * 1232 + 12 * 2 * 8 * 3


@pytest.mark.parametrize("seq", [1, 7, 128])
def test_model_flops_per_token_matches_train_flops(seq):
    config = dataclasses.replace(TINY, num_hidden_layers=3, num_key_value_heads=2)
    per_token = flops.train_flops(config, 4, seq) / (4 * seq)
    assert flops.model_flops_per_token(config, seq) == pytest.approx(per_token, rel=1e-12)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"architecture": "Qwen2ForCausalLM", "qkv_bias": True},
        {"architecture": "Qwen3ForCausalLM", "qk_norm": True, "o_bias": True, "qkv_bias": True},
        {"tie_word_embeddings": True},
    ],
)
def test_param_count_matches_the_models_parameters(overrides):
    config = dataclasses.replace(TINY, **overrides)
    sizes = [leaf.size for leaf in jax.tree.leaves(param_shapes(config))]
    assert flops.param_count(config) == sum(sizes)


def test_attention_pairs():
    assert flops.attention_pairs(4) == 10
    assert flops.attention_pairs(4, causal=False) == 16
    assert flops.attention_pairs(4, kv_len=4) == 10
    assert flops.attention_pairs(4, kv_len=9) == 36
    assert flops.attention_pairs(1, kv_len=9) == 9


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: flops.forward_flops(TINY, 0, 3), "batch"),
        (lambda: flops.forward_flops(TINY, 1, 3, logits_positions=4), "logits_positions"),
        (lambda: flops.forward_flops(TINY, 1, 3, kv_len=0), "kv_len"),
        (lambda: flops.train_flops(TINY, 1, 3, remat="full"), "remat"),
        (lambda: flops.model_flops_per_token(TINY, 0), "seq"),
    ],
)
def test_bad_input_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- against XLA's count of the project's own model -------------------------------------------

ONE_LAYER = ModelConfig(
    architecture="Qwen3ForCausalLM",
    vocab_size=512,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    qk_norm=True,
)
B, S = 2, 64


def _xla_flops(fn, *args):
    return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]


def _tokens(seq):
    return jax.ShapeDtypeStruct((B, seq), jnp.int32)


def _check(xla, analytic):
    # XLA adds the elementwise work: at most ~1% here, never less than the matmuls.
    assert 1.0 <= xla / analytic < 1.02, (xla, analytic)


def test_forward_matches_xla_cost_analysis():
    def fn(params, tokens):
        return unembed(params, ONE_LAYER, forward(params, ONE_LAYER, tokens)[0])

    # Without a cache the model computes every (query, key) score and masks: the full square.
    analytic = flops.forward_flops(ONE_LAYER, B, S, causal=False)
    _check(_xla_flops(fn, param_shapes(ONE_LAYER), _tokens(S)), analytic)


def test_decode_matches_xla_cost_analysis():
    def fn(params, tokens, cache):
        positions = jnp.zeros((B, 1), jnp.int32)
        hidden, _ = forward(
            params, ONE_LAYER, tokens, positions=positions, cache=cache, cache_index=5
        )
        return unembed(params, ONE_LAYER, hidden)

    cache = jax.eval_shape(lambda: init_cache(ONE_LAYER, B, 128, dtype=jnp.float32))
    _check(
        _xla_flops(fn, param_shapes(ONE_LAYER), _tokens(1), cache),
        flops.decode_flops(ONE_LAYER, B, 128),
    )


@pytest.mark.parametrize("remat", ["none", "layer"])
def test_train_step_matches_xla_cost_analysis(remat):
    def loss(params, tokens):
        hidden, _ = forward(params, ONE_LAYER, tokens, remat=remat)
        return jnp.square(unembed(params, ONE_LAYER, hidden)).sum()

    analytic = flops.train_flops(ONE_LAYER, B, S, remat=remat, causal=False)
    _check(_xla_flops(jax.grad(loss), param_shapes(ONE_LAYER), _tokens(S)), analytic)


# TINY's attention with a Qwen2-MoE MLP: E=4 experts of width F_e=6, k=2 a token, a shared
# expert of width 12 with its gate.
TINY_MOE = dataclasses.replace(
    TINY,
    architecture="Qwen2MoeForCausalLM",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=6,
    shared_expert_intermediate_size=12,
)


def test_moe_counts_the_active_weights_by_hand():
    # Router 8*4 = 32; two experts 2 * 3*8*6 = 288; shared 3*8*12 = 288 and its gate 8.
    mlp = 32 + 288 + 288 + 8
    assert flops.mlp_params_per_layer(TINY_MOE) == mlp == 616
    attention = 8 * (2 * 4 + 2 * 1 * 4) + 2 * 4 * 8  # 192
    assert flops.matmul_params_per_layer(TINY_MOE) == attention + mlp
    assert flops.forward_flops_breakdown(TINY_MOE, 1, 3)["mlp"] == 2 * 3 * 2 * mlp
    no_shared = dataclasses.replace(
        TINY_MOE, architecture="Qwen3MoeForCausalLM", shared_expert_intermediate_size=0
    )
    assert flops.mlp_params_per_layer(no_shared) == 32 + 288
    # Nothing of a mixture is dropped under remat: the layers' whole forward again.
    forward = flops.forward_flops(TINY_MOE, 1, 3)
    assert flops.train_flops(TINY_MOE, 1, 3, remat="layer") == 4 * forward - 3 * 160
