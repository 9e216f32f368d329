"""Continuous batching (``jaxrl_llm.sampling.engine``): same tokens as ``generate`` and as
transformers with refills happening, per-request reproducibility, trainer log-probs (a test's
requests scored in one padded trainer call), stats."""

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.logprobs import completion_logprobs
from jaxrl_llm.models import ModelConfig, init_params, load_pretrained
from jaxrl_llm.sampling import SamplingOptions, generate, layout
from jaxrl_llm.sampling import engine as engine_module
from jaxrl_llm.sampling import slots as slots_module
from jaxrl_llm.sampling.engine import Engine, EngineSettings, Request, generate_requests
from tests.models.hf_utils import build_checkpoint
from tests.sampling.hf_reference import engine_and_hf_greedy

CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)
PAD = 0


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, jax.random.key(0), dtype=jnp.float32)


def _requests(rng, lengths, budgets, keys=None):
    keys = keys or [None] * len(lengths)
    prompts = {}
    out = []
    for n, budget, key in zip(lengths, budgets, keys):
        if key is None or key not in prompts:
            prompt = rng.integers(3, CONFIG.vocab_size, size=n).astype(np.int32)
            if key is not None:
                prompts[key] = prompt
        else:
            prompt = prompts[key]
        out.append(Request(prompt, budget, prompt_key=key))
    return out


def _left_padded(requests, width=None):
    """The requests' prompts left-padded (with ``PAD``, 0) to ``width`` (default: the longest)."""
    width = width or max(len(r.prompt) for r in requests)
    prompts = np.zeros((len(requests), width), np.int32)
    for i, r in enumerate(requests):
        prompts[i, width - len(r.prompt) :] = r.prompt
    return prompts


def _greedy(params, requests, *, eos_ids, max_new_tokens=12):
    """``generate``'s greedy completions of the requests' prompts, in one left-padded batch."""
    prompts = _left_padded(requests)
    return generate(
        params,
        CONFIG,
        prompts,
        prompts > 0,
        key=jax.random.key(0),
        max_new_tokens=max_new_tokens,
        sampling=SamplingOptions(eos_ids=eos_ids, pad_id=PAD, temperature=0.0),
    )


def _assert_trainer_logprobs(params, requests, results, temperature):
    """Each result's log-probs are the trainer's (``completion_logprobs``) for its prompt and
    tokens to 1e-5. All requests go through the trainer in one call, in padded rows of one
    shape (8 rows, the last ones repeating row 0; prompts left-padded to 8, completions
    right-padded to 12), so every test scores the same shapes and the eager forward compiles
    once; the padded completion positions score exactly 0 and are cut off before the
    comparison."""
    rows, width, length = 8, 8, 12
    assert len(requests) <= rows
    prompts = np.zeros((rows, width), np.int32)
    prompts[: len(requests)] = _left_padded(requests, width)
    completions = np.zeros((rows, length), np.int32)
    lengths = np.zeros(rows, int)
    for i, result in enumerate(results):
        completions[i, : len(result.tokens)] = result.tokens
        lengths[i] = len(result.tokens)
    n = len(requests)
    prompts[n:], completions[n:], lengths[n:] = prompts[0], completions[0], lengths[0]
    completion_mask = np.arange(length)[None] < lengths[:, None]
    want = np.asarray(
        completion_logprobs(
            params,
            CONFIG,
            prompts,
            prompts > 0,
            completions,
            completion_mask,
            temperature=temperature,
        )
    )
    assert (want[~completion_mask] == 0).all()
    for i, result in enumerate(results):
        np.testing.assert_allclose(result.logprobs, want[i, : lengths[i]], atol=1e-5)


