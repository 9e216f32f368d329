"""Mixture-of-experts layers (``models.moe``): routing, grouped experts, router losses, f32
router under bf16 compute, gradients against a float64 per-token loop, and the model's router
logits and auxiliary loss against transformers. Logits parity and the save -> transformers round
trip of the MoE variants run with the dense ones (test_transformer.py, test_checkpoint.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.models.qwen2_moe import modeling_qwen2_moe

from jaxrl_llm.models import (
    ModelConfig,
    cast_params,
    forward,
    logits,
    moe,
    param_count,
    param_shapes,
    save_pretrained,
)
from tests.models import hf_utils
from tests.reference import moe as ref

jit_forward = jax.jit(forward, static_argnums=1, static_argnames="outputs")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (torch model, config, f32 params) for each tiny MoE variant."""
    loaded = hf_utils.load_variants(tmp_path_factory, hf_utils.MOE_VARIANTS, first_seed=30)
    return {
        name: (torch_model, config, params)
        for name, (torch_model, config, params, _) in loaded.items()
    }


def _layer_weights(rng, d=8, scale=1.0):
    """``(router [D, E], w_gate [E, D, F], w_up [E, D, F], w_down [E, F, D])``, E = 4, F = 6."""
    return ref.layer_weights(rng, d, 4, 6, router_scale=scale)


@pytest.mark.parametrize("normalize", [False, True])
def test_route_is_top_k_of_the_softmax(rng, normalize):
    logits = rng.standard_normal((7, 5)).astype(np.float32)
    weights, experts = moe.route(jnp.asarray(logits), top_k=2, normalize=normalize)
    want_weights, want_experts = ref.route(logits, 2, normalize)
    np.testing.assert_array_equal(np.asarray(experts), want_experts)
    np.testing.assert_allclose(np.asarray(weights), want_weights, rtol=1e-6)
    if normalize:  # Mixtral's form: the softmax over the k chosen logits
        chosen = np.take_along_axis(logits, want_experts, axis=-1)
        softmax = np.exp(chosen) / np.exp(chosen).sum(-1, keepdims=True)
        np.testing.assert_allclose(np.asarray(weights), softmax, rtol=1e-6)


def test_grouped_experts_equal_a_per_token_loop(rng):
    _, w_gate, w_up, w_down = _layer_weights(rng)
    x = rng.standard_normal((9, 8)).astype(np.float32)
    # Expert 2 gets no token, expert 3 most of them, in no particular order.
    experts = np.array([[3, 0], [1, 3], [3, 1], [0, 3], [3, 0], [1, 0], [0, 3], [3, 1], [1, 3]])
    weights = rng.uniform(0.1, 1.0, size=experts.shape).astype(np.float32)
    got = moe.grouped_experts(
        jnp.asarray(x), jnp.asarray(weights), jnp.asarray(experts, jnp.int32), w_gate, w_up, w_down
    )
    want = ref.experts_mlp(x, weights, experts, w_gate, w_up, w_down)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def _grouped_matmul_reference(x, w, sizes, cotangent):
    """float64 ``out[r] = x[r] W[g(r)]`` (zeros past ``sum(sizes)``) and the gradients of
    ``<out, c>``: ``dx[r] = c[r] W[g(r)]^T``, ``dW[g] = sum_{r in g} x[r]^T c[r]``."""
    x, w, c = (np.asarray(a, np.float64) for a in (x, w, cotangent))
    out, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
    start = 0
    for g, n in enumerate(sizes):
        rows = slice(start, start + n)
        out[rows], dx[rows], dw[g] = x[rows] @ w[g], c[rows] @ w[g].T, x[rows].T @ c[rows]
        start += n
    return out, dx, dw


@pytest.mark.parametrize("tile", [4, 64])
def test_tiled_grouped_matmul_equals_a_float64_loop(rng, monkeypatch, tile):
    """The CPU grouped matmul and its custom VJP: groups of one tile, several tiles and a
    partial tile, empty groups (first and inside), and rows past the groups' end (zeros)."""
    monkeypatch.setattr(moe, "TILE_ROWS", tile)
    sizes = np.array([0, 9, 1, 4, 0, 13, 2], np.int32)  # 29 rows in groups, 32 in all
    x = rng.standard_normal((32, 5)).astype(np.float32)
    w = rng.standard_normal((7, 5, 3)).astype(np.float32)
    c = rng.standard_normal((32, 3)).astype(np.float32)
    want, want_dx, want_dw = _grouped_matmul_reference(x, w, sizes, c)

    def loss(x, w):
        out = moe.tiled_grouped_matmul(x, w, jnp.asarray(sizes))
        return jnp.sum(out * c), out

    (_, out), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out)[29:] == 0) and np.all(np.asarray(dx)[29:] == 0)


