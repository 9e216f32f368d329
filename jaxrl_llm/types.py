"""NamedTuple containers passed between the layers.

All containers are pytrees (NamedTuples), so they cross `jax.jit` boundaries as is.
Optional fields default to `None`, which JAX treats as an empty subtree.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm._checks import check_rank, check_same_shape

Array = jax.Array


class Sequences(NamedTuple):
    """The token quadruple a model scores: prompts and their completions.

    What every forward pass of the trainers takes (log-prob recompute, values, reward-model
    scores, SFT); the loss inputs travel separately, so no placeholder arrays are ever built.

    Attributes:
      prompt_tokens: ``[B, P]`` int32, left-padded.
      prompt_mask: ``[B, P]`` bool.
      completion_tokens: ``[B, T]`` int32, right-padded.
      completion_mask: ``[B, T]`` bool, 1 on generated tokens up to and including EOS.
    """

    prompt_tokens: Array
    prompt_mask: Array
    completion_tokens: Array
    completion_mask: Array


class RolloutBatch(NamedTuple):
    """One batch of sampled completions and everything the policy loss needs.

    Rows are prompts x group size; groups are contiguous (rows ``g*G ... g*G+G-1``).

    Attributes:
      completion_mask: ``[B, T]`` bool/f32, 1 on generated tokens up to and including EOS.
      old_logprobs: ``[B, T]`` log-probs of the behaviour policy (no gradient).
      advantages: ``[B]`` or ``[B, T]`` f32.
      ref_logprobs: ``[B, T]`` log-probs of the reference policy, when a KL term needs them.
      prompt_tokens: ``[B, P]`` int32, left-padded.
      prompt_mask: ``[B, P]``.
      completion_tokens: ``[B, T]`` int32, right-padded.
      rewards: ``[B]`` scalar reward per completion.
      old_values: ``[B, T]`` critic values at rollout time (PPO).
      returns: ``[B, T]`` value targets (PPO).
      num_tokens: scalar, valid tokens of the *whole* batch (global normaliser for micro-batches).
      num_seqs: scalar, non-empty rows of the *whole* batch (global normaliser for micro-batches).
      rollout_logprobs: ``[B, T]`` the sampler's own log-probs of the completion tokens, when
        the step should report how far they are from the trainer's (``rollout/*`` metrics).
      attention_mask: ``[B, T]`` the completion tokens the model attends to, when more than
        the trained ones (multi-turn: environment tokens are context with loss mask 0, in
        ``completion_mask``); None = ``completion_mask``.
      is_weights: ``[B, T]`` rollout-correction importance weights multiplying the per-token
        surrogate loss (``jaxrl_llm.losses.correction``; no gradient), when computed for the whole
        batch before the update.
      packing: a ``jaxrl_llm.packing.PackingPlan`` of the rows (the forward runs packed), or
        None (padded). A step's batch carries one plan a micro-batch (leading axis ``K``).
      teacher_top_logprobs: ``[B, T, k]`` f32, a distillation teacher's log-probs of its ``k``
        most likely tokens at each completion position (GKD's JSD loss:
        ``Objective.distill_loss``); 0 on padding.
      teacher_top_ids: ``[B, T, k]`` int32, those tokens' ids (where the update gathers the
        student's log-probs); 0 on padding.
      routing: ``[B, P + T, L, k]`` int32, the expert ids the sampler routed each token of
        ``[prompt ; completion]`` to in each MoE layer (-1 on padding), when recorded
        (``model.routing_replay``); the update replays them or measures its mismatch.
    """

    completion_mask: Array
    old_logprobs: Array
    advantages: Array
    ref_logprobs: Array | None = None
    prompt_tokens: Array | None = None
    prompt_mask: Array | None = None
    completion_tokens: Array | None = None
    rewards: Array | None = None
    old_values: Array | None = None
    returns: Array | None = None
    num_tokens: Array | None = None
    num_seqs: Array | None = None
    rollout_logprobs: Array | None = None
    attention_mask: Array | None = None
    is_weights: Array | None = None
    packing: Any = None
    teacher_top_logprobs: Array | None = None
    teacher_top_ids: Array | None = None
    routing: Array | None = None


class MaskedSequences(NamedTuple):
    """``Sequences`` whose trained tokens are a subset of the attended ones: a multi-turn
    episode's environment tokens are context, not targets (the SFT warm-up's demonstrations).

    Attributes:
      prompt_tokens, prompt_mask, completion_tokens: as in ``Sequences``.
      completion_mask: ``[B, T]`` bool, the tokens trained on (the loss mask).
      attention_mask: ``[B, T]`` bool, the completion tokens attended (``>= completion_mask``).
    """

    prompt_tokens: Array
    prompt_mask: Array
    completion_tokens: Array
    completion_mask: Array
    attention_mask: Array


class PreferenceBatch(NamedTuple):
    """Pairs of completions for offline preference training.

    Attributes:
      prompt_tokens: ``[N, P]`` int32, left-padded.
      prompt_mask: ``[N, P]``.
      chosen_tokens: ``[N, T]`` int32, right-padded preferred completions.
      chosen_mask: ``[N, T]``.
      rejected_tokens: ``[N, T]`` int32, right-padded dispreferred completions.
      rejected_mask: ``[N, T]``.
      ref_chosen_logps: ``[N]`` summed reference log-probs of the chosen completions.
      ref_rejected_logps: ``[N]`` summed reference log-probs of the rejected completions.
    """

    prompt_tokens: Array
    prompt_mask: Array
    chosen_tokens: Array
    chosen_mask: Array
    rejected_tokens: Array
    rejected_mask: Array
    ref_chosen_logps: Array | None = None
    ref_rejected_logps: Array | None = None


class LossOutput(NamedTuple):
    """A scalar loss and a flat dict of scalar metrics (both f32)."""

    loss: Array
    metrics: dict[str, Any]


class Completion(NamedTuple):
    """What the sampler returns.

    Attributes:
      tokens: ``[B, T]`` int32, right-padded with ``pad_id`` after EOS.
      logprobs: ``[B, T]`` f32 log-prob of each sampled token under the
        temperature-scaled distribution; 0 on padding.
      mask: ``[B, T]`` bool, 1 on generated tokens up to and including EOS.
    """

    tokens: Array
    logprobs: Array
    mask: Array


def sequences_of(batch: Any) -> Sequences:
    """The ``Sequences`` of any batch that carries the four token fields; the completion mask
    is the batch's ``attention_mask`` when it has one (the tokens the model sees)."""
    attention = getattr(batch, "attention_mask", None)
    return Sequences(
        batch.prompt_tokens,
        batch.prompt_mask,
        batch.completion_tokens,
        batch.completion_mask if attention is None else attention,
    )


