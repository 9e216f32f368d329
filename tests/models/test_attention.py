"""Attention pieces: attention over a head-major cache and causal self-attention per backend
(against float64 references), masks."""

import importlib.util

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding, PartitionSpec

from jaxrl_llm.models import attention as attn_lib
from jaxrl_llm.models import attention_backends as backends
from jaxrl_llm.models.attention import attention_mask, cache_attention
from tests.reference import attention as ref


def _random_attention_inputs(rng, *, batch=2, seq=3, heads=4, kv_heads=2, slots=7, dim=8):
    q = rng.normal(size=(batch, seq, heads, dim)).astype(np.float32)
    k = rng.normal(size=(batch, kv_heads, slots, dim)).astype(np.float32)
    v = rng.normal(size=(batch, kv_heads, slots, dim)).astype(np.float32)
    mask = rng.random((batch, 1, seq, slots)) < 0.6
    mask[..., 0] = True  # every query sees at least one slot
    return q, k, v, mask


@pytest.mark.parametrize("seq", [3, 1])  # 1: a decode step (on CPU, without the query axis)
def test_cache_attention_matches_reference_with_gqa(rng, seq):
    q, k, v, mask = _random_attention_inputs(rng, seq=seq)
    got = jax.jit(cache_attention, static_argnames="scale")(q, k, v, mask, scale=8**-0.5)
    chex.assert_shape(got, q.shape)
    want = ref.cache_attention(q, k, v, mask, 8**-0.5)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    # Query head 1 reads kv head 0 and head 2 reads kv head 1: grouped, not interleaved.
    other = ref.cache_attention(q, k[:, ::-1], v[:, ::-1], mask, 8**-0.5)
    assert not np.allclose(np.asarray(got), other, atol=1e-3)


@pytest.mark.parametrize("seq", [3, 1])
def test_cache_attention_without_grouping(rng, seq):
    q, k, v, mask = _random_attention_inputs(rng, seq=seq, heads=3, kv_heads=3)
    got = cache_attention(q, k, v, mask, scale=8**-0.5)
    np.testing.assert_allclose(
        np.asarray(got), ref.cache_attention(q, k, v, mask, 8**-0.5), atol=1e-5, rtol=1e-5
    )


def test_cache_attention_ignores_masked_slots(rng):
    q, k, v, mask = _random_attention_inputs(rng, seq=1)
    mask[:] = False
    mask[..., :3] = True
    noisy_k, noisy_v = k.copy(), v.copy()
    noisy_k[:, :, 3:] = 1e4  # would dominate the softmax if it leaked in
    noisy_v[:, :, 3:] = 1e6
    got = cache_attention(q, noisy_k, noisy_v, mask, scale=0.5)
    want = ref.cache_attention(q, k[:, :, :3], v[:, :, :3], mask[..., :3], 0.5)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seq", [3, 1])
def test_cache_attention_bf16_cache_is_close(rng, seq):
    q, k, v, mask = _random_attention_inputs(rng, seq=seq)
    got = cache_attention(
        jnp.asarray(q, jnp.bfloat16),
        jnp.asarray(k, jnp.bfloat16),
        jnp.asarray(v, jnp.bfloat16),
        mask,
        scale=8**-0.5,
    )
    assert got.dtype == jnp.bfloat16
    want = ref.cache_attention(q, k, v, mask, 8**-0.5)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=5e-2, rtol=5e-2)


def test_attention_mask_is_causal_over_real_keys_and_always_sees_its_own_slot():
    # Row 0: slot 0 is padding; row 1: all real. Queries sit at slots 1 and 2 of 3.
    key_valid = np.array([[False, True, True], [True, True, True]])
    mask = np.asarray(attention_mask(jnp.asarray(key_valid), jnp.array([1, 2])))
    assert mask.shape == (2, 1, 2, 3)
    np.testing.assert_array_equal(mask[0, 0], [[0, 1, 0], [0, 1, 1]])
    np.testing.assert_array_equal(mask[1, 0], [[1, 1, 0], [1, 1, 1]])
    # A pad query (its own slot not real) still sees itself, so its softmax stays finite.
    lone = np.asarray(attention_mask(jnp.array([[False, False]]), jnp.array([0, 1])))
    np.testing.assert_array_equal(lone[0, 0], [[1, 0], [0, 1]])


# --- dot_product_attention: causal self-attention per implementation. ---

# Each implementation under test: (name passed to dot_product_attention, extra keyword args).
# "compacted" is the cuDNN path's packing (real tokens first, causal + lengths) run through
# jax.nn's XLA implementation, since cuDNN itself needs a GPU.
_IMPLS = {
    "xla": ("xla", {}),
    "einsum": ("einsum", {}),
    "einsum_blocks": ("einsum", {"kernel": attn_lib.KernelOptions(block_q=32)}),
    "splash": ("splash", {"kernel": attn_lib.KernelOptions(interpret=True)}),
    "splash_tiles": (
        "splash",
        {"kernel": attn_lib.KernelOptions(interpret=True, block_q=128, block_kv=128)},
    ),
    "compacted": ("compacted", {}),
}


