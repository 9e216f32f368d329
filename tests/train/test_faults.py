"""Faults where users run (issue 42, item 5): each ends in one clear line and a resumable run.

A reward that raises, a step whose loss turns NaN, a full disk, a process killed while orbax
writes a checkpoint, and a process of a two-process job killed mid-step. After each, the run
directory holds its last complete checkpoint (and nothing of a poisoned step), the message says
which step ``resume=true`` continues from, and the resumed run writes the rows an uninterrupted
run writes (the data position restored), or, across two processes, continues from that step.
The survivor of a killed process is stopped within the heartbeat timeout (set small here), by
JAX's coordination service or, where a collective's connection to the dead process breaks
first, by the CLI's own line (exit 75); which of the two comes first is the processes' race.

The faults are planted through public hooks (``tests/train/fault_worker.py``): the RL trainer's
``update`` and ``train_step``, orbax's JSON handler (the checkpoint's extras), a file filling a
small filesystem. The full-disk run on a real filesystem needs a user and mount namespace
(``unshare -rm``) for a small tmpfs; the same fault is also injected as the ``OSError`` a full
disk gives, so it is tested everywhere.
"""

from __future__ import annotations

import errno
import logging
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

from jaxrl_llm.parallel import distributed
from jaxrl_llm.train import cli, core
from jaxrl_llm.train.checkpoint import Checkpointer, committed_steps, interrupted_steps
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.rl.trainer import RLTrainer
from tests.parallel import launcher
from tests.train import fault_worker
from tests.train.helpers import SHARED_CACHE_ENV, cache_env, without_timing
from tests.train.rl import rl_helpers

REWARD = "rewards=[{name: tests.train.fault_worker:reward}]"
RUN = (*rl_helpers.TINY, REWARD, "trainer.max_steps=3", "checkpoint.every_steps=1")
# Two processes of 4 CPU devices (tests/parallel/launcher.py): one 8-device mesh.
TWO_PROCESSES = (
    *rl_helpers.TINY,
    REWARD,
    "mesh.data=2",
    "mesh.fsdp=4",
    "data.eval_size=8",
    "rollout.prompts_per_step=8",
    "rollout.group_size=2",
    "trainer.max_steps=2",
    "checkpoint.every_steps=1",
)
# Hang stoppers, never performance bounds.
TIMEOUT_S = 600
# The survivor of a killed process must be gone within SURVIVOR_EXIT_S: the heartbeat timeout
# the test sets and the coordination service's next check fit well inside it, JAX's default
# timeout (100 s) does not.
HEARTBEAT_S = 10
SURVIVOR_EXIT_S = 60


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """The session's compilation cache (``tests/conftest.py``) where there is one: the
    subprocesses compile what this process compiled once."""
    return os.environ.get(SHARED_CACHE_ENV) or tmp_path_factory.mktemp("jax_cache")


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(cache_dir):
    with rl_helpers.persistent_compilation_cache(cache_dir):
        yield


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> list[dict]:
    """The rows of the uninterrupted run every resumed run must reproduce."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    assert cli.train_main([*RUN, f"run_dir={run_dir}"]) == 0
    return without_timing(read_metrics(run_dir))


def _errors(captured) -> list[str]:
    return [line for line in captured.err.splitlines() if line.startswith("error:")]


def _resume(argv, caplog, straight, step: int) -> None:
    """``resume=true`` continues from checkpoint ``step`` and ends as the straight run."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jaxrl_llm"):
        assert cli.train_main([*argv, "resume=true"]) == 0
    assert f"resumed from step {step}" in caplog.text
    run_dir = pathlib.Path(next(a for a in argv if a.startswith("run_dir=")).split("=", 1)[1])
    assert without_timing(read_metrics(run_dir)) == straight
    assert (run_dir / "hf").is_dir()


def _session_subprocess(argv, cache_dir, fault: str) -> subprocess.CompletedProcess:
    """``fault_worker`` with this session's devices and flags (the resumed run in this process
    must match it)."""
    return subprocess.run(
        [sys.executable, "-m", "tests.train.fault_worker", *argv],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=launcher.REPO,
        env={**os.environ, **cache_env(cache_dir), "FAULT": fault},
    )


# -- the pieces --------------------------------------------------------------------------------


def test_diverged_metrics_are_the_non_finite_losses_and_gradient_norms():
    metrics = {
        "reward_mean": float("nan"),  # not the update's: a failing reward says so itself
        "vf_loss": float("inf"),
        "prm/loss": float("nan"),
        "grad_norm": float("nan"),
        "loss": float("-inf"),
        "pg_loss": 0.5,
        "entropy": 1.0,
    }
    assert core.diverged_metrics(metrics) == {
        "loss": float("-inf"),
        "grad_norm": metrics["grad_norm"],
        "prm/loss": metrics["prm/loss"],
        "vf_loss": float("inf"),
    }
    assert core.diverged_metrics({"loss": 0.0, "grad_norm": 3.0, "reward_mean": 1.0}) == {}


