"""Model forwards the trainers share: per-token log-probs of ``Sequences``, frozen and jitted.

A frozen forward (old-policy or reference log-probs, PRIME's PRM scores) takes parameters with
their own shardings and a sharded :class:`~jaxrl_llm.types.Sequences`; its ``[B, T]`` output stays
on device, sharded like the batch, so it joins the update's batch without a host round trip.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxrl_llm import logprobs, parallel
from jaxrl_llm.train.packing import micro_plan
from jaxrl_llm.train.step import (
    TokenBudget,
    merge_micro_batches,
    micro_batch_count,
    packed_micro_batch_count,
    split_micro_batches,
)
from jaxrl_llm.types import Sequences

PyTree = Any


def sequence_logprobs(params, model_config, seqs: Sequences, *, packing=None, **kwargs):
    """``[B, T]`` per-token log-probs of ``seqs.completion_tokens`` (``completion_logprobs``),
    or, with a ``packing`` plan (``jaxrl_llm.packing``: leaves ``[shards, rows, W]``), the same
    values computed over packed rows (``packed_completion_logprobs``)."""
    if packing is not None:
        return logprobs.packed_completion_logprobs(params, model_config, seqs, packing, **kwargs)
    return logprobs.completion_logprobs(
        params,
        model_config,
        seqs.prompt_tokens,
        seqs.prompt_mask,
        seqs.completion_tokens,
        seqs.completion_mask,
        **kwargs,
    )


def routed_sequence_logprobs(
    params, model_config, seqs: Sequences, *, packing=None, **kwargs
) -> logprobs.RoutedLogprobs:
    """``sequence_logprobs``'s values with the router logits of the same forward
    (``logprobs.routed_completion_logprobs``): what a mixture-of-experts update's router
    losses are computed from, padded or (with a ``packing`` plan) packed."""
    return logprobs.routed_completion_logprobs(params, model_config, seqs, packing, **kwargs)


def make_logprob_fn(
    model_config,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    param_shardings: PyTree | None = None,
    micro_batches: int | TokenBudget = 1,
    top_k: int | None = None,
):
    """A jitted ``(params, seqs) -> [B, T]`` for old-policy, reference or teacher log-probs.

    No gradient flows into ``params``; ``temperature`` is the sampling temperature, so the
    log-probs are those of the distribution the tokens were drawn from. ``micro_batches``
    (as in ``train.step.make_step``) runs the rows in K strided groups, one after another.
    ``packing``: the batch's stacked plan (``train.packing.plan_micro_batches`` for these K
    micro-batches), or None (padded). ``top_k`` (a distillation teacher's): the function
    returns a ``logprobs.LogprobOutputs`` instead, the ``[B, T]`` log-probs with the ``k``
    most likely tokens' log-probs and ids ``[B, T, k]`` (f32 / int32) at each completion
    position, from the same chunked forward. ``routing``: a mixture-of-experts batch's
    recorded expert ids ``[B, P + T, L, k]`` (routing replay, ``LogprobOptions.routing``),
    split into the micro-batches with the rows; None: free routing.
    """

    mesh = None if param_shardings is None else jax.tree.leaves(param_shardings)[0].mesh
    devices = 1 if mesh is None else parallel.batch_shards(mesh)

    def fn(params, seqs: Sequences, packing=None, routing=None):
        with parallel.mesh_context(mesh):
            return _logprobs(params, seqs, packing, routing)

    def _logprobs(params, seqs: Sequences, packing, routing):
        params = jax.lax.stop_gradient(params)

        def one(rows, plan=None):
            part, part_routing = rows
            return sequence_logprobs(
                params,
                model_config,
                part,
                packing=plan,
                temperature=temperature,
                chunk_size=chunk_size,
                top_k=top_k,
                routing=part_routing,
            )

        k = packed_micro_batch_count(
            packing, micro_batches, micro_batch_count(micro_batches, seqs, devices)
        )
        if k == 1:
            return one((seqs, routing), None if packing is None else micro_plan(packing, 0))
        parts = split_micro_batches((seqs, routing), k)
        return merge_micro_batches(jax.lax.map(lambda xs: one(*xs), (parts, packing)))

    if param_shardings is None:
        return LogprobProgram(jax.jit(fn), takes_routing=True)
    jitted = jax.jit(fn, in_shardings=(param_shardings, None, None, None))
    return LogprobProgram(jitted, takes_routing=True)


class LogprobProgram:
    """A jitted ``(params, seqs, packing)`` (with ``takes_routing``: ``(params, seqs,
    packing, routing)``) called (and lowered) as ``(params, seqs)`` when the batch is padded
    and routes freely: ``jax.jit`` with ``in_shardings`` takes positional arguments only.

    Raises (when called):
      ValueError: a ``routing`` to replay given to a program that takes none.
    """

    def __init__(self, jitted, *, takes_routing: bool = False):
        self.jitted, self.takes_routing = jitted, takes_routing

    def _args(self, params, seqs, packing, routing) -> tuple:
        if self.takes_routing:
            return params, seqs, packing, routing
        if routing is not None:
            raise ValueError("this log-prob program does not replay a routing (routing=None)")
        return params, seqs, packing

    def __call__(self, params, seqs: Sequences, packing=None, routing=None):
        return self.jitted(*self._args(params, seqs, packing, routing))

    def lower(self, params, seqs: Sequences, packing=None, routing=None):
        return self.jitted.lower(*self._args(params, seqs, packing, routing))