@pytest.mark.parametrize("engine", ["continuous", "static"])
def test_greedy_equals_generate_per_request_with_refills(params, rng, engine):
    requests = _requests(rng, [3, 7, 5, 2, 6, 4, 1], [4, 9, 2, 12, 6, 12, 3])
    # An EOS the free-running greedy output of request 3 emits at its 5th token.
    free = _greedy(params, requests[3:4], eos_ids=(), max_new_tokens=requests[3].max_new_tokens)
    eos = int(np.asarray(free.tokens)[0, 4])
    results, stats = generate_requests(
        params,
        CONFIG,
        requests,
        settings=EngineSettings(slots=2, engine=engine),
        max_new_tokens=12,
        sampling=SamplingOptions(eos_ids=eos, pad_id=PAD, temperature=0.0),
    )
    assert stats.admissions >= 3  # slots were refilled
    # ``generate`` on all prompts at once (left-padded, 12 columns): greedy, so each request's
    # completion is the first ``max_new_tokens`` columns up to its EOS.
    want = _greedy(params, requests, eos_ids=eos)
    stopped = 0
    for i, (request, result) in enumerate(zip(requests, results, strict=True)):
        n = request.max_new_tokens
        mask = np.asarray(want.mask)[i, :n]
        np.testing.assert_array_equal(result.tokens, np.asarray(want.tokens)[i, :n][mask])
        np.testing.assert_allclose(
            result.logprobs, np.asarray(want.logprobs)[i, :n][mask], atol=1e-5
        )
        stop = int(result.tokens[-1]) == eos
        assert result.finish_reason == ("stop" if stop else "length")
        assert stop or len(result.tokens) == request.max_new_tokens
        stopped += stop
    assert stopped >= 1
    assert stats.tokens == sum(len(r.tokens) for r in results)


@pytest.mark.parametrize("kv_block_size", [None, 4])  # contiguous and paged caches
def test_greedy_equals_transformers_generate_with_refills(tmp_path, kv_block_size):
    torch_model = build_checkpoint("llama", str(tmp_path), seed=3)
    config, params = load_pretrained(str(tmp_path), dtype=jnp.float32)
    runs = engine_and_hf_greedy(
        torch_model,
        params,
        config,
        [5, 2, 9, 4, 7],
        [6, 10, 3, 10, 8],
        seed=5,
        kv_block_size=kv_block_size,
    )
    for result, want, _ in runs:
        np.testing.assert_array_equal(result.tokens, want)


def test_bursts_attend_over_a_cache_cut_to_the_furthest_live_slot(tmp_path, monkeypatch):
    """On CPU with T >= 64 the contiguous cache takes ``P`` plus ``layout.decode_windows``'
    steps (``most=ENGINE_WIDTHS``) as its widths, and each burst runs on the narrowest that
    holds every live slot's writes: it grows while the 100-token request decodes next to short
    refills and shrinks once it finishes. Greedy tokens and every step's log-prob are still
    transformers', so no cut dropped a slot's keys or values and none hid a write; and every
    admission has the same shapes, so each width compiles one."""
    torch_model = build_checkpoint("llama", str(tmp_path), seed=6)
    config, params = load_pretrained(str(tmp_path), dtype=jnp.float32)
    widths, admitted, real = [], set(), (engine_module.resize, slots_module.admit)

    def resize(state, *, width, mesh=None):
        widths.append(width)
        return real[0](state, width=width, mesh=mesh)

    def admit(params, state, arrays, prefilled, *args, **kwargs):
        mask = None if prefilled is None else prefilled.cache.mask.shape
        admitted.add((arrays.slot.shape, arrays.prompt_tokens, mask))
        return real[1](params, state, arrays, prefilled, *args, **kwargs)

    monkeypatch.setattr(engine_module, "resize", resize)
    monkeypatch.setattr(slots_module, "admit", admit)
    budgets = [100] + [10] * 9 + [40, 20]
    runs = engine_and_hf_greedy(
        torch_model, params, config, [5, 9, 3, 7] * 3, budgets, seed=2, kv_block_size=None
    )
    for result, want, want_logprobs in runs:
        np.testing.assert_array_equal(result.tokens, want)
        np.testing.assert_allclose(result.logprobs, want_logprobs, atol=1e-4)
    ends = layout.decode_windows(params, 100, most=layout.ENGINE_WIDTHS)
    assert ends == (34, 67, 100)
    prompt_width = 16  # the longest prompt (9) bucketed
    assert widths[0] == prompt_width + ends[0]
    assert sorted(set(widths)) == [prompt_width + e for e in ends]
    full = widths.index(prompt_width + ends[-1])
    assert widths[:full] == [prompt_width + e for e in ends[:-1]]  # grown step by step
    assert widths[full + 1] < widths[full]  # and cut once the 100-token request finished
    # Every admission the same shapes whatever it admits (one admission program a width): an
    # entry per slot, each request's prompt row already laid out by the prefill.
    assert admitted == {((2,), None, (2, prompt_width))}


