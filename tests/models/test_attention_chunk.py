"""``splash_chunk_attention``: one chunk of C queries (slots ``offset .. offset + C - 1``) over
all S keys, the per-device core of context parallelism, run in the Pallas interpreter on CPU
against a float64 NumPy reference written from the masking rule (forward and VJP): plain
causal at offset 0, at the end and in the middle of the sequence, GQA, several tiles, packed
rows with pads, a sliding window, logit soft-capping, sinks; bad input.
"""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxrl_llm.models.attention_backends import splash_chunk_attention


def _reference(q, k, v, q_segments, kv_segments, offset, scale, d_out, *, cap, window, sinks):
    """Float64 forward and VJP of chunk attention, from the formulas.

    Query ``i`` (slot ``offset + i``) sees key ``j`` iff ``j <= offset + i``, the segments
    match, and ``offset + i - j < W``. ``r = scale q k^T``, ``s = c tanh(r / c)`` (or ``r``),
    ``P_ij = exp(s_ij) / (sum_k exp(s_ik) + exp(σ_n))`` over visible keys (no ``σ`` term
    without sinks), ``O = P V``; ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P (dP - rowsum(dP
    P))``, ``dR = dS (1 - tanh^2(r / c))``, ``dQ = scale dR K``, ``dK = scale dR^T Q``. Query
    head n reads kv head ``n // (N / K)``.
    """
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    chunk, heads, seq, kv_heads = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    group = heads // kv_heads
    i, j = offset + np.arange(chunk)[:, None], np.arange(seq)[None]
    inside = (j <= i) & (i - j < (window or seq + 1))
    mask = inside[None] & (q_segments[:, :, None] == kv_segments[:, None, :])
    assert mask.any(-1).all()  # every query sees a key: the rule defines every output
    out, dq, dk, dv = np.zeros(q.shape), np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for n in range(heads):
        kv = n // group
        r = np.einsum("bih,bjh->bij", q[:, :, n], k[:, :, kv]) * scale
        s = r if cap is None else cap * np.tanh(r / cap)
        s = np.where(mask, s, -np.inf)
        sink = -np.inf if sinks is None else float(sinks[n])
        top = np.maximum(s.max(-1, keepdims=True), sink)
        e = np.exp(s - top)
        p = e / (e.sum(-1, keepdims=True) + np.exp(sink - top))
        out[:, :, n] = np.einsum("bij,bjh->bih", p, v[:, :, kv])
        dv[:, :, kv] += np.einsum("bij,bih->bjh", p, d_out[:, :, n])
        dp = np.einsum("bih,bjh->bij", d_out[:, :, n], v[:, :, kv])
        ds = p * (dp - np.sum(dp * p, -1, keepdims=True))
        dr = ds if cap is None else ds * (1 - np.tanh(r / cap) ** 2)
        dq[:, :, n] = scale * np.einsum("bij,bjh->bih", dr, k[:, :, kv])
        dk[:, :, kv] += scale * np.einsum("bij,bih->bjh", dr, q[:, :, n])
    return out, (dq, dk, dv)


def _packed(batch, seq):
    """``[B, S]`` segment ids: row 0 = 3 sequences (100, 150, 70 tokens) then pads; row 1 =
    left pads, 2 sequences, right pads (a segment boundary inside every chunk below)."""
    segments = np.zeros((batch, seq), np.int32)
    segments[0, :100], segments[0, 100:250], segments[0, 250:320] = 1, 2, 3
    if batch > 1:
        segments[1, 10:140], segments[1, 140:300] = 1, 2
    return segments


# name: (B, C, S, N, K, H, offset, options of splash_chunk_attention, packed?)
_CASES = {
    "causal_offset_0": (2, 128, 256, 4, 2, 32, 0, {}, False),
    "causal_last_chunk": (1, 128, 256, 2, 1, 64, 128, {}, False),
    "causal_middle_tiles": (1, 128, 384, 2, 2, 32, 128, {"block_kv": 128}, False),
    "two_q_tiles": (1, 256, 512, 2, 1, 32, 128, {"block_q": 128, "block_kv": 256}, False),
    "packed_middle": (2, 128, 384, 2, 1, 32, 128, {"block_kv": 128}, True),
    "packed_last": (2, 128, 384, 2, 1, 32, 256, {}, True),
    "window": (1, 128, 384, 2, 1, 32, 128, {"sliding_window": 100, "block_kv": 128}, False),
    "window_packed": (2, 128, 384, 2, 1, 32, 256, {"sliding_window": 60}, True),
    "softcap": (1, 128, 256, 2, 1, 32, 128, {"logit_softcap": 2.0}, False),
    "sinks": (1, 128, 384, 4, 2, 32, 128, {"sinks": True, "block_kv": 128}, True),
}


