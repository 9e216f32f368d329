"""A Weights & Biases run mirroring a run directory's metrics, config, plots and summary.

``logging.wandb`` (``train.config.WandbSection``) turns it on; ``train.metrics.MetricsWriter``
drives it, on the primary process only. ``wandb`` is an optional dependency (the ``wandb``
extra), imported only when a run asks for it.

The W&B run's id is kept in ``<run_dir>/wandb_id.txt``: a run resumed from a checkpoint continues
the same W&B run (``resume="allow"``); a fresh start gets a new one. W&B's history cannot be
rewritten: after a resume, the steps replayed since the checkpoint are at or before the last step
W&B already holds, and W&B ignores them (with a warning) when it knows that step (online mode);
see docs/logging.md.
"""

from __future__ import annotations

import os
import secrets
import string
from collections.abc import Iterable, Mapping
from typing import Any

from jaxrl_llm.train.config import WandbSection

ID_FILE = "wandb_id.txt"
PLOT_PREFIX = "plots/"
INSTALL_HINT = 'pip install "jaxrl-llm[wandb]"'
_ID_ALPHABET = string.ascii_lowercase + string.digits


def require_wandb():
    """The ``wandb`` module.

    Raises:
      ImportError: ``wandb`` is not installed (the message names the extra to install).
    """
    try:
        import wandb  # noqa: PLC0415  (optional, and slow to import: only when a run uses it)
    except ImportError as err:
        raise ImportError(
            f"logging.wandb needs the wandb package: {INSTALL_HINT} (or pip install wandb), "
            "or set logging.wandb: null"
        ) from err
    return wandb


def new_run_id() -> str:
    """A fresh W&B run id: 8 random lowercase letters and digits (as W&B makes them)."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(8))


def run_id(run_dir: str | os.PathLike, *, resume: bool) -> str:
    """The W&B run id of ``run_dir``: the stored one when resuming, else a new one (stored).

    Args:
      run_dir: the run directory holding ``wandb_id.txt``.
      resume: the run continues from a checkpoint; a stored id is reused.
    """
    path = os.path.join(os.fspath(run_dir), ID_FILE)
    if resume and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            stored = f.read().strip()
        if stored:
            return stored
    fresh = new_run_id()
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(fresh + "\n")
    os.replace(tmp, path)
    return fresh


class WandbLogger:
    """One W&B run: scalars per step, images, summary values.

    Example::

        logger = WandbLogger(cfg.logging.wandb, run_dir, config=to_dict(cfg), resume=False)
        logger.log(3, {"train/loss": 0.5})
        logger.log_images(3, ["runs/x/plots/reward_mean.png"])
        logger.summary({"eval_after": {"accuracy": 0.9}})
        logger.finish()
    """

    def __init__(
        self,
        settings: WandbSection,
        run_dir: str | os.PathLike,
        *,
        config: Mapping[str, Any] | None = None,
        resume: bool = False,
    ):
        """Starts (or, when resuming, continues) the W&B run, writing under ``run_dir/wandb/``.

        Args:
          settings: ``logging.wandb``.
          run_dir: the run directory (created if missing).
          config: the job's full resolved config (``config_io.to_dict``), shown as the run's
            config.
          resume: the run continues from a checkpoint: reuse the W&B run in ``wandb_id.txt``.

        Raises:
          ImportError: ``wandb`` is not installed.
        """
        self._wandb = require_wandb()
        run_dir = os.fspath(run_dir)
        os.makedirs(run_dir, exist_ok=True)
        self.id = run_id(run_dir, resume=resume)
        self.run = self._wandb.init(
            project=settings.project,
            entity=settings.entity,
            mode=settings.mode,
            name=settings.name or os.path.basename(os.path.abspath(run_dir)),
            group=settings.group,
            tags=list(settings.tags) or None,
            notes=settings.notes,
            dir=run_dir,
            config=dict(config or {}),
            id=self.id,
            resume="allow",
            # One run per process, and ``wandb.run`` is this one; a run an earlier job of this
            # process left open (it raised) is finished instead of being handed back.
            reinit="finish_previous",
        )
        self._finished = False

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Logs scalars at ``step`` (the same keys as ``metrics.jsonl``)."""
        self.run.log(dict(metrics), step=int(step))

    def log_images(self, step: int, paths: Iterable[str | os.PathLike]) -> None:
        """Logs PNGs at ``step`` as ``plots/<file name without .png>``."""
        images = {
            PLOT_PREFIX + os.path.splitext(os.path.basename(os.fspath(p)))[0]: self._wandb.Image(
                os.fspath(p)
            )
            for p in paths
        }
        if images:
            self.run.log(images, step=int(step))

    def summary(self, values: Mapping[str, Any]) -> None:
        """Adds ``values`` (JSON-able) to the run's summary."""
        self.run.summary.update(dict(values))

    def finish(self) -> None:
        """Ends the run (flushing what is left); later calls do nothing."""
        if not self._finished:
            self._finished = True
            self.run.finish()
