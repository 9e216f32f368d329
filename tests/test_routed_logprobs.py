"""``logprobs.routed_completion_logprobs``: the log-probs of ``completion_logprobs`` /
``packed_completion_logprobs`` and, from the same forward, the router logits with the mask of
the real tokens they cover (the MoE router losses' values: tests/train/rl/test_router_loss.py).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxrl_llm import models
from jaxrl_llm.logprobs import (
    completion_logprobs,
    packed_completion_logprobs,
    routed_completion_logprobs,
)
from jaxrl_llm.packing import plan_sequences
from jaxrl_llm.types import Sequences
from tests.train import step_problem
from tests.train.moe_problem import MOE


def _seqs() -> Sequences:
    b = step_problem.host_batch(3, batch=4)
    return Sequences(b.prompt_tokens, b.prompt_mask, b.completion_tokens, b.completion_mask)


def test_dense_model_gives_the_same_logprobs_and_no_router_logits():
    config, seqs = step_problem.CONFIG, _seqs()
    params = models.init_params(config, jax.random.key(0))
    routed = routed_completion_logprobs(params, config, seqs, return_entropy=True)
    want = completion_logprobs(params, config, *seqs, return_entropy=True)
    for got, ref in zip(routed.logprobs, want, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    assert routed.router_logits is None
    real = np.concatenate([seqs.prompt_mask, seqs.completion_mask], axis=1)
    np.testing.assert_array_equal(np.asarray(routed.token_mask), real)


def test_moe_router_logits_are_the_forwards_padded_and_packed():
    seqs = _seqs()
    params = models.init_params(MOE, jax.random.key(1))
    tokens = np.concatenate([seqs.prompt_tokens, seqs.completion_tokens], axis=1)
    real = np.concatenate([seqs.prompt_mask, seqs.completion_mask], axis=1)
    _, _, want = models.forward(
        params, MOE, tokens, attention_mask=real, outputs=("router_logits",)
    )
    padded = routed_completion_logprobs(params, MOE, seqs)
    assert padded.router_logits.shape == (MOE.num_hidden_layers, *tokens.shape, 4)
    np.testing.assert_allclose(
        np.asarray(padded.router_logits)[:, real], np.asarray(want)[:, real], atol=1e-6
    )
    plan = plan_sequences(seqs.prompt_mask, seqs.completion_mask)
    packed = routed_completion_logprobs(params, MOE, seqs, plan)
    np.testing.assert_allclose(
        np.asarray(packed.logprobs),
        np.asarray(packed_completion_logprobs(params, MOE, seqs, plan)),
        rtol=1e-6,
        atol=1e-6,
    )
    segments = np.asarray(plan.flat("segment_ids"))
    np.testing.assert_array_equal(np.asarray(packed.token_mask), segments > 0)
    # The packed real slots hold the padded real tokens' router logits, in some order.
    got = np.sort(np.asarray(packed.router_logits)[:, segments > 0], axis=1)
    np.testing.assert_allclose(got, np.sort(np.asarray(want)[:, real], axis=1), atol=1e-5)
