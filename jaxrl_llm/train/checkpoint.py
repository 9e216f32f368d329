"""orbax checkpoints of the train state, host-side JSON extras and the reference policy.

Layout under ``directory``::

    <step>/state/         the TrainState (orbax StandardSave: sharded arrays, per-shard writes)
    <step>/extra/         JSON: data position, evaluation results, ...
    reference/<step>/     reference parameters, written only at steps where they changed

The reference lives in its own orbax manager because it changes rarely (a frozen reference is
saved once): the state manager keeps only the last ``keep`` steps, and the reference of a kept
step -- the latest reference saved at or before it -- must outlive the step it was saved with.
References no kept step needs are deleted.

Atomicity: orbax writes each step to ``<step>.orbax-checkpoint-tmp`` and renames it when every
shard is written (or writes a commit marker on object stores); old steps are removed only
after the new one is committed, so a process killed mid-save leaves the previous step
loadable, and the leftover temporary directory is removed when the directory is next opened
(with a warning naming the step it would have been: :func:`interrupted_steps`). A reference is
committed before the state step that needs it starts saving, so a committed state step always
finds its reference. :func:`committed_steps` reads which steps are complete without opening
the directory (no barrier, nothing removed): what a failed run can still resume from.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxrl_llm import parallel
from jaxrl_llm.train import process_local

if TYPE_CHECKING:
    from jaxrl_llm.train.state import TrainState

PyTree = Any

log = logging.getLogger(__name__)

_REFERENCE_DIR = "reference"


class Checkpointer:
    """Saves and restores ``TrainState`` checkpoints, optionally asynchronously.

    Every process of a multi-host job must make the same calls (orbax synchronises them).

    Example::

        ckpt = Checkpointer(run_dir / "checkpoints", keep=3)
        ckpt.save(step, state, extra={"data_position": 128}, reference_params=ref)
        ...
        state, extra, ref = ckpt.restore(abstract_state=abstract, abstract_reference=abs_ref)
        ckpt.close()
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True):
        """Opens (and, on the first save, creates) a checkpoint directory.

        Args:
          directory: where checkpoints live (a local path or an ``epath`` URL such as
            ``gs://bucket/run/checkpoints``).
          keep: number of most recent state checkpoints to keep (>= 1).
          async_save: write in a background thread; ``save`` returns once the arrays are
            copied to host memory, so the caller may donate or overwrite the state.

        Raises:
          ValueError: ``keep`` is not a positive int.
        """
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep must be a positive int, got {keep!r}")
        path = os.fspath(directory)
        self.directory = path if "://" in path else os.path.abspath(path)
        self.keep = keep
        self.async_save = bool(async_save)
        self._state_manager: ocp.CheckpointManager | None = None
        self._reference_manager: ocp.CheckpointManager | None = None
        self._orphans_checked = False
        if _exists(self.directory):
            self._open()

    # -- managers ----------------------------------------------------------------------------

    def _open(self) -> None:
        if self._state_manager is not None:
            return
        for step in interrupted_steps(self.directory):
            complete = committed_steps(self.directory)
            log.warning(
                "checkpoint step %d in %s is incomplete (its write never finished): removing it; "
                "%s",
                step,
                self.directory,
                f"the latest complete checkpoint is step {complete[-1]}"
                if complete
                else "no complete checkpoint is left",
            )
        # A job whose first processes only sample (``mesh.rollout_devices`` across processes):
        # the trainer processes alone hold the state, so they alone meet in orbax's barriers.
        processes = parallel.trainer_processes()
        multiprocess, handlers = {}, {"state": None, "extra": None, "reference": None}
        if processes is not None:  # orbax leaves the directories to us then
            options = ocp.options.MultiprocessingOptions(
                primary_host=min(processes), active_processes=set(processes)
            )
            multiprocess = {"multiprocessing_options": options, "create": False}
            handlers = {
                "state": ocp.StandardCheckpointHandler(multiprocessing_options=options),
                "extra": ocp.JsonCheckpointHandler(multiprocessing_options=options),
                "reference": ocp.StandardCheckpointHandler(multiprocessing_options=options),
            }
            for path in (self.directory, _join(self.directory, _REFERENCE_DIR)):
                _mkdir(path)
        self._state_manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=self.keep,
                enable_async_checkpointing=self.async_save,
                cleanup_tmp_directories=True,
                **multiprocess,
            ),
            **_items(handlers, "state", "extra"),
        )
        # References are saved synchronously: the state step that needs one must not commit
        # before it. They are rare (a frozen reference is saved once).
        self._reference_manager = ocp.CheckpointManager(
            _join(self.directory, _REFERENCE_DIR),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=None,
                enable_async_checkpointing=False,
                cleanup_tmp_directories=True,
                **multiprocess,
            ),
            **_items(handlers, "reference"),
        )
        # orbax deletes uncommitted ``<step>.orbax-checkpoint-tmp`` directories in a background
        # thread that ``close`` does not join: finish it now, so two managers opened one after
        # the other on one directory never race to delete the same files.
        for manager in (self._state_manager, self._reference_manager):
            await_cleanup = getattr(manager, "_maybe_await_cleanup_tmp_directory", None)
            if await_cleanup is not None:
                await_cleanup()

    def all_steps(self) -> list[int]:
        """Steps of the state checkpoints present, ascending (including one being saved)."""
        if self._state_manager is None:
            return []
        return sorted(self._state_manager.all_steps())

    def reference_steps(self) -> list[int]:
        """Steps at which reference parameters were saved, ascending."""
        if self._reference_manager is None:
            return []
        return sorted(self._reference_manager.all_steps())

    def latest_step(self) -> int | None:
        """The latest state checkpoint step, or ``None`` when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def reference_step_for(self, step: int) -> int | None:
        """The reference save a checkpoint at ``step`` uses: the latest one at or before it."""
        earlier = [r for r in self.reference_steps() if r <= step]
        return earlier[-1] if earlier else None

    # -- save --------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: TrainState,
        *,
        extra: Mapping[str, Any] | None = None,
        reference_params: PyTree | None = None,
        force: bool = False,
    ) -> None:
        """Checkpoints ``state`` (and ``extra``, and ``reference_params`` when given) at ``step``.

        Args:
          step: the checkpoint's step number (the caller's count, e.g. RL steps; it need not
            equal ``state.step``). Must be after the latest checkpoint unless ``force``.
          state: the train state (sharded ``jax.Array`` leaves are written shard by shard).
          extra: JSON-serialisable host data (data position, metrics-history length, ...);
            NumPy / JAX scalars are converted.
          reference_params: the reference policy's parameters; pass them only at steps where
            they changed -- later checkpoints reuse the latest saved reference.
          force: replace the checkpoints at or after ``step`` (e.g. after restoring an older
            step on purpose) and the references saved after ``step``; without it such
            checkpoints are an error.

        Raises:
          ValueError: a negative step, ``extra`` that is not JSON-serialisable, or a step not
            after the latest checkpoint without ``force``.
        """
        step = _as_step(step)
        extra_json = _jsonable(dict(extra or {}), "extra")
        self._open()
        # Only once the previous save is committed has orbax removed the steps it replaces, so
        # only then may the references of those steps go.
        self.wait()
        self._delete_orphan_references()
        latest = self.latest_step()
        if latest is not None and step <= latest:
            if not force:
                raise ValueError(
                    f"cannot save checkpoint step {step}: {self.directory} already holds step "
                    f"{latest}. Resume from it, use another directory, or pass force=True to "
                    f"replace the checkpoints at steps >= {step}"
                )
            self._delete_from(step)
        if reference_params is not None:
            if step in self.reference_steps():
                self._reference_manager.delete(step)
            self._reference_manager.save(
                step,
                args=ocp.args.Composite(
                    reference=ocp.args.StandardSave(process_local.to_host(reference_params))
                ),
                force=True,
            )
            self._reference_manager.wait_until_finished()
        self._state_manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(process_local.to_host(state)),
                extra=ocp.args.JsonSave(extra_json),
            ),
            force=True,
        )

    def _delete_from(self, step: int) -> None:
        for s in self.all_steps():
            if s >= step:
                self._state_manager.delete(s)
        # A reference saved at ``step`` itself still describes the policy at that step.
        for r in self.reference_steps():
            if r > step:
                self._reference_manager.delete(r)

    def _delete_orphan_references(self) -> None:
        """Deletes references newer than every state step: a save killed between the two."""
        if self._orphans_checked:
            return
        self._orphans_checked = True
        latest = self.latest_step()
        for r in self.reference_steps():
            if latest is None or r > latest:
                log.warning("deleting reference step %d: no state checkpoint uses it", r)
                self._reference_manager.delete(r)

    def _prune_references(self) -> None:
        """Deletes references that no state step on disk needs any more.

        Called only with no save in flight: orbax drops a replaced step from ``all_steps`` as
        soon as the new save starts but deletes it from disk only after the new one commits.
        """
        state_steps = self.all_steps()
        if not state_steps:
            return
        needed = {self.reference_step_for(s) for s in state_steps}
        for r in self.reference_steps():
            if r not in needed and r < state_steps[-1]:
                self._reference_manager.delete(r)

    def wait(self) -> None:
        """Blocks until every started save is committed to disk."""
        if self._state_manager is not None:
            self._state_manager.wait_until_finished()
            self._reference_manager.wait_until_finished()
            self._prune_references()

    def close(self) -> None:
        """Waits for pending saves and releases the managers."""
        if self._state_manager is not None:
            self.wait()
            self._state_manager.close()
            self._reference_manager.close()
            self._state_manager = self._reference_manager = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- restore -----------------------------------------------------------------------------

    def _resolve_step(self, step: int | None) -> int:
        """The kept step to read (``None``: the latest), after pending saves have finished."""
        if not _exists(self.directory):
            raise FileNotFoundError(f"checkpoint directory {self.directory} does not exist")
        self._open()
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        step = steps[-1] if step is None else _as_step(step)
        if step not in steps:
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self.directory}; available steps: {steps}"
            )
        self._state_manager.wait_until_finished()
        return step

    def _check_shapes(self, step: int, target: PyTree) -> None:
        """Refuses a target whose leaves' shapes differ from the saved ones, naming the first,
        before any read starts (orbax finds it mid-read, leaving the other reads' coroutines
        to be collected with "Exception ignored" noise). Leaves the checkpoint lacks, and
        metadata this orbax cannot give, are left to the restore to refuse."""
        try:
            saved = self._state_manager.item_metadata(step)["state"]
            saved = {m.name: tuple(m.shape) for m in jax.tree.leaves(saved.tree)}
        except (AttributeError, KeyError, TypeError, ValueError):
            return
        for path, leaf in jax.tree_util.tree_leaves_with_path(target):
            name = jax.tree_util.keystr(path, simple=True, separator=".")  # as orbax names it
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):  # saved as its key data
                leaf = jax.eval_shape(jax.random.key_data, leaf)
            if name in saved and tuple(leaf.shape) != saved[name]:
                raise ValueError(
                    f"checkpoint step {step} in {self.directory} does not match "
                    f"abstract_state: {name} has shape {saved[name]} there, "
                    f"{tuple(leaf.shape)} here"
                )

    def restore(
        self,
        step: int | None = None,
        *,
        abstract_state: TrainState,
        abstract_reference: PyTree | None = None,
    ) -> tuple[TrainState, dict[str, Any], PyTree | None]:
        """Restores a checkpoint straight into the shardings of ``abstract_state``.

        Args:
          step: the step to restore; ``None`` = the latest.
          abstract_state: the state's structure as ``jax.ShapeDtypeStruct`` leaves carrying a
            ``.sharding`` (e.g. ``NamedSharding``s of the train mesh); each process reads only
            its shards. Concrete ``jax.Array`` leaves are accepted and stand for their own
            shape, dtype and sharding. A dtype differing from the saved one is cast to.
          abstract_reference: the reference parameters' abstract structure, or ``None`` to
            skip them.

        Returns:
          ``(state, extra, reference_params)``: ``reference_params`` is the latest reference
          saved at or before ``step``, or ``None`` when none was saved (or none was asked for).

        Raises:
          FileNotFoundError: the directory does not exist, holds no checkpoint, or lacks
            ``step``.
          ValueError: an abstract leaf without a sharding, or a structure / shape that does not
            match the checkpoint.
        """
        abstract_state = _abstract_tree(abstract_state, "abstract_state")
        if abstract_reference is not None:
            abstract_reference = _abstract_tree(abstract_reference, "abstract_reference")
        step = self._resolve_step(step)
        target = process_local.host_target(abstract_state)
        self._check_shapes(step, target)
        try:
            restored = self._state_manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target),
                    extra=ocp.args.JsonRestore(),
                ),
            )
        except ValueError as err:
            raise ValueError(
                f"checkpoint step {step} in {self.directory} does not match abstract_state: {err}"
            ) from err
        reference = None
        reference_step = self.reference_step_for(step)
        if abstract_reference is not None and reference_step is not None:
            try:
                reference = self._reference_manager.restore(
                    reference_step,
                    args=ocp.args.Composite(
                        reference=ocp.args.StandardRestore(
                            process_local.host_target(abstract_reference)
                        )
                    ),
                )["reference"]
                reference = process_local.placed(reference, abstract_reference)
            except ValueError as err:
                raise ValueError(
                    f"reference saved at step {reference_step} in {self.directory} does not "
                    f"match abstract_reference: {err}"
                ) from err
        extra = restored["extra"]
        state = process_local.placed(restored["state"], abstract_state)
        return state, dict(extra) if extra is not None else {}, reference

    def restore_raw(self, step: int | None = None) -> tuple[PyTree, dict[str, Any]]:
        """``(state, extra)`` of a checkpoint as saved, on the CPU, without an abstract target
        (for export tools on one host: NamedTuples come back as dicts).

        Raises:
          FileNotFoundError: no checkpoint, or no checkpoint at ``step``.
        """
        step = self._resolve_step(step)
        state_dir = os.path.join(self.directory, str(step), "state")
        metadata = ocp.StandardCheckpointer().metadata(state_dir)
        tree = getattr(metadata, "item_metadata", metadata)
        tree = getattr(tree, "tree", tree)
        cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=cpu), tree)
        restored = self._state_manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), extra=ocp.args.JsonRestore()
            ),
        )
        return restored["state"], dict(restored["extra"] or {})


def committed_steps(directory: str | os.PathLike) -> list[int]:
    """The state checkpoints in ``directory`` whose write completed, ascending; [] when there is
    none (or no directory). Reads the directory only: no barrier, nothing removed, so a process
    whose job failed can still tell what a resumed run would start from."""
    path = os.fspath(directory)
    if not _exists(path):
        return []
    return sorted(ocp.utils.checkpoint_steps(path))


def interrupted_steps(directory: str | os.PathLike) -> list[int]:
    """The state checkpoints in ``directory`` whose write started but never completed (a process
    killed or a disk filled mid-save), ascending. Opening a :class:`Checkpointer` on the
    directory removes them; none is ever restored."""
    path = os.fspath(directory)
    if not _exists(path):
        return []
    steps = []
    for tmp in ocp.utils.tmp_checkpoints(path):
        name = os.path.basename(os.fspath(tmp.get_final()))
        if name.isdigit():
            steps.append(int(name))
    return sorted(steps)


def _exists(path: str) -> bool:
    if "://" in path:
        from etils import epath  # noqa: PLC0415  (an orbax dependency, only for URLs)

        return epath.Path(path).exists()
    return os.path.isdir(path)


def _items(handlers: dict[str, Any], *names: str) -> dict[str, Any]:
    """A manager's ``item_names``, or its ``item_handlers`` where ``handlers`` has them."""
    if handlers[names[0]] is None:
        return {"item_names": names}
    return {"item_handlers": {name: handlers[name] for name in names}}


