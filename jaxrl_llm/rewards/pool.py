"""Scoring in a process pool, so slow verifiers (math-verify, code execution) run in parallel
and, through ``submit``, alongside the next rollout.

``ScoringPool(reward_fn, workers)`` sends the reward function to each worker once (it must be
picklable: a registered reward, a module-level function or a ``combine_rewards`` of those) and
scores batches in chunks of consecutive rows. Workers are started with ``spawn`` (``fork`` is
unsafe in a multi-threaded JAX process), lazily, on the first batch: each imports the reward's
module afresh. Results come back in input order, equal to ``compute_rewards`` in the parent;
``workers=0`` scores in the calling process. A failing reward raises the same ``RewardError``
as ``compute_rewards`` (naming the reward, the batch row and the completion), a worker that
dies raises one naming the rows it held; the pool then starts fresh workers on the next batch.

Overlap: ``future = pool.submit(inputs)`` returns at once; sample the next batch, then
``future.result()``. The scoring uses other CPU cores, so it overlaps host-side work and
device work; with ``workers=0`` the future is already done when ``submit`` returns.
"""

from __future__ import annotations

import concurrent.futures
import math
import multiprocessing
import pickle
import threading
from collections.abc import Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np

from jaxrl_llm.rewards.base import RewardError, RewardFn, RewardInput
from jaxrl_llm.rewards.combine import CombinedReward, call_reward, reward_name

_CHUNKS_PER_WORKER = 4  # per batch: few enough calls to amortise, enough to balance load

_WORKER_FN: Any = None  # the reward function, in a worker process


def _init_worker(payload: bytes) -> None:
    global _WORKER_FN
    _WORKER_FN = pickle.loads(payload)


def score_rows(
    reward_fn: RewardFn, inputs: Sequence[RewardInput], start: int = 0
) -> tuple[list[float], dict[str, list[float]]]:
    """Totals and per-component values of ``inputs`` (rows ``start, start + 1, ...``).

    The per-row work of ``compute_rewards``, with row numbers offset by ``start`` so errors
    name the row of the whole batch.

    Raises:
      RewardError: if a reward function fails (see ``call_reward``).
    """
    if isinstance(reward_fn, CombinedReward):
        rows = [reward_fn.components(inp, row=start + i) for i, inp in enumerate(inputs)]
        totals = [reward_fn.total(values) for values in rows]
        names = [t.name for t in reward_fn.terms]
    else:
        name = reward_name(reward_fn)
        totals = [
            call_reward(reward_fn, inp, name=name, row=start + i) for i, inp in enumerate(inputs)
        ]
        rows, names = [{name: value} for value in totals], [name]
    return totals, {n: [values[n] for values in rows] for n in names}


def _score_chunk(
    start: int, inputs: Sequence[RewardInput]
) -> tuple[list[float], dict[str, list[float]]]:
    return score_rows(_WORKER_FN, inputs, start)