def _inputs(rng, batch, chunk, seq, heads, kv_heads, dim, offset, packed, q_spread=1.0):
    q = (q_spread * rng.normal(size=(batch, chunk, heads, dim))).astype(np.float32)
    k = rng.normal(size=(batch, seq, kv_heads, dim)).astype(np.float32)
    v = rng.normal(size=(batch, seq, kv_heads, dim)).astype(np.float32)
    kv_segments = _packed(batch, seq) if packed else np.ones((batch, seq), np.int32)
    return q, k, v, kv_segments[:, offset : offset + chunk].copy(), kv_segments


def _case(rng, name):
    batch, chunk, seq, heads, kv_heads, dim, offset, options, packed = _CASES[name]
    options = dict(options)
    # Soft-capping only bites on large scores: spread the queries so many exceed the cap.
    spread = 4.0 if "logit_softcap" in options else 1.0
    inputs = _inputs(rng, batch, chunk, seq, heads, kv_heads, dim, offset, packed, spread)
    if options.pop("sinks", False):
        options["sinks"] = rng.normal(size=heads).astype(np.float32) + 2.0  # sinks that matter
    return inputs, offset, dim**-0.5, options


def _want(inputs, offset, scale, options, d_out):
    return _reference(
        *inputs,
        offset,
        scale,
        d_out,
        cap=options.get("logit_softcap"),
        window=options.get("sliding_window"),
        sinks=options.get("sinks"),
    )


@pytest.mark.parametrize("name", list(_CASES))
def test_chunk_attention_matches_float64_reference(rng, name):
    inputs, offset, scale, options = _case(rng, name)
    out = jax.jit(
        lambda q, k, v, *segments: splash_chunk_attention(
            q, k, v, segments, offset=offset, scale=scale, interpret=True, **options
        )
    )(*inputs)
    assert out.shape == inputs[0].shape and out.dtype == jnp.float32
    want, _ = _want(inputs, offset, scale, options, np.zeros(inputs[0].shape))
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", ["causal_middle_tiles", "sinks", "window_packed", "softcap"])
def test_chunk_attention_gradients_match_float64_reference(rng, name):
    """dq, dk, dv of ``sum(d_out * out)`` against the reference's closed-form float64 VJP."""
    inputs, offset, scale, options = _case(rng, name)
    d_out = rng.normal(size=inputs[0].shape).astype(np.float32)

    def loss(q, k, v, q_segments, kv_segments):
        out = splash_chunk_attention(
            q,
            k,
            v,
            (q_segments, kv_segments),
            offset=offset,
            scale=scale,
            interpret=True,
            **options,
        )
        return jnp.sum(out * d_out)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*inputs)
    _, want = _want(inputs, offset, scale, options, d_out)
    for name_, got, ref in zip("qkv", grads, want):
        np.testing.assert_allclose(np.asarray(got), ref, atol=1e-4, rtol=1e-4, err_msg=name_)


def test_chunk_attention_keeps_bf16(rng):
    inputs, offset, scale, _ = _case(rng, "causal_last_chunk")
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in inputs[:3])
    out = splash_chunk_attention(
        q, k, v, tuple(inputs[3:]), offset=offset, scale=scale, interpret=True
    )
    assert out.dtype == jnp.bfloat16
    rounded = [np.asarray(x, np.float32) for x in (q, k, v)]
    want, _ = _want((*rounded, *inputs[3:]), offset, scale, {}, np.zeros(q.shape))
    # bf16 keeps 8 significant bits: ~0.4% per rounding, of outputs of size ~1.
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=3e-2)


def _sequence_attention(mesh, chunk, scale, **options):
    """``(q, k, v, segments) -> out`` over ``mesh``'s ``sequence`` axis: each device attends
    its ``chunk`` queries (offset ``chunk * rank``) over the all-gathered keys."""
    ranks = mesh.shape["sequence"]

    def local(q, k, v, q_segments):
        k, v, kv_segments = (
            jax.lax.all_gather(x, "sequence", axis=1, tiled=True) for x in (k, v, q_segments)
        )
        calls = [
            functools.partial(splash_chunk_attention, offset=chunk * r, scale=scale, **options)
            for r in range(ranks)
        ]
        rank = jax.lax.axis_index("sequence")
        return jax.lax.switch(rank, calls, q, k, v, (q_segments, kv_segments))

    split = PartitionSpec(None, "sequence")
    return jax.shard_map(local, mesh=mesh, in_specs=(split,) * 4, out_specs=split, check_vma=False)