def test_sampled_tokens_depend_only_on_seed_and_request_id(params, rng):
    """Sampled tokens and log-probs are a function of the seed and each request's index only:
    the same on other slot counts, burst lengths, the static engine and a longer request list
    (prompt-mates included); another seed changes them."""
    requests = _requests(rng, [3, 7, 5, 2, 6, 4], [8, 5, 8, 3, 8, 6], keys=[0, 0, 1, 1, 2, 3])

    def run(slots, engine, reqs=requests, seed=7, burst=8):
        out, _ = generate_requests(
            params,
            CONFIG,
            reqs,
            settings=EngineSettings(slots=slots, burst=burst, engine=engine),
            max_new_tokens=8,
            sampling=SamplingOptions(eos_ids=(5,), pad_id=PAD),
            seed=seed,
        )
        return out

    # Against the base run (2 slots, bursts of 8): more slots and bursts of 1 together; the
    # static engine on 3 slots with two more requests queued behind these.
    base = run(2, "continuous")
    more = requests + _requests(rng, [4, 4], [8, 8])
    for other in (
        run(5, "continuous", burst=1),
        run(3, "static", reqs=more)[: len(requests)],
    ):
        for a, b in zip(base, other, strict=True):
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
    # Another seed draws other tokens; a request's samples differ from its prompt-mate's.
    assert any(
        not np.array_equal(a.tokens, b.tokens) for a, b in zip(base, run(2, "continuous", seed=8))
    )
    assert not np.array_equal(base[0].tokens[:5], base[1].tokens[:5])


def test_sampler_logprobs_equal_the_trainers(params, rng):
    requests = _requests(rng, [3, 7, 5, 2], [8, 6, 8, 4])
    results, _ = generate_requests(
        params,
        CONFIG,
        requests,
        settings=EngineSettings(slots=3),
        max_new_tokens=8,
        sampling=SamplingOptions(eos_ids=(), pad_id=PAD, temperature=0.7),
        seed=3,
    )
    _assert_trainer_logprobs(params, requests, results, 0.7)


def test_continuous_refills_shrinks_and_counts(params, rng):
    budgets = [1, 1, 1, 12, 1, 1, 1, 1]
    requests = _requests(rng, [4] * 8, budgets, keys=[0, 0, 0, 0, 1, 1, 1, 1])
    kw = dict(max_new_tokens=12, sampling=SamplingOptions(eos_ids=(), pad_id=PAD, temperature=0.0))
    continuous = EngineSettings(slots=4, engine="continuous")
    results, stats = generate_requests(params, CONFIG, requests, settings=continuous, **kw)
    assert [len(r.tokens) for r in results] == budgets
    assert stats.tokens == sum(budgets) and stats.requests == 8
    # Three 1-step bursts on 4 slots (each refilling the slots that finished), then the
    # 12-token request's last 9 steps alone (bursts of 8 + 1): the engine shrinks straight to
    # 1 slot.
    assert (stats.admissions, stats.bursts, stats.decode_steps) == (3, 5, 12)
    assert stats.shrinks == 1 and stats.slot_steps == 3 * 4 + 9
    # One prefill row per admission: the requests admitted together share their prompt.
    assert stats.prefill_rows == 3
    static_results, static = generate_requests(
        params, CONFIG, requests, settings=EngineSettings(slots=4, engine="static"), **kw
    )
    assert static.decode_steps == 12 + 1 and static.slot_steps == 4 * 13
    assert static.utilisation < stats.utilisation
    for a, b in zip(results, static_results):
        np.testing.assert_array_equal(a.tokens, b.tokens)


@pytest.mark.parametrize(
    ("kwargs", "requests", "match"),
    [
        ({}, [Request([], 2)], "non-empty"),
        ({}, [Request([[1, 2]], 2)], "1-D"),
        ({}, [Request([1.5, 2.0], 2)], "token ids"),
        ({}, [Request([1, 2], 9)], r"max_new_tokens must be an int in \[1, 8\]"),
        ({}, [Request([1, 2], 0)], "max_new_tokens"),
        ({"max_prompt_len": 4}, [Request(list(range(1, 7)), 2)], "exceeds"),
        ({"settings": EngineSettings(slots=0)}, [Request([1], 1)], "slots must be a positive int"),
        ({"settings": EngineSettings(slots=2, burst=0)}, [Request([1], 1)], "burst"),
        (
            {"settings": EngineSettings(slots=2, engine="paged")},
            [Request([1], 1)],
            "engine must be one of",
        ),
        (
            {"sampling": SamplingOptions(eos_ids=(), pad_id=PAD, top_k=-1)},
            [Request([1], 1)],
            "top_k",
        ),
        ({"stop_sequences": [[]]}, [Request([1], 1)], "stop_sequences must be non-empty"),
        (
            {},
            [Request([1, 2], 2, prompt_key=0), Request([3], 1), Request([1, 3], 2, prompt_key=0)],
            "requests 0 and 2 share prompt_key 0 but their prompts differ",
        ),
    ],
)
def test_bad_input_is_refused(params, kwargs, requests, match):
    args = dict(
        settings=EngineSettings(slots=2),
        max_new_tokens=8,
        max_prompt_len=4,
        sampling=SamplingOptions(eos_ids=(), pad_id=PAD),
    )
    with pytest.raises(ValueError, match=match):
        Engine(params, CONFIG, **args | kwargs).run(requests)