def test_grouped_matmul_on_cpu_does_not_expand_over_the_groups():
    """XLA:CPU expands ``jax.lax.ragged_dot`` into ``[G, R, K]`` masked copies of the rows;
    ``grouped_matmul`` compiles there to the tile loop, whose temporaries are ``O(R·(K+N))``."""
    groups, rows, k, n = 32, 512, 64, 16
    args = (
        jax.ShapeDtypeStruct((rows, k), jnp.float32),
        jax.ShapeDtypeStruct((groups, k, n), jnp.float32),
        jax.ShapeDtypeStruct((groups,), jnp.int32),
    )

    def temp_bytes(fn):
        step = jax.grad(lambda x, w, s: jnp.sum(fn(x, w, s)), argnums=(0, 1))
        return jax.jit(step).lower(*args).compile().memory_analysis().temp_size_in_bytes

    expanded = groups * rows * k * 4
    assert temp_bytes(jax.lax.ragged_dot) >= expanded  # what the tile loop avoids
    assert temp_bytes(moe.grouped_matmul) < expanded // 8


def _dense_loop_mlp(h, router, w_gate, w_up, w_down, shared, experts, *, normalize):
    """The sparse MLP as a per-token loop over its (given) top-k experts; jax.grad-able."""
    tokens = h.reshape(-1, h.shape[-1])
    out = []
    for t in range(tokens.shape[0]):
        probs = jax.nn.softmax(tokens[t] @ router)
        chosen = probs[experts[t]]
        weights = chosen / chosen.sum() if normalize else chosen
        y = sum(
            weights[j] * ((jax.nn.silu(tokens[t] @ w_gate[e]) * (tokens[t] @ w_up[e])) @ w_down[e])
            for j, e in enumerate(experts[t])
        )
        s_gate, s_up, s_down, s_sigmoid = shared
        y = y + jax.nn.sigmoid(tokens[t] @ s_sigmoid)[0] * (
            (jax.nn.silu(tokens[t] @ s_gate) * (tokens[t] @ s_up)) @ s_down
        )
        out.append(y)
    return jnp.stack(out).reshape(h.shape)


@pytest.mark.parametrize("normalize", [False, True])
def test_gradient_matches_a_float64_per_token_loop(rng, normalize):
    """d/d(h, router, experts, shared expert) of ``<y, c>`` through routing, the sort, three
    ragged matmuls and the unsort, against ``jax.grad`` of a float64 per-token loop."""
    d, top_k = 8, 2
    router, w_gate, w_up, w_down = _layer_weights(rng, d=d, scale=3.0)
    weight = ref.fan_in_weight
    shared = (weight(rng, d, 5), weight(rng, d, 5), weight(rng, 5, d), weight(rng, d, 1))
    h = rng.standard_normal((2, 5, d)).astype(np.float32)
    cotangent = rng.standard_normal((2, 5, d)).astype(np.float32)
    args = (h, router, w_gate, w_up, w_down, shared)

    def ours(h, router, w_gate, w_up, w_down, shared):
        out, _ = moe.sparse_mlp(
            h,
            router,
            w_gate,
            w_up,
            w_down,
            top_k=top_k,
            normalize=normalize,
            shared=moe.SharedExpert(*shared),
        )
        return jnp.sum(out * cotangent)

    got = jax.jit(jax.grad(ours, argnums=tuple(range(6))))(*args)
    _, experts = ref.route(h.reshape(-1, d) @ router, top_k, normalize)
    assert len(np.unique(experts)) == 4  # every expert takes part
    with jax.enable_x64(True):
        args64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), args)

        def loop(*params):
            out = _dense_loop_mlp(*params, experts, normalize=normalize)
            return jnp.sum(out * jnp.asarray(cotangent, jnp.float64))

        want = jax.grad(loop, argnums=tuple(range(6)))(*args64)
        want = jax.tree.map(np.asarray, want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.abs(w).max() > 1e-3
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-4, atol=2e-5 * np.abs(w).max())


