"""The CPU decode layout: per-layer weights and cache, unrolled, read and updated in place."""

import importlib
import re

import jax
import numpy as np
import pytest

from jaxrl_llm.models import ModelConfig
from jaxrl_llm.sampling import layout
from tests.sampling import random_params

gen = importlib.import_module("jaxrl_llm.sampling.generate")

# Distinct sizes, so that a copied weight or cache slice is recognisable by its element count.
CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=67,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
)
ROWS, PROMPT, NEW = 3, 16, 6


@pytest.fixture(scope="module")
def setup():
    params = random_params(CONFIG, seed=4)
    rng = np.random.default_rng(5)
    tokens = rng.integers(1, CONFIG.vocab_size, size=(ROWS, PROMPT)).astype(np.int32)
    mask = np.ones((ROWS, PROMPT), bool)
    mask[0, :9] = False
    return params, tokens, mask


def _decode(setup, *, unroll, temperature, windows=(), new=NEW, eos_ids=()):
    params, tokens, mask = setup
    sampling = gen.sampling_params(temperature=temperature, eos_ids=eos_ids, pad_id=0)
    state = gen.prefill(params, CONFIG, tokens, mask, max_new_tokens=new, pad_id=0)
    args = (params, state, jax.random.key(7), sampling)
    static = dict(config=CONFIG, top_k=0, mesh=None, unroll=unroll, windows=windows)
    return gen.decode_program(*args, **static), gen.decode_program.lower(*args, **static)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_unrolled_decode_equals_scanned_decode(setup, temperature):
    scanned, _ = _decode(setup, unroll=False, temperature=temperature)
    unrolled, _ = _decode(setup, unroll=True, temperature=temperature)
    np.testing.assert_array_equal(unrolled.tokens, scanned.tokens)
    np.testing.assert_allclose(unrolled.logprobs, scanned.logprobs, atol=1e-5)
    assert not isinstance(unrolled.cache.k, tuple)  # restacked for the caller
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), unrolled.cache, scanned.cache
    )
    assert int(unrolled.step) == NEW


def _computations(hlo: str) -> dict[str, str]:
    """Compiled HLO text split into ``name -> body`` per computation."""
    parts = re.split(r"\n(?=(?:ENTRY )?%[\w.\-]+ \()", hlo)
    return {
        re.match(r"(?:ENTRY )?%([\w.\-]+)", p).group(1): p
        for p in parts
        if p.startswith(("%", "ENTRY"))
    }


def _loop_instructions(hlo: str) -> list[str]:
    """Instructions of the decode while loop's body and every non-fusion computation it runs."""
    comps = _computations(hlo)
    entry = next(body for name, body in comps.items() if body.startswith("ENTRY"))
    todo = re.findall(r"while\(.*?body=%([\w.\-]+)", entry)
    seen, lines = set(), []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in comps[name].splitlines()[1:]:
            lines.append(line)
            todo += re.findall(r"(?:body|condition|to_apply)=%([\w.\-]+)", line)
            todo += re.findall(r"branch_computations=\{([^}]*)\}", line) and [
                b.strip().lstrip("%")
                for b in re.findall(r"branch_computations=\{([^}]*)\}", line)[0].split(",")
            ]
    return lines


