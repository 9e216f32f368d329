"""The RL trainer's rollout side: the sampler's parameters, one step's rollout, and the
asynchronous loop of ``rollout.max_staleness``.

With ``max_staleness = k >= 1`` the rollouts of the next ``k`` steps are generated on a
background thread while the trainer updates on the current one (one-step-off for k = 1, as
verl's ``one_step_off_policy`` and AReaL's bounded staleness): the rollout of step ``s + j``
starts at step ``s`` from a snapshot of the parameters then (version ``s``), so the batch a
step trains on is at most ``k`` updates old. The behaviour log-probs then differ from the
trainer's by the staleness as well as the numerics; the objective's ``rollout_correction``
(``jaxrl_llm.losses.correction``) corrects both. ``k = 0`` is the synchronous loop, unchanged.

With ``rollout.partial`` (partial rollouts, as AReaL's interruptible generation and slime's /
verl's partial rollouts) a rollout in flight does not finish on the weights it started with:
each step publishes the weights the trainer is about to train with (``WeightUpdates``), and
the continuous engine decodes every live request with them from its next burst on, tagging
each token with the version that sampled it (``Samples.versions``). The step's batch then
mixes versions ``step - k .. step``, the newest on-policy; the behaviour log-probs are the
sampler's, token by token, which is what the correction needs. When the swap lands depends on
wall-clock time (how far the rollout got while the update ran), so a partial-rollout run is
not bit-reproducible, and a resumed one differs from an uninterrupted one.
"""

from __future__ import annotations

import abc
import collections
import concurrent.futures
import contextlib
import logging
import pathlib
import pickle
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxrl_llm.sampling.requests import WeightUpdates
from jaxrl_llm.train.core import PhaseTimer
from jaxrl_llm.train.rl import rollout as rollout_lib
from jaxrl_llm.train.rl.spec import check_staleness  # noqa: F401 (re-exported: its old home)

log = logging.getLogger("jaxrl_llm")

# In the run directory: the rollouts in flight at each checkpoint, ``<step>-process<i>.pkl``.
IN_FLIGHT_DIR = "rollouts_in_flight"

Produce = Callable[[int, Any, PhaseTimer], tuple[rollout_lib.Samples, dict]]