def join_sequences(
    prompt_tokens: Array, prompt_mask: Array, completion_tokens: Array, completion_mask: Array
) -> tuple[Array, Array]:
    """``([prompt ; completion] int32, [prompt_mask ; completion_mask] bool)``, ``[B, P + T]``:
    the rows every forward of a ``Sequences`` runs over, after the shape checks.

    Raises:
      ValueError: tokens and masks of different shapes, ranks other than 2, an empty prompt
        axis or prompts and completions of different batch sizes (naming the shapes).
    """
    check_rank("prompt_tokens", prompt_tokens, 2)
    check_rank("completion_tokens", completion_tokens, 2)
    check_same_shape(prompt_tokens=prompt_tokens, prompt_mask=prompt_mask)
    check_same_shape(completion_tokens=completion_tokens, completion_mask=completion_mask)
    if prompt_tokens.shape[1] < 1 or prompt_tokens.shape[0] != completion_tokens.shape[0]:
        raise ValueError(
            f"prompt_tokens {tuple(prompt_tokens.shape)} must be [B, P] with P >= 1 and the "
            f"batch of completion_tokens {tuple(completion_tokens.shape)}"
        )
    tokens = jnp.concatenate([prompt_tokens, completion_tokens], axis=1).astype(jnp.int32)
    mask = jnp.concatenate([prompt_mask.astype(bool), completion_mask.astype(bool)], axis=1)
    return tokens, mask