def test_stop_sequences_end_a_completion_on_device(params, rng):
    requests = _requests(rng, [5, 3], [12, 12])
    # Both prompts' free-running greedy outputs from one ``generate`` call (left-padded).
    free = np.asarray(_greedy(params, requests, eos_ids=()).tokens)
    # A 2-token stop taken from request 0's free-running output at columns 3-4; another that
    # never occurs in either output (checked), so request 1 runs to its length.
    stop = tuple(int(t) for t in free[0][3:5])
    never = next(
        (a, b)
        for a in range(3, CONFIG.vocab_size)
        for b in range(3, CONFIG.vocab_size)
        if not any((a, b) == tuple(row[i : i + 2]) for row in free for i in range(11))
    )
    first = next(i for i in range(11) if tuple(free[0][i : i + 2]) == stop)
    results, _ = generate_requests(
        params,
        CONFIG,
        requests,
        settings=EngineSettings(slots=1),
        max_new_tokens=12,
        sampling=SamplingOptions(eos_ids=(), pad_id=PAD, temperature=0.0),
        stop_sequences=[list(never), list(stop), [int(free[1][0]) + 1000]],
    )
    np.testing.assert_array_equal(results[0].tokens, free[0][: first + 2])
    assert results[0].finish_reason == "stop"
    np.testing.assert_array_equal(results[1].tokens, free[1])
    assert results[1].finish_reason == "length"


