"""Routing replay ("R3", Ma et al. 2025): ``models.moe.replay_route`` and
``forward(..., routing=, outputs=("routing",))``. The replayed gate weights and a forced-expert
layer against float64 NumPy (forward and the router's gradient); the ids a forward chooses against
the top-k of transformers' router logits; a replay of those ids equal bit for bit to the free
forward, of other ids equal to a different forward; packed == padded and expert-parallel == one
device under replay."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm import parallel
from jaxrl_llm.models import forward, load_pretrained, moe, unembed
from tests.models import hf_utils
from tests.reference import moe as ref

jit_forward = jax.jit(forward, static_argnums=1, static_argnames="outputs")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (torch model, config, f32 params) for tiny Mixtral, Qwen2-MoE (weights not
    renormalised, a shared expert), Qwen3-MoE and gpt-oss (biased router) checkpoints."""
    loaded = hf_utils.load_variants(
        tmp_path_factory, ("mixtral", "qwen2_moe", "qwen3_moe"), first_seed=60, prefix="replay_"
    )
    out = {name: (tm, config, params) for name, (tm, config, params, _) in loaded.items()}
    path = str(tmp_path_factory.mktemp("replay_gpt_oss"))
    torch_model = hf_utils.build_gpt_oss(seed=64)
    torch_model.save_pretrained(path)
    out["gpt_oss"] = (torch_model, *load_pretrained(path, dtype=jnp.float32))
    return out


def _softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _forced_weights(logits, experts, normalize):
    """Float64 gate weights of given experts: ``softmax(z[e])`` or ``softmax(z)[e]``."""
    if normalize:
        return _softmax(np.take_along_axis(np.asarray(logits, np.float64), experts, -1))
    return np.take_along_axis(_softmax(logits), experts, -1)


@pytest.mark.parametrize("normalize", [False, True])
def test_replay_route_weights_against_float64(rng, normalize):
    logits = rng.standard_normal((7, 6)).astype(np.float32)
    # Forced ids: the bottom two (never the top-k), in a scrambled order.
    forced = np.argsort(logits, axis=-1)[:, [1, 0]].astype(np.int32)
    weights, experts = moe.replay_route(
        jnp.asarray(logits), jnp.asarray(forced), normalize=normalize
    )
    np.testing.assert_array_equal(np.asarray(experts), forced)
    want = _forced_weights(logits, forced, normalize)
    np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-6, atol=1e-7)
    # Replaying the top-k: route's weights bit for bit.
    own_w, own_e = moe.route(jnp.asarray(logits), top_k=2, normalize=normalize)
    again_w, again_e = moe.replay_route(jnp.asarray(logits), own_e, normalize=normalize)
    np.testing.assert_array_equal(np.asarray(again_e), np.asarray(own_e))
    np.testing.assert_array_equal(np.asarray(again_w), np.asarray(own_w))
    # A token with a negative id (padding of a recording) routes freely.
    mixed = forced.copy()
    mixed[3] = [-1, -1]
    w, e = moe.replay_route(jnp.asarray(logits), jnp.asarray(mixed), normalize=normalize)
    np.testing.assert_array_equal(np.asarray(e)[3], np.asarray(own_e)[3])
    np.testing.assert_array_equal(np.asarray(w)[3], np.asarray(own_w)[3])
    np.testing.assert_array_equal(np.asarray(e)[4], forced[4])


