"""The run core both wings stand on: run directory, resume guard, loop skeleton, outputs.

:class:`Trainer` owns what every job does the same way: it refuses a run directory that already
holds checkpoints unless ``resume=true`` (and then a config that changed in a way that breaks
exact resumption unless ``resume_force=true``), writes ``config.yaml`` only once every check has
passed, runs the step loop with evaluation, ``metrics.jsonl`` rows, per-phase timings, the
progress bar, orbax checkpoints and, with ``logging.wandb``, a W&B run, and ends with
``summary.json``, ``plots/*.png`` and a Hugging Face checkpoint of the final policy in ``hf/``
(with the prompt format it was trained with, ``hf/prompt_format.json``). A wing
(``train.rl``, ``train.preference``) supplies the state, one step, the evaluation and what to
export.

Interruption: SIGINT (Ctrl-C) or SIGTERM while a single-process run trains lets the current
step finish, checkpoints it and raises :class:`Interrupted` (``jaxrl-llm train`` says where
and how to resume in one line, and exits ``128 + signal``); a second signal stops at once. A
wing whose setup trains before step 1 (the RL job's SFT warm-up) records the steps it ran in
``extra[WARMUP_KEY]``, and a fresh run then checkpoints step 0, so a resumed run never redoes
the warm-up; the warm-up itself stops on a signal with nothing saved.

Faults: a step whose loss or gradient norm is not finite (:func:`diverged_metrics`) raises
:class:`Diverged` before anything of it is saved or logged; any exception out of the steps
first lets the checkpoint being written commit (so the run can resume from it), except where
another process of the job is gone (``parallel.distributed.lost_process``: that commit would
wait for it forever). :func:`disk_full` tells a full disk from other errors.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import pathlib
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import jax

from jaxrl_llm import parallel
from jaxrl_llm.data.encoding import PromptFormat, write_prompt_format
from jaxrl_llm.parallel.distributed import lost_process
from jaxrl_llm.train import plots, timeline
from jaxrl_llm.train.checkpoint import Checkpointer
from jaxrl_llm.train.config_io import load_config, save_config, to_dict
from jaxrl_llm.train.metrics import MetricsWriter, ProgressBar
from jaxrl_llm.train.wandb_logger import require_wandb

log = logging.getLogger("jaxrl_llm")

# Keys a resumed run may change without breaking its equality with an uninterrupted run.
RESUME_SAFE_KEYS = (
    "resume",
    "resume_force",
    "run_dir",  # a run directory moved (or mounted elsewhere) resumes the same run
    "trainer.max_steps",
    "trainer.eval_every",
    "checkpoint.every_steps",
    "checkpoint.keep",
    "checkpoint.async_save",
    "logging.",
)
# How a run was started, not what it computes: never a change worth a note.
RESUME_FLAGS = ("resume", "resume_force")

#: ``extra`` key under which a wing records the steps its setup trained before step 1 (the RL
#: job's SFT warm-up): a fresh run with such steps checkpoints step 0.
WARMUP_KEY = "sft_warmup_steps"

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_stop_signals: list[int] = []  # received while a run trains (``stop_at_step_boundaries``)


class Interrupted(Exception):
    """A run stopped by a signal at a step boundary.

    Attributes:
      signum: the signal (``signal.SIGINT``, ``signal.SIGTERM``).
      step: the checkpoint a resumed run continues from, or None when none was saved.
      where: where it stopped, in words (``at step 7``).
    """

    def __init__(self, signum: int, step: int | None, where: str):
        super().__init__(f"interrupted {where}")
        self.signum, self.step, self.where = int(signum), step, where


class Diverged(Exception):
    """A step whose loss or gradient norm came out NaN or infinite: its update poisoned the
    state, so nothing of it was saved (the run resumes from the checkpoint before it).

    Attributes:
      step: the step that diverged (1-based, as rows and checkpoints count).
      values: ``{metric: value}`` of the step's non-finite metrics (``diverged_metrics``).
    """

    def __init__(self, step: int, values: Mapping[str, float]):
        self.step, self.values = int(step), dict(values)
        described = ", ".join(f"{k} is {v}" for k, v in self.values.items())
        super().__init__(f"step {self.step} diverged: {described}")


# The metrics whose non-finite value means the update itself went wrong (the last part of the
# name, after any ``prefix/``): a loss or a gradient norm.
_GUARDED_NAMES = ("loss", "grad_norm")
_GUARDED_SUFFIXES = ("_loss", "_grad_norm")


def diverged_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The loss and gradient-norm entries of a step's metrics that are NaN or infinite:
    ``loss``, ``grad_norm`` first, then every ``*_loss`` / ``*_grad_norm`` (``vf_loss``,
    ``prm/loss``, ...) in name order; {} when all are finite."""

    def guarded(key: str) -> bool:
        name = key.rsplit("/", 1)[-1]
        return name in _GUARDED_NAMES or name.endswith(_GUARDED_SUFFIXES)

    def order(key: str) -> tuple[int, str]:
        top = _GUARDED_NAMES.index(key) if key in _GUARDED_NAMES else len(_GUARDED_NAMES)
        return top, key

    out = {}
    for key in sorted((k for k in metrics if guarded(k)), key=order):
        try:
            value = float(metrics[key])
        except (TypeError, ValueError):
            continue
        if not math.isfinite(value):
            out[key] = value
    return out


