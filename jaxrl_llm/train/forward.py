"""Model forwards the trainers share: per-token log-probs of ``Sequences``, frozen and jitted.

A frozen forward (old-policy or reference log-probs, PRIME's PRM scores) takes parameters with
their own shardings and a sharded :class:`~jaxrl_llm.types.Sequences`; its ``[B, T]`` output stays
on device, sharded like the batch, so it joins the update's batch without a host round trip.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxrl_llm import logprobs, parallel
from jaxrl_llm.types import Sequences

PyTree = Any


def sequence_logprobs(params, model_config, seqs: Sequences, **kwargs) -> jax.Array:
    """``[B, T]`` per-token log-probs of ``seqs.completion_tokens`` (``completion_logprobs``)."""
    return logprobs.completion_logprobs(
        params,
        model_config,
        seqs.prompt_tokens,
        seqs.prompt_mask,
        seqs.completion_tokens,
        seqs.completion_mask,
        **kwargs,
    )


def make_logprob_fn(
    model_config,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    param_shardings: PyTree | None = None,
):
    """A jitted ``(params, seqs) -> [B, T]`` for old-policy or reference log-probs.

    No gradient flows into ``params``; ``temperature`` is the sampling temperature, so the
    log-probs are those of the distribution the tokens were drawn from.
    """

    mesh = None if param_shardings is None else jax.tree.leaves(param_shardings)[0].mesh

    def fn(params, seqs: Sequences):
        with parallel.mesh_context(mesh):
            return _logprobs(params, seqs)

    def _logprobs(params, seqs: Sequences):
        return sequence_logprobs(
            jax.lax.stop_gradient(params),
            model_config,
            seqs,
            temperature=temperature,
            chunk_size=chunk_size,
        )

    if param_shardings is None:
        return jax.jit(fn)
    return jax.jit(fn, in_shardings=(param_shardings, None))