def test_disk_full_is_told_from_other_errors():
    enospc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/a/metrics.jsonl")
    assert core.disk_full(enospc) and core.disk_full(OSError(errno.EDQUOT, "quota"))
    # tensorstore (orbax's array writes) reports the errno's text inside a ValueError.
    assert core.disk_full(ValueError(f"RESOURCE_EXHAUSTED: ...: {os.strerror(errno.ENOSPC)}"))
    try:
        try:
            raise enospc
        except OSError as err:
            raise RuntimeError("save failed") from err
    except RuntimeError as chained:
        assert core.disk_full(chained)
    assert not core.disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not core.disk_full(ValueError("bad config"))


def test_a_lost_process_is_told_from_other_errors_in_a_multi_process_job(monkeypatch):
    gloo = RuntimeError(
        "UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:538] Read "
        "error [127.0.0.1]:34526: Connection reset by peer"
    )
    assert not distributed.lost_process(gloo)  # this test's process is one process
    monkeypatch.setattr(distributed, "_initialized_as", "explicit")
    assert distributed.lost_process(gloo)
    assert distributed.lost_process(ValueError("UNAVAILABLE: Task 1 heartbeat timeout."))
    assert not distributed.lost_process(ValueError("bad config"))


def test_the_heartbeat_timeout_is_configurable(monkeypatch):
    assert distributed.heartbeat_timeout_seconds(environ={}) is None  # JAX's default
    env = {distributed.HEARTBEAT_TIMEOUT_ENV: "7"}
    assert distributed.heartbeat_timeout_seconds(environ=env) == 7
    assert distributed.heartbeat_timeout_seconds(3, environ=env) == 3
    with pytest.raises(ValueError, match="JAXRL_HEARTBEAT_TIMEOUT_S='soon' must be a positive"):
        distributed.heartbeat_timeout_seconds(environ={distributed.HEARTBEAT_TIMEOUT_ENV: "soon"})
    # ... and reaches jax.distributed.initialize.
    seen = {}
    monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda **kw: seen.update(kw))
    monkeypatch.setattr(distributed, "_initialized_as", None)
    for name, value in {
        "JAX_COORDINATOR_ADDRESS": "127.0.0.1:1",
        "JAX_NUM_PROCESSES": "2",
        "JAX_PROCESS_ID": "1",
        distributed.HEARTBEAT_TIMEOUT_ENV: "5",
    }.items():
        monkeypatch.setenv(name, value)
    distributed.initialize_distributed()
    assert seen["heartbeat_timeout_seconds"] == 5 and seen["num_processes"] == 2
    monkeypatch.setattr(distributed, "_initialized_as", None)
    monkeypatch.delenv(distributed.HEARTBEAT_TIMEOUT_ENV)
    seen.clear()
    distributed.initialize_distributed()
    assert seen["num_processes"] == 2 and "heartbeat_timeout_seconds" not in seen


# -- one process -------------------------------------------------------------------------------


def test_a_reward_that_raises_keeps_the_checkpoint_in_flight_and_resume_continues(
    tmp_path, capsys, caplog, monkeypatch, straight
):
    run_dir = tmp_path / "run"
    argv = [*RUN, f"run_dir={run_dir}"]
    train_step = RLTrainer.train_step

    def failing_step(self, step, timer):
        if step == 2:  # the grader goes down in step 3, while checkpoint 2 is being written
            fault_worker.RAISING.append(True)
        return train_step(self, step, timer)

    monkeypatch.setattr(RLTrainer, "train_step", failing_step)
    capsys.readouterr()
    try:
        assert cli.train_main(argv) == 2
    finally:
        fault_worker.RAISING.clear()
    captured = capsys.readouterr()
    errors = _errors(captured)
    assert len(errors) == 1 and "raised RuntimeError: the grader is down" in errors[0]
    assert (
        f"  once it is fixed, resume with {cli.resume_command(argv)} (it continues from "
        "checkpoint step 2)"
    ) in captured.err.splitlines()
    # The asynchronous save of step 2 committed before the process went.
    assert committed_steps(run_dir / "checkpoints") == [1, 2]
    assert interrupted_steps(run_dir / "checkpoints") == []

    monkeypatch.setattr(RLTrainer, "train_step", train_step)
    _resume(argv, caplog, straight, step=2)