# errno values (and their texts, for writers that report only the text: tensorstore's
# "... No space left on device [os_error_code='28']") of a full disk or an exhausted quota.
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXTS = tuple(os.strerror(code) for code in _DISK_FULL_ERRNOS)


def disk_full(err: BaseException) -> bool:
    """Whether ``err`` (or an exception it was raised from) is a write that found the disk
    full (or the user's quota spent): an ``OSError`` with ``ENOSPC`` / ``EDQUOT``, or another
    library's error that quotes it (orbax's tensorstore writes raise a ``ValueError``)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in _DISK_FULL_ERRNOS:
            return True
        if any(text in str(err) for text in _DISK_FULL_TEXTS):
            return True
        err = err.__cause__ or err.__context__
    return False


def stop_requested() -> int | None:
    """The signal that asked the running job to stop at its next step boundary, or None."""
    return _stop_signals[0] if _stop_signals else None


@contextlib.contextmanager
def stop_at_step_boundaries() -> Iterator[None]:
    """Inside, SIGINT and SIGTERM ask the run to stop at its next step boundary
    (:func:`stop_requested`) instead of killing it mid-step; a second signal stops at once
    (``KeyboardInterrupt``).

    Only in the main thread (where Python runs signal handlers) of a single-process job: each
    process of a multi-process job would stop at the step it happens to be on, and they would
    never meet in one checkpoint.
    """
    if threading.current_thread() is not threading.main_thread() or jax.process_count() > 1:
        yield
        return

    def handler(signum, frame):
        if _stop_signals:
            raise KeyboardInterrupt
        _stop_signals.append(signum)
        # A raw write: the handler may run inside a write to the buffered stderr (the bar's).
        name = signal.Signals(signum).name
        os.write(2, f"\n{name}: stopping at the end of this step (again: at once)\n".encode())

    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum in STOP_SIGNALS:
        signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, former in previous.items():
            signal.signal(signum, former)
        _stop_signals.clear()


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple]:
    """``{dotted key: (old value, new value)}`` for every leaf that differs."""
    a, b = _flatten(old), _flatten(new)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def _resume_safe(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUME_SAFE_KEYS)


class PhaseTimer:
    """Seconds (and tokens) per phase of one step: ``with timer.phase("rollout"):``; each phase
    is also a span ``(lane, phase, start, end)`` (``time.perf_counter``) of the run's
    timeline (``lane``: the thread of work, ``trainer`` or ``rollout``)."""

    def __init__(self, lane: str = "trainer"):
        self.lane = lane
        self.seconds: dict[str, float] = {}
        self.tokens: dict[str, float] = {}
        self.spans: list[tuple[str, str, float, float]] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self.seconds[name] = self.seconds.get(name, 0.0) + end - start
            self.spans.append((self.lane, name, start, end))

    def count(self, name: str, tokens: float) -> None:
        self.tokens[name] = self.tokens.get(name, 0.0) + float(tokens)

    def merge(self, other: PhaseTimer) -> None:
        """Adds another timer's phases, tokens and spans (a rollout run on another thread)."""
        for name, seconds in other.seconds.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        for name, tokens in other.tokens.items():
            self.count(name, tokens)
        self.spans.extend(other.spans)

    def metrics(self) -> dict[str, float]:
        """``time/<phase>`` seconds and ``tokens_per_s/<phase>`` where tokens were counted."""
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        for name, tokens in self.tokens.items():
            out[f"tokens_per_s/{name}"] = tokens / max(self.seconds.get(name, 0.0), 1e-9)
        return out


