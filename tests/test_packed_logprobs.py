"""Packed log-probs equal padded ones, and a sequence's log-probs do not depend on the batch's
shape (issue 44 item 7).

Packed == padded: ``packed_completion_logprobs`` against ``completion_logprobs`` (itself checked
against float64 transformers in tests/test_logprobs.py), values and parameter gradients within
1e-5 in f32, for a dense (Qwen2), a sliding-window + soft-capped (Gemma 2) and a
mixture-of-experts (Qwen3-MoE) model, temperature != 1 and several chunk sizes.

Shape invariance: one batch scored padded (the default chunk), then with other chunk sizes,
packed (1 and 2 shards), in 2 and 4 micro-batches (``train.forward.make_logprob_fn``), beside
other neighbours, in reverse row order, with wider padding and alone. f32: within 1e-5 (the
differences measured are float rounding, at most a few 1e-6 on log-probs of size ~10). bf16
compute (``compute_dtype="bfloat16"``): a different matmul shape (packed rows, micro-batches)
may round a bf16 activation the other way, which later layers carry on; the worst change
measured on this model is ~2e-2 nats (a ratio of exp(0.02) ~ 1.02), below the bf16 model's own
distance from f32; tested against ``BF16_SHAPE_BOUND`` and against that distance. Chunk sizes
change nothing beyond f32 rounding in either dtype: the logits and their log-softmax are f32
whatever the compute dtype.
"""

import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm import parallel
from jaxrl_llm.logprobs import completion_logprobs, packed_completion_logprobs
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.packing import plan_sequences
from jaxrl_llm.train.forward import make_logprob_fn
from jaxrl_llm.types import Sequences
from tests.models import hf_utils

B, P, T = 6, 5, 12
F32_TOL = 1e-5
BF16_SHAPE_BOUND = 5e-2


def _config(name: str, **overrides) -> ModelConfig:
    return dataclasses.replace(ModelConfig.from_hf_dict(hf_utils.hf_dict(name)), **overrides)


@functools.lru_cache(maxsize=8)
def _params(config: ModelConfig):
    """Random weights 10x the default init (std 0.2): log-probs of size ~10, not ~log V."""
    params = init_params(config, jax.random.key(0))
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x if "norm" in str(path[-1]) else x * 10.0, params
    )


def _batch(seed: int, batch: int = B, prompt: int = P, completion: int = T) -> Sequences:
    """Random lengths (row 0 full width: one sequence fills a packed row), left-padded prompts
    of >= 1 token, right-padded completions of >= 1 token."""
    rng = np.random.default_rng(seed)
    prompt_lengths = rng.integers(1, prompt + 1, batch)
    completion_lengths = rng.integers(1, completion + 1, batch)
    prompt_lengths[0], completion_lengths[0] = prompt, completion
    prompt_mask = np.arange(prompt)[None] >= prompt - prompt_lengths[:, None]
    completion_mask = np.arange(completion)[None] < completion_lengths[:, None]
    prompt_tokens = rng.integers(3, 128, (batch, prompt)) * prompt_mask
    completion_tokens = rng.integers(3, 128, (batch, completion)) * completion_mask
    return Sequences(
        prompt_tokens.astype(np.int32), prompt_mask, completion_tokens.astype(np.int32),
        completion_mask,
    )  # fmt: skip


def _max_diff(a, b, mask=None):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() if mask is None else np.abs(a - b)[mask].max())


@pytest.mark.parametrize("name", ["qwen2", "gemma2", "qwen3_moe"])
def test_packed_equals_padded_values_and_gradients(name):
    config = _config(name)
    params = _params(config)
    seqs = _batch(1)
    plan = plan_sequences(seqs.prompt_mask, seqs.completion_mask, shards=2)
    assert plan.flat("segment_ids").max() >= 2  # some row really holds two sequences
    weights = np.linspace(0.5, 1.5, B * T).reshape(B, T) * seqs.completion_mask

    def loss(params, packed):
        options = dict(temperature=0.7, chunk_size=5)
        if packed:
            lp = packed_completion_logprobs(params, config, seqs, plan, **options)
        else:
            lp = completion_logprobs(params, config, *seqs, **options)
        return jnp.sum(lp * weights), lp

    grad = jax.jit(jax.grad(loss, has_aux=True), static_argnums=1)
    want_grads, want = grad(params, False)
    got_grads, got = grad(params, True)
    mask = seqs.completion_mask
    assert np.abs(np.asarray(want)[mask]).max() > 3.0  # not near-uniform log-probs
    np.testing.assert_array_equal(np.asarray(got)[~mask], 0.0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=F32_TOL, rtol=0)
    for path, g, w in zip(
        jax.tree_util.tree_leaves_with_path(got_grads),
        jax.tree.leaves(got_grads),
        jax.tree.leaves(want_grads),
    ):
        scale = max(1.0, float(np.abs(np.asarray(w)).max()))
        np.testing.assert_allclose(g, w, atol=F32_TOL * scale, rtol=0, err_msg=str(path[0]))