def test_a_nan_loss_stops_the_run_before_its_step_is_saved(
    tmp_path, capsys, caplog, monkeypatch, straight
):
    run_dir = tmp_path / "run"
    argv = [*RUN, f"run_dir={run_dir}"]
    update = RLTrainer.update

    def poisoned(self, step, minibatch):
        if step == 2:  # step 3's advantages are NaN: its loss and gradient are, and its update
            minibatch = minibatch._replace(advantages=minibatch.advantages * jnp.nan)
        return update(self, step, minibatch)

    monkeypatch.setattr(RLTrainer, "update", poisoned)
    capsys.readouterr()
    assert cli.train_main(argv) == 2
    captured = capsys.readouterr()
    forced = cli.resume_command([*argv, "resume_force=true"])
    assert _errors(captured) == [
        "error: step 3 diverged (loss is nan, grad_norm is nan, pg_loss is nan); nothing of it "
        "was saved; resumed as it is, the run repeats it: change what made it diverge (e.g. a "
        f"lower trainer.learning_rate), then resume with {forced} (it continues from "
        "checkpoint step 2)"
    ]
    assert "Traceback" not in captured.err
    # Nothing of step 3: no checkpoint of the poisoned state, no row, no final outputs.
    assert committed_steps(run_dir / "checkpoints") == [1, 2]
    assert interrupted_steps(run_dir / "checkpoints") == []
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    assert not (run_dir / "summary.json").exists() and not (run_dir / "hf").exists()

    monkeypatch.setattr(RLTrainer, "update", update)
    _resume(argv, caplog, straight, step=2)


def test_a_full_disk_is_one_line_and_the_last_checkpoint_is_kept(
    tmp_path, capsys, caplog, monkeypatch, straight
):
    run_dir = tmp_path / "run"
    argv = [*RUN, f"run_dir={run_dir}"]
    save_fn = ocp.JsonCheckpointHandler._save_fn
    full = run_dir / "checkpoints" / "2.orbax-checkpoint-tmp" / "extra" / "metadata"

    async def out_of_space(self, item, directory):
        if pathlib.Path(directory).parent.name.split(".")[0] == "2":  # checkpoint 2's extras
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(full))
        return await save_fn(self, item, directory)

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", out_of_space)
    capsys.readouterr()
    assert cli.train_main(argv) == 2
    captured = capsys.readouterr()
    assert _errors(captured) == [
        f"error: the disk is full (no space left on the device of {full}): free space there, "
        f"then resume with {cli.resume_command(argv)} (it continues from checkpoint step 1)"
    ]
    assert committed_steps(run_dir / "checkpoints") == [1]
    assert interrupted_steps(run_dir / "checkpoints") == [2]

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", save_fn)
    _resume(argv, caplog, straight, step=1)
    assert "checkpoint step 2 in" in caplog.text and "is incomplete" in caplog.text


