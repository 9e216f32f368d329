"""The continuous engine's requests and results (``jaxrl_llm.sampling.engine``): what is asked
(``Request``), what comes back (``Result``, ``EngineStats``) and the box of weights published
while a run is in flight (``WeightUpdates``, partial rollouts)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxrl_llm import parallel

FINISH_REASONS = ("stop", "length")


class Request(NamedTuple):
    """One completion to sample.

    Attributes:
      prompt: the prompt's token ids (no padding), at least one.
      max_new_tokens: this request's budget (``None``: the engine's ``max_new_tokens``).
      prompt_key: requests with equal keys share one prefill (e.g. the prompt's index for its
        ``G`` samples), so they must have equal prompts (refused otherwise); ``None`` never
        shares.
    """

    prompt: Sequence[int]
    max_new_tokens: int | None = None
    prompt_key: Any = None

    def share_key(self, index: int) -> Any:
        """Requests with equal share keys share a prefill (and a paged cache's prompt blocks);
        ``index``: this request's position in its run."""
        return ("request", index) if self.prompt_key is None else ("key", self.prompt_key)


class Result(NamedTuple):
    """One request's completion.

    Attributes:
      tokens: ``[n]`` int32 sampled tokens, the EOS included when it stopped there.
      logprobs: ``[n]`` f32 log-probs of those tokens (temperature-scaled full distribution).
      finish_reason: ``"stop"`` (an EOS or a stop sequence) or ``"length"`` (its
        ``max_new_tokens``).
      versions: ``[n]`` int32, the version of the weights that sampled each token (``run``'s
        ``version``, then those of the weight updates taken in flight).
      routing: ``[p + n, L, k]`` int32 (``p`` the prompt's length) the experts each of the
        ``L`` mixture-of-experts layers chose for every token of ``[prompt ; tokens]`` (an
        engine with ``record_routing``), or None. ``batch_routing`` lays a run's out as
        ``generate``'s ``[B, P + T, L, k]``.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    finish_reason: str
    versions: np.ndarray | None = None
    routing: np.ndarray | None = None


class WeightUpdates:
    """The newest weights for runs in flight (partial rollouts): the trainer's thread
    ``publish``-es ``(version, params)`` after each update; an engine run polls ``newer`` between
    bursts. Thread-safe; only the newest is kept."""

    def __init__(self):
        self._lock = threading.Lock()
        self._latest: tuple[int, Any] | None = None

    def publish(self, version: int, params: Any) -> None:
        with self._lock:
            self._latest = (int(version), params)

    def newer(self, version: int) -> tuple[int, Any] | None:
        """``(version, params)`` of the newest weights when newer than ``version``, else None."""
        with self._lock:
            latest = self._latest
        return latest if latest is not None and latest[0] > version else None


class EngineStats(NamedTuple):
    """What a run did.

    ``slot_steps`` counts every slot of every decode step run (the program's slots per step:
    ``S``, fewer once the queue is empty and the engine has shrunk), so ``utilisation = tokens /
    slot_steps`` is the share of decode work that produced a token. ``shrinks`` counts those
    halvings.
    ``preemptions`` and ``peak_blocks``: a paged cache's requests preempted (recomputed) and
    most blocks in use at once. ``prefill_rows``: prompts prefilled; ``reused_prompts``:
    requests admitted from a prompt a live slot held, without a prefill
    (``sampling.admission``).
    ``resizes``: the contiguous cache cut or padded to another width (``Engine``'s cache
    width).
    ``seconds`` is the run's wall time (compilation included the first time a shape is seen).
    """

    requests: int
    tokens: int
    decode_steps: int
    slot_steps: int
    bursts: int
    admissions: int
    prefill_rows: int
    shrinks: int
    seconds: float
    updates: int = 0
    preemptions: int = 0
    peak_blocks: int = 0
    reused_prompts: int = 0
    resizes: int = 0

    @property
    def utilisation(self) -> float:
        return self.tokens / self.slot_steps if self.slot_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def finish_reason(tokens: np.ndarray, eos: set, stop_sequences: Sequence[tuple]) -> str:
    """``"stop"`` when a completion ends with an EOS id or one of ``stop_sequences``, else
    ``"length"``."""
    n = len(tokens)
    stopped = n and int(tokens[-1]) in eos
    stopped = stopped or any(
        n >= len(s) and tuple(tokens[n - len(s) :].tolist()) == s for s in stop_sequences
    )
    return "stop" if stopped else "length"


def harvest(
    state: Any,
    occupant: list[int | None],
    results: list[Result | None],
    marks: list[list[tuple[int, int]]],
    eos: set,
    stop_sequences: Sequence[tuple],
    prompt_lengths: Sequence[int] | None = None,
) -> tuple[int, np.ndarray]:
    """Moves an engine's finished slots' completions (``state``: its ``EngineState``) to
    ``results`` (each token's weight version from the slot's ``marks``) and empties their
    ``occupant`` entries; returns how many, and the host copy of every slot's count.

    With ``state.routing`` (``[S, P + T, L, k]``, the prompt ending at column ``P - 1``), a
    result's ``routing`` is its slot's columns ``[P - p, P + n)`` as int32, ``p =
    prompt_lengths[request]``."""
    done, all_counts = (np.array(parallel.fetch(x)) for x in (state.done, state.count))
    ready = [s for s, r in enumerate(occupant) if r is not None and done[s]]
    if not ready:
        return 0, all_counts
    index = np.asarray(ready, np.int32)
    count = all_counts[ready]
    tokens, logprobs = (parallel.fetch(x) for x in _rows(state.tokens, state.logprobs, index))
    routing = None
    if getattr(state, "routing", None) is not None:
        if prompt_lengths is None:
            raise ValueError("harvesting a routing buffer needs prompt_lengths")
        routing = np.asarray(parallel.fetch(_routing_rows(state.routing, index)))
        prompt_width = routing.shape[1] - state.tokens.shape[1]
    for i, s in enumerate(ready):
        n = int(count[i])
        row = tokens[i, :n]
        versions = np.zeros(n, np.int32)
        for start, version in marks[s]:
            versions[start:] = version
        reason = finish_reason(row, eos, stop_sequences)
        ids = None
        if routing is not None:
            start = prompt_width - int(prompt_lengths[occupant[s]])
            ids = routing[i, start : prompt_width + n].astype(np.int32)
        results[occupant[s]] = Result(row, logprobs[i, :n], reason, versions, ids)
        occupant[s] = None
    return len(ready), all_counts


@jax.jit
def _rows(tokens: jax.Array, logprobs: jax.Array, index: jax.Array) -> tuple[jax.Array, jax.Array]:
    return tokens[index], logprobs[index]


@jax.jit
def _routing_rows(routing: jax.Array, index: jax.Array) -> jax.Array:
    return routing[index]


def batch_routing(results: Sequence[Result], prompt_width: int, max_new_tokens: int) -> np.ndarray:
    """The results' routing as one ``[B, P + T, L, k]`` int32 array aligned with
    ``types.join_sequences`` of their prompts left-padded to ``P = prompt_width`` and their
    tokens right-padded to ``T = max_new_tokens`` (``generate(..., record_routing=True)``'s
    layout): row ``b``'s prompt ids at columns ``[P - p_b, P)``, its completion's at ``[P, P +
    n_b)``, -1 (``NO_EXPERT``) elsewhere. ``jnp.moveaxis(out, 2, 0)`` is what
    ``models.forward(..., routing=)`` replays.

    Raises:
      ValueError: a result without routing (an engine run without ``record_routing``), or a
        prompt or completion longer than ``prompt_width`` or ``max_new_tokens``.
    """
    if not results:
        raise ValueError("batch_routing needs at least one result")
    if any(r.routing is None for r in results):
        raise ValueError("a result has no routing: run the engine with record_routing=True")
    layers_k = results[0].routing.shape[1:]
    out = np.full((len(results), prompt_width + max_new_tokens, *layers_k), -1, np.int32)
    for b, result in enumerate(results):
        n = len(result.tokens)
        p = result.routing.shape[0] - n
        if p > prompt_width or n > max_new_tokens:
            raise ValueError(
                f"result {b}: a prompt of {p} and {n} tokens do not fit prompt_width="
                f"{prompt_width} and max_new_tokens={max_new_tokens}"
            )
        out[b, prompt_width - p : prompt_width + n] = result.routing
    return out


def check_requests(requests: Sequence[Request], max_new_tokens: int) -> list[Request]:
    """The requests as ``Request``s of int32 prompts and int budgets; bad ones refused, and
    so are two requests with one ``prompt_key`` but different prompts (the engine would give
    the second the first's keys, values and first-token logits)."""
    checked, first = [], {}
    for i, req in enumerate(requests):
        if not isinstance(req, Request):
            req = Request(*req) if isinstance(req, tuple) else Request(req)
        prompt = np.asarray(req.prompt)
        if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
            raise ValueError(
                f"request {i}: the prompt must be a non-empty 1-D sequence of token ids, got "
                f"shape {prompt.shape} dtype {prompt.dtype}"
            )
        budget = max_new_tokens if req.max_new_tokens is None else req.max_new_tokens
        if not isinstance(budget, int | np.integer) or not 1 <= budget <= max_new_tokens:
            raise ValueError(
                f"request {i}: max_new_tokens must be an int in [1, {max_new_tokens}] (the "
                f"engine's max_new_tokens), got {req.max_new_tokens!r}"
            )
        if req.prompt_key is not None:
            j = first.setdefault(req.prompt_key, i)
            if j != i and not np.array_equal(prompt, checked[j].prompt):
                raise ValueError(
                    f"requests {j} and {i} share prompt_key {req.prompt_key!r} but their prompts "
                    "differ: equal keys must mean equal prompts (they share one prefill)"
                )
        checked.append(Request(prompt.astype(np.int32), int(budget), req.prompt_key))
    return checked


__all__ = [
    "FINISH_REASONS",
    "batch_routing",
    "EngineStats",
    "Request",
    "Result",
    "WeightUpdates",
    "check_requests",
    "finish_reason",
    "harvest",
]