class Pipeline(abc.ABC):
    """Where each step's samples come from, and what is in flight: the one interface of the
    inline loop (``k = 0``), the threaded one (:class:`RolloutPipeline`, ``k >= 1``) and a
    sampler on processes of its own (``remote.RemotePipeline``). A pipeline owns the staleness
    ``k``, the data position each draw started from (``draw_starts``), the rollouts in flight
    and their checkpoint (:meth:`save_in_flight`, :meth:`restore_in_flight`).

    Attributes:
      max_staleness: ``k``, the rollouts drawn ahead of the update.
      prompts: the run's ``data.PromptSampler`` (the data position a checkpoint saves).
      draw_starts: the prompts' position before each recent step's draws, by step (empty where
        another process draws: its batches carry their position).
    """

    max_staleness: int
    prompts: Any
    draw_starts: dict[int, Any]

    @abc.abstractmethod
    def next(self, step: int, snapshot: Callable[[], Any], timer: PhaseTimer) -> tuple:
        """``(samples, info)`` step ``step`` trains on; ``snapshot()`` gives the current
        weights in the sampler's layout (buffers the update does not donate)."""

    @abc.abstractmethod
    def drain_until_failure(self, finish: Callable[[Any, PhaseTimer], Any]) -> tuple:
        """The rollouts in flight, ``(step, samples, info, version, timer)`` each with its
        scoring finished by ``finish``, up to the first that failed: ``(items before it, (its
        step, its error) or None)``."""

    @abc.abstractmethod
    def preload(self, items) -> None:
        """Queues finished rollouts (a checkpoint's, on resume) in place of those in flight."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stops what is in flight (the run ends)."""

    @staticmethod
    def in_flight_file(directory: pathlib.Path, step: int) -> pathlib.Path:
        """This process's file of checkpoint ``step``'s rollouts in flight in ``directory``."""
        return directory / f"{step}-process{jax.process_index()}.pkl"

    def save_in_flight(
        self,
        step: int,
        directory: pathlib.Path,
        *,
        kept_steps: Any,
        finish: Callable[[Any, PhaseTimer], Any],
        max_steps: int,
    ) -> None:
        """Writes the rollouts in flight beside checkpoint ``step`` (waiting for them; their
        scoring finished by ``finish``) into ``directory``, and drops those of checkpoints no
        longer kept (``kept_steps``).

        Raises:
          Exception: a rollout's error, unless it is past the run's last step (``max_steps``).
        """
        if not self.max_staleness:
            return
        items, failure = self.drain_until_failure(finish)
        if failure is not None:
            failed, err = failure
            if step < max_steps:
                raise err
            # Rollouts past the run's end only serve a longer resumed run. The checkpoint keeps
            # those before the failed one, and the data position where the failed one started
            # drawing, so a longer run draws its prompts again. (A sampler process's batches
            # carry their position: the trainer's follows the last one received.)
            if failed in self.draw_starts:
                self.prompts.restore(self.draw_starts[failed])
            log.warning(
                "the rollout of step %d (past the last step) failed (%s): checkpoint %d keeps "
                "the %d before it; a longer resumed run draws its prompts again",
                failed,
                err,
                step,
                len(items),
            )
        path = self.in_flight_file(directory, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(items))
        tmp.replace(path)
        kept = set(kept_steps) | {step}
        for old in path.parent.glob("*.pkl"):
            if int(old.name.split("-")[0]) < min(kept):
                old.unlink(missing_ok=True)

    def restore_in_flight(self, step: int, directory: pathlib.Path) -> None:
        """Queues the rollouts checkpoint ``step`` had in flight (none: they start afresh)."""
        path = self.in_flight_file(directory, step)
        if self.max_staleness and path.exists():
            items = pickle.loads(path.read_bytes())
            for *_, timer in items:
                timer.spans.clear()  # the saving process's clock
            self.preload(items)