@pytest.mark.parametrize("normalize", [False, True])
def test_forced_expert_layer_and_router_gradient_against_float64(rng, normalize):
    """``sparse_mlp(..., routing=ids)`` = the float64 per-token mixture of the forced experts,
    and the router's gradient of ``sum(c * y)`` = its float64 chain rule through the weights."""
    d, e, f, k = 8, 5, 6, 2
    router, w_gate, w_up, w_down = ref.layer_weights(rng, d, e, f)
    h = rng.standard_normal((2, 3, d)).astype(np.float32)
    cot = rng.standard_normal(h.shape).astype(np.float32)
    x = h.reshape(-1, d).astype(np.float64)
    z = x @ router.astype(np.float64)
    forced = np.argsort(z, axis=-1)[:, :k][:, ::-1].astype(np.int32)  # the k least likely

    def loss(router, h):
        out, _ = moe.sparse_mlp(
            h,
            router,
            w_gate,
            w_up,
            w_down,
            top_k=k,
            normalize=normalize,
            routing=jnp.asarray(forced.reshape(2, 3, k)),
        )
        return jnp.sum(out * cot), out

    (_, out), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(router), jnp.asarray(h))
    weights = _forced_weights(z, forced, normalize)
    want = ref.experts_mlp(x, weights, forced, w_gate, w_up, w_down)
    np.testing.assert_allclose(np.asarray(out).reshape(-1, d), want, atol=1e-5, rtol=1e-5)

    # dL/dw_tj = c_t . SwiGLU_{e_tj}(x_t); back through the weights to the logits, then W_r.
    w64 = [np.asarray(a, np.float64) for a in (w_gate, w_up, w_down)]
    g = np.zeros_like(weights)
    for t in range(x.shape[0]):
        for j, ex in enumerate(forced[t]):
            expert_out = (ref.silu(x[t] @ w64[0][ex]) * (x[t] @ w64[1][ex])) @ w64[2][ex]
            g[t, j] = cot.reshape(-1, d)[t] @ expert_out
    dz = np.zeros_like(z)
    if normalize:
        dsel = weights * (g - (weights * g).sum(-1, keepdims=True))
        np.put_along_axis(dz, forced, dsel, -1)
    else:
        probs = _softmax(z)
        big = np.zeros_like(z)
        np.put_along_axis(big, forced, g, -1)
        dz = probs * (big - (probs * big).sum(-1, keepdims=True))
    want_grad = x.T @ dz
    assert np.abs(want_grad).max() > 1e-3  # the router does get a gradient
    np.testing.assert_allclose(np.asarray(grad), want_grad, atol=1e-5, rtol=1e-4)


def _hf_top_k(torch_model, tokens, mask, k):
    """transformers' router logits ``[L, B, S, E]`` and the k-th/(k+1)-th logit margin."""
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        out = torch_model(
            input_ids=torch.as_tensor(tokens, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long),
            position_ids=torch.as_tensor(positions, dtype=torch.long),
            output_router_logits=True,
        )
    logits = np.stack([x.numpy().reshape(*tokens.shape, -1) for x in out.router_logits])
    ordered = -np.sort(-logits, axis=-1)
    return np.argsort(-logits, axis=-1)[..., :k], ordered[..., k - 1] - ordered[..., k]


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"])
def test_replay_of_the_chosen_ids_is_the_free_forward_bit_for_bit(models, rng, name):
    torch_model, config, params = models[name]
    k, layers = config.num_experts_per_tok, config.num_hidden_layers
    tokens, mask = hf_utils.padded_batch(rng, [9, 5, 2], 9, vocab=config.vocab_size, side="left")
    hidden, _, chosen = jit_forward(
        params, config, tokens, attention_mask=mask, outputs=("routing",)
    )
    assert chosen.shape == (layers, 3, 9, k) and chosen.dtype == jnp.int32

    # The chosen ids are the top-k of transformers' router logits (as sets, clear margins).
    want, margin = _hf_top_k(torch_model, tokens, mask, k)
    real = np.broadcast_to(mask.astype(bool), (layers, 3, 9)) & (margin > 1e-3)
    assert real.sum() >= 0.9 * layers * mask.sum()
    np.testing.assert_array_equal(np.sort(np.asarray(chosen), -1)[real], np.sort(want, -1)[real])
    assert len(np.unique(np.asarray(chosen)[real])) == config.num_experts

    again, _, echoed = jit_forward(
        params, config, tokens, attention_mask=mask, routing=chosen, outputs=("routing",)
    )
    np.testing.assert_array_equal(np.asarray(echoed), np.asarray(chosen))
    np.testing.assert_array_equal(
        np.asarray(unembed(params, config, again)), np.asarray(unembed(params, config, hidden))
    )

    # Other ids (each layer's next-best k): another forward, equal to no run of the free one.
    z = jit_forward(params, config, tokens, attention_mask=mask, outputs=("router_logits",))[2]
    other = jnp.argsort(-z, axis=-1)[..., k : 2 * k].astype(jnp.int32)
    moved, _ = jit_forward(params, config, tokens, attention_mask=mask, routing=other)
    on = mask.astype(bool)
    assert np.abs(np.asarray(moved - hidden)[on]).min(-1).max() > 1e-3


