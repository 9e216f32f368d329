"""Vocabulary parallelism over fsdp (``jaxrl_llm.parallel.vocab``): on an fsdp-only mesh the
embedding and unembedding tables are used split by vocabulary, never gathered whole.

On 8 fake CPU devices, the log-prob forward and its gradient (a GRPO-style surrogate plus an
entropy bonus) on an fsdp mesh equal the one-device result, whose tables are whole; the
compiled HLO moves no table-sized array but by all-to-all (the stored shard to its vocabulary
rows and back), all-gathers no whole table, and returns the activations' gradient by a
reduce-scatter, with no all-reduce carrying an activation or vocabulary-sized array.
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
from jaxrl_llm.parallel.vocab import vocab_parallel_axis

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8
    or "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""),
    reason="needs 8 fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)",
)

# V = 176: V / 8 = 22 and V / 4 = 44, unlike every other dim (B 16, P 8, T 24, P + T 32,
# chunk 8, D 64, F 160, heads 4 / 2 x 16), so a collective's dims say what it carries.
VOCAB, WIDTH, ROWS, PROMPT, COMPLETION, CHUNK = 176, 64, 16, 8, 24, 8


def _config(tied: bool) -> models.ModelConfig:
    return models.ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=tied,
    )


def _batch():
    rng = np.random.default_rng(0)
    prompt_mask = np.ones((ROWS, PROMPT), bool)
    prompt_mask[:, :2] = rng.random((ROWS, 2)) > 0.5  # some left padding
    return (
        jnp.asarray(rng.integers(0, VOCAB, (ROWS, PROMPT)), jnp.int32),
        jnp.asarray(prompt_mask),
        jnp.asarray(rng.integers(0, VOCAB, (ROWS, COMPLETION)), jnp.int32),
        jnp.asarray(rng.random((ROWS, COMPLETION)) > 0.2),
        jnp.asarray(rng.normal(size=(ROWS, 1)), jnp.float32),
    )


def _loss(config):
    """``sum(A_b logp_bt m_bt) + 0.1 sum(H_bt)``: the policy-gradient and entropy terms."""

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
        value = jnp.sum(logprobs * advantages * completion_mask) + 0.1 * jnp.sum(entropy)
        return value, (logprobs, entropy)

    return jax.value_and_grad(loss, has_aux=True)


def _sharded_step(config, params, mesh):
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
    return fn, args


@pytest.mark.parametrize(("tied", "data"), [(False, 1), (True, 2)])
def test_vocab_parallel_logprobs_and_gradients_match_one_device(tied, data):
    config = _config(tied)
    params = models.init_params(config, jax.random.key(0))
    (want_loss, want_aux), want_grads = jax.jit(_loss(config))(params, *_batch())
    mesh = parallel.make_mesh(data=data, fsdp=-1, tensor=1)
    fn, args = _sharded_step(config, params, mesh)
    (loss, aux), grads = fn(*args)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves((aux, grads)), jax.tree.leaves((want_aux, want_grads))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_vocab_parallel_only_on_fsdp_only_meshes():
    for shape, want in [
        ({"data": 1, "fsdp": 8, "tensor": 1}, "fsdp"),
        ({"data": 2, "fsdp": 4, "tensor": 1}, "fsdp"),
        ({"data": 1, "fsdp": 4, "tensor": 2}, None),  # the tensor axis splits the vocabulary
        ({"data": 8, "fsdp": 1, "tensor": 1}, None),
    ]:
        with jax.set_mesh(parallel.make_mesh(**shape)):
            assert vocab_parallel_axis(VOCAB, WIDTH, ROWS) == want, shape
            assert vocab_parallel_axis(VOCAB + 1, WIDTH, ROWS) is None  # 8 does not divide V
    assert vocab_parallel_axis(VOCAB, WIDTH, ROWS) is None  # no mesh


COLLECTIVE = re.compile(
    r"^\s*\S+ = (?P<shape>.*?) (?P<op>all-reduce|all-gather|reduce-scatter|all-to-all)"
    r"(?:-start)?\((?P<rest>.*)$",
    re.MULTILINE,
)
ARRAY = re.compile(r"[a-z]+\d*\[(?P<dims>[\d,]*)\]")


def _collectives(hlo: str) -> list[tuple[str, tuple[int, ...], int]]:
    """``(op, dims, devices per replica group)`` of every array a collective produces."""
    out = []
    for match in COLLECTIVE.finditer(hlo):
        groups = re.search(r"replica_groups=\{\{([\d,]+)\}", match["rest"])
        size = len(groups.group(1).split(",")) if groups else 8
        for array in ARRAY.finditer(match["shape"]):
            dims = tuple(int(d) for d in array["dims"].split(",") if d)
            out.append((match["op"], dims, size))
    return out


def test_vocab_parallel_step_never_gathers_the_table():
    config = _config(tied=False)
    params = models.init_params(config, jax.random.key(0))
    mesh = parallel.make_mesh(data=1, fsdp=8, tensor=1)
    fn, args = _sharded_step(config, params, mesh)
    collectives = _collectives(fn.lower(*args).compile().as_text())
    vocab_dims = {VOCAB, VOCAB // 8}
    # The tables move only as their stored shards, by all-to-all (E and W_U, to their
    # vocabulary rows and their gradients back).
    moved = [c for c in collectives if vocab_dims & set(c[1]) and c[2] > 1]
    assert moved, "no collective moved a table shard"
    assert {op for op, _, _ in moved} == {"all-to-all"}, moved
    # No all-reduce across devices of an activation (the activations' gradients are
    # reduce-scattered: the unembedding's hidden states and the embedding's rows).
    reduced = [c for c in collectives if c[0] == "all-reduce" and c[2] > 1 and len(c[1]) == 3]
    assert not [c for c in reduced if c[1][-1] == WIDTH], reduced
    scattered = [c for c in collectives if c[0] == "reduce-scatter" and c[1][-1] == WIDTH]
    assert len(scattered) >= 2, collectives
