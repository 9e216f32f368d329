"""``jaxrl-llm train`` with one fault planted, for the subprocesses of ``test_faults.py``.

``python -m tests.train.fault_worker OVERRIDES...`` runs ``jaxrl-llm train OVERRIDES...`` after
planting the fault ``$FAULT`` names (steps count from 1, as rows and checkpoints do):

* ``kill-in-update:STEP:PROCESS``: process ``PROCESS`` of the job SIGKILLs itself in the middle
  of step ``STEP`` (its rollout done, in its policy update), once the checkpoint it was writing
  has committed;
* ``kill-in-save:STEP``: the process SIGKILLs itself while orbax writes checkpoint ``STEP`` (in
  the background thread, as it writes the checkpoint's extras);
* ``fill-disk:STEP``: once checkpoint ``STEP`` has committed, a file fills what is left of the
  run directory's disk (another program filling it).

:func:`reward` is the tests' reward: deterministic, with variance within a group (a non-zero
update), and it raises while :data:`RAISING` is set.
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys

#: Set: :func:`reward` raises (a grader that is down).
RAISING: list[bool] = []

FILLER = "filler.bin"


def reward(prompt: str, completion: str, example) -> float:
    """1 for a completion of even length, else 0 (raises while :data:`RAISING` is set)."""
    if RAISING:
        raise RuntimeError("the grader is down")
    return float(len(completion) % 2 == 0)


def _kill() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def fill_disk(directory: pathlib.Path) -> None:
    """Writes ``directory/filler.bin`` until the disk holding it is full."""
    block = b"\0" * (1 << 16)
    with open(directory / FILLER, "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError:
            pass
    # A smaller write may still fit the last partial block: take that too.
    with open(directory / FILLER, "ab", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 512)
        except OSError:
            pass


def plant(fault: str) -> None:
    """Plants ``fault`` (see the module docstring) by wrapping public hooks."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    from jaxrl_llm.train.rl.trainer import RLTrainer  # noqa: PLC0415

    kind, _, where = fault.partition(":")
    if kind == "kill-in-update":
        step, process = (int(x) for x in where.split(":"))
        update = RLTrainer.update

        def killed_update(self, index, minibatch):
            import jax  # noqa: PLC0415

            if index + 1 == step and jax.process_index() == process:
                self.checkpointer.wait()
                _kill()
            return update(self, index, minibatch)

        RLTrainer.update = killed_update
    elif kind == "kill-in-save":
        save_fn = ocp.JsonCheckpointHandler._save_fn

        async def killed_save(self, item, directory):
            if pathlib.Path(directory).parent.name.split(".")[0] == where:
                _kill()
            return await save_fn(self, item, directory)

        ocp.JsonCheckpointHandler._save_fn = killed_save
    elif kind == "fill-disk":
        train_step = RLTrainer.train_step

        def filled_step(self, index, timer):
            if index == int(where):  # checkpoint STEP was the last step's
                self.checkpointer.wait()
                fill_disk(self.run_dir)
            return train_step(self, index, timer)

        RLTrainer.train_step = filled_step
    else:
        raise ValueError(f"unknown fault {fault!r}")


def main(argv: list[str]) -> int:
    from jaxrl_llm.train import cli  # noqa: PLC0415

    if os.environ.get("FAULT"):
        plant(os.environ["FAULT"])
    return cli.train_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