def _attend(q, k, v, key_valid, scale, impl):
    name, options = _IMPLS[impl]
    if name == "compacted":
        return backends._compacted_attention(q, k, v, key_valid, scale, implementation="xla")
    return attn_lib.dot_product_attention(
        q, k, v, key_valid=key_valid, scale=scale, implementation=name, **options
    )


def _valid_pattern(batch, seq, case):
    """Row masks: "gaps" (S=40) = left pad + prompt + completion + right pad, and a row with
    one real token; "middle" (S=200) = a full row, and a row with a gap and right padding."""
    valid = np.ones((batch, seq), bool)
    if case == "gaps":
        valid[0, :7] = False
        valid[0, 33:] = False
        valid[1] = False
        valid[1, 25] = True
    else:
        valid[1, 60:75] = False
        valid[1, 170:] = False
    return valid


def _reference(q, k, v, valid, scale, d_out):
    """Float64 forward and VJP of causal attention over real keys, from the formulas.

    ``P = softmax(scale q k^T)`` over ``j <= i`` and ``j`` real (plus the own slot), ``O = P V``;
    ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - sum_j dP P)``, ``dQ = scale dS K``,
    ``dK = scale dS^T Q``; query head n reads kv head n // (N / K).
    """
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    seq, heads, kv_heads = q.shape[1], q.shape[2], k.shape[2]
    group = heads // kv_heads
    mask = np.tril(np.ones((seq, seq), bool))[None] & valid[:, None, :]
    mask |= np.eye(seq, dtype=bool)[None]
    out, dq, dk, dv = np.zeros(q.shape), np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for n in range(heads):
        kv = n // group
        scores = np.where(mask, np.einsum("bih,bjh->bij", q[:, :, n], k[:, :, kv]) * scale, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[:, :, n] = np.einsum("bij,bjh->bih", p, v[:, :, kv])
        dv[:, :, kv] += np.einsum("bij,bih->bjh", p, d_out[:, :, n])
        dp = np.einsum("bih,bjh->bij", d_out[:, :, n], v[:, :, kv])
        ds = p * (dp - np.sum(dp * p, -1, keepdims=True))
        dq[:, :, n] = scale * np.einsum("bij,bjh->bih", ds, k[:, :, kv])
        dk[:, :, kv] += scale * np.einsum("bij,bih->bjh", ds, q[:, :, n])
    return out, (dq, dk, dv)


def _inputs(rng, seq, *, batch=2, heads=4, kv_heads=2, dim=64):
    q = rng.normal(size=(batch, seq, heads, dim)).astype(np.float32)
    k = rng.normal(size=(batch, seq, kv_heads, dim)).astype(np.float32)
    v = rng.normal(size=(batch, seq, kv_heads, dim)).astype(np.float32)
    return q, k, v


def _value_and_grads(q, k, v, valid, scale, impl, d_out):
    """Attention output and the gradient of ``sum(d_out * out)`` w.r.t. q, k, v (jitted)."""

    def loss(q, k, v):
        out = _attend(q, k, v, jnp.asarray(valid), scale, impl)
        return jnp.sum(out.astype(jnp.float32) * d_out), out

    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


@pytest.mark.parametrize("case,seq", [("gaps", 40), ("middle", 200)])
@pytest.mark.parametrize("impl", list(_IMPLS))
def test_dot_product_attention_matches_float64_reference(rng, impl, case, seq):
    q, k, v = _inputs(rng, seq)
    valid = _valid_pattern(2, seq, case)
    # The loss weights only real query rows: pad rows are implementation-defined.
    d_out = rng.normal(size=q.shape).astype(np.float32) * valid[:, :, None, None]
    out, grads = _value_and_grads(q, k, v, valid, 64**-0.5, impl, d_out)
    chex.assert_shape(out, q.shape)
    assert out.dtype == jnp.float32
    assert np.isfinite(np.asarray(out)).all()  # pad rows too
    want, want_grads = _reference(q, k, v, valid, 64**-0.5, d_out)
    np.testing.assert_allclose(np.asarray(out)[valid], want[valid], atol=1e-5, rtol=1e-5)
    for name, got, ref_grad in zip("qkv", grads, want_grads):
        np.testing.assert_allclose(np.asarray(got), ref_grad, atol=1e-4, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("impl", ["xla", "einsum", "splash", "compacted"])
def test_dot_product_attention_bf16_is_close_to_the_f32_reference(rng, impl):
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _inputs(rng, 40))
    valid = _valid_pattern(2, 40, "gaps")
    out = _attend(q, k, v, jnp.asarray(valid), 64**-0.5, impl)
    assert out.dtype == jnp.bfloat16
    rounded = [np.asarray(x, np.float32) for x in (q, k, v)]  # the reference sees bf16 inputs
    want, _ = _reference(*rounded, valid, 64**-0.5, np.zeros(q.shape))
    # bf16 keeps 8 significant bits: ~0.4% per rounding, of outputs of size ~1.
    np.testing.assert_allclose(np.asarray(out, np.float32)[valid], want[valid], atol=3e-2)


@pytest.mark.parametrize("impl", ["xla", "einsum", "splash", "compacted"])
def test_dot_product_attention_rows_without_real_tokens_stay_finite(rng, impl):
    q, k, v = _inputs(rng, 24, dim=64)
    valid = np.ones((2, 24), bool)
    valid[0] = False  # a row of pads only: every query there has no real key
    d_out = rng.normal(size=q.shape).astype(np.float32)  # pad rows weighted too
    out, grads = _value_and_grads(q, k, v, valid, 0.125, impl, d_out)
    for x in (out, *grads):
        assert np.isfinite(np.asarray(x)).all()
    want, _ = _reference(q, k, v, valid, 0.125, d_out)
    np.testing.assert_allclose(np.asarray(out)[1], want[1], atol=1e-5, rtol=1e-5)


@pytest.mark.needs_devices(8)
@pytest.mark.parametrize("impl", ["splash", "einsum"])
def test_dot_product_attention_under_a_mesh_matches_the_reference(rng, impl):
    # fsdp=2 splits the batch, tensor=2 the query and key/value heads. Splash runs per device
    # on its block (jax.shard_map), grouped heads still reading their own kv head; einsum is
    # partitioned by XLA.
    mesh = jax.make_mesh(
        (1, 2, 2),
        ("data", "fsdp", "tensor"),
        axis_types=(AxisType.Auto,) * 3,
        devices=jax.devices()[:4],
    )
    q, k, v = _inputs(rng, 40)
    valid = _valid_pattern(2, 40, "gaps")
    d_out = rng.normal(size=q.shape).astype(np.float32) * valid[:, :, None, None]
    with jax.set_mesh(mesh):
        heads = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None, "tensor", None))
        rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))
        args = [jax.device_put(x, heads) for x in (q, k, v)]
        out, grads = _value_and_grads(*args, jax.device_put(valid, rows), 0.125, impl, d_out)
    want, want_grads = _reference(q, k, v, valid, 0.125, d_out)
    np.testing.assert_allclose(np.asarray(out)[valid], want[valid], atol=1e-5, rtol=1e-5)
    for got, ref_grad in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(got), ref_grad, atol=1e-4, rtol=1e-4)