@pytest.mark.parametrize("windows", [(), (2, NEW)])
def test_decode_loop_reads_weights_and_cache_in_place(setup, windows):
    """No weight or cache slice is copied inside the loop(s); the cache is only updated in place.

    Before the per-layer layout, every step copied each layer's weights out of the stacked
    arrays and a transposed copy of each layer's cache before the attention.
    """
    _, lowered = _decode(setup, unroll=True, temperature=1.0, windows=windows)
    hlo = lowered.compile().as_text()
    slots = PROMPT + (windows or (NEW,))[0]  # the smallest cache a loop carries
    layer_cache = ROWS * CONFIG.num_key_value_heads * slots * CONFIG.head_dim
    smallest_weight = CONFIG.hidden_size * CONFIG.num_key_value_heads * CONFIG.head_dim
    big = min(layer_cache, smallest_weight)
    offenders = []
    for line in _loop_instructions(hlo):
        match = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = \w+\[([\d,]*)\]\{[^}]*\} (\S+?)\(", line)
        if not match or match.group(3) in ("parameter", "get-tuple-element", "bitcast"):
            continue
        size = int(np.prod([int(d) for d in match.group(2).split(",") if d]))
        if size >= big and "dynamic-update-slice" not in match.group(1):
            offenders.append(line.strip()[:160])
    assert not offenders, "\n".join(offenders)
    assert any("dynamic-update-slice" in line for line in _loop_instructions(hlo))


def test_worth_unstacking_on_cpu_up_to_a_size(setup, monkeypatch):
    params = setup[0]
    assert jax.devices()[0].platform == "cpu"
    assert layout.worth_unstacking(params)
    monkeypatch.setattr(layout, "UNROLL_MAX_BYTES", 1000)
    assert not layout.worth_unstacking(params)


def test_decode_layers_modes_override_the_rule(setup, monkeypatch):
    """``rollout.decode_layers``: ``stacked`` never splits, ``per_layer`` always does, ``auto``
    is the CPU rule; an unknown mode is named."""
    params = setup[0]
    monkeypatch.setattr(layout, "UNROLL_MAX_BYTES", 1000)  # auto would keep this one stacked
    assert not layout.worth_unstacking(params, "auto")
    assert layout.worth_unstacking(params, "per_layer")
    monkeypatch.undo()
    assert layout.worth_unstacking(params, "auto")
    assert not layout.worth_unstacking(params, "stacked")
    with pytest.raises(ValueError, match="rollout.decode_layers must be one of"):
        layout.worth_unstacking(params, "unrolled")


def test_generate_decodes_stacked_or_per_layer_as_asked(setup, monkeypatch):
    """``generate(decode_layers=...)`` reaches the decode program, and both layouts sample the
    same completions."""
    params, tokens, mask = setup
    seen = []
    real = gen.decode_program

    def recording(*args, **kwargs):
        seen.append(kwargs["unroll"])
        return real(*args, **kwargs)

    monkeypatch.setattr(gen, "decode_program", recording)
    outs = [
        gen.generate(
            params,
            CONFIG,
            tokens,
            mask,
            key=jax.random.key(3),
            max_new_tokens=NEW,
            sampling=gen.SamplingOptions(eos_ids=(), pad_id=0),
            decode_layers=mode,
        )
        for mode in ("stacked", "per_layer")
    ]
    assert seen == [False, True]
    np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
    np.testing.assert_allclose(outs[0].logprobs, outs[1].logprobs, atol=1e-5)


def test_decode_windows_rule(setup, monkeypatch):
    """Window ends ``ceil(T * i / n)`` with ``n = min(most, T // 32)`` (``most``: 4, the
    engine's 8), none below two windows; only for per-layer decoding on CPU."""
    params = setup[0]
    assert layout.decode_windows(params, 63) == ()
    assert layout.decode_windows(params, 64) == (32, 64)
    assert layout.decode_windows(params, 100) == (34, 67, 100)
    assert layout.decode_windows(params, 128) == (32, 64, 96, 128)
    assert layout.decode_windows(params, 1001) == (251, 501, 751, 1001)
    assert layout.decode_windows(params, 128, "stacked") == ()
    assert layout.decode_windows(params, 100, most=8) == (34, 67, 100)
    assert layout.decode_windows(params, 512, most=8) == tuple(range(64, 513, 64))
    monkeypatch.setattr(layout, "UNROLL_MAX_BYTES", 1000)
    assert layout.decode_windows(params, 128) == ()
    assert layout.decode_windows(params, 128, "per_layer") == (32, 64, 96, 128)
    monkeypatch.setattr(layout, "_on_cpu", lambda p: False)
    assert layout.decode_windows(params, 128, "per_layer") == ()


WINDOWED_NEW = 11


@pytest.mark.parametrize("unroll", [True, False])
@pytest.mark.parametrize(
    "temperature, eos_ids",
    [(0.0, ()), (1.0, (5, 9, 17, 23, 31, 40, 52, 60)), (1.0, tuple(range(CONFIG.vocab_size)))],
    ids=["greedy", "sampled-some-rows-stop", "sampled-all-stop-at-once"],
)
def test_windowed_decode_equals_one_loop(setup, unroll, temperature, eos_ids):
    """Loops over windows of 3, 7 and 11 steps sample what one loop over the whole cache does
    (tokens, log-probs, masks, finished rows, steps run) and return the whole ``P + T`` cache.
    Rows stop at their EOS inside and across windows; when all stop in the first window, the
    later loops run no step."""
    one, one_lowered = _decode(
        setup, unroll=unroll, temperature=temperature, new=WINDOWED_NEW, eos_ids=eos_ids
    )
    windowed, lowered = _decode(
        setup,
        unroll=unroll,
        temperature=temperature,
        new=WINDOWED_NEW,
        eos_ids=eos_ids,
        windows=(3, 7, WINDOWED_NEW),
    )
    np.testing.assert_array_equal(windowed.tokens, one.tokens)
    np.testing.assert_array_equal(windowed.mask, one.mask)
    np.testing.assert_array_equal(windowed.done, one.done)
    np.testing.assert_allclose(windowed.logprobs, one.logprobs, atol=1e-5)
    assert int(windowed.step) == int(one.step)
    lengths = np.asarray(one.mask).sum(axis=1)
    if len(eos_ids) == CONFIG.vocab_size:
        assert int(one.step) == 1  # every row stopped at its first token
    elif eos_ids:
        assert lengths.min() <= 7 < lengths.max()  # rows stop in different windows
    assert windowed.cache.k.shape == one.cache.k.shape  # [L, B, K, P + T, H]
    assert windowed.cache.k.shape[3] == PROMPT + WINDOWED_NEW
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5),
        windowed.cache,
        one.cache,
    )
    # The loops carry caches of P + 3, P + 7 and P + 11 slots; the one loop only P + 11.
    text, one_text = lowered.as_text(), one_lowered.as_text()
    for end in (3, 7, WINDOWED_NEW):
        cache = f"{ROWS}x{CONFIG.num_key_value_heads}x{PROMPT + end}x{CONFIG.head_dim}xf32>"
        assert cache in text, cache
        assert (cache in one_text) == (end == WINDOWED_NEW), cache


