"""Run metrics: ``metrics.jsonl``, TensorBoard events, ``summary.json``, plots, a progress bar.

A run directory holds::

    metrics.jsonl      one JSON object per step: {"step": n, "reward_mean": ..., ...}
    tensorboard/       event files (when tensorboardX is installed)
    summary.json       the end-of-run summary
    plots/<key>.png    curves of chosen metrics (``train.plots``)
    wandb/             the W&B run's local files (``logging.wandb``; ``train.wandb_logger``)
    wandb_id.txt       its id, so that a resumed run continues it

Only the primary process (``parallel.is_primary()``: process 0 unless a job names another)
writes, so every process of a multi-host job can make the same calls. On resume,
``truncate(step)`` drops the rows written after the restored checkpoint, so the file ends up as
an uninterrupted run would have written it (W&B cannot drop points: see docs/logging.md).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from jaxrl_llm.train.config import WandbSection
    from jaxrl_llm.train.wandb_logger import WandbLogger

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
TENSORBOARD_DIR = "tensorboard"

_TENSORBOARD_OPENED = itertools.count()


def _is_primary() -> bool:
    # (metrics stay importable, and cheap, without starting JAX)
    from jaxrl_llm.parallel.distributed import is_primary  # noqa: PLC0415

    return is_primary()


def _scalar(value: Any, key: str) -> float:
    """A Python float from a Python / NumPy / JAX scalar (0-d or size-1 array)."""
    if isinstance(value, bool | int | float | np.generic):
        return float(value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        array = np.asarray(value)
        if array.size == 1 and array.dtype.kind in "biuf":
            return float(array.reshape(()))
        raise ValueError(f"metric {key!r} must be a scalar, got an array of shape {array.shape}")
    raise ValueError(f"metric {key!r} must be a number, got {type(value).__name__}: {value!r}")


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def read_metrics(path: str | os.PathLike) -> list[dict[str, float]]:
    """The rows of a ``metrics.jsonl`` (a file, or a run directory holding one).

    A last line cut short by a killed process is skipped with a warning.

    Raises:
      FileNotFoundError: no such file.
      ValueError: a malformed line other than the last, or a row without an int ``step``.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):
                log.warning("%s: skipping the incomplete last line %d", path, number)
                continue
            raise ValueError(f"{path}: line {number} is not valid JSON: {err}") from err
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(f"{path}: line {number} has no integer 'step': {line[:200]}")
        rows.append(row)
    return rows


