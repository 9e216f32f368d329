"""The local sandbox: one Python program run under operating-system isolation, Linux only.

``run_sandboxed(source, stdin, timeout_s=..., memory_mb=...)`` runs ``source`` as the
``__main__`` script and returns its ``RunResult``. Each run is its own little container, built
with what the machine allows (``protections()`` says which; the first use logs the missing
ones, once per process):

* **namespaces** (``unshare(2)``: no bubblewrap or setuid helper needed): fresh PID, mount,
  network (no interfaces but a down loopback), IPC and UTS namespaces; without root, inside a
  fresh user namespace.
* **a filesystem view of its own**: the root is an empty read-only tmpfs holding read-only binds
  of the system libraries (``/usr``, ``/lib*``, ``/bin``), the interpreter's prefix and its
  site-packages, ``/dev/{null,zero,full,random,urandom}``, a fresh ``/proc`` (its own PID
  namespace only) and a writable, size-limited ``/tmp`` tmpfs (its working directory a fresh
  ``/tmp/run``; binds of an interpreter under ``/tmp`` lie on it, read-only); nothing
  else of the host (no datasets, checkpoints, home directories, other runs) is visible, and
  whatever it writes disappears with the mount namespace.
* **an unprivileged user**: a fresh uid per run (from a range no account uses) when the trainer
  runs as root, else the trainer's uid mapped to root of the user namespace with every
  capability dropped; ``no_new_privs`` either way.
* **limits for the whole run** in a cgroup (v1 or v2) when one can be created: memory
  (``memory_mb`` + 64 MiB for the launcher), 64 tasks, one CPU; always per process: address
  space ``memory_mb`` (``RLIMIT_AS``), CPU time ``ceil(timeout_s) + 1`` s, 16 MiB per written
  file, no core files, and without a cgroup a task count (``RLIMIT_NPROC``: 64 for a fresh
  uid, else 64 over the tasks running at launch; root ignores it).
* **an environment of constants only**: single-threaded BLAS/OpenMP, nothing inherited (no
  tokens, keys or paths of the trainer).
* **teardown**: the run ends when the program's main process exits or at ``timeout_s``; the
  namespace's init then exits, which makes the kernel kill every process left in it (``setsid``
  or double-forked ones included), the cgroup is swept and removed, and the per-run directory
  deleted.
* **output through pipes** the trainer opened: stdout (at most 16 MiB: more stops the run) and
  stderr (first 64 KiB kept) are read with a deadline, so the program cannot delete, replace or
  block them; the trainer never waits past ``timeout_s`` plus a second.

The launcher is one ``python -I -S`` process (no ``preexec_fn``, unsafe in a multi-threaded
JAX parent): it joins the cgroup, unshares, forks the namespace's init, which mounts the view
and forks the program's process, which sets the limits, drops privileges and runs the program
in the already started interpreter (one interpreter start per run, like before).

When a protection cannot be had (no namespaces in this container, not root and no user
namespaces, no writable cgroup, an interpreter the fresh uid cannot read), the run goes on
without it: the weakest level is a plain child process in a private temporary directory with
the per-process limits and the constant environment, and its own session killed as a group.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from typing import NamedTuple

logger = logging.getLogger(__name__)

MAX_OUTPUT_BYTES = 16 << 20  # stdout kept; more stops the run
MAX_STDERR_BYTES = 64 << 10  # stderr kept (diagnostics only)
_MAX_FILE_BYTES = 16 << 20  # RLIMIT_FSIZE
_TMP_MB = 64  # the run's /tmp
_LAUNCHER_MB = 64  # cgroup memory beyond memory_mb: the launcher and namespace init
_MAX_TASKS = 64  # cgroup pids.max, or RLIMIT_NPROC without a cgroup
_UID_BASE, _UID_SPAN = 1_500_000_000, 1 << 24  # fresh uids for the program when root
_CGROUP_ROOT = "/sys/fs/cgroup"
_EXIT_GRACE_S = 0.2  # reading what is left in the pipes after the program's exit

ENVIRONMENT = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

PROTECTIONS = (
    "pid namespace",
    "mount namespace",
    "network namespace",
    "ipc namespace",
    "private filesystem view",
    "unprivileged user",
    "cgroup limits",
)


class RunResult(NamedTuple):
    """What a sandboxed run left behind.

    Attributes:
      returncode: the exit status (negative: killed by that signal), ``None`` when it was
        stopped at the wall-clock limit or its status is unknown.
      stdout: its standard output (at most 16 MiB; UTF-8, undecodable bytes replaced).
      stderr: the first 64 KiB of its standard error.
      timed_out: whether it ran past the wall-clock limit.
    """

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool


class Protections(NamedTuple):
    """The isolation a local run gets on this machine.

    Attributes:
      level: ``"namespaces"`` (user, filesystem, PID, network, IPC) or ``"process"``.
      missing: the entries of ``PROTECTIONS`` not achieved.
    """

    level: str
    missing: tuple[str, ...]


# ---------------------------------------------------------------------------------------------
# The launcher: runs as `python -I -S -X utf8 -c _LAUNCHER <config fd> <status fd>`.

_LAUNCHER = r"""
import ctypes, json, os, resource, sys
config_fd, status_fd = int(sys.argv[1]), int(sys.argv[2])
with os.fdopen(config_fd, "rb") as f:
    cfg = json.loads(f.read())
