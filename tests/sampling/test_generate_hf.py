"""Greedy decoding equals transformers ``generate(do_sample=False)`` on tiny random checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxrl_llm.models import load_pretrained
from jaxrl_llm.sampling import generate, layout
from tests.models.hf_utils import build_checkpoint, padded_batch

MAX_NEW = 12
PAD = 0


def _hf_greedy(model, tokens, mask, *, eos_ids):
    """transformers greedy completions, right-padded with PAD to MAX_NEW columns."""
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.as_tensor(tokens, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long),
            do_sample=False,
            max_new_tokens=MAX_NEW,
            min_new_tokens=0,
            eos_token_id=list(eos_ids) if eos_ids else None,
            pad_token_id=PAD,
            use_cache=True,
        ).numpy()
    completion = out[:, tokens.shape[1] :]
    return np.pad(completion, ((0, 0), (0, MAX_NEW - completion.shape[1])), constant_values=PAD)


def _greedy(params, config, tokens, mask, *, max_new, eos_ids):
    """Our greedy completions."""
    return generate(
        params,
        config,
        tokens,
        mask,
        key=jax.random.key(0),
        max_new_tokens=max_new,
        temperature=0.0,
        eos_ids=eos_ids,
        pad_id=PAD,
    )


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_greedy_matches_transformers_generate(tmp_path, variant):
    torch_model = build_checkpoint(variant, str(tmp_path), seed=3)
    config, params = load_pretrained(str(tmp_path), dtype=jnp.float32)
    rng = np.random.default_rng(4)
    # Left-padded, ragged, and wider than its bucket's minimum (13 columns -> bucket 16).
    tokens, mask = padded_batch(rng, [13, 4, 9], 13, vocab=config.vocab_size, side="left")

    ours = _greedy(params, config, tokens, mask, max_new=MAX_NEW, eos_ids=())
    want = _hf_greedy(torch_model, tokens, mask, eos_ids=())
    np.testing.assert_array_equal(ours.tokens, want)
    assert bool(ours.mask.all())

    # Two EOS ids, taken from the free-running output so that rows stop at different steps.
    eos = (int(want[0, 3]), int(want[2, 6]))
    ours = _greedy(params, config, tokens, mask, max_new=MAX_NEW, eos_ids=eos)
    want = _hf_greedy(torch_model, tokens, mask, eos_ids=eos)
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
    with torch.no_grad():
        out = torch_model.generate(
            input_ids=torch.as_tensor(tokens, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long),
            do_sample=False,
            max_new_tokens=64,
            min_new_tokens=64,
            pad_token_id=PAD,
            use_cache=True,
            output_logits=True,
            return_dict_in_generate=True,
        )
    want = out.sequences.numpy()[:, tokens.shape[1] :]
    logits = np.stack([x.double().numpy() for x in out.logits], axis=1)  # [B, 64, V]
    logits -= logits.max(axis=-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    want_logprobs = np.take_along_axis(log_probs, want[..., None], axis=-1)[..., 0]
    ours = _greedy(params, config, tokens, mask, max_new=64, eos_ids=())
    np.testing.assert_array_equal(ours.tokens, want)
    np.testing.assert_allclose(ours.logprobs, want_logprobs, atol=2e-5)