def _assemble(
    parts: list[tuple[list[float], dict[str, list[float]]]], names: list[str]
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    totals = [value for part_totals, _ in parts for value in part_totals]
    components = {n: np.array([v for _, part in parts for v in part[n]], np.float32) for n in names}
    return np.array(totals, np.float64).astype(np.float32), components


def _pickled(reward_fn: RewardFn) -> bytes:
    """``pickle.dumps(reward_fn)``, or a ``ValueError`` naming the reward (term) that fails."""
    try:
        return pickle.dumps(reward_fn)
    except Exception as err:  # noqa: BLE001  (PicklingError, TypeError, AttributeError, ...)
        culprit = reward_name(reward_fn)
        terms = reward_fn.terms if isinstance(reward_fn, CombinedReward) else ()
        for term in terms:
            try:
                pickle.dumps(term.fn)
            except Exception:  # noqa: BLE001
                culprit = term.name
                break
        raise ValueError(
            f"reward {culprit!r} cannot be sent to scoring workers ({type(err).__name__}: "
            f"{err}); use a registered reward, a module-level function or a combine_rewards "
            f"of those, or workers=0"
        ) from err


class ScoringPool:
    """Scores ``RewardInput`` batches with ``reward_fn`` in ``workers`` processes.

    Args:
      reward_fn: the reward (e.g. ``rewards.combine_rewards(...)`` of registered rewards).
      workers: worker processes; 0 scores in the calling process.
      chunk_size: rows per task sent to a worker; default ``ceil(B / (4 · workers))``.

    Raises:
      ValueError: on a negative ``workers``, a non-positive ``chunk_size``, or (with workers)
        a reward function that cannot be pickled, naming it.
    """

    def __init__(self, reward_fn: RewardFn, workers: int, *, chunk_size: int | None = None):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"ScoringPool workers must be an int >= 0, got {workers!r}")
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(f"ScoringPool chunk_size must be a positive int, got {chunk_size!r}")
        self.reward_fn, self.workers, self.chunk_size = reward_fn, workers, chunk_size
        if isinstance(reward_fn, CombinedReward):
            self._names = [t.name for t in reward_fn.terms]
        else:
            self._names = [reward_name(reward_fn)]
        self._payload = _pickled(reward_fn) if workers else b""
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    def _pool(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError("ScoringPool is closed")
            if self._executor is None:
                self._executor = concurrent.futures.ProcessPoolExecutor(
                    max_workers=self.workers,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_init_worker,
                    initargs=(self._payload,),
                )
            return self._executor

    def _discard(self, executor: concurrent.futures.ProcessPoolExecutor) -> None:
        """Forgets a broken executor (it stops its own workers); the next batch starts fresh."""
        with self._lock:
            if self._executor is executor:
                self._executor = None

    def _check(self, inputs: Sequence[RewardInput]) -> list[RewardInput]:
        inputs = list(inputs)
        for row, inp in enumerate(inputs):
            if not isinstance(inp, RewardInput):
                raise ValueError(f"inputs[{row}] must be a RewardInput, got {type(inp).__name__}")
        return inputs

    def submit_score(self, inputs: Sequence[RewardInput]) -> concurrent.futures.Future:
        """Starts scoring ``inputs``; the future gives ``compute_rewards``' ``(rewards,
        components)``: ``[B]`` float32 totals and each term's ``[B]`` float32 values.

        Raises:
          ValueError: if an input is not a ``RewardInput`` (at once, not in the future).
          RuntimeError: if the pool is closed.
        """
        inputs = self._check(inputs)
        result: concurrent.futures.Future = concurrent.futures.Future()
        if self.workers == 0 or not inputs:
            if self._closed:
                raise RuntimeError("ScoringPool is closed")
            try:
                result.set_result(_assemble([score_rows(self.reward_fn, inputs)], self._names))
            except RewardError as err:
                result.set_exception(err)
            return result
        size = self.chunk_size or math.ceil(len(inputs) / (_CHUNKS_PER_WORKER * self.workers))
        starts = list(range(0, len(inputs), size))
        for attempt in range(2):  # an executor that broke since the last batch: start afresh
            executor = self._pool()
            try:
                parts = [executor.submit(_score_chunk, s, inputs[s : s + size]) for s in starts]
                break
            except BrokenProcessPool:
                self._discard(executor)
                if attempt:
                    raise
        pending = [len(parts)]
        lock = threading.Lock()

        def on_done(_: concurrent.futures.Future) -> None:
            with lock:
                pending[0] -= 1
                if pending[0]:
                    return
            self._finish(result, parts, starts, size, inputs, executor)

        for part in parts:
            part.add_done_callback(on_done)
        return result

    def _finish(self, result, parts, starts, size, inputs, executor) -> None:
        """Sets ``result`` from the chunk futures: the first failure in row order, else the
        assembled arrays. Runs in a done-callback, so it must always settle ``result``."""
        try:
            for part, start in zip(parts, starts):
                err = RuntimeError("cancelled") if part.cancelled() else part.exception()
                if err is None:
                    continue
                if isinstance(err, BrokenProcessPool):
                    self._discard(executor)
                    end = min(start + size, len(inputs)) - 1
                    err = RewardError(
                        f"reward {', '.join(map(repr, self._names))}: a scoring worker process "
                        f"died ({err}) with rows {start}..{end} among those unscored; "
                        f"row {start}:\n  completion: {inputs[start].completion[:500]!r}"
                    )
                elif not isinstance(err, RewardError):
                    err = RewardError(f"scoring rows {start}.. failed: {type(err).__name__}: {err}")
                result.set_exception(err)
                return
            result.set_result(_assemble([part.result() for part in parts], self._names))
        except BaseException as err:  # noqa: BLE001  (never leave the caller waiting)
            if not result.done():
                result.set_exception(err)

    def submit(self, inputs: Sequence[RewardInput]) -> concurrent.futures.Future:
        """Starts scoring ``inputs``; the future gives ``map``'s ``[B]`` float32 rewards."""
        scored = self.submit_score(inputs)
        result: concurrent.futures.Future = concurrent.futures.Future()

        def forward(done: concurrent.futures.Future) -> None:
            err = done.exception()
            if err is None:
                result.set_result(done.result()[0])
            else:
                result.set_exception(err)

        scored.add_done_callback(forward)
        return result

    def score(self, inputs: Sequence[RewardInput]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """``compute_rewards(reward_fn, inputs)``, computed by the workers.

        Raises:
          ValueError: if an input is not a ``RewardInput``.
          RewardError: if a reward function fails or a worker dies.
        """
        return self.submit_score(inputs).result()

    def map(self, inputs: Sequence[RewardInput]) -> np.ndarray:
        """The ``[B]`` float32 rewards of ``inputs``, in input order (see ``score``)."""
        return self.submit(inputs).result()

    def close(self) -> None:
        """Stops the workers (waiting for running chunks; queued ones are cancelled)."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