@pytest.mark.parametrize("chunk_size", [1, 7, None])
def test_packed_entropy_and_prompt_logprobs_across_chunk_sizes(chunk_size):
    config = _config("qwen2")
    params = _params(config)
    seqs = _batch(2)
    plan = plan_sequences(seqs.prompt_mask, seqs.completion_mask)
    padded = completion_logprobs(
        params, config, *seqs, temperature=1.3, chunk_size=chunk_size, return_entropy=True
    )
    packed = packed_completion_logprobs(
        params, config, seqs, plan, temperature=1.3, chunk_size=chunk_size, return_entropy=True
    )
    for got, want in zip(packed, padded):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=F32_TOL, rtol=0)
    padded = completion_logprobs(
        params, config, *seqs, chunk_size=chunk_size, return_prompt_logprobs=True
    )
    packed = packed_completion_logprobs(
        params, config, seqs, plan, chunk_size=chunk_size, return_prompt_logprobs=True
    )
    for got, want in zip(packed, padded):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=F32_TOL, rtol=0)
    # Prompt log-probs: 0 on padding and on each row's first real token.
    first = np.argmax(seqs.prompt_mask, axis=1)
    np.testing.assert_array_equal(np.asarray(packed[1])[np.arange(B), first], 0.0)


def _shape_variants(config, params, seqs):
    """``{variant: [B, T] log-probs of seqs' rows}`` for the batch shapes of item 7."""
    score = jax.jit(
        lambda s, c: completion_logprobs(params, config, *s, chunk_size=c), static_argnums=1
    )
    out = {"padded": score(seqs, None)}
    for chunk in (1, 3, 8):
        out[f"chunk {chunk}"] = score(seqs, chunk)
    for shards in (1, 2):
        plan = plan_sequences(seqs.prompt_mask, seqs.completion_mask, shards=shards)
        out[f"packed x{shards}"] = jax.jit(
            lambda s, p: packed_completion_logprobs(params, config, s, p, chunk_size=5)
        )(seqs, plan)
    for k in (2, 4):
        out[f"micro-batches {k}"] = make_logprob_fn(config, micro_batches=k)(params, seqs)
    # The first half beside other neighbours; the rows in reverse order.
    rows = seqs.prompt_tokens.shape[0]
    others = _batch(9, batch=rows)
    half = rows // 2
    mixed = Sequences(*(np.concatenate([a[:half], b[half:]]) for a, b in zip(seqs, others)))
    out["neighbours"] = np.concatenate(
        [np.asarray(score(mixed, None))[:half], np.asarray(out["padded"])[half:]]
    )
    reverse = Sequences(*(a[::-1] for a in seqs))
    out["reverse"] = np.asarray(score(reverse, None))[::-1]
    # Wider padding on both sides: 3 more prompt columns, 5 more completion columns.
    wide = Sequences(
        np.pad(seqs.prompt_tokens, ((0, 0), (3, 0))),
        np.pad(seqs.prompt_mask, ((0, 0), (3, 0))),
        np.pad(seqs.completion_tokens, ((0, 0), (0, 5))),
        np.pad(seqs.completion_mask, ((0, 0), (0, 5))),
    )
    out["wider"] = np.asarray(score(wide, None))[:, :T]
    out["alone"] = np.concatenate(
        [np.asarray(score(Sequences(*(a[i : i + 1] for a in seqs)), None)) for i in range(rows)]
    )
    return out


def test_logprobs_do_not_depend_on_the_batch_shape_f32():
    config = _config("qwen2")
    seqs = _batch(3, batch=8)
    variants = _shape_variants(config, _params(config), seqs)
    base = variants.pop("padded")
    for name, got in variants.items():
        assert _max_diff(got, base, seqs.completion_mask) <= F32_TOL, name


