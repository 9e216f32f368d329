"""The continuous engine's routing record (``Engine(..., record_routing=True)``), for routing
replay: greedy on a tiny Mixtral / Qwen3-MoE, each request's ``Result.routing`` equals the
static sampler's ``generate(record_routing=True)`` ids for the same prompt and tokens (and
transformers' top-k wherever its router is not near a tie) with refills, prompts shared by a
group's samples admitted while a holder decodes, drains to smaller programs, and a paged cache
small enough to preempt; ``batch_routing`` lays them out as ``generate`` does; off by default
(nothing changes) and refused on a dense model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import load_pretrained
from jaxrl_llm.sampling import SamplingOptions, generate
from jaxrl_llm.sampling.engine import (
    Engine,
    EngineSettings,
    Request,
    batch_routing,
    generate_requests,
)
from tests.models import hf_utils
from tests.sampling.test_routing_record import _hf_top_k

MAX_NEW = 6
PAD = 0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    loaded = hf_utils.load_variants(
        tmp_path_factory, ("mixtral", "qwen3_moe"), first_seed=70, prefix="engine_record_"
    )
    return {name: (tm, config, params) for name, (tm, config, params, _) in loaded.items()}


def _groups(config, lengths, group, seed=5):
    """Left-padded prompts ``[N, P]`` and ``group`` requests a prompt (one prompt key each)."""
    rng = np.random.default_rng(seed)
    tokens, mask = hf_utils.padded_batch(
        rng, lengths, max(lengths), vocab=config.vocab_size, side="left"
    )
    mask = mask.astype(bool)
    requests = [
        Request(tokens[g][mask[g]], None, g) for g in range(len(lengths)) for _ in range(group)
    ]
    return tokens, mask, requests


def _static(params, config, tokens, mask, group, eos):
    return generate(
        params,
        config,
        tokens,
        mask,
        key=jax.random.key(0),
        max_new_tokens=MAX_NEW,
        sampling=SamplingOptions(eos_ids=eos, pad_id=PAD, temperature=0.0),
        num_samples=group,
        record_routing=True,
    )


def _engine_run(params, config, requests, settings, eos, record_routing=True):
    return generate_requests(
        params,
        config,
        requests,
        settings=settings,
        max_new_tokens=MAX_NEW,
        sampling=SamplingOptions(eos_ids=eos, pad_id=PAD, temperature=0.0),
        record_routing=record_routing,
    )


def _eos(params, config, tokens, mask, group):
    """An EOS id the free-running greedy output of the second prompt emits at its 3rd token."""
    free, _ = _static(params, config, tokens, mask, group, ())
    return (int(np.asarray(free.tokens)[group, 2]),)


@pytest.mark.parametrize(
    "name, decode_layers", [("mixtral", "stacked"), ("qwen3_moe", "per_layer")]
)
def test_shared_prompts_refills_and_drains_record_generates_ids(models, name, decode_layers):
    """3 prompts x 3 samples in 2 slots (bursts of 2): samples admitted while another of their
    prompt decodes copy its prompt (``reused_prompts``), slots are refilled and the engine
    drains to one slot; the batch of results is ``generate``'s routing array, -1 included,
    and agrees with transformers' top-k away from router near-ties."""
    torch_model, config, params = models[name]
    tokens, mask, requests = _groups(config, [5, 7, 3], 3)
    # Sample 0 of each prompt decodes longest while the others come and go in the other slot.
    budgets = [MAX_NEW, 1, 2] * 3
    requests = [r._replace(max_new_tokens=b) for r, b in zip(requests, budgets, strict=True)]
    eos = _eos(params, config, tokens, mask, 3)
    completion, want = _static(params, config, tokens, mask, 3, eos)
    width, want = tokens.shape[1], np.array(want)
    for row, budget in enumerate(budgets):  # generate's ids cut to each request's budget
        want[row, width + budget :] = -1
    settings = EngineSettings(slots=2, burst=2, decode_layers=decode_layers)
    results, stats = _engine_run(params, config, requests, settings, eos)
    assert stats.reused_prompts > 0 and stats.shrinks > 0 and stats.admissions > 2
    layers, k = config.num_hidden_layers, config.num_experts_per_tok
    for request, result in zip(requests, results, strict=True):
        assert result.routing.dtype == np.int32
        assert result.routing.shape == (len(request.prompt) + len(result.tokens), layers, k)
        assert (result.routing >= 0).all()  # every prompt and completion token routed
    got = batch_routing(results, width, MAX_NEW)
    for row, result in enumerate(results):
        n = len(result.tokens)
        np.testing.assert_array_equal(result.tokens, np.asarray(completion.tokens)[row, :n])
    np.testing.assert_array_equal(got, want)
    assert (want[:3, width:] == -1).any()  # completion padding after an EOS

    seq_mask = np.concatenate([np.repeat(mask, 3, 0), np.asarray(completion.mask)], axis=1)
    seq_mask[:, width:] &= np.arange(MAX_NEW)[None] < np.asarray(budgets)[:, None]
    seq = np.concatenate([np.repeat(tokens, 3, 0), np.asarray(completion.tokens)], axis=1)
    hf, margin = _hf_top_k(torch_model, seq, seq_mask, k)
    real = seq_mask[:, :, None] & (margin > 1e-3)
    assert real.sum() >= 0.9 * layers * seq_mask.sum()
    np.testing.assert_array_equal(np.sort(got, -1)[real], np.sort(hf, -1)[real])


