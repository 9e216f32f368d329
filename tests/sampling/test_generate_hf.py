"""Greedy decoding equals transformers ``generate(do_sample=False)`` on tiny random checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxrl_llm.models import load_pretrained
from jaxrl_llm.sampling import generate
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


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_greedy_matches_transformers_generate(tmp_path, variant):
    torch_model = build_checkpoint(variant, str(tmp_path), seed=3)
    config, params = load_pretrained(str(tmp_path), dtype=jnp.float32)
    rng = np.random.default_rng(4)
    # Left-padded, ragged, and wider than its bucket's minimum (13 columns -> bucket 16).
    tokens, mask = padded_batch(rng, [13, 4, 9], 13, vocab=config.vocab_size, side="left")

    ours = generate(
        params,
        config,
        tokens,
        mask,
        key=jax.random.key(0),
        max_new_tokens=MAX_NEW,
        temperature=0.0,
        eos_ids=(),
        pad_id=PAD,
    )
    want = _hf_greedy(torch_model, tokens, mask, eos_ids=())
    np.testing.assert_array_equal(ours.tokens, want)
    assert bool(ours.mask.all())

    # Two EOS ids, taken from the free-running output so that rows stop at different steps.
    eos = (int(want[0, 3]), int(want[2, 6]))
    ours = generate(
        params,
        config,
        tokens,
        mask,
        key=jax.random.key(0),
        max_new_tokens=MAX_NEW,
        temperature=0.0,
        eos_ids=eos,
        pad_id=PAD,
    )
    want = _hf_greedy(torch_model, tokens, mask, eos_ids=eos)
    np.testing.assert_array_equal(ours.tokens, want)
    for row in range(tokens.shape[0]):
        hits = [t for t in range(MAX_NEW) if want[row, t] in eos]
        length = hits[0] + 1 if hits else MAX_NEW
        assert ours.mask[row].tolist() == [True] * length + [False] * (MAX_NEW - length)
    assert not bool(ours.mask.all()), "at least one row must have stopped early"