def _abstract_mesh(platform, kind):
    device = AbstractDevice(device_kind=kind, num_cores=1, platform=platform)
    return AbstractMesh((1,), ("fsdp",), axis_types=(AxisType.Auto,), abstract_device=device)


@pytest.mark.parametrize(
    "platform,kind,dtype,head_dim,want",
    [
        ("tpu", "TPU v5 lite", jnp.bfloat16, 128, "splash"),
        ("tpu", "TPU v5 lite", jnp.float32, 64, "splash"),
        ("gpu", "NVIDIA H100 80GB HBM3", jnp.bfloat16, 128, "cudnn"),
        ("gpu", "NVIDIA H100 80GB HBM3", jnp.float32, 128, "xla"),
        ("gpu", "NVIDIA H100 80GB HBM3", jnp.bfloat16, 100, "xla"),
        ("gpu", "AMD Instinct MI300X", jnp.bfloat16, 128, "xla"),
        ("cpu", "cpu", jnp.float32, 64, "einsum"),
    ],
)
def test_auto_implementation_follows_the_context_backend(platform, kind, dtype, head_dim, want):
    with jax.sharding.use_abstract_mesh(_abstract_mesh(platform, kind)):
        got = attn_lib.resolve_attention_implementation("auto", dtype=dtype, head_dim=head_dim)
    assert got == want


@pytest.mark.cpu_only
def test_auto_implementation_on_this_cpu_is_einsum(rng):
    assert (
        attn_lib.resolve_attention_implementation("auto", dtype=jnp.float32, head_dim=64)
        == "einsum"
    )
    q, k, v = _inputs(rng, 16)
    valid = jnp.asarray(_valid_pattern(2, 16, "middle"))
    auto = attn_lib.dot_product_attention(q, k, v, key_valid=valid, scale=0.125)
    einsum = attn_lib.dot_product_attention(
        q, k, v, key_valid=valid, scale=0.125, implementation="einsum"
    )
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(einsum))


