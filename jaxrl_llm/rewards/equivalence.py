"""Symbolic answer equivalence by ``math-verify``, in bounded time, from any thread.

``equivalent(prediction, reference, timeout_s=...)`` parses both texts with ``math_verify.parse``
(LaTeX, e.g. ``\\boxed{...}``, and plain expressions) and compares them with
``math_verify.verify``: ``\\frac{1}{2}`` = ``0.5``, ``2^{10}`` = ``1024``, ``\\sqrt{4}`` = ``2``,
``x+1`` = ``1+x``, ``\\{1,2\\}`` = ``\\{2,1\\}``, ``[0,1)`` = ``[0, 1)``, ``x=2`` = ``2``; floats
compare after rounding to 6 decimals. It answers ``None`` when it cannot decide: math-verify
missing, a side without a parsed math object (only text), an error, or the time limit.

Time. math-verify's own timeouts use ``signal.alarm`` (whole seconds, main thread only; in
other threads they raise), so they are switched off and one ``timeout_s`` budget covers the
whole parse-and-compare: in the main thread a repeating ``SIGALRM`` timer (``setitimer``)
interrupts it, then restores any timer that was armed before; in other threads it runs in a
helper process (``spawn``, started on first use) where that timer works, and a helper that
still does not answer in time is killed (and restarted on the next call). In the main thread a
computation stuck inside one C call is interrupted only when that call returns.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import multiprocessing
import os
import signal
import threading
import time
from types import ModuleType
from typing import Any

_log = logging.getLogger(__name__)

_REPEAT_S = 0.05  # the timer fires again until the computation gives up (a swallowed raise)
_HELPER_START_S = 120.0  # a helper's start: spawn plus importing math-verify and SymPy
_HELPER_GRACE_S = 2.0  # beyond ``timeout_s``: the helper's own timer should have fired


class _Expired(BaseException):
    """Raised by the timer; a ``BaseException`` so math-verify's ``except Exception`` lets it
    through."""


class _QuietTimeoutWarning(logging.Filter):
    """Drops math-verify's warning that its own timeout is off: this module bounds the time."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


@functools.cache
def installed() -> bool:
    """Whether the ``math_verify`` package can be found (without importing it); cached."""
    return importlib.util.find_spec("math_verify") is not None


@functools.cache
def _load() -> ModuleType | None:
    """``math_verify``, imported once; ``None`` if it cannot be imported."""
    try:
        import math_verify  # noqa: PLC0415  (optional dependency, ~0.5 s to import)
    except Exception:  # noqa: BLE001  (missing, or broken by its own dependencies)
        return None
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_QuietTimeoutWarning())
    return math_verify


def available() -> bool:
    """Whether math-verify imports (importing it on the first call)."""
    return _load() is not None


def _has_math(parsed: Any) -> bool:
    from sympy import Basic, MatrixBase  # noqa: PLC0415  (math-verify's own dependency)

    return any(isinstance(item, Basic | MatrixBase) for item in parsed)


def _compare(prediction: str, reference: str) -> bool | None:
    """math-verify's verdict, ``None`` when a side has no math object; no time limit."""
    mv = _load()
    if mv is None:
        return None
    gold = mv.parse(reference, parsing_timeout=None)
    if not _has_math(gold):
        return None
    predicted = mv.parse(prediction, parsing_timeout=None)
    if not _has_math(predicted):
        return None
    return bool(mv.verify(gold, predicted, timeout_seconds=None))


def _timed(prediction: str, reference: str, timeout_s: float) -> bool | None:
    """``_compare`` under a ``SIGALRM`` timer; call only from the main thread."""

    def on_alarm(signum, frame):
        # Never interrupt this function's own bookkeeping (only the work it called), so the
        # timer cannot fire into the cleanup below and escape to the caller.
        if frame is not None and frame.f_code is _TIMED_CODE:
            return
        raise _Expired

    previous = signal.signal(signal.SIGALRM, on_alarm)
    start = time.monotonic()
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, timeout_s, _REPEAT_S)
    try:
        verdict = _compare(prediction, reference)
    except _Expired:
        verdict = None
    except Exception:  # noqa: BLE001  (a parser bug is "cannot decide", never a crash)
        _log.debug("math-verify failed", exc_info=True)
        verdict = None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_delay > 0:  # an enclosing timer (e.g. a test timeout) keeps its deadline
            remaining = max(outer_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, remaining, outer_interval)
    return verdict


_TIMED_CODE = _timed.__code__


def _helper_main(conn: Any) -> None:
    """The helper process: answers ``(prediction, reference, timeout_s)`` requests."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    _load()
    conn.send("ready")
    while True:
        try:
            prediction, reference, timeout_s = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(_timed(prediction, reference, timeout_s))


class _Helper:
    """One helper process per parent process, serving every non-main thread in turn."""

    def __init__(self):
        self._lock = threading.Lock()
        self._process: Any = None
        self._conn: Any = None
        self._owner = os.getpid()
        self._broken = False

    def _start(self) -> bool:
        if self._process is not None and self._process.is_alive():
            return True
        self._stop()
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(
            target=_helper_main, args=(child,), daemon=True, name="math-verify-helper"
        )
        process.start()
        child.close()
        self._process, self._conn = process, parent
        try:
            if parent.poll(_HELPER_START_S) and parent.recv() == "ready":
                return True
        except (EOFError, OSError):
            pass
        _log.warning("math-verify helper process did not start; using the builtin matcher")
        self._broken = True
        self._stop()
        return False

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(timeout=5)
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None

    def call(self, prediction: str, reference: str, timeout_s: float) -> bool | None:
        with self._lock:
            if self._owner != os.getpid():  # inherited through fork: not ours to talk to
                self._process = self._conn = None
                self._owner, self._broken = os.getpid(), False
            if self._broken or not self._start():
                return None
            try:
                self._conn.send((prediction, reference, timeout_s))
                if self._conn.poll(timeout_s + _HELPER_GRACE_S):
                    return self._conn.recv()
            except (EOFError, OSError):
                pass
            self._stop()  # stuck (or dead): kill it; the next call starts a fresh one
            return None


_HELPER = _Helper()


def equivalent(prediction: str, reference: str, *, timeout_s: float = 5.0) -> bool | None:
    """Whether math-verify finds ``prediction`` equal to ``reference``.

    Args:
      prediction: the answer text to check, e.g. ``"\\boxed{2^{10}}"``.
      reference: the gold answer text, e.g. ``"\\boxed{1024}"``. math-verify's comparison is
        not symmetric (``gold`` first): equations and intervals are read the gold's way.
      timeout_s: the time budget for parsing both and comparing (see the module docstring).

    Returns:
      ``True`` / ``False``, or ``None`` when math-verify cannot decide (module docstring).
    """
    if not available():
        return None
    main = threading.current_thread() is threading.main_thread()
    if main and signal.getsignal(signal.SIGALRM) is not None:
        return _timed(prediction, reference, timeout_s)
    return _HELPER.call(prediction, reference, timeout_s)
