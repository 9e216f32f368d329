"""The static sampler's routing record (``generate(..., record_routing=True)``), for routing
replay: the experts of every prompt and completion token equal the top-k of transformers'
router logits on ``[prompt ; completion]`` (greedy, tiny Mixtral / Qwen3-MoE); replaying them
in a training-style forward gives the free forward's log-probs exactly (f32) and, under bf16
compute with near-tied routers, the sampler's experts on every token where the free forward
picks others on some; off by default, refused on a dense model, and the same on a mesh."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxrl_llm.models import forward, logical_axes, unembed
from jaxrl_llm.parallel import PARAM_RULES, logical_to_sharding, make_mesh
from jaxrl_llm.sampling import SamplingOptions, generate
from jaxrl_llm.sampling.generate import routing_dtype
from jaxrl_llm.types import Completion
from tests.models import hf_utils

MAX_NEW = 6
LENGTHS = [7, 3, 5]

jit_forward = jax.jit(forward, static_argnums=1, static_argnames="outputs")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    loaded = hf_utils.load_variants(
        tmp_path_factory, ("mixtral", "qwen3_moe"), first_seed=70, prefix="record_"
    )
    return {name: (tm, config, params) for name, (tm, config, params, _) in loaded.items()}


def _prompts(config, seed=3):
    rng = np.random.default_rng(seed)
    return hf_utils.padded_batch(rng, LENGTHS, 7, vocab=config.vocab_size, side="left")


def _sample(params, config, tokens, mask, *, eos_ids=(), decode_layers="auto", mesh=None):
    return generate(
        params,
        config,
        tokens,
        mask,
        key=jax.random.key(0),
        max_new_tokens=MAX_NEW,
        sampling=SamplingOptions(eos_ids=eos_ids, pad_id=0, temperature=0.0),
        decode_layers=decode_layers,
        record_routing=True,
        mesh=mesh,
    )


def _joined(tokens, mask, completion):
    seq = np.concatenate([tokens, np.asarray(completion.tokens)], axis=1)
    seq_mask = np.concatenate([mask.astype(bool), np.asarray(completion.mask)], axis=1)
    return seq, seq_mask


def _logprobs(params, config, seq, seq_mask, routing=None):
    """Training-style log-probs ``[B, S - 1]`` of each next token, and the experts used."""
    hidden, _, chosen = jit_forward(
        params, config, seq, attention_mask=seq_mask, routing=routing, outputs=("routing",)
    )
    logp = jax.nn.log_softmax(unembed(params, config, hidden[:, :-1]), axis=-1)
    return np.asarray(jnp.take_along_axis(logp, seq[:, 1:, None], -1)[..., 0]), chosen


def _hf_top_k(torch_model, seq, seq_mask, k):
    positions = np.maximum(np.cumsum(seq_mask, axis=1) - 1, 0)
    with torch.no_grad():
        out = torch_model(
            input_ids=torch.as_tensor(seq, dtype=torch.long),
            attention_mask=torch.as_tensor(seq_mask, dtype=torch.long),
            position_ids=torch.as_tensor(positions, dtype=torch.long),
            output_router_logits=True,
        )
    logits = np.stack([x.numpy().reshape(*seq.shape, -1) for x in out.router_logits], axis=2)
    ordered = -np.sort(-logits, axis=-1)
    return np.argsort(-logits, axis=-1)[..., :k], ordered[..., k - 1] - ordered[..., k]


@pytest.mark.parametrize(
    "name, decode_layers", [("mixtral", "stacked"), ("qwen3_moe", "per_layer")]
)
def test_recorded_routing_is_transformers_top_k_and_replays_the_free_logprobs(
    models, name, decode_layers
):
    torch_model, config, params = models[name]
    layers, k = config.num_hidden_layers, config.num_experts_per_tok
    tokens, mask = _prompts(config)
    free = _sample(params, config, tokens, mask, decode_layers=decode_layers)[0]
    eos = (int(free.tokens[1, 2]),)  # row 1 stops early: completion padding after it
    completion, routing = _sample(
        params, config, tokens, mask, eos_ids=eos, decode_layers=decode_layers
    )
    routing = np.asarray(routing)
    assert routing.dtype == np.int32
    assert routing.shape == (3, 7 + MAX_NEW, layers, k)
    seq, seq_mask = _joined(tokens, mask, completion)
    assert not seq_mask.all()  # prompt padding and completion padding both present
    np.testing.assert_array_equal(routing[~seq_mask], -1)
    assert (routing[seq_mask] >= 0).all()

    want, margin = _hf_top_k(torch_model, seq, seq_mask, k)
    real = seq_mask[:, :, None] & (margin > 1e-3)
    assert real.sum() >= 0.9 * layers * seq_mask.sum()
    np.testing.assert_array_equal(np.sort(routing, -1)[real], np.sort(want, -1)[real])
    completion_cols = np.zeros_like(seq_mask)
    completion_cols[:, 7:] = True
    assert (real & completion_cols[:, :, None]).sum() > 0  # completion tokens were compared

    free_logp, own = _logprobs(params, config, seq, seq_mask)
    replay = jnp.moveaxis(jnp.asarray(routing), 2, 0)
    np.testing.assert_array_equal(np.asarray(jnp.moveaxis(own, 0, 2))[seq_mask], routing[seq_mask])
    replay_logp, used = _logprobs(params, config, seq, seq_mask, replay)
    np.testing.assert_array_equal(replay_logp, free_logp)
    np.testing.assert_array_equal(np.moveaxis(np.asarray(used), 0, 2)[seq_mask], routing[seq_mask])


def test_bf16_replay_uses_the_sampler_experts_where_the_free_forward_does_not(models):
    """Near-tied routers (scaled by 0.02) under bf16 compute: the decode steps' bf16
    activations differ from the one-pass forward's by rounding, enough to flip some top-k
    choices; with the recorded routing the training forward uses the sampler's experts on
    every token."""
    _, config, params = models["qwen3_moe"]
    bf16 = dataclasses.replace(config, compute_dtype="bfloat16")
    params = {**params, "layers": {**params["layers"]}}
    params["layers"]["router"] = params["layers"]["router"] * 0.02
    tokens, mask = _prompts(config, seed=11)
    completion, routing = _sample(params, bf16, tokens, mask)
    routing = np.asarray(routing)
    seq, seq_mask = _joined(tokens, mask, completion)

    _, own = _logprobs(params, bf16, seq, seq_mask)
    own = np.moveaxis(np.asarray(own), 0, 2)[seq_mask]
    recorded = routing[seq_mask]
    mismatch = np.mean(np.any(np.sort(own, -1) != np.sort(recorded, -1), axis=-1))
    print(f"bf16 tokens whose free top-k differs from the sampler's: {mismatch:.3f}")
    assert mismatch > 0, "no near-tie flipped: the case does not show what replay is for"

    replay = jnp.moveaxis(jnp.asarray(routing), 2, 0)
    _, used = _logprobs(params, bf16, seq, seq_mask, replay)
    used = np.moveaxis(np.asarray(used), 0, 2)[seq_mask]
    np.testing.assert_array_equal(np.sort(used, -1), np.sort(recorded, -1))


def test_off_by_default_and_refused_on_a_dense_model(models, tmp_path):
    _, config, params = models["mixtral"]
    tokens, mask = _prompts(config)
    out = generate(
        params,
        config,
        tokens,
        mask,
        key=jax.random.key(0),
        max_new_tokens=2,
        sampling=SamplingOptions(eos_ids=(), pad_id=0, temperature=0.0),
    )
    assert isinstance(out, Completion)
    hf_utils.build_checkpoint("llama", str(tmp_path), seed=1)
    from jaxrl_llm.models import load_pretrained

    dense_config, dense_params = load_pretrained(str(tmp_path), dtype=jnp.float32)
    with pytest.raises(ValueError, match="record_routing needs a mixture-of-experts"):
        _sample(dense_params, dense_config, tokens, mask)


@pytest.mark.needs_devices(8)
def test_record_on_a_mesh_equals_one_device(models):
    _, config, params = models["mixtral"]
    tokens, mask = hf_utils.padded_batch(
        np.random.default_rng(2), [7, 3, 5, 6], 7, vocab=config.vocab_size, side="left"
    )
    single, want = _sample(params, config, tokens, mask)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    shardings = logical_to_sharding(logical_axes(config), mesh, PARAM_RULES, shapes=params)
    multi, got = _sample(jax.device_put(params, shardings), config, tokens, mask, mesh=mesh)
    np.testing.assert_array_equal(np.asarray(multi.tokens), np.asarray(single.tokens))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_routing_buffer_is_the_smallest_int_that_holds_the_ids():
    assert routing_dtype(8) == jnp.int8 and routing_dtype(128) == jnp.int8
    assert routing_dtype(129) == jnp.int16 and routing_dtype(32768) == jnp.int16
    assert routing_dtype(32769) == jnp.int32