def test_a_process_killed_while_writing_a_checkpoint_resumes_from_the_one_before(
    tmp_path, cache_dir, caplog, straight
):
    run_dir = tmp_path / "run"
    argv = [*RUN, f"run_dir={run_dir}"]
    result = _session_subprocess(argv, cache_dir, "kill-in-save:2")
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    # What the killed write left: checkpoint 2 half written, checkpoint 1 whole.
    assert committed_steps(run_dir / "checkpoints") == [1]
    assert interrupted_steps(run_dir / "checkpoints") == [2]

    _resume(argv, caplog, straight, step=1)
    assert (
        f"checkpoint step 2 in {run_dir / 'checkpoints'} is incomplete (its write never "
        "finished): removing it; the latest complete checkpoint is step 1"
    ) in caplog.text
    assert interrupted_steps(run_dir / "checkpoints") == []  # the half-written one is gone
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [2, 3]


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m none /tmp"],
        capture_output=True,
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="no user and mount namespaces (unshare -rm)")
def test_a_disk_that_fills_up_on_a_real_filesystem(tmp_path, cache_dir, straight):
    """A tmpfs of its own (a mount namespace), filled by another file once checkpoint 1 is
    written: orbax's tensorstore writes fail as they do on a full disk. Freed, it resumes."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    run_dir = mount / "run"
    argv = [*RUN, f"run_dir={run_dir}"]
    outside = tmp_path / "out"
    outside.mkdir()
    worker = [sys.executable, "-m", "tests.train.fault_worker"]
    script = "\n".join(
        [
            f"mount -t tmpfs -o size=64m none {mount}",
            f"FAULT=fill-disk:1 {shlex.join(worker + argv)} 2> {outside}/full.txt",
            f"echo $? > {outside}/full_rc.txt",
            f"ls {run_dir}/checkpoints > {outside}/checkpoints.txt",
            f"rm {run_dir}/{fault_worker.FILLER}",
            f"{shlex.join(worker + argv)} resume=true 2> {outside}/resumed.txt",
            f"echo $? > {outside}/resumed_rc.txt",
            f"cp {run_dir}/metrics.jsonl {outside}/",
        ]
    )
    subprocess.run(
        ["unshare", "-rm", "sh", "-c", script],
        cwd=launcher.REPO,
        env={**os.environ, **cache_env(cache_dir)},
        timeout=TIMEOUT_S,
        check=True,
    )
    full = (outside / "full.txt").read_text()
    assert (outside / "full_rc.txt").read_text().strip() == "2", full[-3000:]
    errors = [line for line in full.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, full[-3000:]
    assert re.fullmatch(
        rf"error: the disk is full \(no space left on the device of {re.escape(str(run_dir))}"
        rf"(/.*)?\): free space there, then resume with {re.escape(cli.resume_command(argv))} "
        r"\(it continues from checkpoint step 1\)",
        errors[0],
    ), errors[0]
    kept = (outside / "checkpoints.txt").read_text().split()
    assert "1" in kept and not {"2", "3"} & set(kept), kept
    resumed = (outside / "resumed.txt").read_text()
    assert (outside / "resumed_rc.txt").read_text().strip() == "0", resumed[-3000:]
    assert "resumed from step 1" in resumed
    assert without_timing(read_metrics(outside / "metrics.jsonl")) == straight


# -- two processes -----------------------------------------------------------------------------


def test_a_process_killed_mid_step_stops_the_other_and_both_resume(tmp_path, cache_dir):
    """Process 1 of two is SIGKILLed in the middle of step 2 (in its update). Process 0, waiting
    on it, stops within the heartbeat timeout (``JAXRL_HEARTBEAT_TIMEOUT_S``; JAX's default 100
    s would overrun ``SURVIVOR_EXIT_S``): stopped by JAX's coordination service, with its "another
    task died" line, or -- where the collective's connection to the dead process broke first
    -- with one ``error:`` line, exit 75. Relaunched, the pair resumes from checkpoint 1."""
    run_dir = tmp_path / "run"
    argv = [*TWO_PROCESSES, f"run_dir={run_dir}"]
    logs = [tmp_path / f"stderr{i}.txt" for i in range(2)]
    env = {
        **cache_env(cache_dir),
        "FAULT": "kill-in-update:2:1",
        distributed.HEARTBEAT_TIMEOUT_ENV: str(HEARTBEAT_S),
    }
    procs = []
    with launcher.reserved_port() as port:
        try:
            for i, log in enumerate(logs):
                with open(log, "w") as stderr:
                    procs.append(
                        subprocess.Popen(
                            [sys.executable, "-m", "tests.train.fault_worker", *argv],
                            env={**launcher.worker_env(port, i, 2, 4), **env},
                            cwd=launcher.REPO,
                            stdout=subprocess.DEVNULL,
                            stderr=stderr,
                        )
                    )
            assert procs[1].wait(timeout=TIMEOUT_S) == -signal.SIGKILL, logs[1].read_text()
            killed = time.monotonic()
            survivor = procs[0].wait(timeout=SURVIVOR_EXIT_S)  # a hang fails here
            waited = time.monotonic() - killed
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    stderr = logs[0].read_text()
    assert waited < SURVIVOR_EXIT_S
    if survivor == cli.LOST_PROCESS_EXIT:
        line = re.fullmatch(
            r"error: another process of this 2-process job is gone \((.+)\); relaunch every "
            rf"process with {re.escape(cli.resume_command(argv))} \(it continues from "
            r"checkpoint step 1\)",
            stderr.splitlines()[-1],
        )
        assert line and "Traceback" not in stderr, stderr[-3000:]
    else:
        assert survivor == -signal.SIGABRT, stderr[-3000:]
        assert "the JAX distributed service detected fatal errors" in stderr, stderr[-3000:]
        assert "stopped sending heartbeats" in stderr, stderr[-3000:]
    before = read_metrics(run_dir)
    assert [r["step"] for r in before] == [1]

    relaunched = tmp_path / "relaunched"
    relaunched.mkdir()
    launcher.launch(
        "jaxrl_llm.cli",
        ["train", *argv, "resume=true"],
        log_dir=relaunched,
        timeout_s=TIMEOUT_S,
        extra_env=cache_env(cache_dir),
    )
    resumed = (relaunched / "stderr0.txt").read_text()
    assert "resumed from step 1" in resumed and "is incomplete" not in resumed
    after = read_metrics(run_dir)
    assert [r["step"] for r in after] == [1, 2]
    assert without_timing(after[:1]) == without_timing(before)
    assert (run_dir / "summary.json").exists()