status = os.fdopen(status_fd, "w")
missing = []
libc = ctypes.CDLL(None, use_errno=True)
prctl = getattr(libc, "prctl", lambda *args: -1)  # Linux only

def check(result, what):
    if result != 0:
        raise OSError(ctypes.get_errno(), what)

def write(path, text):
    with open(path, "w") as f:
        f.write(text)

for path in cfg["cgroups"]:
    try:
        write(os.path.join(path, "cgroup.procs"), str(os.getpid()))
    except OSError:
        if "cgroup limits" not in missing:
            missing.append("cgroup limits")
if not cfg["cgroups"]:
    missing.append("cgroup limits")

namespaces = cfg["namespaces"]
if namespaces:
    uid, gid = os.getuid(), os.getgid()
    flags = 0x00020000 | 0x20000000 | 0x40000000 | 0x08000000 | 0x04000000
    try:
        check(libc.unshare(flags | (0x10000000 if cfg["userns"] else 0)), "unshare")
        if cfg["userns"]:
            write("/proc/self/setgroups", "deny")
            write("/proc/self/uid_map", f"0 {uid} 1")
            write("/proc/self/gid_map", f"0 {gid} 1")
    except OSError:
        namespaces = False
if not namespaces:
    missing += ["pid namespace", "mount namespace", "network namespace", "ipc namespace",
                "private filesystem view"]

init = os.fork()
if init:
    os.closerange(0, 1 << 16)
    os.waitpid(init, 0)
    os._exit(0)

prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG: SIGKILL when the launcher dies
prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE: the program cannot ptrace or read us
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18

def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")

def bind(path, root):
    target = root + path
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.exists(target):
            open(target, "w").close()
    mount(path, target, None, MS_BIND | MS_REC)
    kept = os.statvfs(path).f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC)  # locked in a userns
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | kept)

workdir = cfg["root"]
if namespaces:
    try:
        root = cfg["root"]
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
        for link, target in cfg["symlinks"]:
            os.symlink(target, root + link)
        # The private /tmp first: a bind under /tmp (an interpreter or virtualenv there) then
        # lands on it, read-only, instead of being hidden by it.
        os.makedirs(root + "/tmp")
        mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
              f"size={cfg['tmp_mb']}m,mode=1777")
        for path in cfg["binds"]:
            bind(path, root)
        os.makedirs(root + "/proc")
        mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        os.chdir(root)
        check(libc.syscall(cfg["pivot_root"], b".", b"."), "pivot_root")
        check(libc.umount2(b".", 2), "umount old root")
        os.chdir("/")
        mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
        workdir = "/tmp/run"  # made by the program's user, below (/tmp may hold binds)
    except OSError:
        missing.append("private filesystem view")
        os.chdir("/")