class MetricsWriter:
    """Appends one row of scalar metrics per step to ``metrics.jsonl`` (TensorBoard, W&B too).

    Example::

        writer = MetricsWriter(run_dir)
        writer.truncate(restored_step)     # on resume (0 for a fresh run)
        writer.write(step, {"reward_mean": r, "accuracy": a})
        writer.write_summary({"eval_after_rl": ...})
        writer.close()
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        tensorboard: bool | str = "auto",
        wandb: WandbSection | None = None,
        config: Mapping[str, Any] | None = None,
        resume: bool = False,
        primary: bool | None = None,
    ):
        """Opens the run directory (created if missing), and the W&B run when asked to.

        Args:
          run_dir: the run directory.
          tensorboard: also write TensorBoard events under ``tensorboard/``: ``"auto"`` when
            tensorboardX is importable (silently skipped otherwise), True likewise but a
            missing tensorboardX is said in one warning, False never.
          wandb: ``logging.wandb``: also log rows, plots and the summary to a W&B run
            (``train.wandb_logger``); ``None`` = off.
          config: the job's resolved config (a plain dict), the W&B run's config.
          resume: the run continues from a checkpoint, and so does its W&B run.
          primary: whether this process writes; ``None`` = ``jax.process_index() == 0``.

        Raises:
          ImportError: ``wandb`` is set but the package is not installed.
        """
        self.run_dir = os.fspath(run_dir)
        self.path = os.path.join(self.run_dir, METRICS_FILE)
        self.primary = _is_primary() if primary is None else bool(primary)
        self.tensorboard = tensorboard
        self._tb_writer = None
        self._tb_purge_step: int | None = None
        self._file = None
        self._last_step: int | None = None
        self.wandb: WandbLogger | None = None
        if self.primary:
            os.makedirs(self.run_dir, exist_ok=True)
            if os.path.exists(self.path):
                rows = read_metrics(self.path)
                self._last_step = max((r["step"] for r in rows), default=None)
            if wandb is not None:
                from jaxrl_llm.train.wandb_logger import WandbLogger  # noqa: PLC0415

                self.wandb = WandbLogger(wandb, self.run_dir, config=config, resume=resume)

    def truncate(self, step: int) -> None:
        """Drops the rows with ``step`` greater than ``step`` (call on resume; 0 = fresh run).

        The file is rewritten atomically; TensorBoard events after ``step`` are purged by the
        next write. A W&B run keeps its points (online, W&B ignores the replayed steps it holds).

        Raises:
          ValueError: ``step`` is negative.
        """
        step = int(step)
        if step < 0:
            raise ValueError(f"truncate step must be >= 0, got {step}")
        if not self.primary:
            return
        self._close_files()
        self._tb_purge_step = step + 1
        if not os.path.exists(self.path):
            self._last_step = None
            return
        rows = read_metrics(self.path)
        kept = [row for row in rows if row["step"] <= step]
        if len(kept) < len(rows):
            log.info("%s: dropping %d rows after step %d", self.path, len(rows) - len(kept), step)
        _atomic_write(self.path, "".join(json.dumps(row) + "\n" for row in kept))
        self._last_step = max((r["step"] for r in kept), default=None)

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Appends ``{"step": step, **metrics}`` as one JSON line (flushed at once).

        Args:
          step: the step number; must increase from row to row.
          metrics: name -> scalar (Python, NumPy or JAX; converted to float).

        Returns:
          The row written (also on non-primary processes, which write nothing).

        Raises:
          ValueError: a non-scalar or non-numeric value, a ``step`` key in ``metrics``, or a
            step not after the last row (call ``truncate`` when resuming).
        """
        if isinstance(step, bool) or int(step) != step:
            raise ValueError(f"step must be an int, got {step!r}")
        step = int(step)
        if "step" in metrics:
            raise ValueError("metrics must not contain a 'step' key; pass the step separately")
        row: dict[str, Any] = {"step": step}
        row.update({str(k): _scalar(v, str(k)) for k, v in metrics.items()})
        if not self.primary:
            return row
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"step {step} is not after the last row (step {self._last_step}) of {self.path}; "
                "call truncate(restored_step) when resuming"
            )
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        self._last_step = step
        tb = self._tensorboard_writer()
        if tb is not None:
            for key, value in row.items():
                if key != "step":
                    tb.add_scalar(key, value, global_step=step)
        if self.wandb is not None:
            self.wandb.log(step, {k: v for k, v in row.items() if k != "step"})
        return row

    def log_plots(self, step: int, paths: Sequence[str | os.PathLike]) -> None:
        """Logs the PNGs ``train.plots`` wrote to W&B at ``step`` (nothing without W&B)."""
        if self.primary and self.wandb is not None:
            self.wandb.log_images(step, paths)

    def _tensorboard_writer(self):
        if not self.tensorboard or self._tb_writer is not None:
            return self._tb_writer
        try:
            from tensorboardX import SummaryWriter  # noqa: PLC0415  (optional dependency)
        except ImportError:
            if self.tensorboard is True:
                log.warning(
                    "logging.tensorboard=true, but tensorboardX is not installed: no TensorBoard "
                    'events are written (pip install "jaxrl-llm[tensorboard]")'
                )
            self.tensorboard = False
            return None
        # Event files are named by time and host; the suffix keeps a writer reopened within the
        # same second (after a truncate) from overwriting the previous one.
        self._tb_writer = SummaryWriter(
            logdir=os.path.join(self.run_dir, TENSORBOARD_DIR),
            purge_step=self._tb_purge_step,
            filename_suffix=f".{os.getpid()}.{next(_TENSORBOARD_OPENED)}",
        )
        self._tb_purge_step = None
        return self._tb_writer

    def write_summary(self, summary: Mapping[str, Any]) -> str:
        """Writes ``summary.json`` atomically (NumPy / JAX scalars become Python numbers).

        With W&B, the entries also go to the W&B run's summary.

        Returns:
          The file's path.

        Raises:
          ValueError: a value that is not JSON-serialisable.
        """
        path = os.path.join(self.run_dir, SUMMARY_FILE)
        try:
            text = json.dumps(dict(summary), indent=2, default=_json_default)
        except TypeError as err:
            raise ValueError(f"summary is not JSON-serialisable: {err}") from err
        if self.primary:
            _atomic_write(path, text + "\n")
            if self.wandb is not None:
                self.wandb.summary(json.loads(text))
        return path

    def _close_files(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb_writer is not None:
            self._tb_writer.flush()
            self._tb_writer.close()
            self._tb_writer = None

    def close(self) -> None:
        """Flushes and closes the files, and finishes the W&B run."""
        self._close_files()
        if self.wandb is not None:
            self.wandb.finish()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _json_default(value: Any) -> Any:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        array = np.asarray(value)
        return array.item() if array.ndim == 0 else array.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple | set):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable: {value!r}")


