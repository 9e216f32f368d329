"""transformers' greedy decoding, the reference the sampler's tests (and the model families'
decode tests in tests/models) compare ``generate`` and the continuous engine against."""

import jax
import numpy as np
import torch

from jaxrl_llm.sampling import SamplingOptions, generate
from jaxrl_llm.sampling.engine import EngineSettings, Request, generate_requests


def hf_greedy(model, tokens, mask, max_new, *, eos_ids=(), pad_id=0):
    """transformers ``generate(do_sample=False)`` from left-padded ``tokens`` / ``mask``.

    Without ``eos_ids`` every row decodes ``max_new`` tokens; with them a row stops at its
    first one.

    Returns:
      ``(completion, logprobs)``: ``[B, max_new]`` token ids (right-padded with ``pad_id``
      after a stop) and ``[B, steps]`` float64 log-probs of the tokens taken (transformers'
      logits, log-softmaxed in float64).
    """
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.as_tensor(tokens, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new,
            min_new_tokens=0 if eos_ids else max_new,
            eos_token_id=list(eos_ids) if eos_ids else None,
            pad_token_id=pad_id,
            use_cache=True,
            output_logits=True,
            return_dict_in_generate=True,
        )
    completion = out.sequences.numpy()[:, np.shape(tokens)[1] :]
    logits = np.stack([x.double().numpy() for x in out.logits], axis=1)  # [B, steps, V]
    logits -= logits.max(axis=-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    logprobs = np.take_along_axis(log_probs, completion[..., None], axis=-1)[..., 0]
    padding = ((0, 0), (0, max_new - completion.shape[1]))
    return np.pad(completion, padding, constant_values=pad_id), logprobs


def greedy(params, config, tokens, mask, max_new, *, eos_ids=(), decode_layers="auto"):
    """``generate``'s greedy ``Completion`` of left-padded ``tokens`` / ``mask`` (pad id 0)."""
    return generate(
        params,
        config,
        tokens,
        mask,
        key=jax.random.key(0),
        max_new_tokens=max_new,
        sampling=SamplingOptions(eos_ids=eos_ids, pad_id=0, temperature=0.0),
        decode_layers=decode_layers,
    )


def assert_greedy_matches_hf(
    torch_model, params, config, tokens, mask, max_new, *, decode_layers="auto", atol=1e-4
):
    """:func:`greedy`'s tokens (no stop token) are transformers', and every step's log-prob is
    theirs to ``atol`` (a decode step gone wrong moves it even where the argmax survives)."""
    ours = greedy(params, config, tokens, mask, max_new, decode_layers=decode_layers)
    want, want_logprobs = hf_greedy(torch_model, tokens, mask, max_new)
    np.testing.assert_array_equal(np.asarray(ours.tokens), want)
    np.testing.assert_allclose(np.asarray(ours.logprobs), want_logprobs, atol=atol)


def engine_and_hf_greedy(torch_model, params, config, lengths, budgets, *, seed, kv_block_size):
    """Greedy completions of random prompts (``lengths`` tokens, ``budgets`` new tokens each,
    no stop token) through the continuous engine on 2 slots, so that slots are refilled, and
    through transformers one prompt at a time.

    Returns:
      ``[(result, hf_tokens, hf_logprobs)]`` a request: the engine's ``Result`` and
      :func:`hf_greedy`'s ``[budget]`` tokens and log-probs.
    """
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, config.vocab_size, size=n) for n in lengths]
    results, _ = generate_requests(
        params,
        config,
        [Request(p, b) for p, b in zip(prompts, budgets)],
        settings=EngineSettings(slots=2, kv_block_size=kv_block_size),
        max_new_tokens=max(budgets),
        sampling=SamplingOptions(eos_ids=(), pad_id=0, temperature=0.0),
    )
    out = []
    for prompt, budget, result in zip(prompts, budgets, results, strict=True):
        want, want_logprobs = hf_greedy(
            torch_model, prompt[None], np.ones((1, len(prompt))), budget
        )
        out.append((result, want[0], want_logprobs[0]))
    return out


def assert_engine_matches_hf(
    torch_model, params, config, lengths, budgets, *, seed, kv_block_size, atol=1e-4
):
    """Every request of :func:`engine_and_hf_greedy` decodes transformers' tokens, and each
    step's log-prob is theirs to ``atol``."""
    runs = engine_and_hf_greedy(
        torch_model, params, config, lengths, budgets, seed=seed, kv_block_size=kv_block_size
    )
    for result, want, want_logprobs in runs:
        np.testing.assert_array_equal(result.tokens, want)
        np.testing.assert_allclose(result.logprobs, want_logprobs, atol=atol)
