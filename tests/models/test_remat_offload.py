"""``model.remat="offload"``: layer remat with each layer's input kept in host memory.

On CPU the transfers lower to no-ops, so the forward and backward must equal ``remat="none"``
(f32, stacked layers scanned (unrolled on CPU) and per-layer params, LoRA, MoE; the dense LoRA
model's stacked layers on a mesh only) and equal ``remat="layer"``'s bit for bit, and the jaxpr
must carry the layer inputs in host memory; a deviceless TPU compile must place them there
(``S(5)``) and need less device temp memory than ``remat="layer"``.
"""

from __future__ import annotations

import importlib.util
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.models import ModelConfig, forward, init_params
from jaxrl_llm.models.config import LoraSpec

B, S, D, L = 2, 8, 32, 2

DENSE = ModelConfig(
    architecture="Qwen3ForCausalLM",
    vocab_size=64,
    hidden_size=D,
    intermediate_size=48,
    num_hidden_layers=L,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    qk_norm=True,
    lora=LoraSpec(2, 4.0),
)
MOE = ModelConfig(
    architecture="Qwen2MoeForCausalLM",
    vocab_size=64,
    hidden_size=D,
    intermediate_size=48,
    num_hidden_layers=L,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    qkv_bias=True,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
)


def _params(config: ModelConfig, seed: int):
    """Random params, every leaf (LoRA's zero B too) moved off its init by N(0, 0.1)."""
    params = init_params(config, jax.random.key(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 1), 256))
    return jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(keys), x.shape), params)


def _unstacked(params, config: ModelConfig):
    """The params with their layers split into a tuple of per-layer dicts (unrolled path)."""
    layers = tuple(
        jax.tree.map(lambda x, i=i: x[i], params["layers"]) for i in range(config.num_hidden_layers)
    )
    return {**params, "layers": layers}


def _loss(params, config, tokens, mask, weights, remat):
    hidden, _, router_logits = forward(
        params, config, tokens, attention_mask=mask, remat=remat, outputs=("router_logits",)
    )
    loss = jnp.sum(hidden * weights * mask[..., None])
    if router_logits is not None:
        loss = loss + 0.1 * jnp.sum(jnp.tanh(router_logits))
    return loss


def _batch(rng):
    tokens = jnp.asarray(rng.integers(0, 64, (B, S)), jnp.int32)
    mask = jnp.asarray(np.arange(S)[None] >= np.array([[0], [3]]))  # row 1 left-padded
    weights = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)
    return tokens, mask, weights


# The dense model's stacked layers are checked on a mesh (the next test's dense_lora variant,
# the same comparison on sharded activations); the scan's "layer" == "offload" on CPU by moe.
@pytest.mark.parametrize(
    ("config", "split"),
    [(DENSE, True), (MOE, False), (MOE, True)],
    ids=["dense_lora-per_layer", "moe-stacked", "moe-per_layer"],
)
def test_offload_gives_the_loss_and_gradients_of_no_remat(config, split):
    rng = np.random.default_rng(0)
    params = _params(config, 3)
    if split:
        params = _unstacked(params, config)
    tokens, mask, weights = _batch(rng)

    def value_and_grad(remat):
        fn = jax.value_and_grad(lambda p: _loss(p, config, tokens, mask, weights, remat))
        return jax.jit(fn)(params)

    (plain, grad_plain), (offload, grad_offload) = value_and_grad("none"), value_and_grad("offload")
    assert np.isfinite(plain) and abs(float(plain)) > 0.1
    np.testing.assert_allclose(offload, plain, rtol=1e-6)
    # The recomputed forward fuses differently: gradients of size ~10 move by f32 rounding
    # (2e-6 relative at worst here), not by a missing or wrong term.
    chex.assert_trees_all_close(grad_offload, grad_plain, atol=1e-6, rtol=1e-5)
    if jax.default_backend() == "cpu":  # transfers lowered to no-ops: "layer"'s program
        layer, grad_layer = value_and_grad("layer")
        assert float(layer) == float(offload)
        chex.assert_trees_all_equal(grad_offload, grad_layer)


