"""Mixture-of-experts models through the sampler's KV-cache decode: greedy decoding with the
static ``generate`` (stacked and per-layer layouts) and the continuous engine (paged cache, slot
refills) equals transformers ``generate(do_sample=False)`` on tiny random checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxrl_llm.models import load_pretrained
from jaxrl_llm.sampling import generate
from jaxrl_llm.sampling.engine import generate_requests
from jaxrl_llm.sampling.requests import Request
from tests.models.hf_utils import MOE_VARIANTS, build_checkpoint, padded_batch

MAX_NEW = 8
PAD = 0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for i, name in enumerate(MOE_VARIANTS):
        path = str(tmp_path_factory.mktemp(name))
        torch_model = build_checkpoint(name, path, seed=40 + i)
        out[name] = (torch_model, *load_pretrained(path, dtype=jnp.float32))
    return out


def _hf_greedy(model, tokens, mask, max_new):
    """transformers' greedy tokens ``[B, max_new]`` and their log-probs (float64)."""
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.as_tensor(tokens, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            eos_token_id=None,
            pad_token_id=PAD,
            use_cache=True,
            output_logits=True,
            return_dict_in_generate=True,
        )
    completion = out.sequences.numpy()[:, tokens.shape[1] :]
    logits = np.stack([x.double().numpy() for x in out.logits], axis=1)  # [B, T, V]
    log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    return completion, np.take_along_axis(log_probs, completion[..., None], axis=-1)[..., 0]


@pytest.mark.parametrize(
    "name, decode_layers",
    [("qwen3_moe", "stacked"), ("qwen2_moe", "per_layer"), ("mixtral", "stacked")],
)
def test_greedy_matches_transformers_generate(checkpoints, name, decode_layers):
    torch_model, config, params = checkpoints[name]
    rng = np.random.default_rng(4)
    tokens, mask = padded_batch(rng, [11, 4, 7], 11, vocab=config.vocab_size, side="left")
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
        decode_layers=decode_layers,
    )
    want, want_logprobs = _hf_greedy(torch_model, tokens, mask, MAX_NEW)
    np.testing.assert_array_equal(np.asarray(ours.tokens), want)
    # Every step's log-prob too: a decode step routed wrongly would move it even where the
    # argmax survives.
    np.testing.assert_allclose(np.asarray(ours.logprobs), want_logprobs, atol=1e-4)


def test_continuous_engine_matches_transformers_generate(checkpoints):
    torch_model, config, params = checkpoints["qwen2_moe"]
    rng = np.random.default_rng(5)
    lengths, budgets = [5, 2, 9, 4], [6, 8, 3, 8]
    prompts = [rng.integers(3, config.vocab_size, size=n) for n in lengths]
    results, _ = generate_requests(
        params,
        config,
        [Request(p, b) for p, b in zip(prompts, budgets)],
        slots=2,
        max_new_tokens=8,
        eos_ids=(),
        pad_id=PAD,
        temperature=0.0,
        kv_block_size=4,
    )
    for prompt, budget, result in zip(prompts, budgets, results, strict=True):
        mask = np.ones((1, len(prompt)), np.int32)
        want, want_logprobs = _hf_greedy(torch_model, prompt[None], mask, budget)
        np.testing.assert_array_equal(result.tokens, want[0])
        np.testing.assert_allclose(result.logprobs, want_logprobs[0], atol=1e-4)
