"""Multi-process start-up: ``jax.distributed.initialize`` when the environment asks for it.

One program, launched once per host (TPU pod worker, SLURM task, or by hand), calls
``initialize_distributed()`` first thing, before any other JAX call. The launcher is recognised
from its environment variables, in this order:

* explicit: ``JAX_COORDINATOR_ADDRESS`` + ``JAX_NUM_PROCESSES`` + ``JAX_PROCESS_ID``;
* SLURM: ``SLURM_STEP_NUM_TASKS`` (or ``SLURM_NTASKS``) > 1 with ``SLURM_PROCID``; the
  coordinator is the step's first node (``SLURM_STEP_NODELIST``/``SLURM_JOB_NODELIST``) on port
  ``JAX_COORDINATOR_PORT`` or, as JAX itself does, ``61440 + SLURM_JOB_ID mod 4096``;
* TPU pod / multislice: several hosts in ``TPU_WORKER_HOSTNAMES`` / ``TPU_PROCESS_ADDRESSES``
  or ``MEGASCALE_NUM_SLICES`` > 1; JAX then reads the rest from the environment and metadata.

Anything else is one process and ``initialize_distributed`` is a no-op.

A lost process. When a process of the job dies, the others learn it one of two ways: a
collective's connection to it breaks (gloo on CPU: "Connection reset by peer"), which raises in
the process that waits on it (:func:`lost_process`), or the coordination service misses its
heartbeats for ``JAXRL_HEARTBEAT_TIMEOUT_S`` seconds (JAX's default, 100, when unset) and
stops every process (JAX's "Terminating process because the JAX distributed service detected
fatal errors"). Either way no survivor waits forever.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax


class ClusterSpec(NamedTuple):
    """What the environment says about the processes of this job.

    Attributes:
      kind: ``"none"`` (one process), ``"explicit"``, ``"slurm"`` or ``"tpu"``.
      num_processes: number of processes, when the environment states it.
      process_id: this process's index in ``[0, num_processes)``, when stated.
      coordinator_address: ``host:port`` of process 0's coordinator, when known here (JAX's own
        detection fills it in for TPU).
    """

    kind: str
    num_processes: int | None = None
    process_id: int | None = None
    coordinator_address: str | None = None


class DistributedInfo(NamedTuple):
    """Where this process stands once JAX is (or is not) distributed.

    Attributes:
      process_index: ``jax.process_index()``.
      process_count: ``jax.process_count()``.
      local_device_count: devices this process addresses.
      global_device_count: devices of all processes together.
      cluster: the ``ClusterSpec.kind`` that initialised JAX; ``"none"`` for a single process,
        ``"external"`` when JAX was already initialised by someone else.
    """

    process_index: int
    process_count: int
    local_device_count: int
    global_device_count: int
    cluster: str


# ``host:port`` where this process serves JAX's cross-process device transfers (the weights a
# sampler on processes of its own receives) on backends without their own, such as CPU.
TRANSFER_ADDRESS_ENV = "JAX_CROSS_HOST_TRANSFER_SOCKET_ADDRESS"
TRANSFER_TIMEOUT_S = 24 * 3600

#: Seconds without a heartbeat from a process after which the coordination service declares it
#: dead and stops the job (``jax.distributed.initialize``'s ``heartbeat_timeout_seconds``;
#: unset: JAX's default, 100).
HEARTBEAT_TIMEOUT_ENV = "JAXRL_HEARTBEAT_TIMEOUT_S"

# What a collective or the coordination service says when a peer process is gone.
_LOST_PROCESS = re.compile(
    r"Gloo \w+ failed|Connection (?:reset|closed) by peer|Socket closed|heartbeat timeout"
    r"|stopped sending heartbeats|tasks are unhealthy"
)

# The cluster kind this module initialised JAX with; makes initialize_distributed idempotent.
_initialized_as: str | None = None


def _int_var(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _check_process(num_processes: int, process_id: int, source: str) -> None:
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(
            f"{source}: process id {process_id} is not in [0, {num_processes}) processes"
        )


def first_slurm_host(nodelist: str) -> str:
    """The first host name of a SLURM node list.

    ``"node[003-005,9],gpu1"`` → ``"node003"``; ``"a[1-2]b[7-8]"`` → ``"a1b7"``.

    Raises:
      ValueError: an unclosed ``[`` or an empty list.
    """
    parts, i = [], 0
    while i < len(nodelist) and nodelist[i] != ",":
        if nodelist[i] == "[":
            end = nodelist.find("]", i)
            if end < 0:
                raise ValueError(f"malformed SLURM node list {nodelist!r}: unclosed '['")
            parts.append(nodelist[i + 1 : end].replace("-", ",").split(",")[0])
            i = end + 1
        else:
            parts.append(nodelist[i])
            i += 1
    host = "".join(parts).strip()
    if not host:
        raise ValueError(f"empty SLURM node list {nodelist!r}")
    return host


def _explicit_spec(environ: Mapping[str, str]) -> ClusterSpec:
    names = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    missing = [n for n in names if not environ.get(n)]
    if missing:
        raise ValueError(
            f"explicit multi-process setup needs {names}; missing {missing} "
            f"(set {[n for n in names if n not in missing]})"
        )
    num_processes = _int_var(environ, "JAX_NUM_PROCESSES")
    process_id = _int_var(environ, "JAX_PROCESS_ID")
    _check_process(num_processes, process_id, "JAX_NUM_PROCESSES/JAX_PROCESS_ID")
    if num_processes == 1:
        return ClusterSpec("none", 1, 0, environ["JAX_COORDINATOR_ADDRESS"])
    return ClusterSpec("explicit", num_processes, process_id, environ["JAX_COORDINATOR_ADDRESS"])


def _slurm_spec(environ: Mapping[str, str], num_processes: int) -> ClusterSpec:
    if "SLURM_PROCID" not in environ:
        raise ValueError(f"SLURM describes {num_processes} tasks but SLURM_PROCID is not set")
    process_id = _int_var(environ, "SLURM_PROCID")
    _check_process(num_processes, process_id, "SLURM tasks/SLURM_PROCID")
    address = environ.get("JAX_COORDINATOR_ADDRESS")
    if not address:
        nodelist = next(
            (
                environ[n]
                for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                if environ.get(n)
            ),
            None,
        )
        if nodelist is None:
            raise ValueError(
                "SLURM job without SLURM_STEP_NODELIST/SLURM_JOB_NODELIST/SLURM_NODELIST; set "
                "JAX_COORDINATOR_ADDRESS=host:port"
            )
        if environ.get("JAX_COORDINATOR_PORT"):
            port = _int_var(environ, "JAX_COORDINATOR_PORT")
        elif environ.get("SLURM_JOB_ID"):
            # Same rule as JAX's SlurmCluster, so mixed launchers agree on the port.
            port = _int_var(environ, "SLURM_JOB_ID") % 2**12 + (65535 - 2**12 + 1)
        else:
            raise ValueError("SLURM job without SLURM_JOB_ID; set JAX_COORDINATOR_PORT")
        address = f"{first_slurm_host(nodelist)}:{port}"
    return ClusterSpec("slurm", num_processes, process_id, address)


def _tpu_spec(environ: Mapping[str, str]) -> ClusterSpec:
    hostnames = environ.get("TPU_PROCESS_ADDRESSES") or environ.get("TPU_WORKER_HOSTNAMES") or ""
    hosts = [h for h in hostnames.split(",") if h.strip()]
    slices = _int_var(environ, "MEGASCALE_NUM_SLICES") if environ.get("MEGASCALE_NUM_SLICES") else 1
    if len(hosts) <= 1 and slices <= 1:
        return ClusterSpec("none")
    num_processes = len(hosts) * slices if hosts else None
    process_id = None
    if hosts and environ.get("TPU_WORKER_ID"):
        slice_id = (
            _int_var(environ, "MEGASCALE_SLICE_ID") if environ.get("MEGASCALE_SLICE_ID") else 0
        )
        process_id = _int_var(environ, "TPU_WORKER_ID") + slice_id * len(hosts)
    return ClusterSpec("tpu", num_processes, process_id, None)


def detect_cluster(environ: Mapping[str, str] | None = None) -> ClusterSpec:
    """Reads the launcher's environment variables (see the module docstring); touches no JAX.

    Args:
      environ: the environment to read; defaults to ``os.environ``.

    Returns:
      A ``ClusterSpec``; ``kind == "none"`` unless several processes are described.

    Raises:
      ValueError: a half-specified or inconsistent environment (missing variables, a process id
        out of range, a non-integer count), naming the variables.
    """
    environ = os.environ if environ is None else environ
    if any(environ.get(n) for n in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID")):
        return _explicit_spec(environ)
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"):
        if environ.get(name):
            tasks = _int_var(environ, name)
            if tasks > 1:
                return _slurm_spec(environ, tasks)
            break
    return _tpu_spec(environ)


def _info(cluster: str) -> DistributedInfo:
    return DistributedInfo(
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        local_device_count=jax.local_device_count(),
        global_device_count=jax.device_count(),
        cluster=cluster,
    )


def initialize_distributed(
    *,
    force: bool = False,
    local_device_ids: Sequence[int] | None = None,
    initialization_timeout: int = 300,
    heartbeat_timeout: int | None = None,
) -> DistributedInfo:
    """Calls ``jax.distributed.initialize`` iff the environment describes several processes.

    Idempotent: later calls (or a call after JAX was initialised elsewhere) only report. Call it
    before any other JAX function; on CPU hosts JAX's cross-process collectives use gloo
    (``jax.config.update("jax_cpu_collectives_implementation", "gloo")``).

    Args:
      force: call ``jax.distributed.initialize()`` with JAX's own auto-detection even when the
        environment variables describe one process (e.g. a GCE TPU VM pod, whose topology comes
        from the metadata server).
      local_device_ids: devices this process may use, passed through (JAX's default on SLURM
        GPU jobs is one device per task, ``[SLURM_LOCALID]``).
      initialization_timeout: seconds to wait for all processes to connect.
      heartbeat_timeout: seconds without a heartbeat after which a process counts as dead and
        the coordination service stops the job; None: ``$JAXRL_HEARTBEAT_TIMEOUT_S``, else
        JAX's default (100 s). A shorter one stops the survivors of a dead process sooner.

    ``JAX_CROSS_HOST_TRANSFER_SOCKET_ADDRESS`` (``host:port``, one per process), when set,
    becomes JAX's ``jax_cross_host_transfer_socket_address``: device-to-device copies between
    processes on backends that have no transport of their own (CPU).

    Returns:
      A ``DistributedInfo`` with this process's index, the process count and device counts.

    Raises:
      ValueError: from ``detect_cluster`` when the environment is half-specified, or a
        heartbeat timeout that is not a positive number of seconds.
    """
    global _initialized_as
    if _initialized_as is not None:
        return _info(_initialized_as)
    is_initialized = getattr(jax.distributed, "is_initialized", None)
    if is_initialized is not None and is_initialized():
        return _info("external")
    spec = detect_cluster()
    if spec.kind == "none" and not force:
        return _info("none")
    kwargs: dict = {"initialization_timeout": initialization_timeout}
    heartbeat = heartbeat_timeout_seconds(heartbeat_timeout)
    if heartbeat is not None:
        kwargs["heartbeat_timeout_seconds"] = heartbeat
    if local_device_ids is not None:
        kwargs["local_device_ids"] = list(local_device_ids)
    if spec.kind in ("explicit", "slurm"):
        kwargs.update(
            coordinator_address=spec.coordinator_address,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
        )
    if spec.kind == "explicit":
        # Everything is given; stop JAX probing SLURM/MPI/k8s variables that may be lying around.
        kwargs["cluster_detection_method"] = "deactivate"
    address = os.environ.get(TRANSFER_ADDRESS_ENV)
    if address:  # JAX reads these flags from its config only
        jax.config.update("jax_cross_host_transfer_socket_address", address)
        # A transfer waits for its receiver (a sampler still generating, a trainer still
        # updating): far longer than JAX's default minute.
        jax.config.update("jax_cross_host_transfer_timeout_seconds", TRANSFER_TIMEOUT_S)
    jax.distributed.initialize(**kwargs)
    _initialized_as = "auto" if spec.kind == "none" else spec.kind
    return _info(_initialized_as)


def heartbeat_timeout_seconds(
    timeout: int | None = None, environ: Mapping[str, str] | None = None
) -> int | None:
    """The heartbeat timeout to start JAX with: ``timeout``, else ``$JAXRL_HEARTBEAT_TIMEOUT_S``,
    else None (JAX's default).

    Raises:
      ValueError: a value that is not a positive whole number of seconds, naming its source.
    """
    environ = os.environ if environ is None else environ
    source, value = "heartbeat_timeout", timeout
    if value is None and environ.get(HEARTBEAT_TIMEOUT_ENV):
        source, value = HEARTBEAT_TIMEOUT_ENV, environ[HEARTBEAT_TIMEOUT_ENV]
    if value is None:
        return None
    try:
        seconds = int(str(value).strip())
    except ValueError:
        seconds = 0
    if isinstance(value, bool) or seconds < 1:
        raise ValueError(f"{source}={value!r} must be a positive whole number of seconds")
    return seconds


def lost_process(err: BaseException) -> bool:
    """Whether ``err`` (or an exception it was raised from) says that another process of this
    multi-process job is gone: a collective's connection to it broke (gloo: "Connection reset
    by peer"), or the coordination service stopped hearing from it. Always False in a job of
    one process.

    Such a job cannot go on: every process must be relaunched (and resumed from the last
    complete checkpoint). Nothing it still has to do with the other processes -- a checkpoint
    to commit, JAX's shutdown barrier -- can finish.
    """
    is_initialized = getattr(jax.distributed, "is_initialized", None)
    if _initialized_as is None and not (is_initialized is not None and is_initialized()):
        return False
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if _LOST_PROCESS.search(str(err)):
            return True
        err = err.__cause__ or err.__context__
    return False


# The process that writes a job's files (metrics, exports, config) and the processes that
# train (and checkpoint): process 0 and all of them, unless a job whose first processes only
# sample (``mesh.rollout_devices`` across processes) says otherwise (``set_trainer_processes``).
_primary_process = 0
_trainer_processes: frozenset[int] | None = None


def set_trainer_processes(processes: Sequence[int] | None) -> None:
    """The processes that hold the trained state (None: all); the first of them writes the
    job's files (``is_primary``) and they alone take part in checkpoints."""
    global _primary_process, _trainer_processes
    _trainer_processes = None if processes is None else frozenset(int(p) for p in processes)
    _primary_process = 0 if not _trainer_processes else min(_trainer_processes)


def trainer_processes() -> frozenset[int] | None:
    """The processes set by ``set_trainer_processes`` (None: every process trains)."""
    return _trainer_processes


def is_primary() -> bool:
    """Whether this process writes the job's files (metrics, summary, exports)."""
    return jax.process_index() == _primary_process