@pytest.mark.needs_devices(8)
@pytest.mark.parametrize(
    ("config", "shape"),
    [(DENSE, (2, 2, 2, 1)), (MOE, (1, 2, 1, 4))],
    ids=["dense_lora_data2_fsdp2_tensor2", "moe_fsdp2_expert4"],
)
def test_offload_on_a_mesh_gives_the_loss_and_gradients_of_no_remat(config, shape):
    """Sharded activations (and the experts' all-to-all exchange under ``shard_map``) with
    host-memory residuals: the values of ``"none"`` on the same mesh."""
    from jaxrl_llm import parallel

    params = _params(config, 3)
    tokens, mask, weights = (jnp.concatenate([a] * 4) for a in _batch(np.random.default_rng(0)))

    def value_and_grad(remat):
        return jax.value_and_grad(lambda p: _loss(p, config, tokens, mask, weights, remat))

    data, fsdp, tensor, expert = shape
    with jax.set_mesh(parallel.make_mesh(data, fsdp, tensor, expert=expert)):
        plain, grad_plain = jax.jit(value_and_grad("none"))(params)
        offload, grad_offload = jax.jit(value_and_grad("offload"))(params)
    assert abs(float(plain)) > 0.1
    np.testing.assert_allclose(offload, plain, rtol=1e-6)
    chex.assert_trees_all_close(grad_offload, grad_plain, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("split", [False, True], ids=["stacked", "per_layer"])
def test_offload_moves_each_layer_input_to_the_host(split):
    """The backward's residuals: the layer inputs ``[B, S, D]`` (``[L, B, S, D]`` stacked by
    the scan) go to ``pinned_host``; ``"layer"`` keeps them on the device."""
    params = _params(MOE, 3)
    if split:
        params = _unstacked(params, MOE)
    tokens, mask, weights = _batch(np.random.default_rng(0))

    def jaxpr(remat):
        fn = jax.grad(lambda p: _loss(p, MOE, tokens, mask, weights, remat))
        return str(jax.make_jaxpr(fn)(params))

    offload, layer = jaxpr("offload"), jaxpr("layer")
    shape = f"f32<host>[{B},{S},{D}]" if split else f"f32<host>[{L},{B},{S},{D}]"
    assert shape in offload
    assert "<host>" not in layer
    if split:  # one offloaded input per unrolled layer, fetched back once
        assert len(re.findall(rf"f32<host>\[{B},{S},{D}\] = device_put", offload)) == L


def test_bad_remat_names_are_refused():
    assert models.REMAT_POLICIES == ("none", "layer", "offload")
    assert models.remat_policy("none") is None
    assert models.remat_policy("layer") is jax.checkpoint_policies.nothing_saveable
    with pytest.raises(ValueError, match="remat"):
        models.remat_policy("host")
    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="remat"):
        forward(_params(MOE, 0), MOE, tokens, remat="offload_all")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed")
def test_offload_compiles_for_tpu_with_host_residuals_and_less_device_memory(monkeypatch):
    """Deviceless AOT compile of a forward + backward for a v5e 2x2 slice (data=4, 2 rows a
    chip): L=16 f32 layers of D=512 over S=512 tokens. ``"layer"`` keeps the 16 layer inputs
    (``16 x 2 x 512 x 512 x 4 B = 32 MiB`` a chip) in device memory (temp 51 MiB);
    ``"offload"`` puts that stack in host memory (``S(5)``, ``host_temp`` 32 MiB) and needs
    15 MiB of device temp memory: asserted under half of ``"layer"``'s."""
    from jax.sharding import NamedSharding, PartitionSpec

    from tests.models.tpu_mesh import v5e_2x2_mesh

    mesh = v5e_2x2_mesh(monkeypatch, (4, 1, 1))
    layers, batch, seq, width = 16, 8, 512, 512
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=256,
        hidden_size=width,
        intermediate_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=128,
    )
    replicated = NamedSharding(mesh, PartitionSpec())
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), params
    )
    tokens = jax.ShapeDtypeStruct(
        (batch, seq), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec("data"))
    )

    def compiled(remat):
        def step(params, tokens):
            def loss(params):
                hidden, _ = forward(params, config, tokens, remat=remat)
                return jnp.sum(hidden**2)

            return jax.grad(loss)(params)

        with jax.set_mesh(mesh):
            return jax.jit(step).lower(params, tokens).compile()

    layer, offload = compiled("layer"), compiled("offload")
    stack = layers * (batch // 4) * seq * width * 4
    host = offload.memory_analysis().host_temp_size_in_bytes
    assert layer.memory_analysis().host_temp_size_in_bytes == 0
    assert host == stack
    residuals = f"f32[{layers},{batch // 4},{seq},{width}]"
    assert re.search(re.escape(residuals) + r"\{[^}]*S\(5\)\}", offload.as_text())
    assert not re.search(r"S\(5\)", layer.as_text())
    layer_temp = layer.memory_analysis().temp_size_in_bytes
    offload_temp = offload.memory_analysis().temp_size_in_bytes
    assert layer_temp >= stack  # the residuals are on the device with "layer"
    assert offload_temp * 2 < layer_temp, (offload_temp, layer_temp)
