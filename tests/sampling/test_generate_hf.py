"""Greedy decoding equals transformers ``generate(do_sample=False)`` on tiny random checkpoints."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import load_pretrained
from jaxrl_llm.sampling import layout
from tests.models.hf_utils import build_checkpoint, padded_batch
from tests.sampling.hf_reference import greedy, hf_greedy

MAX_NEW = 12


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_greedy_matches_transformers_generate(tmp_path, variant):
    torch_model = build_checkpoint(variant, str(tmp_path), seed=3)
    config, params = load_pretrained(str(tmp_path), dtype=jnp.float32)
    rng = np.random.default_rng(4)
    # Left-padded, ragged, and wider than its bucket's minimum (13 columns -> bucket 16).
    tokens, mask = padded_batch(rng, [13, 4, 9], 13, vocab=config.vocab_size, side="left")

    ours = greedy(params, config, tokens, mask, MAX_NEW)
    want, _ = hf_greedy(torch_model, tokens, mask, MAX_NEW)
    np.testing.assert_array_equal(ours.tokens, want)
    assert bool(ours.mask.all())

    # Two EOS ids, taken from the free-running output so that rows stop at different steps.
    eos = (int(want[0, 3]), int(want[2, 6]))
    ours = greedy(params, config, tokens, mask, MAX_NEW, eos_ids=eos)
    want, _ = hf_greedy(torch_model, tokens, mask, MAX_NEW, eos_ids=eos)
    np.testing.assert_array_equal(ours.tokens, want)
    for row in range(tokens.shape[0]):
        hits = [t for t in range(MAX_NEW) if want[row, t] in eos]
        length = hits[0] + 1 if hits else MAX_NEW
        assert ours.mask[row].tolist() == [True] * length + [False] * (MAX_NEW - length)
    assert not bool(ours.mask.all()), "at least one row must have stopped early"


def test_greedy_and_logprobs_match_transformers_over_decode_windows(tmp_path):
    """64 new tokens on CPU decode in two windows of the cache (``layout.decode_windows``); the
    tokens and every step's log-prob are still transformers' (its logits, log-softmaxed in
    float64), so each step attended over the right slots in either window."""
    torch_model = build_checkpoint("llama", str(tmp_path), seed=8)
    config, params = load_pretrained(str(tmp_path), dtype=jnp.float32)
    assert layout.decode_windows(params, 64) == (32, 64)
    rng = np.random.default_rng(4)
    tokens, mask = padded_batch(rng, [13, 4, 9], 13, vocab=config.vocab_size, side="left")
    want, want_logprobs = hf_greedy(torch_model, tokens, mask, 64)
    ours = greedy(params, config, tokens, mask, 64)
    np.testing.assert_array_equal(ours.tokens, want)
    np.testing.assert_allclose(ours.logprobs, want_logprobs, atol=2e-5)