class ProgressBar:
    """A tqdm bar over steps showing reward, accuracy, tokens/s and phase seconds.

    Reads ``reward_mean``, ``accuracy``, ``tokens_per_s``, ``time/rollout`` and
    ``time/update`` from each step's metrics (any missing one is left out).
    """

    POSTFIX_KEYS: tuple[tuple[str, str], ...] = (
        ("reward_mean", "reward"),
        ("accuracy", "acc"),
        ("tokens_per_s", "tok/s"),
        ("time/rollout", "rollout s"),
        ("time/update", "update s"),
    )

    def __init__(
        self,
        total: int,
        initial: int = 0,
        *,
        disable: bool = False,
        file=None,
    ):
        """Starts the bar.

        Args:
          total: the last step.
          initial: steps already done (a resumed run).
          disable: draw nothing (e.g. on non-primary processes, or ``logging.progress: false``).
          file: stream to draw on (default: stderr).

        Raises:
          ValueError: ``initial`` outside ``[0, total]``.
        """
        if not 0 <= initial <= total:
            raise ValueError(f"initial={initial} must lie in [0, total={total}]")
        from tqdm.auto import tqdm  # noqa: PLC0415

        self._bar = tqdm(
            total=total,
            initial=initial,
            unit="step",
            dynamic_ncols=True,
            disable=disable,
            file=file,
            desc="step",
        )
        self._postfix: dict[str, str] = {}

    @property
    def n(self) -> int:
        """Steps done."""
        return int(self._bar.n)

    @property
    def postfix(self) -> dict[str, str]:
        """What the bar shows after the counts (label -> formatted value)."""
        return dict(self._postfix)

    def update(self, metrics: Mapping[str, Any] | None = None, steps: int = 1) -> None:
        """Advances by ``steps`` and shows the chosen metrics of ``metrics``.

        A metric missing from ``metrics`` keeps showing its last value.
        """
        for key, label in self.POSTFIX_KEYS:
            if metrics and key in metrics:
                value = _scalar(metrics[key], key)
                fmt = "{:.0f}" if key == "tokens_per_s" else "{:.2f}" if "/" in key else "{:.3f}"
                self._postfix[label] = fmt.format(value)
        if self._postfix:
            self._bar.set_postfix(self._postfix, refresh=False)
        self._bar.update(steps)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