if cfg["uid"] is None and not (cfg["userns"] and namespaces):
    missing.append("unprivileged user")
if not namespaces:
    prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come back to us
status.write(json.dumps({"missing": missing}) + "\n")
status.flush()

program = os.fork()
if program:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    while True:
        try:
            pid, code = os.waitpid(-1, 0)
        except ChildProcessError:
            code = None
            break
        if pid == program:
            break
    if not namespaces:  # no PID namespace to tear down: at least its session
        try:
            os.killpg(program, 9)
        except OSError:
            pass
    status.write(json.dumps({"exit": code}) + "\n")
    status.flush()
    os._exit(0)

os.setsid()
os.closerange(3, 1 << 16)
limits = [(resource.RLIMIT_AS, cfg["memory"]), (resource.RLIMIT_CPU, cfg["cpu_s"]),
          (resource.RLIMIT_FSIZE, cfg["fsize"]), (resource.RLIMIT_CORE, 0)]
if cfg["nproc"]:
    limits.append((resource.RLIMIT_NPROC, cfg["nproc"]))
for kind, value in limits:
    hard = resource.getrlimit(kind)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    try:
        resource.setrlimit(kind, (value, value))
    except (ValueError, OSError):
        pass
try:
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
    elif cfg["userns"] and namespaces:
        for cap in range(64):
            prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)
        check(libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")
    if sys.platform == "linux":
        check(prctl(38, 1, 0, 0, 0), "no_new_privs")
    if namespaces and workdir == "/tmp/run":
        os.mkdir(workdir, 0o700)
    os.chdir(workdir)
    with open("main.py", "w", encoding="utf-8") as f:
        f.write(cfg["source"])
except OSError as err:
    print(f"sandbox setup failed: {err}", file=sys.stderr)
    os._exit(125)
os.environ.clear()
os.environ.update(cfg["env"])
sys.path[:] = cfg["path"]
sys.argv = ["main.py"]
del cfg, status, libc, limits
import runpy
code = 0
try:
    runpy.run_path("main.py", run_name="__main__")
except SystemExit as stop:
    if stop.code is None:
        code = 0
    elif isinstance(stop.code, int):
        code = stop.code & 0xFF
    else:
        print(stop.code, file=sys.stderr)
        code = 1
except BaseException:
    import traceback
    traceback.print_exc()
    code = 1
try:
    sys.stdout.flush()
    sys.stderr.flush()
except BaseException:
    code = code or 120
os._exit(code)
"""

_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}


# ---------------------------------------------------------------------------------------------
# cgroups


class _Cgroup:
    """A per-run cgroup: v1 (one directory per controller) or v2 (one directory)."""

    def __init__(self, paths: list[str], version: int):
        self.paths, self.version = paths, version

    @staticmethod
    def parents() -> tuple[list[str], int]:
        """Where this process may create child cgroups: ``(dirs, version)``, ``([], 0)``."""
        try:
            with open("/proc/self/cgroup") as f:
                lines = [line.rstrip("\n").split(":", 2) for line in f]
        except OSError:
            return [], 0
        own = {ctrl: path for _, ctrls, path in lines for ctrl in ctrls.split(",")}
        v1 = [
            os.path.join(_CGROUP_ROOT, ctrl) + own[ctrl]
            for ctrl in ("memory", "pids", "cpu")
            if ctrl in own and os.path.isdir(os.path.join(_CGROUP_ROOT, ctrl))
        ]
        if len(v1) == 3 and all(os.access(p, os.W_OK) for p in v1):
            return v1, 1
        if os.path.exists(os.path.join(_CGROUP_ROOT, "cgroup.controllers")) and "" in own:
            parent = _CGROUP_ROOT + own[""]
            if os.access(parent, os.W_OK):
                return [parent], 2
        return [], 0

    @classmethod
    def create(cls, memory_bytes: int) -> _Cgroup | None:
        parents, version = _Cgroup.parents()
        if not parents:
            return None
        name = f"jaxrl-sandbox-{os.getpid()}-{secrets.token_hex(6)}"
        group = cls([os.path.join(p, name) for p in parents], version)
        try:
            for path in group.paths:
                os.mkdir(path)
            if version == 1:
                memory, pids, cpu = group.paths
                _write(os.path.join(memory, "memory.limit_in_bytes"), memory_bytes)
                with contextlib.suppress(OSError):  # absent without swap accounting
                    _write(os.path.join(memory, "memory.memsw.limit_in_bytes"), memory_bytes)
                _write(os.path.join(pids, "pids.max"), _MAX_TASKS)
                _write(os.path.join(cpu, "cpu.cfs_period_us"), 100_000)
                _write(os.path.join(cpu, "cpu.cfs_quota_us"), 100_000)
            else:
                (path,) = group.paths
                _write(os.path.join(path, "memory.max"), memory_bytes)
                with contextlib.suppress(OSError):
                    _write(os.path.join(path, "memory.swap.max"), 0)
                _write(os.path.join(path, "pids.max"), _MAX_TASKS)
                _write(os.path.join(path, "cpu.max"), "100000 100000")
        except OSError:
            group.remove()
            return None
        return group

    def kill(self) -> None:
        """SIGKILLs every task in the group until none is left (or a second has passed)."""
        if self.version == 2:
            with contextlib.suppress(OSError):
                _write(os.path.join(self.paths[0], "cgroup.kill"), 1)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            pids = set()
            for path in self.paths:
                with contextlib.suppress(OSError, ValueError):
                    with open(os.path.join(path, "cgroup.procs")) as f:
                        pids |= {int(p) for p in f.read().split()}
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.001)

    def remove(self) -> None:
        self.kill()
        for path in self.paths:
            for _ in range(100):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.002)


def _task_count() -> int:
    """Tasks (threads included) running on the machine now, from ``/proc/loadavg``; 0 unknown."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[1])
    except (OSError, IndexError, ValueError):
        return 0


def _write(path: str, value: object) -> None:
    with open(path, "w") as f:
        f.write(str(value))


# ---------------------------------------------------------------------------------------------
# The view of the filesystem


@functools.lru_cache(maxsize=1)
def _view() -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """``(binds, symlinks, sys.path)`` of the program's filesystem view."""
    binds: list[str] = []
    symlinks: list[tuple[str, str]] = []
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            symlinks.append((top, os.readlink(top)))
        elif os.path.isdir(top):
            binds.append(top)
    paths = sysconfig.get_paths()
    wanted = [sys.base_prefix, sys.base_exec_prefix, paths["purelib"], paths["platlib"]]

    def covered(path: str, dirs: list[str]) -> bool:
        return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)

    for path in sorted(map(os.path.realpath, wanted), key=len):
        if os.path.isdir(path) and not covered(path, binds):
            binds.append(path)
    # Only the interpreter's own entries of sys.path: never the trainer's working directory.
    sys_path = [p for p in sys.path if p and covered(os.path.realpath(p), binds)]
    files = ["/etc/ld.so.cache", "/etc/localtime"]
    binds += [f for f in files if os.path.isfile(f)]
    binds += [f"/dev/{d}" for d in ("null", "zero", "full", "random", "urandom")]
    return binds, symlinks, sys_path


