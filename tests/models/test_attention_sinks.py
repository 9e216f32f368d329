"""Attention sinks (gpt-oss: a learned logit per query head in each softmax's denominator) in
every attention path, against a float64 NumPy reference: the training / prefill backends
(``xla``, ``einsum`` with its hand-written backward pass, the splash kernel in its
interpreter), packed rows, a traced sliding-window flag, attention over a cache (the CPU
one-query decode path and the general one, head-major and kv-major), the paged cache (which
never takes the TPU kernel with sinks), and the cuDNN refusal.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxrl_llm.models import attention as attn_lib
from jaxrl_llm.models import kv_cache
from jaxrl_llm.models.attention_backends import sink_softmax


def _reference(q, k, v, valid, scale, sinks, window, d_out, segments=None):
    """Float64 forward and VJP of causal attention with sinks (and a window, segments).

    ``S = scale q k^T``, ``P_ij = exp(S_ij) / (sum_k exp(S_ik) + exp(σ_n))`` over the visible
    keys (``i - W < j <= i``, ``j`` real and in ``i``'s segment, plus the own slot), ``O = P V``;
    ``dS = P * (dP - rowsum(dP P))`` and ``dσ_n = -sum_i p_σ,i rowsum(dO_i O_i)``.
    """
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    seq, heads, kv_heads = q.shape[1], q.shape[2], k.shape[2]
    group = heads // kv_heads
    i, j = np.arange(seq)[:, None], np.arange(seq)[None]
    inside = (j <= i) & (i - j < (window or seq + 1))
    mask = inside[None] & valid[:, None, :]
    if segments is not None:
        mask = mask & (segments[:, :, None] == segments[:, None, :])
    mask = mask | np.eye(seq, dtype=bool)[None]
    out, dq, dk, dv = np.zeros(q.shape), np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    d_sinks = np.zeros(heads)
    for n in range(heads):
        kv = n // group
        s = np.einsum("bih,bjh->bij", q[:, :, n], k[:, :, kv]) * scale
        s = np.where(mask, s, -np.inf)
        top = np.maximum(s.max(-1, keepdims=True), sinks[n])
        e = np.exp(s - top)
        denominator = e.sum(-1, keepdims=True) + np.exp(sinks[n] - top)
        p, p_sink = e / denominator, np.exp(sinks[n] - top) / denominator
        out[:, :, n] = np.einsum("bij,bjh->bih", p, v[:, :, kv])
        dv[:, :, kv] += np.einsum("bij,bih->bjh", p, d_out[:, :, n])
        dp = np.einsum("bih,bjh->bij", d_out[:, :, n], v[:, :, kv])
        delta = np.sum(dp * p, -1, keepdims=True)
        ds = p * (dp - delta)
        dq[:, :, n] = scale * np.einsum("bij,bjh->bih", ds, k[:, :, kv])
        dk[:, :, kv] += scale * np.einsum("bij,bih->bjh", ds, q[:, :, n])
        d_sinks[n] = -np.sum(p_sink * delta)
    return out, (dq, dk, dv, d_sinks)


_BACKENDS = {
    "xla": ("xla", {}),
    "einsum": ("einsum", {}),
    "einsum_blocks": (
        "einsum",
        {"kernel": attn_lib.KernelOptions(block_q=8)},
    ),  # blocks skip the keys before their window
    "splash": ("splash", {"kernel": attn_lib.KernelOptions(interpret=True)}),
}


def _case(rng, seq=24):
    q, k, v = (rng.normal(size=(2, seq, heads, 32)).astype(np.float32) * 2 for heads in (4, 2, 2))
    valid = np.ones((2, seq), bool)
    valid[0, :5] = False  # left padding
    valid[0, 20:] = False  # right padding
    valid[1, 10:13] = False  # a gap
    sinks = rng.normal(size=4).astype(np.float32) * 2
    d_out = rng.normal(size=q.shape).astype(np.float32) * valid[:, :, None, None]
    return q, k, v, valid, sinks, d_out


def _grads(name, options, q, k, v, valid, sinks, window, active, d_out, segments=None):
    """``(q/k/v/sinks gradients of sum(d_out * out), out)`` under jit; ``active`` may be a
    traced flag (a jit argument)."""

    def loss(q, k, v, sinks, active):
        out = attn_lib.dot_product_attention(
            q,
            k,
            v,
            key_valid=jnp.asarray(valid),
            scale=0.2,
            implementation=name,
            sliding_window=window,
            window_active=active,
            segment_ids=None if segments is None else jnp.asarray(segments),
            sinks=sinks,
            **options,
        )
        return jnp.sum(out * d_out), out

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    return grad(q, k, v, sinks, active)


@pytest.mark.parametrize("backend", list(_BACKENDS))
@pytest.mark.parametrize("window", [None, 5])
def test_backends_with_sinks_match_float64(rng, backend, window):
    """Each backend's output and q/k/v/sink gradients against the float64 reference, with and
    without a sliding window."""
    name, options = _BACKENDS[backend]
    q, k, v, valid, sinks, d_out = _case(rng)
    grads, out = _grads(name, options, q, k, v, valid, sinks, window, True, d_out)
    want, want_grads = _reference(q, k, v, valid, 0.2, sinks, window, d_out)
    np.testing.assert_allclose(np.asarray(out)[valid], want[valid], atol=2e-5, rtol=1e-5)
    for label, got, ref_grad in zip(("q", "k", "v", "sinks"), grads, want_grads):
        np.testing.assert_allclose(np.asarray(got), ref_grad, atol=2e-4, rtol=1e-4, err_msg=label)
    assert np.abs(want_grads[3]).max() > 0.1  # the sinks' gradient is tested, not ~0


@pytest.mark.parametrize("backend", ["xla", "einsum"])
def test_sinks_with_packed_rows_and_a_traced_window(rng, backend):
    """Packed rows (segments) under a layer-scan's traced window flag, on and off."""
    name, options = _BACKENDS[backend]
    q, k, v, valid, sinks, d_out = _case(rng)
    segments = np.ones((2, 24), np.int32)
    segments[:, 9:] = 2
    segments[1, 17:] = 3
    for active in (True, False):
        grads, out = _grads(
            name, options, q, k, v, valid, sinks, 5, jnp.asarray(active), d_out, segments
        )
        want, want_grads = _reference(
            q, k, v, valid, 0.2, sinks, 5 if active else None, d_out, segments
        )
        np.testing.assert_allclose(np.asarray(out)[valid], want[valid], atol=2e-5, rtol=1e-5)
        for label, got, ref_grad in zip(("q", "k", "v", "sinks"), grads, want_grads):
            np.testing.assert_allclose(np.asarray(got), ref_grad, atol=2e-4, err_msg=label)


def test_sink_softmax_hand_checked():
    """Scores ``[0, ln 2]`` and a sink ``ln 3``: ``p = [1, 2] / 6``, the sink's 1/2 dropped; a
    masked key (``-inf``) gets 0; no sink: the plain softmax."""
    scores = jnp.array([[0.0, np.log(2.0), -np.inf]])
    got = sink_softmax(scores, jnp.array([[np.log(3.0)]]))
    np.testing.assert_allclose(np.asarray(got), [[1 / 6, 2 / 6, 0.0]], rtol=1e-6)
    plain = sink_softmax(scores, None)
    np.testing.assert_allclose(np.asarray(plain), [[1 / 3, 2 / 3, 0.0]], rtol=1e-6)


@pytest.mark.parametrize("kv_major", [False, True])
@pytest.mark.parametrize("seq", [1, 3])  # 1: the CPU decode path without the query axis
def test_cache_attention_with_sinks(rng, seq, kv_major):
    """Attention over a 12-slot cache (queries at slots 9.., a window of 4) with sinks, in both
    cache layouts, against float64."""
    slots, window = 12, 4
    q = rng.normal(size=(2, seq, 4, 16)).astype(np.float32) * 2
    k, v = (rng.normal(size=(2, 2, slots, 16)).astype(np.float32) * 2 for _ in range(2))
    sinks = rng.normal(size=4).astype(np.float32)
    key_valid = np.ones((2, slots), bool)
    key_valid[0, :3] = False
    mask = attn_lib.attention_mask(jnp.asarray(key_valid), jnp.arange(9, 9 + seq), window=window)
    keys, values = (np.swapaxes(x, 0, 1) if kv_major else x for x in (k, v))
    got = attn_lib.cache_attention(
        q, keys, values, mask, scale=0.25, kv_major=kv_major, sinks=jnp.asarray(sinks)
    )
    for b in range(2):
        for s in range(seq):
            visible = [j for j in range(slots) if 0 <= 9 + s - j < window and key_valid[b, j]]
            for n in range(4):
                scores = k[b, n // 2, visible].astype(np.float64) @ q[b, s, n] * 0.25
                e = np.exp(scores - scores.max())
                p = e / (e.sum() + np.exp(sinks[n] - scores.max()))
                want = p @ v[b, n // 2, visible]
                np.testing.assert_allclose(np.asarray(got)[b, s, n], want, atol=1e-5)


def test_paged_cache_with_sinks_never_takes_the_kernel(rng, monkeypatch):
    """JAX's paged-attention kernel has no sinks: with sinks the paged cache gathers (the
    implementation choice is not even consulted) and attends as ``cache_attention`` does."""

    def refuse(*_):
        raise AssertionError("the paged kernel was considered for a layer with sinks")

    monkeypatch.setattr(kv_cache, "paged_attention_implementation", refuse)
    size, blocks = 4, 6
    pools = tuple(jnp.zeros((2, blocks, size, 16), jnp.float32) for _ in range(2))
    new = tuple(jnp.asarray(rng.normal(size=(2, 1, 2, 16)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(2, 1, 4, 16)), jnp.float32)
    table = jnp.array([[0, 1, 2], [3, 4, 5]], jnp.int32)
    key_valid = jnp.zeros((2, 12), bool).at[:, 0].set(True)
    mask = attn_lib.attention_mask(key_valid, jnp.zeros((1,), jnp.int32))
    sinks = jnp.asarray(rng.normal(size=4), jnp.float32)
    _, got = kv_cache.paged_cache_attention(
        pools,
        new,
        q,
        mask,
        layer_index=None,
        cache_index=jnp.int32(0),
        table=table,
        scale=0.25,
        key_valid=key_valid,
        sinks=sinks,
    )
    # One visible key per row (the one just written): p = e^s / (e^s + e^σ).
    scores = jnp.einsum("bnh,bnh->bn", q[:, 0], jnp.repeat(new[0][:, 0], 2, axis=1)) * 0.25
    weight = jax.nn.sigmoid(scores - sinks)
    want = weight[..., None] * jnp.repeat(new[1][:, 0], 2, axis=1)
    np.testing.assert_allclose(np.asarray(got)[:, 0], np.asarray(want), atol=1e-5)


def test_cudnn_refuses_sinks_and_auto_avoids_it(monkeypatch):
    import jaxrl_llm.models.attention as attention_module

    monkeypatch.setattr(attention_module, "current_platform", lambda: ("gpu", "NVIDIA H100"))
    resolve = attn_lib.resolve_attention_implementation
    assert resolve("auto", dtype=jnp.bfloat16, head_dim=64) == "cudnn"
    assert resolve("auto", dtype=jnp.bfloat16, head_dim=64, sinks=True) == "xla"
    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="no attention sinks"):
        attn_lib.dot_product_attention(
            q,
            q,
            q,
            key_valid=jnp.ones((1, 8), bool),
            scale=0.1,
            implementation="cudnn",
            sinks=jnp.zeros(2),
        )


def test_bad_sinks_are_named():
    q = jnp.zeros((1, 8, 4, 16))
    with pytest.raises(ValueError, match=r"sinks must be a \[N\] = \(4,\)"):
        attn_lib.dot_product_attention(
            q, q, q, key_valid=jnp.ones((1, 8), bool), scale=0.1, sinks=jnp.zeros(3)
        )


@pytest.mark.needs_devices(8)
@pytest.mark.parametrize("impl", ["splash", "einsum"])
def test_sinks_under_a_mesh_match_float64(rng, impl):
    """fsdp=2 splits the rows, tensor=2 the heads (and their sinks); splash runs per device
    (``jax.shard_map``) with each device's heads' sinks."""
    mesh = jax.make_mesh(
        (1, 2, 2),
        ("data", "fsdp", "tensor"),
        axis_types=(AxisType.Auto,) * 3,
        devices=jax.devices()[:4],
    )
    q, k, v, valid, sinks, d_out = _case(rng)
    name, options = _BACKENDS[impl]
    with jax.set_mesh(mesh):
        heads = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None, "tensor", None))
        q, k, v = (jax.device_put(x, heads) for x in (q, k, v))
        sinks = jax.device_put(sinks, NamedSharding(mesh, PartitionSpec("tensor")))
        grads, out = _grads(name, options, q, k, v, valid, sinks, 5, True, d_out)
    want, want_grads = _reference(q, k, v, valid, 0.2, np.asarray(sinks), 5, d_out)
    np.testing.assert_allclose(np.asarray(out)[valid], want[valid], atol=2e-5, rtol=1e-5)
    for label, got, ref_grad in zip(("q", "k", "v", "sinks"), grads, want_grads):
        np.testing.assert_allclose(np.asarray(got), ref_grad, atol=2e-4, rtol=1e-4, err_msg=label)