def test_bf16_compute_keeps_the_router_in_f32(models, rng):
    _, config, params = models["qwen3_moe"]
    bf16 = dataclasses.replace(config, compute_dtype="bfloat16")
    cast = cast_params(params, bf16)
    assert cast["layers"]["router"].dtype == jnp.float32
    assert cast["layers"]["expert_w_gate"].dtype == jnp.bfloat16

    # The logits are those of the bf16 activations under the f32 router, to f32 precision.
    router = np.asarray(params["layers"]["router"][0])
    h = jnp.asarray(3.0 * rng.standard_normal((2, 6, config.hidden_size)), jnp.bfloat16)
    experts = tuple(cast["layers"][k][0] for k in ("expert_w_gate", "expert_w_up", "expert_w_down"))
    out, z = moe.sparse_mlp(h, router, *experts, top_k=2, normalize=True)
    assert out.dtype == jnp.bfloat16 and z.dtype == jnp.float32
    want = np.asarray(h, np.float64) @ router.astype(np.float64)
    np.testing.assert_allclose(np.asarray(z), want, rtol=1e-5, atol=1e-5)
    in_bf16 = np.asarray(h @ router.astype(jnp.bfloat16), np.float64)
    assert np.abs(in_bf16 - want).max() > 1e-3  # the check can tell bf16 from f32

    tokens = rng.integers(3, config.vocab_size, size=(2, 5)).astype(np.int32)
    hidden, _, router_logits = jit_forward(params, bf16, tokens, outputs=("router_logits",))
    assert hidden.dtype == jnp.bfloat16 and router_logits.dtype == jnp.float32


def test_router_logits_and_aux_loss_match_transformers(models, rng):
    for name, (torch_model, config, params) in models.items():
        tokens, mask = hf_utils.padded_batch(
            rng, [9, 5, 2], 9, vocab=config.vocab_size, side="left"
        )
        hidden, cache, router_logits = jit_forward(
            params, config, tokens, attention_mask=mask, outputs=("router_logits",)
        )
        assert cache is None
        layers, experts = config.num_hidden_layers, config.num_experts
        assert router_logits.shape == (layers, 3, 9, experts)
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
        with torch.no_grad():
            out = torch_model(
                input_ids=torch.as_tensor(tokens, dtype=torch.long),
                attention_mask=torch.as_tensor(mask, dtype=torch.long),
                position_ids=torch.as_tensor(positions, dtype=torch.long),
                output_router_logits=True,
            )
        want = np.stack([x.numpy().reshape(3, 9, experts) for x in out.router_logits])
        real = np.broadcast_to(mask.astype(bool), (layers, 3, 9))
        np.testing.assert_allclose(np.asarray(router_logits)[real], want[real], atol=1e-4)
        # Every expert is somebody's choice: routing is not degenerate, parity means something.
        chosen = np.argsort(-want[real], axis=-1)[:, : config.num_experts_per_tok]
        assert len(np.unique(chosen)) == experts, name
        loss = moe.load_balancing_loss(router_logits, mask, top_k=config.num_experts_per_tok)
        np.testing.assert_allclose(float(loss), float(out.aux_loss), rtol=1e-5)


def test_load_balancing_loss_equals_transformers_function(rng):
    logits = 2.0 * rng.standard_normal((3, 2, 6, 5)).astype(np.float32)  # [L, B, S, E]
    mask = (rng.uniform(size=(2, 6)) > 0.3).astype(np.int32)
    for top_k in (1, 2):
        for m in (None, mask):
            want = modeling_qwen2_moe.load_balancing_loss_func(
                tuple(torch.as_tensor(x.reshape(-1, 5)) for x in logits),
                num_experts=5,
                top_k=top_k,
                attention_mask=None if m is None else torch.as_tensor(m),
            )
            got = moe.load_balancing_loss(logits, m, top_k=top_k)
            np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    # Uniform routing is the minimum, k.
    assert float(moe.load_balancing_loss(np.zeros((4, 5)), top_k=2)) == pytest.approx(2.0)


def test_router_z_loss_is_the_mean_squared_logsumexp(rng):
    logits = 3.0 * rng.standard_normal((2, 3, 4, 6))
    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 1, 1, 1]])
    z = np.log(np.exp(logits).sum(-1)) ** 2  # [L, B, S]
    want = (z * mask).sum() / (2 * mask.sum())
    got = moe.router_z_loss(jnp.asarray(logits, jnp.float32), mask)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    np.testing.assert_allclose(float(moe.router_z_loss(logits)), z.mean(), rtol=1e-5)
    with pytest.raises(ValueError, match="must match the router logits' token dims"):
        moe.router_z_loss(logits, mask[:2])


def test_dense_models_keep_their_return_signature(rng):
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    from jaxrl_llm.models import init_params  # noqa: PLC0415

    params = init_params(config, jax.random.key(0))
    tokens = rng.integers(0, 32, size=(2, 3)).astype(np.int32)
    assert len(forward(params, config, tokens)) == 2
    hidden, cache, router_logits = forward(params, config, tokens, outputs=("router_logits",))
    assert router_logits is None and cache is None and hidden.shape == (2, 3, 16)