# ---------------------------------------------------------------------------------------------
# Running


_LADDER_ROOT = (("namespaces", True), ("process", True), ("process", False))
_LADDER_USER = (("namespaces", False), ("process", False))
_choice: tuple[str, bool, tuple[str, ...]] | None = None
_choice_lock = threading.Lock()
_announced = False


def _launch(
    source: str,
    stdin: bytes,
    *,
    timeout_s: float,
    memory_mb: int,
    level: str,
    drop_uid: bool,
) -> tuple[RunResult, list[str] | None]:
    """One run at ``level``; returns the result and the missing protections it reported."""
    is_root = os.geteuid() == 0
    namespaces = level == "namespaces" and sys.platform == "linux"
    pivot = _PIVOT_ROOT.get(os.uname().machine)
    if pivot is None:
        namespaces = False
    root = tempfile.mkdtemp(prefix="jaxrl-sandbox-")
    uid = _UID_BASE + secrets.randbelow(_UID_SPAN) if (is_root and drop_uid) else None
    cgroup = _Cgroup.create((memory_mb + _LAUNCHER_MB) << 20)
    binds, symlinks, sys_path = _view()
    cfg = {
        "cgroups": cgroup.paths if cgroup else [],
        "namespaces": namespaces,
        "userns": namespaces and not is_root,
        "root": root,
        "binds": binds,
        "symlinks": symlinks,
        "pivot_root": pivot,
        "tmp_mb": _TMP_MB,
        "uid": uid,
        "memory": memory_mb << 20,
        "cpu_s": math.ceil(timeout_s) + 1,
        "fsize": _MAX_FILE_BYTES,
        # RLIMIT_NPROC counts every process of the uid: a fresh uid has none, a shared one
        # (the trainer's) gets the headroom over what runs now.
        "nproc": 0 if cgroup else _MAX_TASKS + (0 if uid is not None else _task_count()),
        "env": ENVIRONMENT,
        "path": sys_path,
        "source": source,
    }
    if uid is not None and not namespaces:
        os.chown(root, uid, uid)  # its working directory on the host
    status_read, status_write = os.pipe()
    process = None
    try:
        with tempfile.TemporaryFile() as config, tempfile.TemporaryFile() as stdin_file:
            config.write(json.dumps(cfg).encode())
            config.seek(0)
            stdin_file.write(stdin)
            stdin_file.seek(0)
            command = [sys.executable, "-I", "-S", "-X", "utf8", "-c", _LAUNCHER]
            command += [str(config.fileno()), str(status_write)]
            process = subprocess.Popen(
                command,
                stdin=stdin_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=dict(ENVIRONMENT),
                cwd="/",
                pass_fds=(config.fileno(), status_write),
                close_fds=True,
            )
        os.close(status_write)
        status_write = -1
        stdout, stderr, status, stopped = _collect(process, status_read, timeout_s)
    finally:
        if status_write >= 0:
            os.close(status_write)
        os.close(status_read)
        if process is not None:
            _stop(process)
        if cgroup is not None:
            cgroup.remove()
        shutil.rmtree(root, ignore_errors=True)
    missing, returncode = None, None
    for line in status.decode("utf-8", "replace").splitlines():
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            message = json.loads(line)
            if "missing" in message:
                missing = [str(m) for m in message["missing"]]
            if "exit" in message and message["exit"] is not None:
                returncode = os.waitstatus_to_exitcode(int(message["exit"]))
    timed_out = stopped == "timeout"
    if stopped == "output":
        returncode = -signal.SIGKILL
    elif timed_out:
        returncode = None
    result = RunResult(
        returncode,
        stdout.decode("utf-8", errors="replace"),
        stderr[:MAX_STDERR_BYTES].decode("utf-8", errors="replace"),
        timed_out,
    )
    return result, missing