@pytest.mark.parametrize("windows", [(3, 7), (7, 3, WINDOWED_NEW), (0, WINDOWED_NEW)])
def test_windows_must_rise_to_the_last_column(setup, windows):
    with pytest.raises(ValueError, match="windows must rise to max_new_tokens=11"):
        _decode(setup, unroll=True, temperature=0.0, new=WINDOWED_NEW, windows=windows)


def test_decode_runs_the_windows_of_its_length(setup, monkeypatch):
    """``decode`` (as ``generate`` calls it) passes ``decode_windows``' windows to the program:
    64 new tokens on CPU decode in two windows, per layer."""
    params, tokens, mask = setup
    seen = []
    real = gen.decode_program

    def recording(*args, **kwargs):
        seen.append((kwargs["unroll"], kwargs["windows"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(gen, "decode_program", recording)
    out = gen.generate(
        params,
        CONFIG,
        tokens,
        mask,
        key=jax.random.key(3),
        max_new_tokens=64,
        sampling=gen.SamplingOptions(eos_ids=(), pad_id=0),
    )
    assert seen == [(True, (32, 64))]
    assert out.tokens.shape == (ROWS, 64) and bool(np.all(out.mask))


def test_a_state_past_step_0_keeps_its_cache(setup):
    """``decode`` on a state it already ran (step 64 of 64) decodes in one loop: no window cuts
    the slots it filled, and the state comes back unchanged."""
    params, tokens, mask = setup
    sampling = gen.sampling_params(temperature=1.0, eos_ids=(), pad_id=0)
    state = gen.prefill(params, CONFIG, tokens, mask, max_new_tokens=64, pad_id=0)
    state = gen.decode(params, CONFIG, state, key=jax.random.key(1), sampling=sampling)
    before = jax.tree.map(np.asarray, state)  # the next call donates it
    again = gen.decode(params, CONFIG, state, key=jax.random.key(1), sampling=sampling)
    assert int(again.step) == 64
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, again), before)
