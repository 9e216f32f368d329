"""Code-execution reward: run the completion's program against the example's tests, sandboxed.

The program is the completion's last fenced ```` ```python ```` block (also ``py``,
``python3``), else its last fenced block of any kind; a completion without one scores
``incorrect``. The tests come from the example (``example.extra["tests"]`` for a
``jaxrl_llm.data.Example``, ``example["tests"]`` for a mapping), in one of two forms:

* **asserts**, a list of Python snippets (``"assert add(2, 3) == 5"``): one process runs the
  program, then each snippet in the program's namespace, in order, each in its own
  ``try``, so a failing test does not hide the next one; a test passes when its snippet
  raises nothing. A program that fails to load (syntax error, exception, ``sys.exit``) fails
  every test. ``timeout_s`` bounds the whole process: tests not reported by then fail.
* **stdin/stdout cases**, a list of ``{"input": str, "output": str}``: one process per case
  runs the program as ``__main__`` with ``input`` on stdin; the case passes when it exits with
  status 0 within ``timeout_s`` and its stdout equals ``output`` after stripping surrounding
  whitespace and each line's trailing whitespace. All-or-nothing scoring stops at the first
  failing case.

A JSON string holding such a list is decoded first; any other string is one assert snippet.

The sandbox (``run_python``): a fresh temporary directory as the working directory (removed
afterwards), ``python -I -X utf8`` (isolated: no user site, no ``PYTHON*`` variables), a
minimal environment (``PATH``, ``HOME``/``TMPDIR`` = the directory, one BLAS/OpenMP thread;
nothing inherited, so no tokens or keys), its own session and process group, killed as a group
(``SIGKILL``) at the wall-clock limit and again when it ends, so children cannot outlive it. In
the child, before the program runs, hard resource limits: address space ``memory_mb``
(``RLIMIT_AS``), CPU time ``ceil(timeout_s) + 1`` s (``RLIMIT_CPU``), files it writes
16 MiB (``RLIMIT_FSIZE``; stdout and stderr go to such files, so output is capped and never
buffered in the parent), no core dumps, and a process count (``RLIMIT_NPROC``) of the tasks
running now plus 64, which stops a fork bomb from growing without bound (root ignores it).
The limits are set by the child itself rather than in a ``preexec_fn``, which is unsafe in a
multi-threaded parent such as a JAX process.

What it does NOT isolate: the network, reads (and writes within the size limit) anywhere the
user may access on the filesystem, other processes of the same user, and the test snippets
themselves, which run in the program's interpreter where the program can inspect them. It
contains accidents (infinite loops, memory blow-ups, crashes, runaway output, stray child
processes), not an adversary: run untrusted code in a container or VM as well. POSIX only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

from jaxrl_llm.rewards.base import RewardInput

_FENCE = re.compile(r"```[ \t]*([\w+.#-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = frozenset({"python", "py", "python3", "py3"})
_MAX_FILE_BYTES = 16 << 20  # RLIMIT_FSIZE: stdout, stderr and any file the program writes
_MAX_STDERR_CHARS = 64 << 10  # stderr kept in a RunResult (diagnostics only)
_EXTRA_PROCESSES = 64  # RLIMIT_NPROC headroom over the tasks running at launch

# Runs inside the sandboxed interpreter: sets the limits, then either runs main.py as __main__
# ("run") or the program and its assert snippets from a JSON payload on stdin ("tests"),
# reporting "<token> <index> pass|fail" lines on a private copy of stdout.
_HARNESS = r"""
import json, os, resource, runpy, sys

def _limit(kind, value):
    hard = resource.getrlimit(kind)[1]
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    try:
        resource.setrlimit(kind, (value, value))
    except (ValueError, OSError):
        pass

mode, memory, cpu, fsize, nproc = sys.argv[1], *map(int, sys.argv[2:6])
_limit(resource.RLIMIT_AS, memory)
_limit(resource.RLIMIT_CPU, cpu)
_limit(resource.RLIMIT_FSIZE, fsize)
_limit(resource.RLIMIT_CORE, 0)
if nproc > 0:
    _limit(resource.RLIMIT_NPROC, nproc)
if mode == "run":
    sys.argv = ["main.py"]
    runpy.run_path("main.py", run_name="__main__")
else:
    payload = json.loads(sys.stdin.buffer.read())
    token, code, tests = payload["token"], payload["code"], payload["tests"]
    del payload
    report = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(code, "main.py", "exec"), namespace)
    except BaseException as err:
        report.write(f"{token} load {type(err).__name__}\n")
        report.flush()
        os._exit(1)
    for index, test in enumerate(tests):
        try:
            exec(compile(test, f"<test {index}>", "exec"), namespace)
            outcome = "pass"
        except BaseException:
            outcome = "fail"
        report.write(f"{token} {index} {outcome}\n")
        report.flush()
    os._exit(0)