def _collect(
    process: subprocess.Popen, status_fd: int, timeout_s: float
) -> tuple[bytes, bytes, bytes, str | None]:
    """Reads stdout, stderr and the status pipe until they close, the deadline passes
    (``"timeout"``) or stdout overflows (``"output"``)."""
    deadline = time.monotonic() + timeout_s
    buffers = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    buffers[status_fd] = bytearray()
    limits = {process.stdout.fileno(): MAX_OUTPUT_BYTES, process.stderr.fileno(): MAX_STDERR_BYTES}
    limits[status_fd] = 1 << 16
    open_fds = set(buffers)
    stopped = None
    exited = False
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            stopped = None if exited else "timeout"
            break
        ready, _, _ = select.select(list(open_fds), [], [], left)
        for fd in ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                open_fds.discard(fd)
                continue
            buffer = buffers[fd]
            if fd == status_fd and not exited and b'"exit"' in buffer + chunk:
                # The program's main process ended: what it wrote is in the pipes now; stop
                # soon even if a descendant that escaped the teardown keeps them open.
                exited = True
                deadline = min(deadline, time.monotonic() + _EXIT_GRACE_S)
            room = limits[fd] - len(buffer)
            buffer += chunk[: max(room, 0)]
            if len(chunk) > room and fd == process.stdout.fileno():
                stopped = "output"
                open_fds.clear()
    return (
        bytes(buffers[process.stdout.fileno()]),
        bytes(buffers[process.stderr.fileno()]),
        bytes(buffers[status_fd]),
        stopped,
    )


