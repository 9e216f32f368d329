"""The sampler's state: the decode loop's carry, its traced hyper-parameters, their sharding.

``SamplingState`` is what the prefill returns and the ``lax.while_loop`` decode carries;
``SamplingParams`` the hyper-parameters traced into both programs (changing them does not
recompile), ``SamplingOptions`` the same as a sampler's caller gives them (with the static
``top_k``); ``constrain_state`` pins the state to the sampling rules of ``jaxrl_llm.parallel``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import parallel
from jaxrl_llm.models import CACHE_AXES, KVCache
from jaxrl_llm.sampling import strategies

Array = jax.Array

_MIN_EOS_SLOTS = 4


class SamplingState(NamedTuple):
    """The decode loop's carry (B = prompts x num_samples, T = max_new_tokens, S = P + T).

    Attributes:
      step: ``[]`` int32, completion columns filled so far; column ``step`` is sampled next.
      tokens: ``[B, T]`` int32, sampled tokens; ``pad_id`` after a row's EOS and beyond ``step``.
      logprobs: ``[B, T]`` f32, ``log_softmax(logits / T_eff)`` of each sampled token; 0 on padding.
      mask: ``[B, T]`` bool, True on generated tokens up to and including the EOS.
      done: ``[B]`` bool, the row has emitted an EOS.
      positions: ``[B]`` int32, RoPE position of column ``step``'s token (prompt length + step).
      logits: ``[B, V]`` f32, next-token logits for column ``step``.
      cache: ``KVCache`` with k, v ``[L, B, K, S, H]`` and mask ``[B, S]``; slots ``[0, P)`` hold
        the prompt, slot ``P + t`` the token of column ``t`` once it has been fed.
      routing: ``[B, S, L, k]`` (int8 / int16 / int32: ``generate.routing_dtype``), the
        experts each mixture-of-experts layer chose for the token in slot ``s`` (routing
        replay, ``models.forward(..., routing=)``; ``L`` the MoE layers in stack order), -1 on
        padding and on slots not fed yet; None when not recorded.
    """

    step: Array
    tokens: Array
    logprobs: Array
    mask: Array
    done: Array
    positions: Array
    logits: Array
    cache: KVCache
    routing: Array | None = None


class SamplingParams(NamedTuple):
    """Traced sampling hyper-parameters: changing any of them reuses the compiled programs.

    Attributes:
      temperature: ``[]`` f32, ``<= 0`` means greedy.
      top_p: ``[]`` f32 in ``(0, 1]``.
      min_p: ``[]`` f32 in ``[0, 1]``.
      eos_ids: ``[E]`` int32, tokens that end a row, padded with -1 (which never matches).
      pad_id: ``[]`` int32, written after a row's EOS.
    """

    temperature: Array
    top_p: Array
    min_p: Array
    eos_ids: Array
    pad_id: Array


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """How a sampler draws each token and ends a row, as its caller gives it (``generate``,
    ``engine.Engine``).

    Attributes:
      eos_ids: one id or several; the EOS token is kept (mask 1); an empty tuple never stops.
      pad_id: written (mask 0, log-prob 0) after a row's EOS.
      temperature: ``>= 0`` (0 = greedy), traced.
      top_k: static int, 0 = off.
      top_p: ``(0, 1]``, traced. min_p: ``[0, 1]``, traced (truncation order and semantics:
        ``strategies.truncate_logits``).
    """

    eos_ids: int | Sequence[int] | Array
    pad_id: int
    temperature: float | Array = 1.0
    top_k: int = 0
    top_p: float | Array = 1.0
    min_p: float | Array = 0.0

    def traced(self) -> SamplingParams:
        """The traced hyper-parameters (``sampling_params``: validated; ``top_k`` stays
        static)."""
        return sampling_params(
            temperature=self.temperature,
            top_p=self.top_p,
            min_p=self.min_p,
            eos_ids=self.eos_ids,
            pad_id=self.pad_id,
        )


def state_logical_axes(state: SamplingState) -> SamplingState:
    """Logical axes of every state leaf, for the sampling rule table of ``jaxrl_llm.parallel``."""
    cache_axes = CACHE_AXES
    if isinstance(state.cache.k, tuple):  # unstacked: each layer's array drops the layers axis
        layers = len(state.cache.k)
        cache_axes = CACHE_AXES._replace(
            k=(CACHE_AXES.k[1:],) * layers, v=(CACHE_AXES.v[1:],) * layers
        )
    return SamplingState(
        step=(),
        tokens=("batch", None),
        logprobs=("batch", None),
        mask=("batch", None),
        done=("batch",),
        positions=("batch",),
        logits=("batch", "vocab"),
        cache=cache_axes,
        routing=None if state.routing is None else ("batch", None, None, None),
    )


def constrain_state(state: SamplingState, mesh: Any) -> SamplingState:
    """Pins the state to the sampling rules' sharding (rows over data+fsdp, kv-heads over tensor).

    The parallel layer is imported lazily so that single-device sampling does not depend on it.
    A batch or head count that does not divide its mesh axes raises there, naming the leaf.
    """
    if mesh is None:
        return state
    from jaxrl_llm.parallel import SAMPLING_RULES, logical_to_sharding

    axes = state_logical_axes(state)
    shardings = logical_to_sharding(axes, mesh, SAMPLING_RULES, shapes=state)
    explicit = jax.sharding.AxisType.Explicit in tuple(mesh.axis_types)
    constrain = jax.sharding.reshard if explicit else jax.lax.with_sharding_constraint
    return jax.tree.map(constrain, state, shardings)


def replicate(tree: Any, mesh: Any) -> Any:
    """``tree``'s arrays replicated on ``mesh`` (unchanged without a mesh).

    Small host-made inputs (the PRNG key, ``SamplingParams``) may carry another mesh's
    sharding, e.g. the trainer's when the sampler runs on its serving layout
    (``jaxrl_llm.sampling.serving``); a jitted program needs all its inputs on one mesh. A
    mesh may span processes (``parallel.replicate``).
    """
    return parallel.replicate(tree, mesh)


def grow_cache(cache: KVCache, num_samples: int, extra_slots: int) -> KVCache:
    """Repeats each row ``num_samples`` times (groups contiguous) and appends empty slots."""

    def grow(x: Array, batch_axis: int, seq_axis: int) -> Array:
        widths = [(0, 0)] * x.ndim
        widths[seq_axis] = (0, extra_slots)
        return jnp.pad(jnp.repeat(x, num_samples, axis=batch_axis), widths)

    return cache._replace(k=grow(cache.k, 1, 3), v=grow(cache.v, 1, 3), mask=grow(cache.mask, 0, 1))


def sampling_params(
    *,
    temperature: float | Array = 1.0,
    top_p: float | Array = 1.0,
    min_p: float | Array = 0.0,
    eos_ids: int | Sequence[int] | Array,
    pad_id: int | Array,
) -> SamplingParams:
    """Validates the traced hyper-parameters and packs them as f32/int32 device scalars."""
    strategies.check_sampling_args(
        temperature=temperature, top_k=0, top_p=top_p, min_p=min_p, vocab_size=1
    )
    eos = np.atleast_1d(np.asarray(eos_ids if eos_ids is not None else (), np.int64))
    if eos.ndim != 1 or not np.issubdtype(eos.dtype, np.integer):
        raise ValueError(f"eos_ids must be an int or a 1-D sequence of ints, got {eos_ids!r}")
    if (eos < 0).any():
        raise ValueError(f"eos_ids must be non-negative token ids, got {eos.tolist()}")
    # Padded with -1 (never sampled) to a power of two >= 4, so the number of EOS ids does not
    # change the compiled programs' input shapes.
    slots = max(_MIN_EOS_SLOTS, 1 << max(len(eos) - 1, 0).bit_length())
    eos = np.concatenate([eos, np.full(slots - len(eos), -1)])
    if jnp.ndim(pad_id) != 0:
        raise ValueError(f"pad_id must be a scalar int, got {pad_id!r}")
    return SamplingParams(
        temperature=jnp.asarray(temperature, jnp.float32),
        top_p=jnp.asarray(top_p, jnp.float32),
        min_p=jnp.asarray(min_p, jnp.float32),
        eos_ids=jnp.asarray(eos, jnp.int32),
        pad_id=jnp.asarray(pad_id, jnp.int32),
    )