def test_attention_implementations_are_listed():
    names = attn_lib.attention_implementations()
    assert set(names) == {"auto", "xla", "einsum", "splash", "cudnn"}
    for name in names[1:]:
        assert (
            attn_lib.resolve_attention_implementation(name, dtype=jnp.float32, head_dim=8) == name
        )


_Q, _KV = np.zeros((2, 8, 4, 16), np.float32), np.zeros((2, 8, 2, 16), np.float32)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"implementation": "flash"}, "unknown attention implementation"),
        ({"q": np.zeros((2, 8, 64), np.float32)}, "q must be"),
        ({"k": np.zeros((2, 8, 3, 16), np.float32)}, "k and v shapes differ"),
        (
            {"k": np.zeros((2, 9, 2, 16), np.float32), "v": np.zeros((2, 9, 2, 16), np.float32)},
            "self-attention",
        ),
        (
            {"k": np.zeros((2, 8, 3, 16), np.float32), "v": np.zeros((2, 8, 3, 16), np.float32)},
            "multiple of key/value heads",
        ),
        ({"v": np.zeros((2, 8, 2, 16), np.float16)}, "dtypes differ"),
        ({"key_valid": np.ones((2, 8), np.int32)}, "key_valid must be"),
        ({"key_valid": np.ones((2, 9), bool)}, "key_valid must be"),
        ({"scale": jnp.float32(0.25)}, "scale must be"),
        ({"scale": float("nan")}, "scale must be"),
        (
            {
                "implementation": "splash",
                "kernel": attn_lib.KernelOptions(interpret=True, block_q=100),
            },
            "block_q",
        ),
        (
            {
                "implementation": "splash",
                "kernel": attn_lib.KernelOptions(interpret=True, block_kv=0),
            },
            "block_kv",
        ),
        ({"implementation": "einsum", "kernel": attn_lib.KernelOptions(block_q=-1)}, "block_q"),
        ({"implementation": "splash"}, "needs a TPU"),
        ({"implementation": "cudnn"}, "bf16 or f16"),
        pytest.param(
            {
                name: np.zeros(x.shape, jnp.bfloat16)
                for name, x in (("q", _Q), ("k", _KV), ("v", _KV))
            }
            | {"implementation": "cudnn"},
            "needs an NVIDIA GPU",
            marks=pytest.mark.cpu_only,
        ),
    ],
)
def test_dot_product_attention_rejects_bad_input(change, match):
    args = {"q": _Q, "k": _KV, "v": _KV, "key_valid": np.ones((2, 8), bool), "scale": 0.25}
    args.update(change)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(ValueError, match=match):
        attn_lib.dot_product_attention(q, k, v, **args)


def test_splash_blocks_divide_the_padded_length():
    assert backends._splash_block(128, 512) == 128
    assert backends._splash_block(1536, 512) == 512
    assert backends._splash_block(640, 512) == 128  # 640 = 5 x 128: no 256 or 512 tile fits
    assert backends._splash_block(768, 512) == 384


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed")
def test_splash_compiles_for_tpu_with_memory_linear_in_sequence(monkeypatch):
    """Deviceless AOT compile for a v5e 2x2 slice: fwd+bwd of B=8 (2 rows a chip), S=2048,
    N=32, K=8, H=128 bf16. The XLA path keeps [2, 32, S, S] f32 scores a chip (1.5 GiB); the
    splash kernel's temporaries are O(S) (about 65 MiB)."""
    from tests.models.tpu_mesh import v5e_2x2_mesh

    mesh = v5e_2x2_mesh(monkeypatch, (1, 4, 1))
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    shapes = [(8, 2048, 32, 128), (8, 2048, 8, 128), (8, 2048, 8, 128)]
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=rows) for s in shapes]
    args.append(jax.ShapeDtypeStruct((8, 2048), jnp.bool_, sharding=rows))

    def compiled(implementation):
        def step(q, k, v, key_valid):
            def loss(q, k, v):
                out = attn_lib.dot_product_attention(
                    q, k, v, key_valid=key_valid, scale=128**-0.5, implementation=implementation
                )
                return jnp.sum(out.astype(jnp.float32))

            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

        with jax.set_mesh(mesh):
            return jax.jit(step).lower(*args).compile()

    splash = compiled("auto")  # the mesh's devices are TPUs: auto is splash
    xla = compiled("xla")
    assert "tpu_custom_call" in splash.as_text()
    assert "all-gather" not in splash.as_text()  # the kernel ran per device on its rows
    splash_temp = splash.memory_analysis().temp_size_in_bytes
    xla_temp = xla.memory_analysis().temp_size_in_bytes
    assert xla_temp >= 2 * 32 * 2048 * 2048 * 4  # the [2, N, S, S] f32 scores of a chip
    assert splash_temp * 10 < xla_temp
