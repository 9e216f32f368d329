"""Context parallelism (``jaxrl_llm.models.context_parallel``, issue 44 item 3): a forward's
sequence split over the ``sequence`` mesh axis.

On 8 fake CPU devices (``mesh.sequence=4 mesh.fsdp=2``) the log-prob forward and the gradient
of a GRPO-style surrogate plus entropy equal the one-device result, whose forward is checked
against transformers elsewhere (padded rows, packed rows, Gemma-style sliding windows with soft
caps, a mixture of experts with its router logits and replayed routing); the attention alone
(packed rows, windows, caps, gpt-oss's sinks) equals a float64 NumPy
reference; the compiled HLO gathers each layer's keys and values over groups
of the 4 sequence devices and moves no activation over fsdp. The zigzag order is checked by
hand.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm import models, parallel
from jaxrl_llm.logprobs import completion_logprobs
from jaxrl_llm.models import context_parallel

EIGHT = pytest.mark.skipif(
    len(jax.devices()) < 8
    or "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""),
    reason="needs 8 fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)",
)

# P + T = 29 positions: padded to 32 (2 x 4 shards x 4), so the zigzag chunks are 4 wide.
ROWS, PROMPT, COMPLETION, CHUNK = 4, 8, 21, 8


def _config(**overrides) -> models.ModelConfig:
    base = dict(
        architecture="LlamaForCausalLM",
        vocab_size=112,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    return models.ModelConfig(**{**base, **overrides})


def test_zigzag_by_hand():
    np.testing.assert_array_equal(context_parallel.zigzag(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
    np.testing.assert_array_equal(context_parallel.zigzag(4, 1), [0, 1, 2, 3])
    # 4 devices of 2 chunks of 1: device r holds slots r and 7 - r.
    np.testing.assert_array_equal(context_parallel.zigzag(8, 4), [0, 7, 1, 6, 2, 5, 3, 4])
    with pytest.raises(ValueError, match="divisible by 2 x 4"):
        context_parallel.zigzag(12, 4)
    assert context_parallel.padded_length(29, 4, splash=False) == 32
    assert context_parallel.padded_length(29, 4, splash=True) == 1024
    assert context_parallel.padded_length(1024, 4, splash=True) == 1024


def _batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    prompt_mask = np.ones((ROWS, PROMPT), bool)
    prompt_mask[:, :3] = rng.random((ROWS, 3)) > 0.5  # some left padding
    completion_mask = np.arange(COMPLETION)[None] < np.array([[21], [13], [5], [17]])
    return (
        jnp.asarray(rng.integers(0, 112, (ROWS, PROMPT)), jnp.int32),
        jnp.asarray(prompt_mask),
        jnp.asarray(rng.integers(0, 112, (ROWS, COMPLETION)), jnp.int32),
        jnp.asarray(completion_mask),
        jnp.asarray(rng.normal(size=(ROWS, 1)), jnp.float32),
    )


def _loss(config):
    """``sum(A_b logp_bt m_bt) + 0.1 sum(H_bt m_bt)``: the policy-gradient and entropy terms."""

    def loss(params, prompt, prompt_mask, completion, completion_mask, advantages):
        logprobs, entropy = completion_logprobs(
            params,
            config,
            prompt,
            prompt_mask,
            completion,
            completion_mask,
            return_entropy=True,
            chunk_size=CHUNK,
            temperature=0.7,
        )
        value = jnp.sum((logprobs * advantages + 0.1 * entropy) * completion_mask)
        return value, (logprobs * completion_mask, entropy * completion_mask)

    return jax.value_and_grad(loss, has_aux=True)


def _sharded(config, params, mesh):
    shardings = parallel.logical_to_sharding(
        models.logical_axes(config), mesh, parallel.PARAM_RULES, shapes=params
    )
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))

    def step(*args):
        with parallel.mesh_context(mesh):
            return _loss(config)(*args)

    fn = jax.jit(
        step,
        in_shardings=(shardings, *(rows,) * 5),
        out_shardings=((None, (rows, rows)), shardings),
    )
    args = (jax.device_put(params, shardings), *(jax.device_put(x, rows) for x in _batch()))
    return fn, args, shardings


CASES = {
    "llama": {},
    "tied-bias": {"architecture": "Qwen2ForCausalLM", "tie_word_embeddings": True},
    # Gemma 2: every other layer a sliding window of 8 slots (traced inside the layer scan),
    # soft-capped attention scores.
    "sliding-softcap": {
        "architecture": "Gemma2ForCausalLM",
        "sliding_window": 8,
        "layer_types": ("sliding_attention", "full_attention"),
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "query_pre_attn_scalar": 16,
    },
}


@EIGHT
@pytest.mark.parametrize("case", list(CASES))
def test_sequence_split_logprobs_and_gradients_match_one_device(case):
    config = _config(**CASES[case])
    params = models.init_params(config, jax.random.key(0))
    (want_loss, want_aux), want_grads = jax.jit(_loss(config))(params, *_batch())
    mesh = parallel.make_mesh(data=1, fsdp=2, sequence=4)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "sequence": 4, "tensor": 1}
    fn, args, shardings = _sharded(config, params, mesh)
    # Weights are stored over fsdp x sequence (8 shards of the model width).
    assert shardings["layers"]["w_up"].spec[1] == ("fsdp", "sequence")
    (loss, aux), grads = fn(*args)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves((aux, grads)), jax.tree.leaves((want_aux, want_grads))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@EIGHT
def test_packed_rows_split_over_the_sequence_match_one_device():
    """Packed rows (segment ids, positions restarting per segment) on the sequence mesh give
    the one-device hidden states on every real position."""
    config = _config()
    params = models.init_params(config, jax.random.key(1))
    rng = np.random.default_rng(3)
    seq = 27
    segment_ids = np.zeros((ROWS, seq), np.int32)
    for row, lengths in enumerate([(9, 11, 7), (27,), (5, 5, 5, 5), (13, 6)]):
        start = 0
        for k, n in enumerate(lengths, 1):
            segment_ids[row, start : start + n] = k
            start += n
    tokens = jnp.asarray(rng.integers(0, 112, (ROWS, seq)), jnp.int32)

    def hidden(p, t, s):
        return models.forward(p, config, t, segment_ids=s)[0]

    want = jax.jit(hidden)(params, tokens, jnp.asarray(segment_ids))
    mesh = parallel.make_mesh(data=1, fsdp=2, sequence=4)
    with jax.set_mesh(mesh):
        got = jax.jit(hidden)(params, tokens, jnp.asarray(segment_ids))
    real = segment_ids > 0
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-5)


def _reference_attention(q, k, v, valid, segments, *, scale, window, cap, sinks):
    """float64 NumPy: ``o_i = sum_j p_ij v_j`` over keys ``j <= i`` of row ``i``'s segment
    (``i - j < window``), ``p = exp(s) / (sum exp(s) + exp(sink))``, ``s = cap tanh(q.k scale
    / cap)``; heads grouped ``n -> n // (N / K)``."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, seq, heads, _ = q.shape
    group = heads // k.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        for n in range(heads):
            s = q[b, :, n] @ k[b, :, n // group].T * scale
            if cap is not None:
                s = cap * np.tanh(s / cap)
            i, j = np.arange(seq)[:, None], np.arange(seq)[None]
            seen = (j <= i) & (i - j < (window or seq + 1)) & valid[b][None]
            seen &= segments[b][:, None] == segments[b][None]
            s = np.where(seen, s, -np.inf)
            top = np.max(s, axis=1, keepdims=True)
            with np.errstate(invalid="ignore"):  # pad queries' rows: all masked, not compared
                e = np.exp(s - top)
            denominator = e.sum(axis=1, keepdims=True)
            if sinks is not None:
                denominator = denominator + np.exp(float(sinks[n]) - top)
            out[b, :, n] = (e / denominator) @ v[b, :, n // group]
    return out


@EIGHT
@pytest.mark.parametrize("features", ["plain", "packed-window-cap-sinks"])
def test_context_attention_matches_a_float64_reference(features):
    """``context_parallel.attention`` on a zigzag-ordered sequence split over 4 devices (and
    its batch over 2) against float64 NumPy on the sequence in order, real queries only."""
    rng = np.random.default_rng(5)
    batch, seq, heads, kv_heads, dim = 2, 16, 4, 2, 8
    q = rng.normal(size=(batch, seq, heads, dim)).astype(np.float32)
    k = rng.normal(size=(batch, seq, kv_heads, dim)).astype(np.float32)
    v = rng.normal(size=(batch, seq, kv_heads, dim)).astype(np.float32)
    valid = np.ones((batch, seq), bool)
    valid[0, :3] = False  # left padding
    valid[1, 13:] = False  # right padding
    packed = features != "plain"
    segments = valid.astype(np.int32)
    if packed:
        segments[0, 9:] = 2
        segments[1, 5:13] = 2
    window, cap = (4, 5.0) if packed else (None, None)
    sinks = rng.normal(size=heads).astype(np.float32) if packed else None
    want = _reference_attention(
        q, k, v, valid, segments, scale=0.3, window=window, cap=cap, sinks=sinks
    )
    mesh = parallel.make_mesh(data=1, fsdp=2, sequence=4)
    got = _zigzag_attention(
        mesh,
        (q, k, v, valid, segments if packed else None, sinks),
        scale=0.3,
        logit_softcap=cap,
        sliding_window=window,
    )
    np.testing.assert_allclose(got[valid], want[valid], rtol=2e-5, atol=2e-5)


def _zigzag_attention(mesh, arrays, **options):
    """``context_parallel.attention`` over ``mesh`` of ``(q, k, v, valid, segment ids or None,
    sinks or None)`` stored in ``zigzag`` order over the mesh's sequence shards, returned in
    slot order as NumPy."""
    q, k, v, valid, segments, sinks = arrays
    order = context_parallel.zigzag(q.shape[1], dict(mesh.shape)["sequence"])

    def attend(q, k, v, valid, segments, sinks):
        return context_parallel.attention(
            q,
            k,
            v,
            key_valid=valid,
            slots=jnp.asarray(order, jnp.int32),
            segment_ids=segments,
            sinks=sinks,
            **options,
        )

    stored = [None if x is None else jnp.asarray(x[:, order]) for x in (q, k, v, valid, segments)]
    with jax.set_mesh(mesh):
        got = jax.jit(attend)(*stored, None if sinks is None else jnp.asarray(sinks))
    return np.asarray(got)[:, np.argsort(order)]


@EIGHT
def test_the_splash_path_matches_a_float64_reference(monkeypatch):
    """The TPU path (two splash kernels a device, keys put back in slot order, the device's
    offsets chosen by ``lax.switch``), run in the Pallas interpreter on 2 sequence devices
    over 512 zigzag-ordered positions with packed rows and sinks, against float64 NumPy."""
    from jaxrl_llm.models import attention_backends  # noqa: PLC0415

    monkeypatch.setattr(context_parallel, "uses_splash", lambda *a, **k: True)
    kernel = attention_backends.splash_chunk_attention
    monkeypatch.setattr(
        attention_backends,
        "splash_chunk_attention",
        lambda *a, **k: kernel(*a, **k, interpret=True),
    )
    rng = np.random.default_rng(7)
    batch, seq, heads, kv_heads, dim = 4, 512, 2, 1, 32
    q = rng.normal(size=(batch, seq, heads, dim)).astype(np.float32)
    k = rng.normal(size=(batch, seq, kv_heads, dim)).astype(np.float32)
    v = rng.normal(size=(batch, seq, kv_heads, dim)).astype(np.float32)
    valid = np.ones((batch, seq), bool)
    valid[0, :37] = False
    valid[1, 300:] = False
    segments = valid.astype(np.int32)
    segments[2, 200:] = 2
    segments[3, 100:450] = 3
    sinks = rng.normal(size=heads).astype(np.float32)
    want = _reference_attention(
        q, k, v, valid, segments, scale=0.2, window=None, cap=None, sinks=sinks
    )
    mesh = parallel.make_mesh(data=1, fsdp=4, sequence=2)
    got = _zigzag_attention(mesh, (q, k, v, valid, segments, sinks), scale=0.2)
    np.testing.assert_allclose(got[valid], want[valid], rtol=2e-4, atol=2e-4)


COLLECTIVE = re.compile(
    r"^\s*\S+ = (?P<shape>.*?) (?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|"
    r"collective-permute)(?:-start)?\((?P<rest>.*)$",
    re.MULTILINE,
)
ARRAY = re.compile(r"[a-z]+\d*\[(?P<dims>[\d,]*)\]")


def _group(rest: str) -> int:
    explicit = re.search(r"replica_groups=\{\{([\d,]+)\}", rest)
    if explicit:
        return len(explicit.group(1).split(","))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", rest)
    if iota:
        return int(iota.group(2))
    named = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", rest)
    assert named, rest[:300]
    sizes = dict(re.findall(r"'(\w+)'=(\d+)", named.group(1)))
    return int(np.prod([int(sizes[a]) for a in re.findall(r"'(\w+)'", named.group(2))]))


@EIGHT
def test_each_layer_gathers_keys_and_values_over_the_sequence_devices():
    config = _config()
    params = models.init_params(config, jax.random.key(0))
    mesh = parallel.make_mesh(data=1, fsdp=2, sequence=4)
    fn, args, _ = _sharded(config, params, mesh)
    hlo = fn.lower(*args).compile().as_text()
    # [B / fsdp, T' / 4 -> T', K, H] = [2, 32, 2, 16]: keys and values of each of the 2 layers,
    # forward (and the backward's recomputation, if any), gathered within groups of 4.
    kv = [
        m
        for m in COLLECTIVE.finditer(hlo)
        if m["op"] == "all-gather" and "[2,32,2,16]" in m["shape"].replace(" ", "")
    ]
    assert len(kv) >= 2 * config.num_hidden_layers, len(kv)
    assert all(_group(m["rest"]) == 4 for m in kv)
    # Their gradients come back reduce-scattered over the same groups (XLA:CPU may write a
    # reduce-scatter as an all-reduce + slice): nothing [.., 32, ..]-sized crosses fsdp.
    for m in COLLECTIVE.finditer(hlo):
        dims = [
            tuple(int(d) for d in a["dims"].split(",") if d) for a in ARRAY.finditer(m["shape"])
        ]
        if any(len(d) >= 3 and 32 in d[1:2] for d in dims):
            assert _group(m["rest"]) in (4,), m.group(0)[:300]


MOE = dict(
    architecture="Qwen3MoeForCausalLM",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)


@EIGHT
def test_mixture_of_experts_split_over_the_sequence_match_one_device():
    """A mixture of experts on the sequence mesh: hidden states, router logits and the chosen
    experts in slot order equal the one-device forward's, replaying those experts (routing
    replay) gives the same output, and the gradient of a loss over both agrees."""
    config = _config(**MOE)
    params = models.init_params(config, jax.random.key(0))
    prompt, prompt_mask, completion, completion_mask, _ = _batch(2)
    tokens = jnp.concatenate([prompt, completion], axis=1)
    mask = jnp.concatenate([prompt_mask, completion_mask], axis=1)

    def run(p, routing=None):
        hidden, _, logits, chosen = models.forward(
            p,
            config,
            tokens,
            attention_mask=mask,
            routing=routing,
            outputs=("router_logits", "routing"),
        )
        return hidden, logits, chosen

    def loss(p):
        hidden, logits, _ = run(p)
        return jnp.sum((hidden * mask[..., None]) ** 2) + jnp.sum(logits * mask[None, ..., None])

    want = jax.jit(run)(params)
    want_grads = jax.jit(jax.grad(loss))(params)
    with jax.set_mesh(parallel.make_mesh(data=1, fsdp=2, sequence=4)):
        got = jax.jit(run)(params)
        replayed = jax.jit(run)(params, want[2])
        grads = jax.jit(jax.grad(loss))(params)
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(got[0])[real], np.asarray(want[0])[real], atol=2e-5)
    np.testing.assert_allclose(
        np.asarray(got[1])[:, real], np.asarray(want[1])[:, real], rtol=1e-5, atol=1e-6
    )
    np.testing.assert_array_equal(np.asarray(got[2])[:, real], np.asarray(want[2])[:, real])
    np.testing.assert_allclose(np.asarray(replayed[0])[real], np.asarray(want[0])[real], atol=2e-5)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        # Sums over 8 x 2 shards in another order: float32 rounding of a large loss.
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-4)


def test_expert_and_sequence_axes_together_are_refused():
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    config = _config(**MOE)
    params = models.init_params(config, jax.random.key(0))
    tokens = jnp.zeros((2, 8), jnp.int32)
    mesh = parallel.make_mesh(data=1, fsdp=1, sequence=2, expert=2, devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match="context parallelism .* expert parallelism"):
            jax.jit(lambda p: models.forward(p, config, tokens)[0])(params)


def test_sequence_mesh_sizes():
    devices = jax.devices()
    if len(devices) < 8:
        pytest.skip("needs 8 devices")
    mesh = parallel.make_mesh(data=1, fsdp=-1, sequence=4)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "sequence": 4, "tensor": 1}
    mesh = parallel.make_mesh(data=1, fsdp=1, sequence=2, expert=2, tensor=2)
    assert mesh.axis_names == ("data", "fsdp", "sequence", "expert", "tensor")
    with pytest.raises(ValueError, match="'sequence' must be a positive int"):
        parallel.make_mesh(data=1, fsdp=-1, sequence=0)
    with pytest.raises(ValueError, match="sequence=3"):
        parallel.make_mesh(data=1, fsdp=2, sequence=3)