def test_a_small_paged_pool_preempts_and_records_generates_ids(models):
    """Blocks of 2, a pool of 8 for 4 slots (one request takes up to 7: an 8-slot prompt
    bucket and 6 tokens), shared prompts and budgets cut short: requests are preempted
    and recomputed, and each request's ids are ``generate``'s for its prompt and first
    ``n`` tokens."""
    _, config, params = models["qwen3_moe"]
    tokens, mask, requests = _groups(config, [6, 3, 7, 5], 2, seed=8)
    budgets = [6, 4, 6, 2, 5, 6, 3, 6]
    requests = [r._replace(max_new_tokens=b) for r, b in zip(requests, budgets, strict=True)]
    completion, want = _static(params, config, tokens, mask, 2, ())
    want = np.asarray(want)
    settings = EngineSettings(slots=4, burst=2, kv_block_size=2, kv_blocks=8)
    results, stats = _engine_run(params, config, requests, settings, ())
    assert stats.preemptions > 0 and stats.peak_blocks <= 8 and stats.reused_prompts > 0
    width = tokens.shape[1]
    for row, (request, result) in enumerate(zip(requests, results, strict=True)):
        n, p = len(result.tokens), len(request.prompt)
        np.testing.assert_array_equal(result.tokens, np.asarray(completion.tokens)[row, :n])
        np.testing.assert_array_equal(result.routing, want[row, width - p : width + n])


def test_off_by_default_changes_nothing_and_a_dense_model_is_refused(models, tmp_path):
    _, config, params = models["mixtral"]
    tokens, mask, requests = _groups(config, [5, 3], 2)
    settings = EngineSettings(slots=2, burst=2, kv_block_size=4)
    plain, plain_stats = _engine_run(params, config, requests, settings, (), record_routing=False)
    recorded, stats = _engine_run(params, config, requests, settings, ())
    assert plain_stats.tokens == stats.tokens
    for a, b in zip(plain, recorded, strict=True):
        assert a.routing is None and b.routing is not None
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
    with pytest.raises(ValueError, match="run the engine with record_routing=True"):
        batch_routing(plain, tokens.shape[1], MAX_NEW)

    hf_utils.build_checkpoint("llama", str(tmp_path), seed=1)
    dense_config, dense_params = load_pretrained(str(tmp_path), dtype=jnp.float32)
    with pytest.raises(ValueError, match="record_routing needs a mixture-of-experts model"):
        Engine(
            dense_params,
            dense_config,
            settings=settings,
            max_new_tokens=MAX_NEW,
            max_prompt_len=5,
            sampling=SamplingOptions(eos_ids=(), pad_id=PAD),
            record_routing=True,
        )


@pytest.mark.needs_devices(8)
def test_record_on_a_mesh_equals_one_device(models):
    """Slots over the data x fsdp shards of a (2, 2, 2) mesh, prompts reused across shards:
    the same ids as on one device."""
    from jaxrl_llm.models import logical_axes
    from jaxrl_llm.parallel import PARAM_RULES, logical_to_sharding, make_mesh

    _, config, params = models["mixtral"]
    _, _, requests = _groups(config, [5, 7, 3], 3)
    requests = [r._replace(max_new_tokens=b) for r, b in zip(requests, [6, 1, 2] * 3, strict=True)]
    settings = EngineSettings(slots=4, burst=2)
    single, _ = _engine_run(params, config, requests, settings, ())
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    shardings = logical_to_sharding(logical_axes(config), mesh, PARAM_RULES, shapes=params)
    multi, stats = generate_requests(
        jax.device_put(params, shardings),
        config,
        requests,
        settings=settings,
        max_new_tokens=MAX_NEW,
        sampling=SamplingOptions(eos_ids=(), pad_id=PAD, temperature=0.0),
        record_routing=True,
        mesh=mesh,
    )
    assert stats.reused_prompts > 0
    for a, b in zip(single, multi, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.routing, b.routing)