def test_param_count_of_moe_models(models):
    for torch_model, config, _ in models.values():
        size = sum(x.size for x in jax.tree.leaves(param_shapes(config)))
        assert param_count(config) == size == sum(p.numel() for p in torch_model.parameters())


def test_config_fields():
    qwen3 = ModelConfig.from_hf_dict(hf_utils.hf_dict("qwen3_moe"))
    assert (qwen3.num_experts, qwen3.num_experts_per_tok, qwen3.moe_intermediate_size) == (8, 2, 48)
    assert qwen3.norm_topk_prob and qwen3.qk_norm and qwen3.shared_expert_intermediate_size == 0
    qwen2 = ModelConfig.from_hf_dict(hf_utils.hf_dict("qwen2_moe"))
    assert not qwen2.norm_topk_prob and qwen2.shared_expert_intermediate_size == 80
    assert (qwen2.qkv_bias, qwen2.o_bias) == (True, False)
    mixtral = ModelConfig.from_hf_dict(hf_utils.hf_dict("mixtral"))
    assert mixtral.norm_topk_prob and mixtral.moe_intermediate_size == 96
    assert mixtral.router_aux_loss_coef == 0.001 and mixtral.is_moe and not qwen3.qkv_bias


@pytest.mark.parametrize(
    "name, update, key",
    [
        ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ("qwen2_moe", {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]"),
        ("qwen3_moe", {"num_experts": 0}, "without experts"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ("mixtral", {"sliding_window": 16}, "sliding_window=16"),
    ],
)
def test_refuses_what_it_does_not_implement(name, update, key):
    hf = {**hf_utils.hf_dict(name), **update}
    with pytest.raises(ValueError, match=key) as err:
        ModelConfig.from_hf_dict(hf)
    assert "\n" not in str(err.value)


def test_direct_construction_is_validated():
    base = ModelConfig.from_hf_dict(hf_utils.hf_dict("mixtral"))
    with pytest.raises(ValueError, match="num_experts_per_tok must be in"):
        dataclasses.replace(base, num_experts_per_tok=9)
    with pytest.raises(ValueError, match="norm_topk_prob must be True"):
        dataclasses.replace(base, norm_topk_prob=False)
    with pytest.raises(ValueError, match="moe_intermediate_size must equal"):
        dataclasses.replace(base, moe_intermediate_size=12)
    with pytest.raises(ValueError, match="exactly for Qwen2-MoE"):
        dataclasses.replace(base, shared_expert_intermediate_size=4)
    with pytest.raises(ValueError, match="is dense"):
        dataclasses.replace(base, architecture="MistralForCausalLM")


@pytest.mark.parametrize("name", hf_utils.MOE_VARIANTS)
def test_saved_random_model_gives_transformers_our_logits(models, name, tmp_path, rng):
    """Init (not loaded from HF) -> save_pretrained -> transformers: the same logits as ours."""
    torch_model, config, _ = models[name]
    keys = iter(jax.random.split(jax.random.key(1), 64))
    params = jax.tree.map(
        lambda s: (0.3 * jax.random.normal(next(keys), s.shape)).astype(jnp.float32),
        param_shapes(config),
    )
    save_pretrained(str(tmp_path), config, params)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), attn_implementation="eager", dtype=torch.float32
    ).eval()
    assert type(reloaded) is type(torch_model)
    tokens, mask = hf_utils.padded_batch(rng, [8, 5], 8, vocab=config.vocab_size, side="right")
    want = hf_utils.hf_logits(reloaded, tokens, mask)
    got = np.asarray(logits(params, config, tokens, attention_mask=mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=1e-4)


def test_forward_outputs_come_in_their_fixed_order_and_refuse_unknown_names(models, rng):
    """``outputs`` asked in either order give ``(hidden, cache, router_logits, routing)``; the
    routing is the top-k of those logits (hand-checked against NumPy's argsort); a string or an
    unknown name is refused."""
    _, config, params = next(iter(models.values()))
    tokens = rng.integers(3, config.vocab_size, size=(2, 6)).astype(np.int32)
    out = forward(params, config, tokens, outputs=("routing", "router_logits"))
    assert len(out) == 4
    logits, ids = np.asarray(out[2], np.float64), np.asarray(out[3])
    assert logits.shape[-1] == config.num_experts and ids.shape[-1] == config.num_experts_per_tok
    top = np.sort(np.argsort(-logits, axis=-1)[..., : config.num_experts_per_tok], axis=-1)
    np.testing.assert_array_equal(np.sort(ids, axis=-1), top)
    with pytest.raises(ValueError, match="tuple of names"):
        forward(params, config, tokens, outputs="routing")
    with pytest.raises(ValueError, match="unknown 'logits'"):
        forward(params, config, tokens, outputs=("logits",))