def _mkdir(path: str) -> None:
    if "://" in path:
        from etils import epath  # noqa: PLC0415

        epath.Path(path).mkdir(parents=True, exist_ok=True)
    else:
        os.makedirs(path, exist_ok=True)


def _join(directory: str, name: str) -> str:
    return (
        f"{directory.rstrip('/')}/{name}" if "://" in directory else os.path.join(directory, name)
    )


def _as_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int | np.integer | jax.Array):
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if np.ndim(step) != 0:
        raise ValueError(f"step must be a scalar, got shape {np.shape(step)}")
    step = int(step)
    if step < 0:
        raise ValueError(f"step must be a non-negative int, got {step}")
    return step


def _jsonable(value: Any, where: str) -> Any:
    """A copy of ``value`` with NumPy / JAX scalars as Python scalars and tuples as lists."""
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: JSON keys must be strings, got {k!r}")
            out[k] = _jsonable(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, list | tuple):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, np.generic | np.ndarray | jax.Array) and np.ndim(value) == 0:
        return _jsonable(np.asarray(value).item(), where)
    raise ValueError(
        f"{where}: {type(value).__name__} is not JSON-serialisable (use dicts, lists, strings, "
        "numbers, booleans, null)"
    )


def _abstract_tree(tree: PyTree, name: str) -> PyTree:
    """Checks every leaf is a ``ShapeDtypeStruct`` (or array) with a sharding."""

    def leaf(path, x):
        where = f"{name}{jax.tree_util.keystr(path)}"
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if not isinstance(x, jax.ShapeDtypeStruct):
            raise ValueError(
                f"{where} must be a jax.ShapeDtypeStruct with a sharding, got {type(x).__name__}"
            )
        if x.sharding is None:
            raise ValueError(
                f"{where} has no sharding: build it as jax.ShapeDtypeStruct(shape, dtype, "
                "sharding=...) so the restored array lands in its shards"
            )
        return x

    return jax.tree_util.tree_map_with_path(leaf, tree)
