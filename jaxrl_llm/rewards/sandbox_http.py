"""The remote sandbox: runs a Python program on a SandboxFusion service over HTTP.

SandboxFusion (github.com/bytedance/SandboxFusion, the service verl's ``sandbox_fusion`` reward
calls) runs code in its own isolated workers. One request per run::

    POST <url>   (…/run_code)
    {"code": <source>, "language": "python", "stdin": <stdin>,
     "run_timeout": timeout_s, "compile_timeout": timeout_s, "memory_limit_MB": memory_mb}
    → {"status": "Success" | "Failed" | "SandboxError", "message": str,
       "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error",
                      "return_code": int | null, "stdout": str, "stderr": str, ...}, ...}

Only ``run_result`` is read: ``Finished`` gives the return code and output,
``TimeLimitExceeded`` a timed-out run. The verdict is still computed by the trainer from that
output (``verdict.judge`` for asserts, the stdout comparison for stdin/stdout cases): the service
never receives an expected value.

Robustness: each request has a timeout (``timeout_s + 30`` s: the run plus queueing and
transfer) and is retried with exponential backoff (0.5 s, 1 s, 2 s, ... plus jitter) on
connection errors, timeouts, HTTP 429 / 5xx, a body that is not the expected JSON, and
``SandboxError``; at most ``max_concurrency`` requests per URL are in flight from one process.
A run whose retries are exhausted counts as failed (``RunResult`` with ``returncode=None``) and
is logged: a program must not be able to stop the trainer by upsetting the service. Only when
``_MAX_CONSECUTIVE_FAILURES`` runs in a row fail that way (the service is down or the URL is
wrong) does ``SandboxUnavailable`` stop the run. Responses are read up to 64 MiB.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from jaxrl_llm.rewards.sandbox import MAX_OUTPUT_BYTES, MAX_STDERR_BYTES, RunResult

logger = logging.getLogger(__name__)

_BACKOFF_S = 0.5  # first retry delay; doubles each retry
_REQUEST_SLACK_S = 30.0  # request timeout beyond the run's own
_MAX_RESPONSE_BYTES = 64 << 20
_MAX_CONSECUTIVE_FAILURES = 16

_semaphores: dict[tuple[str, int], threading.BoundedSemaphore] = {}
_state_lock = threading.Lock()
_consecutive_failures = 0


class SandboxUnavailable(RuntimeError):
    """The remote sandbox failed many runs in a row: it is down or misconfigured."""


class _Retry(Exception):
    """A failure worth another try (transport, overload, or the service's own error)."""


def endpoint(url: str) -> str:
    """``url`` as a ``run_code`` endpoint (``http://host:8080`` → ``http://host:8080/run_code``).

    Raises:
      ValueError: if ``url`` is not an ``http(s)://host...`` URL.
    """
    parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"code_exec url must be an http(s)://host[:port][/run_code] URL, got {url!r}"
        )
    path = parts.path.rstrip("/")
    if not path.endswith("/run_code"):
        path += "/run_code"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def _semaphore(url: str, max_concurrency: int) -> threading.BoundedSemaphore:
    with _state_lock:
        key = (url, max_concurrency)
        if key not in _semaphores:
            _semaphores[key] = threading.BoundedSemaphore(max_concurrency)
        return _semaphores[key]


def _post(url: str, body: bytes, timeout: float) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            data = response.read(_MAX_RESPONSE_BYTES + 1)
    except urllib.error.HTTPError as err:
        if err.code == 429 or err.code >= 500:
            raise _Retry(f"HTTP {err.code}") from err
        raise _Retry(f"HTTP {err.code} (not retried)") from err
    except (TimeoutError, urllib.error.URLError, http.client.HTTPException, OSError) as err:
        raise _Retry(f"{type(err).__name__}: {err}") from err
    if len(data) > _MAX_RESPONSE_BYTES:
        raise _Retry("response too large")
    try:
        reply = json.loads(data)
    except (ValueError, RecursionError) as err:
        raise _Retry("response is not JSON") from err
    if not isinstance(reply, dict):
        raise _Retry("response is not a JSON object")
    return reply


def _result(reply: dict[str, Any]) -> RunResult:
    """The ``RunResult`` in a SandboxFusion reply; ``_Retry`` on ``SandboxError``."""
    if reply.get("status") == "SandboxError":
        raise _Retry(f"SandboxError: {str(reply.get('message'))[:200]}")
    run = reply.get("run_result")
    if not isinstance(run, dict) or run.get("status") not in ("Finished", "TimeLimitExceeded"):
        raise _Retry(f"no usable run_result (status {reply.get('status')!r})")
    stdout, stderr = run.get("stdout") or "", run.get("stderr") or ""
    code = run.get("return_code")
    if not isinstance(stdout, str) or not isinstance(stderr, str):
        raise _Retry("run_result output is not text")
    if len(stdout) > MAX_OUTPUT_BYTES:  # as the local sandbox: runaway output fails the run
        return RunResult(None, stdout[:MAX_OUTPUT_BYTES], stderr[:MAX_STDERR_BYTES], False)
    if run["status"] == "TimeLimitExceeded":
        return RunResult(None, stdout, stderr[:MAX_STDERR_BYTES], True)
    if type(code) is not int:
        raise _Retry(f"return_code is {code!r}")
    return RunResult(code, stdout, stderr[:MAX_STDERR_BYTES], False)


def run_remote(
    url: str,
    source: str,
    *,
    stdin: str = "",
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    retries: int = 3,
    max_concurrency: int = 8,
) -> RunResult:
    """Runs ``source`` as a Python script on the SandboxFusion service at ``url``.

    Args:
      url: the service's ``run_code`` endpoint (see ``endpoint``).
      source: the program text.
      stdin: its standard input.
      timeout_s: the run's time limit (``run_timeout``).
      memory_mb: its memory limit (``memory_limit_MB``).
      retries: further tries after a failed request (module docstring).
      max_concurrency: requests in flight to ``url`` from this process.

    Returns:
      The run's ``RunResult``; ``returncode=None`` and the last error in ``stderr`` when every
      try failed.

    Raises:
      SandboxUnavailable: when this is the ``_MAX_CONSECUTIVE_FAILURES``-th failed run in a row.
    """
    global _consecutive_failures
    body = json.dumps(
        {
            "code": source,
            "language": "python",
            "stdin": stdin,
            "run_timeout": timeout_s,
            "compile_timeout": timeout_s,
            "memory_limit_MB": memory_mb,
        }
    ).encode("utf-8")
    error = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(_BACKOFF_S * 2 ** (attempt - 1) * (1 + random.random() / 2))
        try:
            with _semaphore(url, max_concurrency):
                result = _result(_post(url, body, timeout_s + _REQUEST_SLACK_S))
        except _Retry as err:
            error = str(err)
            if "not retried" in error:
                break
            continue
        with _state_lock:
            _consecutive_failures = 0
        return result
    with _state_lock:
        _consecutive_failures += 1
        failures = _consecutive_failures
    logger.warning(
        "code_exec remote sandbox %s: run failed after %d tries (%s)", url, attempt + 1, error
    )
    if failures >= _MAX_CONSECUTIVE_FAILURES:
        with _state_lock:
            _consecutive_failures = 0
        raise SandboxUnavailable(
            f"code_exec remote sandbox {url}: {failures} runs in a row failed, last: {error}"
        )
    return RunResult(None, "", f"remote sandbox failed: {error}", False)