def test_chunk_attention_per_device_under_a_sequence_axis(rng):
    """The use it serves: a ``sequence`` axis of 2 devices splits a packed S = 256 sequence
    into chunks of C = 128; each device all-gathers the keys, values and key segments and
    attends its chunk at ``offset = 128 r`` (static, so the device's rank ``r`` picks its
    kernel with ``lax.switch``). Output and dq, dk, dv equal full-sequence attention."""
    mesh = jax.make_mesh(
        (2,), ("sequence",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2]
    )
    q, k, v, segments, _ = _inputs(rng, 2, 256, 256, 2, 1, 32, 0, packed=True)
    scale = 32**-0.5
    d_out = rng.normal(size=q.shape).astype(np.float32)
    attend = _sequence_attention(mesh, 128, scale, interpret=True)

    def loss(q, k, v):
        out = attend(q, k, v, jnp.asarray(segments))
        return jnp.sum(out * d_out), out

    with jax.set_mesh(mesh):
        grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    want, want_grads = _want((q, k, v, segments, segments), 0, scale, {}, d_out)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5)
    for name, got, ref in zip("qkv", grads, want_grads):
        np.testing.assert_allclose(np.asarray(got), ref, atol=1e-4, rtol=1e-4, err_msg=name)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed")
def test_chunk_attention_compiles_for_tpu_with_memory_linear_in_sequence(monkeypatch):
    """Deviceless AOT compile (Mosaic, not the interpreter) for a v5e 2x2 slice, the 4 chips
    on the ``sequence`` axis: fwd+bwd of S = 8192 (C = 2048 a chip), N = 8, K = 2, H = 128
    bf16. Dense scores would be [N, C, S] f32 = 512 MiB a chip; the kernel's temporaries are
    O(S) (about 2 MiB)."""
    from jax.experimental import topologies

    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # as tests/models/tpu_mesh.py
    topology = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
    mesh = jax.sharding.Mesh(np.array(topology.devices), ("sequence",), axis_types=(AxisType.Auto,))
    seq, chunk, heads, kv_heads, dim = 8192, 2048, 8, 2, 128
    split = NamedSharding(mesh, PartitionSpec(None, "sequence"))
    shapes = [(1, seq, heads, dim), (1, seq, kv_heads, dim), (1, seq, kv_heads, dim)]
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=split) for s in shapes]
    args.append(jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=split))
    attend = _sequence_attention(mesh, chunk, dim**-0.5)

    def step(q, k, v, segments):
        def loss(q, k, v):
            return jnp.sum(attend(q, k, v, segments).astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    with jax.set_mesh(mesh):
        compiled = jax.jit(step).lower(*args).compile()
    assert "tpu_custom_call" in compiled.as_text()
    assert compiled.memory_analysis().temp_size_in_bytes * 10 < heads * chunk * seq * 4


def _bad(change):
    """Shapes ``(q, k, v, q_segments, kv_segments)`` and options, with ``change`` applied."""
    shapes = {"q": (1, 128, 2, 32), "k": (1, 256, 1, 32), "v": (1, 256, 1, 32)}
    shapes |= {"q_segments": (1, 128), "kv_segments": (1, 256)}
    options = {"offset": 0, "scale": 1.0, "interpret": True}
    for key, value in change.items():
        (shapes if key in shapes else options)[key] = value
    arrays = [
        jnp.zeros(shapes[key], jnp.int32 if "segments" in key else jnp.float32)
        for key in ("q", "k", "v", "q_segments", "kv_segments")
    ]
    return arrays, options


@pytest.mark.parametrize(
    "change,match",
    [
        ({"q": (1, 100, 2, 32), "q_segments": (1, 100)}, r"C = 100 .* multiples of 128"),
        ({"k": (1, 200, 1, 32), "v": (1, 200, 1, 32), "kv_segments": (1, 200)}, "S = 200"),
        ({"offset": 129}, r"offset must be .* \[0, 128\], got 129"),
        ({"offset": -1}, "offset must be"),
        ({"offset": 1.0}, "offset must be"),
        ({"offset": jnp.int32(0)}, "offset must be a Python int"),
        ({"q_segments": (1, 256)}, r"q_segments \(1, 256\) must be \(1, 128\)"),
        ({"kv_segments": (2, 256)}, "kv_segments"),
        ({"k": (1, 256, 2, 32), "v": (1, 256, 2, 32), "q": (1, 128, 3, 32)}, "K does not divide N"),
        ({"k": (1, 256, 1, 64)}, r"k = v"),
        ({"sinks": jnp.zeros(3)}, r"sinks must be \[N\] = \(2,\)"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"block_q": 64}, "block_q must be"),
    ],
)
def test_chunk_attention_rejects_bad_input(change, match):
    arrays, options = _bad(change)
    with pytest.raises(ValueError, match=match):
        splash_chunk_attention(*arrays[:3], tuple(arrays[3:]), **options)