"""


class RunResult(NamedTuple):
    """What a sandboxed run left behind.

    Attributes:
      returncode: the exit status (negative: killed by that signal), ``None`` when it was
        killed at the wall-clock limit.
      stdout: its standard output (at most 16 MiB; UTF-8, undecodable bytes replaced).
      stderr: the first 64 KiB characters of its standard error.
      timed_out: whether it ran past the wall-clock limit.
    """

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool


def extract_code(text: str) -> str | None:
    """The program in ``text``: its last fenced python block, else its last fenced block.

    ``"a\\n```python\\nprint(1)\\n```"`` → ``"print(1)\\n"``; text without a complete fence (or
    whose chosen block is blank) → ``None``.
    """
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]
    python = [body for tag, body in blocks if tag in _PYTHON_TAGS]
    chosen = python[-1] if python else blocks[-1][1] if blocks else None
    return chosen if chosen is not None and chosen.strip() else None


def _task_count() -> int:
    """Tasks (threads included) running on the machine now, from ``/proc/loadavg``; 0 unknown."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[1])
    except (OSError, IndexError, ValueError):
        return 0


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _read(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _execute(
    mode: str, files: Mapping[str, str], stdin: bytes, *, timeout_s: float, memory_mb: int
) -> RunResult:
    """Runs the harness in ``mode`` in a fresh directory holding ``files``; see the module."""
    # The program's directory holds only its own files; its stdio files live elsewhere.
    workdir = tempfile.mkdtemp(prefix="jaxrl-sandbox-")
    iodir = tempfile.mkdtemp(prefix="jaxrl-sandbox-io-")
    try:
        for name, text in files.items():
            with open(os.path.join(workdir, name), "w", encoding="utf-8") as f:
                f.write(text)
        paths = {n: os.path.join(iodir, n) for n in ("stdin", "stdout", "stderr")}
        with open(paths["stdin"], "wb") as f:
            f.write(stdin)
        tasks = _task_count()
        limits = [
            memory_mb << 20,
            math.ceil(timeout_s) + 1,
            _MAX_FILE_BYTES,
            tasks + _EXTRA_PROCESSES if tasks else 0,
        ]
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": workdir,
            "TMPDIR": workdir,
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        command = [sys.executable, "-I", "-X", "utf8", "-c", _HARNESS, mode, *map(str, limits)]
        with (
            open(paths["stdin"], "rb") as fin,
            open(paths["stdout"], "wb") as fout,
            open(paths["stderr"], "wb") as ferr,
        ):
            process = subprocess.Popen(
                command,
                stdin=fin,
                stdout=fout,
                stderr=ferr,
                cwd=workdir,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
            try:
                returncode = process.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                _kill_group(process.pid)
                process.wait()
                returncode, timed_out = None, True
            _kill_group(process.pid)  # children it left behind
        stdout = _read(paths["stdout"], _MAX_FILE_BYTES)
        stderr = _read(paths["stderr"], _MAX_STDERR_CHARS)
        return RunResult(returncode, stdout, stderr, timed_out)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(iodir, ignore_errors=True)


def run_python(
    source: str, *, stdin: str = "", timeout_s: float = 5.0, memory_mb: int = 512
) -> RunResult:
    """Runs ``source`` as a ``__main__`` script in the sandbox (module docstring).

    Args:
      source: the program text, saved as ``main.py`` in the run's directory.
      stdin: its standard input.
      timeout_s: wall-clock limit, interpreter start included.
      memory_mb: address-space limit.

    Returns:
      The run's ``RunResult``.
    """
    return _execute(
        "run",
        {"main.py": source},
        stdin.encode("utf-8"),
        timeout_s=timeout_s,
        memory_mb=memory_mb,
    )


def run_assert_tests(
    source: str, tests: Sequence[str], *, timeout_s: float = 5.0, memory_mb: int = 512
) -> list[bool]:
    """Runs ``source`` then each test snippet in one sandboxed process; which passed.

    Args:
      source: the program text.
      tests: Python snippets run after it in its namespace, each on its own.
      timeout_s: wall-clock limit for the whole process.
      memory_mb: address-space limit.

    Returns:
      One bool per test: it ran and raised nothing (tests not reached in time fail).
    """
    token = secrets.token_hex(16)
    payload = json.dumps({"token": token, "code": source, "tests": list(tests)})
    result = _execute(
        "tests", {}, payload.encode("utf-8"), timeout_s=timeout_s, memory_mb=memory_mb
    )
    passed = [False] * len(tests)
    for line in result.stdout.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[0] == token and fields[2] == "pass":
            if fields[1].isdigit() and int(fields[1]) < len(tests):
                passed[int(fields[1])] = True
    return passed


def _same_output(got: str, want: str) -> bool:
    def norm(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip().splitlines()]

    return norm(got) == norm(want)


def example_tests(example: Any) -> tuple[str, list]:
    """The example's tests as ``("asserts", [snippet, ...])`` or ``("io", [{input, output}])``.

    Raises:
      ValueError: if the example has no ``tests`` field, or it is empty or malformed.
    """
    missing = object()
    if isinstance(example, Mapping):
        tests, where = example.get("tests", missing), "example['tests']"
    else:
        extra = getattr(example, "extra", None)
        tests = extra.get("tests", missing) if isinstance(extra, Mapping) else missing
        where = "example.extra['tests']"
    if tests is missing:
        raise ValueError(
            f"code_exec needs the example's 'tests' field ({where}: a list of assert snippets "
            f"or of {{'input', 'output'}} cases), got {type(example).__name__} without it"
        )
    if isinstance(tests, str):
        try:
            decoded = json.loads(tests)
        except ValueError:
            decoded = None
        tests = decoded if isinstance(decoded, list) else [tests]
    if not isinstance(tests, list | tuple) or not tests:
        raise ValueError(f"code_exec: {where} must be a non-empty list, got {tests!r:.200}")
    if all(isinstance(t, str) for t in tests):
        return "asserts", list(tests)
    if all(
        isinstance(t, Mapping)
        and isinstance(t.get("input"), str)
        and isinstance(t.get("output"), str)
        for t in tests
    ):
        return "io", [{"input": t["input"], "output": t["output"]} for t in tests]
    raise ValueError(
        f"code_exec: {where} must hold only assert snippets (str) or only "
        f"{{'input': str, 'output': str}} cases, got {tests!r:.200}"
    )


@dataclasses.dataclass(frozen=True)
class CodeExec:
    """Code-execution reward: the completion's program run against the example's tests.

    ``r = incorrect + (correct - incorrect) · passed / total`` with ``partial``, else
    ``correct`` when every test passes and ``incorrect`` otherwise (a completion without a
    code block included). Tests and sandbox: see the module docstring.

    Attributes:
      timeout_s: wall-clock limit of one run: the asserts' process, or one stdin/stdout case.
      memory_mb: address-space limit of the program's process.
      partial: score the fraction of tests passed instead of all-or-nothing.
      correct: reward when every test passes.
      incorrect: reward when none does (or there is no program).

    Raises:
      ValueError: on a non-positive ``timeout_s`` or ``memory_mb``.
    """

    name: ClassVar[str] = "code_exec"
    timeout_s: float = 5.0
    memory_mb: int = 512
    partial: bool = False
    correct: float = 1.0
    incorrect: float = 0.0

    def __post_init__(self):
        if not isinstance(self.timeout_s, int | float) or not 0 < self.timeout_s < math.inf:
            raise ValueError(
                f"code_exec timeout_s must be a positive number, got {self.timeout_s!r}"
            )
        if isinstance(self.memory_mb, bool) or not isinstance(self.memory_mb, int):
            raise ValueError(f"code_exec memory_mb must be an int, got {self.memory_mb!r}")
        if self.memory_mb <= 0:
            raise ValueError(f"code_exec memory_mb must be positive, got {self.memory_mb}")

    def passed(self, code: str, example: Any) -> list[bool]:
        """Which of ``example``'s tests ``code`` passes (all-or-nothing stops at a failure).

        Raises:
          ValueError: if the example's ``tests`` field is missing or malformed.
        """
        return self._run(code, *example_tests(example))

    def _run(self, code: str, kind: str, tests: list) -> list[bool]:
        limits = {"timeout_s": self.timeout_s, "memory_mb": self.memory_mb}
        if kind == "asserts":
            return run_assert_tests(code, tests, **limits)
        results: list[bool] = []
        for case in tests:
            run = run_python(code, stdin=case["input"], **limits)
            ok = run.returncode == 0 and _same_output(run.stdout, case["output"])
            results.append(ok)
            if not ok and not self.partial:
                break
        return results + [False] * (len(tests) - len(results))

    def __call__(self, inp: RewardInput) -> float:
        kind, tests = example_tests(inp.example)  # a missing field is an error, code or not
        code = extract_code(inp.completion)
        if code is None:
            return float(self.incorrect)
        passed = self._run(code, kind, tests)
        if self.partial:
            fraction = sum(passed) / len(tests)
            return float(self.incorrect + (self.correct - self.incorrect) * fraction)
        return float(self.correct if all(passed) else self.incorrect)
