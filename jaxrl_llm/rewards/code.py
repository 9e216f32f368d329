"""Code-execution reward: run the completion's program against the example's tests, sandboxed.

The program is the completion's last fenced ```` ```python ```` block (also ``py``,
``python3``), else its last fenced block of any kind; a completion without one scores
``incorrect``. The tests come from the example (``example.extra["tests"]`` for a
``jaxrl_llm.data.Example``, ``example["tests"]`` for a mapping), in one of two forms:

* **asserts**, a list of Python snippets (``"assert add(2, 3) == 5"``). The trainer splits each
  (``rewards.verdict``): only the calls into the program (``add(2, 3)``) go to the sandbox, which
  runs the program and prints each call's value as plain data; the comparison with the expected
  values runs here, so the program never sees them and cannot report a pass. A program that
  fails to load (syntax error, exception, ``sys.exit``) fails every test. ``timeout_s`` bounds
  the whole process: tests whose calls were not reported by then fail. A snippet that cannot be
  split this way is a ``ValueError`` naming it.
* **stdin/stdout cases**, a list of ``{"input": str, "output": str}``: one run per case, the
  program as ``__main__`` with ``input`` on stdin; the case passes when it exits with status 0
  within ``timeout_s`` and its stdout equals ``output`` after stripping surrounding whitespace
  and each line's trailing whitespace (compared here). All-or-nothing scoring stops at the first
  failing case.

A JSON string holding such a list is decoded first; any other string is one assert snippet.

Where the program runs (``backend``): ``local``, the operating-system sandbox of
``rewards.sandbox`` (namespaces, a private read-only filesystem view, an unprivileged user,
cgroup limits; what this machine allows is logged once), or ``http``, a SandboxFusion service
(``rewards.sandbox_http``). Either way the program only produces output; every verdict is made
in the trainer's process. See docs/rewards.md for what each backend isolates.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from jaxrl_llm.rewards import sandbox
from jaxrl_llm.rewards.base import RewardInput
from jaxrl_llm.rewards.sandbox import RunResult, run_sandboxed
from jaxrl_llm.rewards.sandbox_http import endpoint, run_remote
from jaxrl_llm.rewards.verdict import TestPlan, harness_source, judge, split_tests

__all__ = [
    "BACKENDS",
    "CodeExec",
    "RunResult",
    "example_tests",
    "extract_code",
    "run_assert_tests",
    "run_python",
]

_FENCE = re.compile(r"```[ \t]*([\w+.#-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = frozenset({"python", "py", "python3", "py3"})
BACKENDS = ("local", "http")

Runner = Callable[[str, str], RunResult]  # (source, stdin) -> result, limits bound


def extract_code(text: str) -> str | None:
    """The program in ``text``: its last fenced python block, else its last fenced block.

    ``"a\\n```python\\nprint(1)\\n```"`` → ``"print(1)\\n"``; text without a complete fence (or
    whose chosen block is blank) → ``None``.
    """
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]
    python = [body for tag, body in blocks if tag in _PYTHON_TAGS]
    chosen = python[-1] if python else blocks[-1][1] if blocks else None
    return chosen if chosen is not None and chosen.strip() else None


def run_python(
    source: str, *, stdin: str = "", timeout_s: float = 5.0, memory_mb: int = 512
) -> RunResult:
    """Runs ``source`` as a ``__main__`` script in the local sandbox (``rewards.sandbox``).

    Args:
      source: the program text, saved as ``main.py`` in the run's private directory.
      stdin: its standard input.
      timeout_s: wall-clock limit, interpreter start included.
      memory_mb: address-space limit of its process.

    Returns:
      The run's ``RunResult``.
    """
    return run_sandboxed(
        source, stdin=stdin.encode("utf-8"), timeout_s=timeout_s, memory_mb=memory_mb
    )


def _assert_tests(run: Runner, source: str, plan: TestPlan) -> list[bool]:
    """Runs ``plan``'s probes after ``source`` with ``run``; judges them here."""
    result = run(harness_source(source, plan.probes), "")
    if not result.timed_out and result.returncode != 0:
        return [False] * len(plan.checks)  # did not load, crashed, or was stopped
    if result.timed_out and not result.stdout:
        return [False] * len(plan.checks)  # never got past loading
    return judge(plan, result.stdout, timed_out=result.timed_out)