def _stop(process: subprocess.Popen) -> None:
    """Kills the launcher (its namespace init follows, and with it every process inside)."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()


def _probe() -> tuple[str, bool, tuple[str, ...]]:
    """The strongest level whose probe program runs correctly here, and what it lacks."""
    ladder = _LADDER_ROOT if os.geteuid() == 0 else _LADDER_USER
    check = "import fractions, json\nprint(json.dumps(str(fractions.Fraction(1, 3))))\n"
    for level, drop_uid in ladder:
        result, missing = _launch(
            check, b"", timeout_s=10.0, memory_mb=256, level=level, drop_uid=drop_uid
        )
        if result.returncode == 0 and result.stdout.strip() == '"1/3"' and missing is not None:
            return level, drop_uid, tuple(m for m in PROTECTIONS if m in missing)
    return (*ladder[-1], PROTECTIONS)


def _level() -> tuple[str, bool, tuple[str, ...]]:
    global _choice
    with _choice_lock:
        if _choice is None:
            _choice = _probe()
        return _choice


def protections() -> Protections:
    """The isolation local runs get here (probed once per process, by running a program)."""
    level, _, missing = _level()
    return Protections(level, missing)


def announce() -> Protections:
    """Logs, once per process, which protections local runs lack (a warning) or that they
    have them all; returns ``protections()``."""
    global _announced
    found = protections()
    if not _announced:
        _announced = True
        if found.missing:
            logger.warning(
                "code_exec sandbox (%s level): missing %s; run the trainer as root or with "
                "user namespaces and a writable cgroup for full isolation, or use backend: http",
                found.level,
                ", ".join(found.missing),
            )
        else:
            logger.info("code_exec sandbox: all protections (%s)", ", ".join(PROTECTIONS))
    return found


def run_sandboxed(
    source: str, *, stdin: bytes = b"", timeout_s: float = 5.0, memory_mb: int = 512
) -> RunResult:
    """Runs ``source`` as ``__main__`` in the local sandbox (module docstring).

    Args:
      source: the program text (saved as ``main.py`` in ``/tmp/run`` of the run's private ``/tmp``).
      stdin: its standard input.
      timeout_s: wall-clock limit, interpreter start included.
      memory_mb: address-space limit of the program's process (the run's cgroup allows
        64 MiB more, for the launcher).

    Returns:
      The run's ``RunResult``.
    """
    level, drop_uid, _ = _level()
    result, _ = _launch(
        source, stdin, timeout_s=timeout_s, memory_mb=memory_mb, level=level, drop_uid=drop_uid
    )
    return result