def test_bad_routing_is_refused(models):
    _, config, params = models["qwen3_moe"]
    tokens = jnp.ones((2, 4), jnp.int32)
    k, layers = config.num_experts_per_tok, config.num_hidden_layers
    with pytest.raises(ValueError, match="routing must be"):
        forward(params, config, tokens, routing=jnp.zeros((layers, 2, 4, k + 1), jnp.int32))
    with pytest.raises(ValueError, match="integer"):
        forward(params, config, tokens, routing=jnp.zeros((layers, 2, 4, k), jnp.float32))
    with pytest.raises(ValueError, match="past the"):
        too_big = jnp.full((layers, 2, 4, k), config.num_experts, jnp.int32)
        forward(params, config, tokens, routing=too_big)
    # Concrete ids closed over by a jitted function are checked on the host, not traced.
    ok = np.zeros((layers, 2, 4, k), np.int32)
    ok[..., 1] = 1
    hidden = jax.jit(lambda p: forward(p, config, tokens, routing=jnp.asarray(ok))[0])(params)
    assert hidden.shape == (2, 4, config.hidden_size)


def _scrambled_routing(config, free, seed):
    """Random distinct ids per token (not the free top-k), ``[L, B, S, k]`` int32."""
    rng = np.random.default_rng(seed)
    shape = free.shape[:-1]
    keys = rng.uniform(size=(*shape, config.num_experts))
    return jnp.asarray(np.argsort(keys, -1)[..., : config.num_experts_per_tok], jnp.int32)


def test_packed_rows_equal_padded_rows_under_replay(models):
    _, config, params = models["qwen3_moe"]
    rng = np.random.default_rng(5)
    a, b = rng.integers(3, config.vocab_size, 5), rng.integers(3, config.vocab_size, 3)
    padded = np.zeros((2, 5), np.int32)
    padded[0], padded[1, :3] = a, b
    pmask = np.array([[1] * 5, [1] * 3 + [0] * 2], np.int32)
    _, _, free = jit_forward(params, config, padded, attention_mask=pmask, outputs=("routing",))
    routing = _scrambled_routing(config, free, 1)
    want, _ = jit_forward(params, config, padded, attention_mask=pmask, routing=routing)

    packed = np.zeros((1, 10), np.int32)
    packed[0, :5], packed[0, 5:8] = a, b
    segments = np.array([[1] * 5 + [2] * 3 + [0] * 2], np.int32)
    packed_routing = jnp.concatenate(
        [routing[:, :1], routing[:, 1:, :3], jnp.full_like(routing[:, 1:, :2], -1)], axis=2
    )
    got, _ = jit_forward(params, config, packed, segment_ids=segments, routing=packed_routing)
    np.testing.assert_allclose(np.asarray(got[0, :5]), np.asarray(want[0]), atol=2e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(got[0, 5:8]), np.asarray(want[1, :3]), atol=2e-6, rtol=0)
    free_hidden, _ = jit_forward(params, config, padded, attention_mask=pmask)
    assert np.abs(np.asarray(free_hidden - want)[pmask.astype(bool)]).max() > 1e-3


@pytest.mark.needs_devices(8)
def test_expert_parallel_forward_equals_one_device_under_replay(models):
    """``mesh.expert=4 mesh.fsdp=2``: the replayed forward (ids split with their tokens) equals
    the single-device one, and so does the chosen routing of a free forward."""
    _, config, params = models["mixtral"]
    assert config.num_experts % 4 == 0
    rng = np.random.default_rng(6)
    tokens, mask = hf_utils.padded_batch(
        rng, [6, 3, 5, 6, 2, 4, 6, 1], 6, vocab=config.vocab_size, side="left"
    )
    _, _, free = jit_forward(params, config, tokens, attention_mask=mask, outputs=("routing",))
    routing = _scrambled_routing(config, free, 2)
    want, _, echoed = jit_forward(
        params, config, tokens, attention_mask=mask, routing=routing, outputs=("routing",)
    )
    np.testing.assert_array_equal(np.asarray(echoed), np.asarray(routing))

    mesh = parallel.make_mesh(1, 2, 1, expert=4)
    replicated = NamedSharding(mesh, P())
    on_mesh = jax.device_put((params, tokens, mask, routing), replicated)
    with jax.set_mesh(mesh):
        assert moe.expert_parallel_mesh() is not None
        got, _ = jit_forward(
            *on_mesh[:1], config, on_mesh[1], attention_mask=on_mesh[2], routing=on_mesh[3]
        )
        _, _, got_free = jit_forward(
            on_mesh[0], config, on_mesh[1], attention_mask=on_mesh[2], outputs=("routing",)
        )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(got_free), np.asarray(free))