def run_assert_tests(
    source: str, tests: Sequence[str], *, timeout_s: float = 5.0, memory_mb: int = 512
) -> list[bool]:
    """Runs ``source`` and each test's calls in the local sandbox; judges the tests here.

    Args:
      source: the program text.
      tests: assert snippets (see ``rewards.verdict`` for the forms accepted).
      timeout_s: wall-clock limit for the whole process.
      memory_mb: address-space limit.

    Returns:
      One bool per test (tests whose calls were not reported in time fail).

    Raises:
      ValueError: naming a test that cannot be judged outside the program.
    """
    plan = split_tests(tests)

    def run(script: str, stdin: str) -> RunResult:
        return run_python(script, stdin=stdin, timeout_s=timeout_s, memory_mb=memory_mb)

    return _assert_tests(run, source, plan)


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
    code block included). Tests, verdicts and backends: see the module docstring.

    Attributes:
      timeout_s: wall-clock limit of one run: the asserts' process, or one stdin/stdout case.
      memory_mb: memory limit of the program's process (local: ``RLIMIT_AS``; http:
        ``memory_limit_MB``).
      partial: score the fraction of tests passed instead of all-or-nothing.
      correct: reward when every test passes.
      incorrect: reward when none does (or there is no program).
      backend: ``"local"`` (the OS sandbox on this machine) or ``"http"`` (SandboxFusion).
      url: the SandboxFusion service (``http://host:8080`` or its ``.../run_code``); http only.
      retries: http: further tries of a failed request, with exponential backoff.
      max_concurrency: http: requests in flight to ``url`` from one process.

    Raises:
      ValueError: on a non-positive ``timeout_s`` or ``memory_mb``, an unknown ``backend``, a
        missing or malformed ``url`` for http, a ``url`` for local, a negative ``retries`` or a
        ``max_concurrency`` below 1.
    """

    name: ClassVar[str] = "code_exec"
    timeout_s: float = 5.0
    memory_mb: int = 512
    partial: bool = False
    correct: float = 1.0
    incorrect: float = 0.0
    backend: str = "local"
    url: str | None = None
    retries: int = 3
    max_concurrency: int = 8

    def __post_init__(self):
        if not isinstance(self.timeout_s, int | float) or not 0 < self.timeout_s < math.inf:
            raise ValueError(
                f"code_exec timeout_s must be a positive number, got {self.timeout_s!r}"
            )
        if isinstance(self.memory_mb, bool) or not isinstance(self.memory_mb, int):
            raise ValueError(f"code_exec memory_mb must be an int, got {self.memory_mb!r}")
        if self.memory_mb <= 0:
            raise ValueError(f"code_exec memory_mb must be positive, got {self.memory_mb}")
        if self.backend not in BACKENDS:
            raise ValueError(
                f"code_exec backend must be one of {list(BACKENDS)}, got {self.backend!r}"
            )
        if self.backend == "http":
            if self.url is None:
                raise ValueError(
                    "code_exec backend 'http' needs url: the SandboxFusion service, "
                    "e.g. url: http://localhost:8080"
                )
            endpoint(self.url)  # a clear ValueError for a malformed one
        elif self.url is not None:
            raise ValueError(
                f"code_exec url is only used with backend 'http' (backend is {self.backend!r})"
            )
        for field, low in (("retries", 0), ("max_concurrency", 1)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"code_exec {field} must be an int >= {low}, got {value!r}")
        if self.backend == "local":
            sandbox.announce()  # the run's first lines say which protections are missing

    def _runner(self) -> Runner:
        limits = {"timeout_s": self.timeout_s, "memory_mb": self.memory_mb}
        if self.backend == "http":
            url, retries, concurrency = endpoint(self.url), self.retries, self.max_concurrency

            def remote(source: str, stdin: str) -> RunResult:
                return run_remote(
                    url, source, stdin=stdin, retries=retries, max_concurrency=concurrency, **limits
                )

            return remote

        def local(source: str, stdin: str) -> RunResult:
            return run_python(source, stdin=stdin, **limits)

        return local

    def passed(self, code: str, example: Any) -> list[bool]:
        """Which of ``example``'s tests ``code`` passes (all-or-nothing stops at a failure).

        Raises:
          ValueError: if the example's ``tests`` field is missing or malformed, or an assert
            cannot be judged outside the program.
        """
        kind, tests = example_tests(example)
        return self._run(code, kind, split_tests(tests) if kind == "asserts" else tests)

    def _run(self, code: str, kind: str, tests: Any) -> list[bool]:
        run = self._runner()
        if kind == "asserts":
            return _assert_tests(run, code, tests)
        results: list[bool] = []
        for case in tests:
            result = run(code, case["input"])
            ok = (
                result.returncode == 0
                and not result.timed_out
                and _same_output(result.stdout, case["output"])
            )
            results.append(ok)
            if not ok and not self.partial:
                break
        return results + [False] * (len(tests) - len(results))

    def __call__(self, inp: RewardInput) -> float:
        # A missing or unsupported tests field is an error, code or not.
        kind, tests = example_tests(inp.example)
        plan = split_tests(tests) if kind == "asserts" else tests
        code = extract_code(inp.completion)
        if code is None:
            return float(self.incorrect)
        passed = self._run(code, kind, plan)
        total = len(passed)
        if self.partial:
            fraction = sum(passed) / total
            return float(self.incorrect + (self.correct - self.incorrect) * fraction)
        return float(self.correct if all(passed) else self.incorrect)
