"""Frozen forwards: micro-batched log-probs keep every row in place (vs a float64 reference)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import load_pretrained
from jaxrl_llm.train.forward import make_logprob_fn
from jaxrl_llm.train.step import TokenBudget, merge_micro_batches, split_micro_batches
from jaxrl_llm.types import Sequences
from tests.models import hf_utils

P, T = 5, 6
LENGTHS = ([5, 3, 1, 4, 2, 5], [6, 4, 2, 1, 5, 3])  # prompt, completion tokens per row


def test_split_then_merge_is_the_identity_and_split_is_strided():
    x = np.arange(12).reshape(6, 2)
    parts = np.asarray(split_micro_batches(x, 3))
    # micro-batch k holds rows k, k + 3
    np.testing.assert_array_equal(parts[1], [[2, 3], [8, 9]])
    np.testing.assert_array_equal(merge_micro_batches(parts), x)


@pytest.mark.parametrize("micro_batches", [1, 3, TokenBudget(1)])
def test_micro_batched_logprobs_match_the_float64_reference(tmp_path, rng, micro_batches):
    torch_model = hf_utils.build_checkpoint("qwen2", str(tmp_path), seed=5)
    config, params = load_pretrained(str(tmp_path), dtype=jnp.float32)
    prompt, prompt_mask = hf_utils.padded_batch(rng, LENGTHS[0], P, vocab=128, side="left")
    completion, completion_mask = hf_utils.padded_batch(rng, LENGTHS[1], T, vocab=128, side="right")
    want = hf_utils.hf_completion_logprobs(
        torch_model, prompt, prompt_mask, completion, completion_mask
    )
    fn = make_logprob_fn(config, micro_batches=micro_batches)
    got = fn(params, Sequences(prompt, prompt_mask, completion, completion_mask))
    assert got.shape == (len(prompt), T)
    np.testing.assert_allclose(got, want, atol=1e-4)