def test_logprobs_shape_dependence_in_bf16_is_bounded():
    f32 = _config("qwen2")
    bf16 = dataclasses.replace(f32, compute_dtype="bfloat16")
    seqs = _batch(3, batch=8)
    mask = seqs.completion_mask
    variants = _shape_variants(bf16, _params(bf16), seqs)
    base = variants.pop("padded")
    exact = completion_logprobs(_params(f32), f32, *seqs)
    precision = _max_diff(base, exact, mask)  # the bf16 model's own distance from f32
    worst = {name: _max_diff(got, base, mask) for name, got in variants.items()}
    print(f"bf16 vs f32: {precision:.3g}; shape changes: {worst}")
    for name, diff in worst.items():
        assert diff <= BF16_SHAPE_BOUND, (name, diff)
        assert diff <= precision, (name, diff, precision)
    # Chunk sizes only regroup f32 logits: f32 rounding, whatever the compute dtype.
    for chunk in (1, 3, 8):
        assert worst[f"chunk {chunk}"] <= F32_TOL


def test_errors():
    config = _config("qwen2")
    params = _params(config)
    seqs = _batch(4)
    plan = plan_sequences(seqs.prompt_mask, seqs.completion_mask)
    with pytest.raises(ValueError, match="cannot be combined"):
        packed_completion_logprobs(
            params, config, seqs, plan, return_entropy=True, return_prompt_logprobs=True
        )
    other = plan_sequences(seqs.prompt_mask[:, 1:], seqs.completion_mask)
    with pytest.raises(ValueError, match="width"):
        packed_completion_logprobs(params, config, seqs, other)
    with pytest.raises(ValueError, match="needs a PackingPlan"):
        packed_completion_logprobs(params, config, seqs, None)


@pytest.mark.needs_devices(8)
def test_packed_on_a_mesh_equals_padded():
    """data=2 x fsdp=2 x tensor=2: a 4-shard plan, rows sharded over the batch axes; the
    values and gradients are those of the padded run without a mesh."""
    config = _config("qwen2")
    params = _params(config)
    seqs = _batch(5, batch=8)
    plan = plan_sequences(seqs.prompt_mask, seqs.completion_mask, shards=4)
    weights = seqs.completion_mask * 1.0

    def loss(params, seqs, plan):
        lp = packed_completion_logprobs(params, config, seqs, plan, temperature=0.7)
        return jnp.sum(lp * weights), lp

    def padded_loss(params):
        lp = completion_logprobs(params, config, *seqs, temperature=0.7)
        return jnp.sum(lp * weights), lp

    want_grads, want = jax.jit(jax.grad(padded_loss, has_aux=True))(params)
    mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    with parallel.mesh_context(mesh):
        sharded = jax.tree.map(lambda x: jax.device_put(x, rows), (seqs, plan))
        got_grads, got = jax.jit(jax.grad(loss, has_aux=True))(params, *sharded)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=F32_TOL, rtol=0)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        scale = max(1.0, float(np.abs(np.asarray(w)).max()))
        np.testing.assert_allclose(g, w, atol=F32_TOL * scale, rtol=0)


def _vocab_outputs(jaxpr, vocab):
    """Shapes of every ``[rows, C, vocab]`` ``dot_general`` output (the unembedding's logits),
    nested jaxprs (scan, remat, pjit) included."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            shape = tuple(eqn.outvars[0].aval.shape)
            if len(shape) == 3 and shape[-1] == vocab:
                shapes.append(shape)
        for param in eqn.params.values():
            for sub in param if isinstance(param, list | tuple) else [param]:
                inner = (
                    sub if isinstance(sub, jax.extend.core.Jaxpr) else getattr(sub, "jaxpr", None)
                )
                if isinstance(inner, jax.extend.core.Jaxpr):
                    shapes.extend(_vocab_outputs(inner, vocab))
    return shapes


def test_unembedding_runs_over_the_packed_rows():
    """Many short sequences: 8 padded rows fit in 2 packed ones, and every unembedding product
    (forward and backward) has the packed rows, not the padded ones."""
    config = _config("qwen2")
    params = _params(config)
    seqs = _batch(6, batch=8, prompt=3, completion=4)
    seqs = Sequences(*(np.pad(a, ((0, 0), (0, 9 if i >= 2 else 0))) for i, a in enumerate(seqs)))
    plan = plan_sequences(seqs.prompt_mask, seqs.completion_mask)
    assert plan.rows < 8

    def loss(params):
        return jnp.sum(packed_completion_logprobs(params, config, seqs, plan, chunk_size=4))

    shapes = _vocab_outputs(jax.make_jaxpr(jax.grad(loss))(params).jaxpr, config.vocab_size)
    assert shapes and all(shape[0] == plan.rows for shape in shapes), shapes