class Trainer:
    """One run of a job. Subclasses implement the hooks below; :meth:`fit` runs it.

    Hooks:
      ``setup()`` builds the state (after the run directory is opened), restoring from
      ``self.latest`` when resuming; ``train_step(step, timer) -> metrics``;
      ``evaluate() -> metrics``; ``checkpoint_state()`` / ``set_checkpoint_state(tree)`` and
      ``reference_tree()``; ``export(directory)`` writes the Hugging Face checkpoint;
      ``summary()`` adds job-specific entries.
    """

    plot_keys: tuple[str, ...] = plots.DEFAULT_PLOT_KEYS
    eval_key = "eval_before"
    #: The job's device mesh (a wing sets it); ``fit`` runs under ``jax.set_mesh(mesh)``.
    mesh: Any = None

    def __init__(self, cfg):
        parallel.initialize_distributed()
        self.cfg = cfg
        self.run_dir = pathlib.Path(cfg.run_dir)
        self.is_main = parallel.is_primary()
        self.extra: dict[str, Any] = {}
        self.latest: int | None = None
        self.saved_step: int | None = None  # the latest checkpoint this run wrote or resumed
        self.completed_steps = 0
        self.last_evaluation: tuple[int, dict[str, float]] | None = None  # (step, its metrics)
        self.reference_dirty = False
        if self.is_main and cfg.logging.wandb is not None:
            require_wandb()  # a missing package fails here, before the model is built

    # -- the run directory ---------------------------------------------------------------------

    def open_run(self) -> None:
        """Checks the run directory against ``resume``, then writes ``config.yaml``.

        Call once every config check has passed and the model and data are built, so a refused
        run leaves no directory (or an untouched one) behind.
        """
        cfg = self.cfg
        self.checkpointer = Checkpointer(
            self.run_dir / "checkpoints",
            keep=cfg.checkpoint.keep,
            async_save=cfg.checkpoint.async_save,
        )
        self.latest = self.checkpointer.latest_step()
        if self.latest is None and cfg.resume:
            log.warning(
                "resume=true: %s holds no checkpoint to resume from; starting from the beginning",
                self.checkpointer.directory,
            )
        if self.latest is not None and not cfg.resume:
            raise ValueError(
                f"{self.run_dir} already holds checkpoints (latest step {self.latest}): pass "
                "resume=true to continue, or choose another run_dir"
            )
        if self.latest is not None:
            self._check_resume_config()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.is_main:
            save_config(cfg, self.run_dir / "config.yaml")
        self.timeline = timeline.Timeline(self.run_dir)
        self.metrics_writer = MetricsWriter(
            self.run_dir,
            tensorboard=cfg.logging.tensorboard,
            wandb=cfg.logging.wandb,
            config=to_dict(cfg),
            resume=self.latest is not None,
        )

    def _check_resume_config(self) -> None:
        saved_path = self.run_dir / "config.yaml"
        if not saved_path.exists():
            return
        changes = config_changes(
            to_dict(load_config(type(self.cfg), saved_path)), to_dict(self.cfg)
        )
        changes = {k: v for k, v in changes.items() if k not in RESUME_FLAGS}
        if not changes:
            return
        described = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())
        unsafe = [k for k in changes if not _resume_safe(k)]
        if unsafe and not getattr(self.cfg, "resume_force", False):
            raise ValueError(
                f"resume=true with a config that differs from {saved_path} ({described}); "
                f"{', '.join(unsafe)} would make the resumed run differ from an uninterrupted "
                "one: restore those values, or pass resume_force=true to resume anyway"
            )
        log.warning("resuming with a changed config: %s", described)

    def start_lines(self, lines: Mapping[str, str]) -> None:
        """Logs the run's opening summary (devices, mesh, model, task, run directory)."""
        devices = jax.devices()
        kinds = sorted({d.device_kind for d in devices})
        head = {
            "devices": f"{len(devices)} x {'/'.join(kinds)} ({jax.default_backend()}), "
            f"{jax.process_count()} process(es)",
            **lines,
            "run directory": os.fspath(self.run_dir.resolve()),
        }
        for key, value in head.items():
            log.info("%-14s %s", key + ":", value)

    # -- hooks ---------------------------------------------------------------------------------

    def setup(self) -> None:
        raise NotImplementedError

    def end_steps(self) -> None:
        """Hook: the steps are over (the last one ran, or one raised): background work stops."""

    def train_step(self, step: int, timer: PhaseTimer) -> dict[str, float]:
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        raise NotImplementedError

    def checkpoint_state(self):
        return self.state

    def set_checkpoint_state(self, tree) -> None:
        self.state = tree

    def reference_tree(self):
        """What the checkpoint keeps of the reference (None: nothing)."""
        return None

    def restore_reference(self, tree) -> None:
        """Takes back what :meth:`reference_tree` saved."""

    def abstract_reference(self):
        return None

    def restore_extra(self, extra: dict[str, Any]) -> None:
        """Takes back the data position (and anything else) from a checkpoint's extras."""

    def save_extra(self) -> dict[str, Any]:
        return {}

    def export(self, directory: pathlib.Path) -> None:
        raise NotImplementedError

    def prompt_format(self) -> PromptFormat | None:
        """How the policy's prompts were written, recorded beside it in ``hf/`` (None: no
        record): the config's ``data.chat_template`` and ``data.system_prompt``."""
        return PromptFormat(self.cfg.data.chat_template, self.cfg.data.system_prompt)

    def summary(self) -> dict[str, Any]:
        return {}

    def progress_view(self, metrics: dict[str, float]) -> dict[str, float]:
        """What the progress bar reads from a step's metrics."""
        return metrics

    @property
    def start_step(self) -> int:
        return 0 if self.latest is None else self.latest

    # -- checkpoints ---------------------------------------------------------------------------

    def restore(self, step: int) -> None:
        abstract = lambda tree: jax.tree.map(  # noqa: E731
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
        )
        state, extra, reference = self.checkpointer.restore(
            step,
            abstract_state=abstract(self.checkpoint_state()),
            abstract_reference=self.abstract_reference(),
        )
        self.set_checkpoint_state(state)
        self.extra = dict(extra)
        if self.abstract_reference() is not None:
            if reference is None:
                raise ValueError(f"checkpoint {step} has no reference to resume from")
            self.restore_reference(reference)
            self.reference_dirty = False
        self.restore_extra(self.extra)
        self.metrics_writer.truncate(step)
        if self.is_main:
            self.timeline.truncate(step)
        log.info("resumed from step %d", step)

    def save(self, step: int) -> None:
        self.extra.update(self.save_extra())
        self.checkpointer.save(
            step,
            self.checkpoint_state(),
            extra=self.extra,
            reference_params=self.reference_tree() if self.reference_dirty else None,
        )
        self.reference_dirty = False

    # -- the loop ------------------------------------------------------------------------------

    def _plot(self, step: int, after: dict[str, float] | None = None) -> None:
        """Draws ``plots/*.png`` (and logs them to W&B at ``step``): the rows, with the
        evaluation before training at step 0 and ``after`` it at ``step``."""
        if self.is_main and self.cfg.logging.plots:
            evaluations = {0: self.extra.get(self.eval_key, {}), step: after or {}}
            extra: dict[str, list[tuple[int, float]]] = {}
            for at, evaluation in evaluations.items():
                for key, value in evaluation.items():
                    extra.setdefault(f"eval/{key}", []).append((at, value))
            paths = plots.plot(self.run_dir, self.plot_keys, extra=extra)
            drawn = timeline.plot(self.run_dir)
            self.metrics_writer.log_plots(step, paths + ([drawn] if drawn else []))

    def fit(self) -> dict[str, Any]:
        """Runs the job from its start (or the latest checkpoint) to ``trainer.max_steps``.

        Raises:
          Interrupted: SIGINT or SIGTERM stopped it at a step boundary (checkpointed there).
          Diverged: a step's loss or gradient norm was not finite (nothing of it saved).
        """
        # The model's activation constraints resolve against the job's mesh.
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            return self._fit()

    def _fit(self) -> dict[str, Any]:
        cfg = self.cfg
        with stop_at_step_boundaries():
            try:
                self._start()
                self._steps()
            except Interrupted:
                self._close()
                raise
            except BaseException as err:
                self._close_after_failure(err)
                raise
        max_steps = cfg.trainer.max_steps
        last = self.last_evaluation  # the last step's own evaluation is the one after training
        if max_steps == 0:  # the warm-up only (an RL job): nothing trained since the first one
            after = self.extra[self.eval_key]
        elif last is not None and last[0] == max_steps:
            after = last[1]
        else:
            after = self.evaluate()
        summary = {
            "job": cfg.job,
            "steps": max_steps,
            self.eval_key: self.extra[self.eval_key],
            self.eval_key.replace("before", "after"): after,
            **self.summary(),
        }
        self.checkpointer.wait()
        hf_dir = self.run_dir / "hf"
        self.export(hf_dir)
        prompt_format = self.prompt_format()
        if self.is_main and prompt_format is not None:
            write_prompt_format(hf_dir, prompt_format)
        summary["hf"] = os.fspath(hf_dir)
        if self.is_main:
            self.metrics_writer.write_summary(summary)
        if max_steps:  # no step: no rows to draw
            self._plot(max_steps, after)
        self._close()
        log.info("evaluation after training: %s", after)
        log.info("Hugging Face checkpoint of the final policy: %s", hf_dir)
        return summary

    def _close(self) -> None:
        self.metrics_writer.close()
        self.checkpointer.close()  # waits for the last save to commit

    def _close_after_failure(self, err: BaseException) -> None:
        """After ``err`` ended the run: the checkpoint being written commits (the last complete
        one is what a resumed run starts from), unless that cannot end -- another process of
        the job is gone -- or the user asked to stop at once (a second Ctrl-C). A failure
        here (the disk that filled up mid-save) is logged: ``err`` is what the run reports."""
        metrics_writer = getattr(self, "metrics_writer", None)
        checkpointer = getattr(self, "checkpointer", None)
        if isinstance(err, KeyboardInterrupt) or lost_process(err):
            checkpointer = None
        closing = (
            ("the metrics files could not be closed", metrics_writer),
            (f"checkpoint step {self.saved_step} was not completed", checkpointer),
        )
        for what, resource in closing:
            if resource is None:
                continue
            try:
                resource.close()
            except Exception as failed:  # noqa: BLE001 (err is the one to report)
                log.warning("%s: %s", what, failed)

    def _start(self) -> None:
        """Setup, restore, the evaluation before training and the warm-up's checkpoint."""
        self.setup()
        if self.latest is None:
            self.metrics_writer.truncate(0)
            if self.is_main:
                self.timeline.truncate(0)
        else:
            self.restore(self.latest)
        self.completed_steps = self.start_step
        self.saved_step = self.latest
        if self.eval_key not in self.extra:
            with_time = time.perf_counter()
            self.extra[self.eval_key] = self.evaluate()
            log.info(
                "evaluation before training (%.1f s): %s",
                time.perf_counter() - with_time,
                self.extra[self.eval_key],
            )
        if self.latest is None and self.extra.get(WARMUP_KEY):
            self.save(0)  # the warm-up's end: a resumed run starts here, not from scratch
            self.saved_step = 0

    def _stop_if_asked(self, bar: ProgressBar) -> None:
        """At a step boundary: on a stop signal, checkpoints the steps done since the last
        checkpoint and raises :class:`Interrupted`."""
        signum = stop_requested()
        if signum is None:
            return
        bar.close()
        if self.completed_steps > 0 and self.completed_steps != self.saved_step:
            self.save(self.completed_steps)
            self.saved_step = self.completed_steps
        where = f"at step {self.completed_steps}"
        if self.completed_steps == 0 and self.saved_step == 0:
            where += " (the end of the warm-up)"
        raise Interrupted(signum, self.saved_step, where)

    def _steps(self) -> None:
        cfg = self.cfg
        max_steps = cfg.trainer.max_steps
        bar = ProgressBar(max_steps, initial=self.start_step, disable=not cfg.logging.progress)
        checkpoint_s = None
        try:
            for step in range(self.start_step, max_steps):
                self._stop_if_asked(bar)
                timer = PhaseTimer()
                start = time.perf_counter()
                metrics = self.train_step(step, timer)
                # Before anything of the step is logged or saved: its update may have poisoned
                # the state, and the last checkpoint must stay the last good one.
                bad = diverged_metrics(metrics)
                if bad:
                    raise Diverged(step + 1, bad)
                self.completed_steps = step + 1
                if cfg.trainer.eval_every and (step + 1) % cfg.trainer.eval_every == 0:
                    with timer.phase("evaluation"):
                        evaluation = self.evaluate()
                    self.last_evaluation = (step + 1, evaluation)
                    metrics.update({f"eval/{k}": v for k, v in evaluation.items()})
                metrics.update(timer.metrics())
                # A checkpoint is written after its step's row (a run killed in between resumes at
                # the previous checkpoint and rewrites the row), so its time shows in the next row.
                if checkpoint_s is not None:
                    metrics["time/checkpoint"] = checkpoint_s
                metrics["time/step"] = time.perf_counter() - start
                if self.is_main:
                    self.metrics_writer.write(step + 1, metrics)
                    self.timeline.write(step + 1, timer.spans)
                checkpoint_s = None
                if (step + 1) % cfg.checkpoint.every_steps == 0 or step + 1 == max_steps:
                    saved = time.perf_counter()
                    self.save(step + 1)
                    self.saved_step = step + 1
                    checkpoint_s = time.perf_counter() - saved
                bar.update(self.progress_view(metrics))
                if any(k.startswith("eval/") for k in metrics):
                    self._plot(step + 1)
            self._stop_if_asked(bar)  # a signal in the last step: stop before the evaluation
        finally:
            bar.close()  # also when a step failed: its error line starts on a line of its own
            self.end_steps()
