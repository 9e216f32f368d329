"""gpt-oss's sparse MLP in ``models.moe``: the biased router (top-k of the logits, softmax over
the k), biased experts and the clamped SwiGLU against transformers' ``GptOssMLP`` and its
``_apply_gate``, and the same layer expert-parallel (experts split over ``expert``, their width
over ``tensor``: the down bias is added once, after the partial sums) against the unsharded
layer, forward and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.models.gpt_oss import modeling_gpt_oss

from jaxrl_llm import parallel
from jaxrl_llm.models import moe

T_BATCH, T_SEQ, D, E, F, TOP_K = 8, 4, 8, 8, 8, 2  # 32 tokens: 4 per device on 8 devices


def _params(rng):
    """``(router [D, E], w_gate, w_up [E, D, F], w_down [E, F, D], router_bias [E],
    b_gate, b_up [E, F], b_down [E, D])``: gate/up pre-activations that cross ±7."""
    router = rng.normal(size=(D, E)) * 3 / np.sqrt(D)
    w_gate, w_up = (rng.normal(size=(E, D, F)) * 4 / np.sqrt(D) for _ in range(2))
    w_down = rng.normal(size=(E, F, D)) / np.sqrt(F)
    router_bias = rng.normal(size=E)
    b_gate, b_up, b_down = rng.normal(size=(E, F)), rng.normal(size=(E, F)), rng.normal(size=(E, D))
    out = (router, w_gate, w_up, w_down, router_bias, b_gate, b_up, b_down)
    return tuple(np.asarray(x, np.float32) for x in out)


def _layer(params, h):
    router, w_gate, w_up, w_down, router_bias, *biases = params
    return moe.sparse_mlp(
        h,
        router,
        w_gate,
        w_up,
        w_down,
        top_k=TOP_K,
        normalize=True,
        router_bias=router_bias,
        biases=moe.ExpertBiases(*biases),
        clamp=moe.ClampedSwiGLU(alpha=1.702, limit=7.0),
    )


def test_clamped_swiglu_matches_transformers():
    gate_up = torch.randn(64, 2 * 24, generator=torch.Generator().manual_seed(0)) * 10
    config = transformers.GptOssConfig(intermediate_size=24, hidden_size=16, num_local_experts=2)
    want = modeling_gpt_oss.GptOssExperts(config)._apply_gate(gate_up).numpy()
    got = moe.gated_activation(
        jnp.asarray(gate_up[:, ::2].numpy()),
        jnp.asarray(gate_up[:, 1::2].numpy()),
        moe.ClampedSwiGLU(),
    )
    assert (np.abs(gate_up.numpy()) > 7).mean() > 0.3  # the clamp binds on both sides
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def test_sparse_mlp_matches_transformers_gpt_oss_mlp(rng):
    params = _params(rng)
    router, w_gate, w_up, w_down, router_bias, b_gate, b_up, b_down = params
    h = rng.normal(size=(T_BATCH, T_SEQ, D)).astype(np.float32)
    config = transformers.GptOssConfig(
        hidden_size=D, intermediate_size=F, num_local_experts=E, num_experts_per_tok=TOP_K
    )
    mlp = modeling_gpt_oss.GptOssMLP(config).eval()
    gate_up = np.stack([w_gate, w_up], axis=-1).reshape(E, D, 2 * F)  # interleaved
    gate_up_bias = np.stack([b_gate, b_up], axis=-1).reshape(E, 2 * F)
    with torch.no_grad():
        mlp.router.weight.copy_(torch.as_tensor(router.T))
        mlp.router.bias.copy_(torch.as_tensor(router_bias))
        mlp.experts.gate_up_proj.copy_(torch.as_tensor(gate_up))
        mlp.experts.gate_up_proj_bias.copy_(torch.as_tensor(gate_up_bias))
        mlp.experts.down_proj.copy_(torch.as_tensor(w_down))
        mlp.experts.down_proj_bias.copy_(torch.as_tensor(b_down))
        want, _ = mlp(torch.as_tensor(h))
        want_logits = mlp.router(torch.as_tensor(h.reshape(-1, D)))[0].numpy()
    out, logits = jax.jit(_layer)(params, h)
    np.testing.assert_allclose(np.asarray(logits).reshape(-1, E), want_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out), want.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.needs_devices(8)
@pytest.mark.parametrize("shape", [(1, 2, 2, 2), (2, 1, 1, 4)], ids=["tensor2_expert2", "expert4"])
def test_expert_parallel_equals_the_unsharded_layer(rng, shape):
    params = _params(rng)
    h = rng.normal(size=(T_BATCH, T_SEQ, D)).astype(np.float32)
    cotangent = rng.normal(size=h.shape).astype(np.float32)

    @jax.jit
    def run(params, h):
        def loss(params, h):
            out, _ = _layer(params, h)
            return jnp.sum(out * cotangent), out

        return jax.grad(loss, argnums=(0, 1), has_aux=True)(params, h)

    plain_grads, plain_out = run(params, h)
    data, fsdp, tensor, expert = shape
    with jax.set_mesh(parallel.make_mesh(data, fsdp, tensor, expert=expert)):
        assert moe.expert_parallel_mesh() is not None
        grads, out = run(params, h)
    np.testing.assert_allclose(np.asarray(out), np.asarray(plain_out), atol=1e-5, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads), strict=True):
        scale = np.abs(np.asarray(want)).max()
        assert scale > 1e-3
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5 * scale)