class RolloutPipeline(Pipeline):
    """Rollouts up to ``max_staleness`` steps ahead of the update, on one background thread.

    The rollout of step ``s + j`` starts during step ``s`` whatever ``trainer.max_steps`` is,
    so a run stopped and resumed with more steps samples what the longer run samples; a
    checkpoint saves the rollouts in flight (:meth:`drain`, :meth:`preload`), which makes the
    resume exact.

    Args:
      produce: ``(step, params, timer) -> (samples, info)``, the step's rollout from ``params``.
      max_staleness: ``k``; 0 runs each rollout inline.
      mesh: the trainer's mesh, set on the rollout thread too (``jax.set_mesh`` is per thread;
        a learned reward model scores under it).
      partial: partial rollouts: each step publishes its weights to the rollout in flight
        (``produce`` then takes ``updates=`` the ``WeightUpdates`` and ``version=`` its
        parameters' version).
      prompts: the run's ``data.PromptSampler``, whose position each draw starts from is
        noted (``draw_starts``).
    """

    def __init__(
        self,
        produce: Produce,
        max_staleness: int,
        mesh: Any = None,
        partial: bool = False,
        prompts: Any = None,
    ):
        self._produce = produce
        self.prompts = prompts
        self.draw_starts: dict[int, Any] = {}
        self.max_staleness = max_staleness
        self.mesh = mesh
        self.updates = WeightUpdates() if partial and max_staleness else None
        self.pending: collections.deque = collections.deque()
        self.executor = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout")
            if max_staleness
            else None
        )

    def produce(self, step: int, params: Any, timer: PhaseTimer, **partial: Any) -> tuple:
        """Step ``step``'s rollout (on the rollout thread, which runs the steps in order),
        noting the data position its draws start from: where a failed rollout past the run's
        end is drawn again."""
        if self.prompts is not None:
            starts = self.draw_starts
            self.draw_starts = {s: v for s, v in starts.items() if s >= step - self.max_staleness}
            self.draw_starts[step] = self.prompts.state()
        return self._produce(step, params, timer, **partial)

    def _run(self, step: int, params: Any, version: int):
        timer = PhaseTimer(lane="rollout")
        partial = {} if self.updates is None else {"updates": self.updates, "version": version}
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            samples, info = self.produce(step, params, timer, **partial)
        return samples, info, timer, version

    def next(
        self, step: int, snapshot: Callable[[], Any], timer: PhaseTimer
    ) -> tuple[rollout_lib.Samples, dict]:
        """The samples step ``step`` trains on, and their info (``rollout/staleness``).

        ``snapshot()`` returns the current parameters in the sampler's layout, in buffers the
        update does not donate.
        """
        if not self.max_staleness:
            samples, info = self.produce(step, snapshot(), timer)
            return samples, {**info, "rollout/staleness": 0.0}
        params = None
        if not self.pending:  # the first step of a run
            params = snapshot()
            self.pending.append((step, self.executor.submit(self._run, step, params, step)))
        first, future = self.pending.popleft()
        if first != step:
            raise RuntimeError(f"rollout pipeline out of order: step {step}, queued {first}")
        if self.updates is not None and params is None:  # the rollout in flight takes them
            params = snapshot()
            self.updates.publish(step, params)
        while len(self.pending) < self.max_staleness:
            nxt = step + 1 + len(self.pending)
            params = snapshot() if params is None else params  # the weights before step's update
            self.pending.append((nxt, self.executor.submit(self._run, nxt, params, step)))
        with timer.phase("wait_rollout"):  # the trainer's idle time
            samples, info, produced, version = future.result()
        timer.merge(produced)
        return samples, {**info, **staleness_info(samples, step, version)}

    def drain(self, finish: Callable[[Any, PhaseTimer], Any]) -> list[tuple]:
        """Waits for the rollouts in flight and returns ``(step, samples, info, version,
        timer)`` for each, their scoring finished by ``finish(samples, timer)``; they stay
        queued, done. Raises the first one's error."""
        items, failure = self.drain_until_failure(finish)
        if failure is not None:
            raise failure[1]
        return items

    def drain_until_failure(
        self, finish: Callable[[Any, PhaseTimer], Any]
    ) -> tuple[list[tuple], tuple[int, Exception] | None]:
        """:meth:`drain`, stopping at the first rollout that fails: ``(items before it,
        (its step, its error))``. After a failure the pipeline is closed (the rollout thread
        has stopped, so nothing draws prompts any more)."""
        items = []
        for step, future in self.pending:
            try:
                samples, info, timer, version = future.result()
                items.append((step, finish(samples, timer), info, version, timer))
            except Exception as err:
                self.close()
                return items, (step, err)
        self.preload(items)
        return items, None

    def preload(self, items) -> None:
        """Queues finished rollouts (a checkpoint's, on resume) in place of those in flight."""
        self.pending.clear()
        for step, samples, info, version, timer in items:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result((samples, info, timer, version))
            self.pending.append((step, done))

    def close(self) -> None:
        """Drops the rollouts queued or in flight and stops the thread (after the running
        one: a device program cannot be interrupted)."""
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)
            self.pending.clear()


def staleness_info(samples: Any, step: int, version: int) -> dict[str, float]:
    """``rollout/staleness``: how many updates old the batch's oldest token is; with partial
    rollouts (``Samples.versions``) also ``rollout/stale_token_frac`` (the share of tokens
    older than the weights the step trains) and ``rollout/token_staleness_mean``."""
    versions = getattr(samples, "versions", None)
    if versions is None:
        return {"rollout/staleness": float(step - version)}
    mask = samples.completion_mask
    lag = step - versions[mask]
    if not lag.size:  # no token: the draw's starting weights
        lag = np.asarray([step - version])
    return {
        "rollout/staleness": float(lag.max()),
        "rollout/stale_token_frac": float((lag > 0).mean()),
        "rollout/token_staleness_mean": float(lag.mean()),
    }