@pytest.mark.needs_devices(8)
def test_engine_on_a_mesh_matches_one_device(params, rng):
    """Slots over data x fsdp (4 shards) of a (2, 2, 2) mesh, weights by PARAM_RULES: the
    same tokens and log-probs as on one device, refills and the drain included."""
    from jaxrl_llm.models import logical_axes
    from jaxrl_llm.parallel import PARAM_RULES, logical_to_sharding, make_mesh

    config = dataclasses.replace(CONFIG, vocab_size=96)  # divisible by the tensor axis
    params = init_params(config, jax.random.key(1), dtype=jnp.float32)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    sharded = jax.device_put(
        params, logical_to_sharding(logical_axes(config), mesh, PARAM_RULES, shapes=params)
    )
    requests = _requests(
        rng,
        [3, 7, 5, 2, 6, 4, 1, 5, 2],
        [4, 9, 2, 12, 6, 12, 3, 1, 8],
        keys=[0, 0, 1, 2, 3, 3, 0, 3, 6],  # 0 and 3 come back while a sample holds them
    )
    # Sampled (temperature 1): equal tokens need equal logits to the last bit that matters, and
    # the log-probs are compared to 1e-5 (greedy decoding would hide logit errors).
    sampled = SamplingOptions(eos_ids=(7,), pad_id=PAD, temperature=1.0)
    kw = dict(max_new_tokens=12, sampling=sampled, seed=2)
    four = EngineSettings(slots=4)
    single, _ = generate_requests(params, config, requests, settings=four, **kw)
    multi, stats = generate_requests(sharded, config, requests, settings=four, mesh=mesh, **kw)
    assert stats.admissions > 1 and stats.reused_prompts > 0  # copied across batch shards
    for a, b in zip(single, multi, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert a.finish_reason == b.finish_reason
    # A paged cache: per batch shard (4 pools of blocks, tables of shard-local ids, one small
    # enough to preempt), and on a tensor-parallel mesh (kv heads split over 2 devices).
    tensor = make_mesh(data=1, fsdp=1, tensor=2, devices=jax.devices()[:2])
    on_tensor = jax.device_put(
        params, logical_to_sharding(logical_axes(config), tensor, PARAM_RULES, shapes=params)
    )
    # 8 slots and 16 blocks of 5 over 4 batch shards: 2 slots and 4 blocks a shard (a request
    # takes up to 4: an 8-token prompt bucket and 12 new tokens); bursts of 2, so an admission
    # reserves less than a whole row and two rows of a shard can outgrow its blocks.
    for weights, on, blocks in ((sharded, mesh, 16), (on_tensor, tensor, None)):
        paged, stats = generate_requests(
            weights,
            config,
            requests,
            settings=EngineSettings(slots=8, burst=2, kv_block_size=5, kv_blocks=blocks),
            mesh=on,
            **kw,
        )
        assert stats.peak_blocks > 0 and (blocks is None or stats.preemptions > 0)
        for a, b in zip(single, paged, strict=True):
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    # A paged engine without a mesh of its own is not split by the caller's.
    with jax.set_mesh(mesh):
        paged, _ = generate_requests(
            params, config, requests, settings=EngineSettings(slots=4, kv_block_size=4), **kw
        )
    for a, b in zip(single, paged, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
    with pytest.raises(ValueError, match="multiple of the mesh's 4 batch shards"):
        Engine(
            sharded,
            CONFIG,
            settings=EngineSettings(slots=6),
            max_new_tokens=4,
            max_prompt_len=4,
            sampling=SamplingOptions(eos_ids=(), pad_id=0),
            mesh=mesh,
        )


def _engine(weights, *, slots, max_prompt_len, kv_block_size=None):
    """An engine of up to 8 new tokens in bursts of 3 (the weight-update tests)."""
    return Engine(
        weights,
        CONFIG,
        settings=EngineSettings(slots=slots, burst=3, kv_block_size=kv_block_size),
        max_new_tokens=8,
        max_prompt_len=max_prompt_len,
        sampling=SamplingOptions(eos_ids=(), pad_id=PAD),
    )


class _OfferAfter:
    """A ``WeightUpdates`` stand-in: version 1's weights from poll ``polls + 1`` on (the
    engine polls once before each admission-and-burst round)."""

    def __init__(self, params, polls):
        self.params, self.polls, self.calls = params, polls, 0

    def newer(self, version):
        self.calls += 1
        return (1, self.params) if self.calls > self.polls and version < 1 else None


@pytest.mark.parametrize("kv_block_size", [None, 2])
def test_weights_updated_in_flight_take_over_at_the_next_token_and_tag_it(
    params, rng, kv_block_size
):
    """Partial rollouts: weights published between bursts decode every live slot from then on.
    The new weights here have a zero unembedding, so every token they sample has log-prob
    exactly ``-log V`` (temperature 1): they take over at each slot's first token sampled from
    their own logits, and every token is tagged with the version that sampled it. Tokens before
    are the old weights' (the same draws as a run without the update)."""
    requests = _requests(rng, [3, 5, 4, 6, 2, 7], [8] * 6)
    zero = {**params, "lm_head": jnp.zeros_like(params["lm_head"])}

    def run(updates=None, version=0):
        engine = _engine(params, slots=4, max_prompt_len=7, kv_block_size=kv_block_size)
        return engine.run(requests, seed=3, updates=updates, version=version)

    before, _ = run(version=4)
    assert all((r.versions == 4).all() for r in before)
    results, stats = run(_OfferAfter(zero, polls=2))
    assert stats.updates == 1
    uniform = -np.log(CONFIG.vocab_size)
    for i, (got, old) in enumerate(zip(results, before, strict=True)):
        # Slots 0-3 decoded two bursts of 3 tokens with the old weights; the 7th token was
        # drawn from the logits their last forward made; requests 4, 5 start after the update.
        took_over = 7 if i < 4 else 0
        want = np.r_[np.zeros(took_over), np.ones(8 - took_over)].astype(np.int32)
        np.testing.assert_array_equal(got.versions, want)
        np.testing.assert_array_equal(got.tokens[:took_over], old.tokens[:took_over])
        np.testing.assert_allclose(got.logprobs[:took_over], old.logprobs[:took_over], atol=1e-6)
        np.testing.assert_allclose(got.logprobs[took_over:], uniform, atol=1e-5)


@pytest.mark.parametrize("kv_block_size", [None, 4])  # contiguous, paged
def test_a_prompt_a_live_slot_holds_is_not_prefilled_again(params, rng, kv_block_size):
    """Samples of a prompt admitted while an earlier one still decodes reuse its prompt: its
    keys and values (copied row, or shared full blocks and a copied partial one) and its
    first-token logits. The tokens they draw have the trainer's log-probs (so what they reuse
    is right) and are those of a run that prefills every request."""
    # Two 2-slot schedules: sample 0 of each prompt decodes 10 tokens while the others come
    # and go in the other slot. Prompts of 6 (a whole 4-slot block and a partial one) and 8;
    # request 1, another prompt, leaves blocks holding other keys and values to be reused.
    requests = _requests(
        rng, [6] * 4 + [8] * 4, [10, 1, 2, 1, 10, 1, 2, 1], keys=[0, None, 0, 0, 1, 1, 1, 1]
    )
    kw = dict(
        settings=EngineSettings(slots=2, kv_block_size=kv_block_size),
        max_new_tokens=10,
        sampling=SamplingOptions(eos_ids=(), pad_id=PAD, temperature=0.7),
        seed=4,
    )
    shared, stats = generate_requests(params, CONFIG, requests, **kw)
    assert (stats.prefill_rows, stats.reused_prompts) == (3, 5)
    alone, alone_stats = generate_requests(
        params, CONFIG, [r._replace(prompt_key=None) for r in requests], **kw
    )
    assert (alone_stats.prefill_rows, alone_stats.reused_prompts) == (8, 0)
    for a, b in zip(shared, alone, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
    _assert_trainer_logprobs(params, requests, shared, 0.7)


def test_a_prompt_held_under_older_weights_is_prefilled_again(params, rng):
    """A request admitted after a weight update does not reuse a live slot's prompt computed by
    the older weights: it is sampled wholly by the new ones, as in a run that starts on them."""
    requests = _requests(rng, [5] * 6, [8, 1, 1, 1, 1, 8], keys=[0] * 6)
    new = init_params(CONFIG, jax.random.key(9), dtype=jnp.float32)

    def run(weights, updates=None):
        engine = _engine(weights, slots=2, max_prompt_len=5)
        return engine.run(requests, seed=3, updates=updates)

    # Requests 0, 1 admitted on version 0; the update lands before request 2's admission,
    # while request 0 (version 0) still holds the prompt.
    results, stats = run(params, _OfferAfter(new, polls=1))
    fresh, _ = run(new)
    assert stats.updates == 1 and stats.prefill_rows >= 2
    for got, want in zip(results[2:], fresh[2:], strict=True):
        assert (got.versions == 1).all()
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


def test_prompt_hidden_states_keep_the_models_hidden_dtype(params):
    """The hidden state a slot keeps for prompt reuse has the dtype ``forward`` returns: bf16
    weights with an f32 final norm (no compute dtype) give f32 hidden states, which a
    bf16-typed buffer would round before the first token's logits."""
    gen = importlib.import_module("jaxrl_llm.sampling.generate")  # the module, not its function
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    mixed = {**bf16, "final_norm": params["final_norm"]}
    computed = dataclasses.replace(CONFIG, compute_dtype="bfloat16")
    assert gen.hidden_dtype(params, CONFIG) == jnp.float32
    assert gen.hidden_dtype(bf16, CONFIG) == jnp.bfloat16
    assert gen.hidden_dtype(params, computed) == jnp.bfloat16
    assert gen.hidden_dtype(mixed, CONFIG) == jnp.float32
    engine = _engine(mixed, slots=2, max_prompt_len=4)
    assert engine._state_args["hidden_dtype"] == jnp.float32
    assert engine._state_args["cache_dtype"] == jnp.bfloat16


def test_the_hidden_dtype_is_traced_once_per_weight_structure(params, monkeypatch):
    """The RL loop builds an engine every step: the abstract trace behind ``hidden_dtype`` runs
    once per (config, weight shapes/dtypes/shardings, rows), not once per engine."""
    gen = importlib.import_module("jaxrl_llm.sampling.generate")
    traced = []
    real = gen._traced_hidden_dtype
    monkeypatch.setattr(gen, "_traced_hidden_dtype", lambda *a: traced.append(a[2]) or real(*a))
    gen._remembered_hidden_dtype.cache_clear()
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    moved = jax.tree.map(lambda x: x + 1, params)  # other values, same structure
    assert gen.hidden_dtype(params, CONFIG, rows=2) == jnp.float32
    assert gen.hidden_dtype(moved, CONFIG, rows=2) == jnp.float32
    assert traced == [2]
    assert gen.hidden_dtype(bf16, CONFIG, rows=2) == jnp.bfloat16  # new dtypes: traced again
    assert gen.hidden_dtype(params, CONFIG, rows=4) == jnp.float32  # new rows: traced again
    assert traced == [2, 2, 4]
    _engine(params, slots=2, max_prompt_len=4)
    _engine(moved, slots=2, max_prompt_len=4)
    assert traced == [2, 2, 4]  # both engines (slots=2) found it remembered
