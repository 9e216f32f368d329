"""Attention over packed rows (``segment_ids``): every backend against a float64 NumPy
reference that never lets a query see another segment, with sliding windows and soft caps;
the model's packed forward against each sequence run alone; errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxrl_llm import models
from jaxrl_llm.models import attention as attn_lib
from jaxrl_llm.models.attention import attention_mask
from tests.models import hf_utils

# (name passed to dot_product_attention, extra keyword args)
_IMPLS = {
    "xla": ("xla", {}),
    "einsum": ("einsum", {}),
    "einsum_blocks": ("einsum", {"kernel": attn_lib.KernelOptions(block_q=8)}),
    "splash": ("splash", {"kernel": attn_lib.KernelOptions(interpret=True)}),
}


def _segments(batch=2, seq=40):
    """Row 0: three sequences (10, 15, 13 tokens) then 2 pads; row 1: one full sequence."""
    seg = np.zeros((batch, seq), np.int32)
    seg[0, :10], seg[0, 10:25], seg[0, 25:38] = 1, 2, 3
    seg[1] = 1
    return seg


def _reference(q, k, v, seg, scale, d_out, *, window=None, cap=None):
    """Float64 forward and VJP of causal attention within segments.

    Key ``j`` visible to query ``i`` iff ``j <= i``, ``seg[j] == seg[i] != 0`` and, with a
    window W, ``i - j < W``; a pad query sees itself. ``s = scale q.k``, capped to
    ``c tanh(s / c)``; ``P = softmax(s)``, ``O = P V``; ``dS = P * (dP - rowsum(dP P))``
    times ``1 - tanh^2`` under a cap.
    """
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    seq, heads, kv_heads = q.shape[1], q.shape[2], k.shape[2]
    group = heads // kv_heads
    i, j = np.arange(seq)[:, None], np.arange(seq)[None]
    visible = (j <= i)[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
    if window is not None:
        visible &= (i - j < window)[None]
    visible |= np.eye(seq, dtype=bool)[None]
    out, dq, dk, dv = np.zeros(q.shape), np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for n in range(heads):
        kv = n // group
        raw = np.einsum("bih,bjh->bij", q[:, :, n], k[:, :, kv]) * scale
        capped = raw if cap is None else cap * np.tanh(raw / cap)
        scores = np.where(visible, capped, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[:, :, n] = np.einsum("bij,bjh->bih", p, v[:, :, kv])
        dv[:, :, kv] += np.einsum("bij,bih->bjh", p, d_out[:, :, n])
        dp = np.einsum("bih,bjh->bij", d_out[:, :, n], v[:, :, kv])
        ds = p * (dp - np.sum(dp * p, -1, keepdims=True))
        if cap is not None:
            ds *= 1.0 - np.tanh(raw / cap) ** 2
        dq[:, :, n] = scale * np.einsum("bij,bjh->bih", ds, k[:, :, kv])
        dk[:, :, kv] += scale * np.einsum("bij,bih->bjh", ds, q[:, :, n])
    return out, (dq, dk, dv)


def _inputs(rng, seq=40, *, batch=2, heads=4, kv_heads=2, dim=32):
    q = rng.normal(size=(batch, seq, heads, dim)).astype(np.float32)
    k = rng.normal(size=(batch, seq, kv_heads, dim)).astype(np.float32)
    v = rng.normal(size=(batch, seq, kv_heads, dim)).astype(np.float32)
    return q, k, v


def _value_and_grads(q, k, v, seg, impl, d_out, **options):
    name, extra = _IMPLS[impl]

    def loss(q, k, v):
        out = attn_lib.dot_product_attention(
            q,
            k,
            v,
            key_valid=jnp.asarray(seg > 0),
            scale=0.2,
            implementation=name,
            segment_ids=jnp.asarray(seg),
            **extra,
            **options,
        )
        return jnp.sum(out.astype(jnp.float32) * d_out), out

    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


@pytest.mark.parametrize(
    "options",
    [{}, {"sliding_window": 6}, {"logit_softcap": 2.0, "sliding_window": 4}],
    ids=["global", "window", "window_softcap"],
)
@pytest.mark.parametrize("impl", list(_IMPLS))
def test_segments_match_float64_reference(rng, impl, options):
    q, k, v = _inputs(rng)
    seg = _segments()
    real = seg > 0
    d_out = rng.normal(size=q.shape).astype(np.float32) * real[:, :, None, None]
    out, grads = _value_and_grads(q, k, v, seg, impl, d_out, **options)
    assert np.isfinite(np.asarray(out)).all()
    want, want_grads = _reference(
        q,
        k,
        v,
        seg,
        0.2,
        d_out,
        window=options.get("sliding_window"),
        cap=options.get("logit_softcap"),
    )
    np.testing.assert_allclose(np.asarray(out)[real], want[real], atol=1e-5, rtol=1e-5)
    for name, got, ref_grad in zip("qkv", grads, want_grads):
        np.testing.assert_allclose(np.asarray(got), ref_grad, atol=1e-4, rtol=1e-4, err_msg=name)


def test_segments_under_a_traced_window_flag(rng):
    """A scanned layer's own window flag (traced): the masked path and splash's lax.cond."""
    q, k, v = _inputs(rng)
    seg = _segments()
    real = seg > 0
    for impl in ("einsum", "splash"):
        name, extra = _IMPLS[impl]

        def run(flag, name=name, extra=extra):
            return attn_lib.dot_product_attention(
                q,
                k,
                v,
                key_valid=jnp.asarray(real),
                scale=0.2,
                implementation=name,
                sliding_window=5,
                window_active=flag,
                segment_ids=jnp.asarray(seg),
                **extra,
            )

        for flag, window in ((True, 5), (False, None)):
            got = np.asarray(jax.jit(run)(jnp.asarray(flag)))
            want, _ = _reference(q, k, v, seg, 0.2, np.zeros(q.shape), window=window)
            np.testing.assert_allclose(got[real], want[real], atol=1e-5, rtol=1e-5, err_msg=impl)


def test_cudnn_runs_packed_rows_on_the_einsum_path(rng, monkeypatch):
    """JAX's public cuDNN attention takes no segment ids: packed rows fall back to einsum (here
    on a pretend GPU, so the code path runs on CPU)."""
    monkeypatch.setattr(attn_lib, "current_platform", lambda: ("gpu", "NVIDIA H100"))
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _inputs(rng))
    seg = _segments()
    real = seg > 0
    got = attn_lib.dot_product_attention(
        q,
        k,
        v,
        key_valid=jnp.asarray(real),
        scale=0.2,
        implementation="auto",
        segment_ids=jnp.asarray(seg),
    )
    rounded = [np.asarray(x, np.float32) for x in (q, k, v)]
    want, _ = _reference(*rounded, seg, 0.2, np.zeros(q.shape))
    np.testing.assert_allclose(np.asarray(got, np.float32)[real], want[real], atol=3e-2)


def test_attention_mask_with_segments_hand_checked():
    # One row: segment 1 at slots 0-1, segment 2 at slots 2-3, a pad at slot 4.
    seg = jnp.array([[1, 1, 2, 2, 0]])
    mask = np.asarray(attention_mask(seg > 0, jnp.arange(5), segments=(seg, seg)))[0, 0]
    np.testing.assert_array_equal(
        mask,
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 0, 0, 1],  # the pad query sees only itself
        ],
    )


CONFIG = models.ModelConfig(
    architecture="Qwen2ForCausalLM",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    qkv_bias=True,
)


def test_packed_forward_equals_each_sequence_alone(rng):
    """Two sequences in one row (default positions restarting per segment) give the hidden
    states each gives alone; Gemma 2 too (sliding window of 6 slots, both sequences longer)."""
    gemma2 = models.ModelConfig.from_hf_dict(hf_utils.hf_dict("gemma2"))
    for config in (CONFIG, gemma2):
        params = models.init_params(config, jax.random.key(1))
        a, b = rng.integers(1, 64, 9), rng.integers(1, 64, 8)
        tokens = np.zeros((1, 20), np.int32)
        tokens[0, :9], tokens[0, 9:17] = a, b
        seg = np.zeros((1, 20), np.int32)
        seg[0, :9], seg[0, 9:17] = 1, 2
        packed, _ = models.forward(params, config, jnp.asarray(tokens), segment_ids=seg)
        alone_a, _ = models.forward(params, config, jnp.asarray(a[None]))
        alone_b, _ = models.forward(params, config, jnp.asarray(b[None]))
        np.testing.assert_allclose(packed[0, :9], alone_a[0], atol=1e-5)
        np.testing.assert_allclose(packed[0, 9:17], alone_b[0], atol=1e-5)
        assert np.isfinite(np.asarray(packed)).all()


def test_packed_forward_errors():
    params = models.init_params(CONFIG, jax.random.key(0))
    tokens = jnp.ones((1, 4), jnp.int32)
    seg = jnp.array([[1, 1, 2, 0]])
    cache = models.init_cache(CONFIG, 1, 8)
    with pytest.raises(ValueError, match="cannot be used with a KV cache"):
        models.forward(params, CONFIG, tokens, segment_ids=seg, cache=cache, cache_index=0)
    with pytest.raises(ValueError, match="not both"):
        models.forward(params, CONFIG, tokens, segment_ids=seg, attention_mask=seg > 0)
    with pytest.raises(ValueError, match="segment_ids must have the tokens' shape"):
        models.forward(params, CONFIG, tokens, segment_ids=seg[:, :3])
    with pytest.raises(ValueError, match="segment_ids must be integers"):
        models.forward(params, CONFIG, tokens, segment_ids=seg.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"segment_ids must be a \[B, S\]"):
        q = jnp.zeros((1, 4, 2, 8))
        attn_lib.dot_product_attention(
            q, q, q, key_valid=jnp.ones((1, 4), bool), scale=1.0, segment_ids=seg[:, :2]
        )


def test_packed_default_positions_restart_per_segment():
    # RoPE is relative, so outputs cannot tell a shifted segment apart: checked directly.
    from jaxrl_llm.models.transformer import _packed_rows

    seg = jnp.array([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    _, positions = _packed_rows(seg, None, None, None)
    np.testing.assert_array_equal(
        np.asarray(positions), [[0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 2, 3, 4, 5, 6, 7]]
    )


@pytest.mark.needs_devices(8)
@pytest.mark.parametrize("impl", ["splash", "einsum"])
def test_segments_under_a_mesh_match_the_reference(rng, impl):
    # fsdp=2 splits the packed rows, tensor=2 the heads; splash runs per device (shard_map)
    # with each device's rows' segment ids.
    mesh = jax.make_mesh(
        (1, 2, 2),
        ("data", "fsdp", "tensor"),
        axis_types=(AxisType.Auto,) * 3,
        devices=jax.devices()[:4],
    )
    q, k, v = _inputs(rng)
    seg = _segments()
    real = seg > 0
    d_out = rng.normal(size=q.shape).astype(np.float32) * real[:, :, None, None]
    with jax.set_mesh(mesh):
        heads = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None, "tensor", None))
        args = [jax.device_put(x, heads) for x in (q, k, v)]
        out, grads = _value_and_grads(*args, seg, impl, d_out)
    want, want_grads = _reference(q, k, v, seg, 0.2, d_out)
    np.testing.assert_allclose(np.asarray(out)[real], want[real], atol=1e-5, rtol=1e-5)
    for got, ref_grad in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(got), ref_grad, atol=1e-4, rtol=1e-4)
