"""Launches the worker processes of the multi-process tests as one JAX cluster on this host.

Ports. The coordinator address needs a free port that stays free until process 0's
coordination service binds it. The usual "bind port 0, close, hand the number over" leaves a
window in which any other process on the machine can take the port. Here the port is
*reserved* instead: a socket with ``SO_REUSEPORT`` is bound to ``127.0.0.1:0`` and kept open
until the workers are done. While it is bound the kernel gives that port to no other
``bind(0)`` and refuses an explicit bind from any socket without ``SO_REUSEPORT``; JAX's
coordination service is a gRPC server, which binds with ``SO_REUSEPORT``, so it alone can
share the reserved port (the reserving socket never listens, so every connection reaches the
coordinator). Should a JAX build bind without ``SO_REUSEPORT``, process 0 fails with gRPC's
"Failed to add port"; the launcher then falls back to a released port (the racy classic) and
tries again, so the tests keep working either way.

Hangs. Output goes to files, not pipes (a chatty worker cannot block on a full pipe), and the
launcher polls every process: the first failure, or the deadline, kills the others, since a
survivor would otherwise wait in its next collective for a peer that is gone. The deadline is
only a hang stopper, never a performance assertion.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence

REPO = pathlib.Path(__file__).resolve().parents[2]
BIND_FAILURE = "Failed to add port"
_STRIPPED_ENV = ("SLURM_", "TPU_", "MEGASCALE_", "JAX_", "XLA_FLAGS")


class WorkerError(RuntimeError):
    """A worker exited with an error or the launch timed out; carries the workers' stderr."""


@contextlib.contextmanager
def reserved_port(*, shared: bool = True) -> Iterator[int]:
    """A local TCP port that no other process can take while the context is open.

    Args:
      shared: keep the port bound with ``SO_REUSEPORT`` for the whole context (only another
        ``SO_REUSEPORT`` socket, such as a gRPC server, can bind it); ``False`` releases it
        at once (the classic, racy way).

    Yields:
      The port number.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        if not shared:
            sock.close()
        yield port
    finally:
        sock.close()


def single_process_env(local_devices: int) -> dict:
    """The environment of a process with ``local_devices`` CPU devices and no cluster: nothing
    inherited that could make JAX auto-detect one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_STRIPPED_ENV)}
    # The session's LLVM level (tests/conftest.py) too: the workers' results are compared
    # with programs this session compiled, and LLVM's levels round differently (FMAs).
    flags = [f"--xla_force_host_platform_device_count={local_devices}"] + [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if f.startswith("--xla_backend_optimization_level")
    ]
    env.update(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    return env


def worker_env(port: int, process_id: int, num_processes: int, local_devices: int) -> dict:
    """The environment of one worker: explicit ``JAX_*`` cluster variables, CPU devices, and
    nothing inherited that could make JAX auto-detect another cluster."""
    env = single_process_env(local_devices)
    env.update(
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES=str(num_processes),
        JAX_PROCESS_ID=str(process_id),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    return env


def _tail(path: pathlib.Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def _report(what: str, logs) -> str:
    tails = "\n".join(
        f"--- process {i} stderr ---\n{_tail(err)}" for i, (_, err) in enumerate(logs)
    )
    return f"multi-process launch failed: {what}\n{tails}"


def _run_once(argv, log_dir, port, num_processes, local_devices, timeout_s, extra_env):
    logs = [(log_dir / f"stdout{i}.txt", log_dir / f"stderr{i}.txt") for i in range(num_processes)]
    procs = []
    try:
        for i, (out, err) in enumerate(logs):
            env = {**worker_env(port, i, num_processes, local_devices), **extra_env}
            with open(out, "w") as stdout, open(err, "w") as stderr:
                procs.append(
                    subprocess.Popen(argv, env=env, cwd=REPO, stdout=stdout, stderr=stderr)
                )
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]  # every process, every round: no short-circuit
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                what = "; ".join(f"process {i} exited with code {codes[i]}" for i in failed)
                raise WorkerError(_report(what, logs))
            if all(code == 0 for code in codes):
                break
            if time.monotonic() > deadline:
                raise WorkerError(
                    _report(f"the workers did not finish within {timeout_s:.0f} s", logs)
                )
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            # communicate() with a timeout: reaping a killed process must not hang either.
            proc.communicate(timeout=30)
    return [out.read_text() for out, _ in logs]


def launch(
    module: str,
    args: Sequence[str] = (),
    *,
    log_dir: pathlib.Path,
    timeout_s: float,
    num_processes: int = 2,
    local_devices: int = 4,
    extra_env: Mapping[str, str] | None = None,
    attempts: int = 3,
) -> list[str]:
    """Runs ``python -m module *args`` as processes ``0 … n-1`` of one JAX cluster.

    Args:
      module: the worker module.
      args: its command-line arguments.
      log_dir: where ``stdout{i}.txt`` / ``stderr{i}.txt`` go.
      timeout_s: deadline of the whole launch (a hang stopper: be generous).
      num_processes: cluster size.
      local_devices: fake CPU devices per process.
      extra_env: variables set on top of the cluster environment.
      attempts: launches tried when the coordinator cannot bind its port.

    Returns:
      Each process's stdout, in process order.

    Raises:
      WorkerError: naming every failed process and its exit code (or the deadline), with the
        tail of every stderr.
    """
    argv = [sys.executable, "-m", module, *map(str, args)]
    shared = True
    for attempt in range(attempts):
        with reserved_port(shared=shared) as port:
            try:
                return _run_once(
                    argv, log_dir, port, num_processes, local_devices, timeout_s, extra_env or {}
                )
            except WorkerError:
                stderr0 = (log_dir / "stderr0.txt").read_text(errors="replace")
                if attempt + 1 == attempts or BIND_FAILURE not in stderr0:
                    raise
        shared = False  # this JAX does not share the port: use the classic free port
    raise AssertionError("unreachable")
