"""The http backend against a small SandboxFusion stand-in (``POST /run_code``, the subset the
client uses) served from a thread: verdicts made here, retries, timeouts, bounded concurrency,
and a service that fails never stopping the trainer for one bad run."""

import contextlib
import http.server
import json
import pickle
import threading
import time

import pytest

from jaxrl_llm.rewards import (
    CodeExec,
    RewardError,
    RewardInput,
    compute_rewards,
    make_reward,
    sandbox_http,
)
from jaxrl_llm.rewards.sandbox import run_sandboxed
from tests.rewards.test_sandbox import (
    ALWAYS_EQUAL,
    CASES,
    CORRECT,
    CORRECT_IO,
    FORGE_REPORT,
    READ_EXPECTED,
    TESTS,
    WRONG,
    fenced,
)


class FakeSandboxFusion(http.server.ThreadingHTTPServer):
    """Runs each request's code in the local sandbox, after the scripted ``faults``."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.faults: list[str] = []  # "503", "sandbox_error", "garbage", "slow", "tle"
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FakeSandboxFusion

    def log_message(self, *args):
        pass

    def do_POST(self):
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with server.lock:
            server.bodies.append(body)
            fault = server.faults.pop(0) if server.faults else None
            server.in_flight += 1
            server.max_in_flight = max(server.max_in_flight, server.in_flight)
        # A request is in flight until its reply is ready: the count drops before the reply
        # is sent, so a client's next request (after it reads this reply) never overlaps it.
        try:
            if self.path != "/run_code":
                code, data = 404, b"{}"
            elif fault == "503":
                code, data = 503, b"overloaded"
            elif fault == "garbage":
                code, data = 200, b"<html>"
            elif fault == "sandbox_error":
                code, data = 200, json.dumps({"status": "SandboxError", "message": "x"}).encode()
            elif fault == "slow":
                time.sleep(1.0)
                code, data = 200, b"{}"
            else:
                code, data = 200, json.dumps(self.run(body, tle=fault == "tle")).encode()
        finally:
            with server.lock:
                server.in_flight -= 1
        self.reply(code, data)

    def run(self, body: dict, tle: bool) -> dict:
        result = run_sandboxed(
            body["code"],
            stdin=(body.get("stdin") or "").encode(),
            timeout_s=body["run_timeout"],
            memory_mb=body["memory_limit_MB"],
        )
        status = "TimeLimitExceeded" if result.timed_out or tle else "Finished"
        run = {"status": status, "execution_time": 0.1, "return_code": result.returncode}
        run |= {"stdout": result.stdout, "stderr": result.stderr}
        ok = status == "Finished" and result.returncode == 0
        return {"status": "Success" if ok else "Failed", "message": "", "run_result": run}

    def reply(self, code: int, data: bytes):
        with contextlib.suppress(OSError):
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)


@pytest.fixture
def service(monkeypatch):
    monkeypatch.setattr(sandbox_http, "_BACKOFF_S", 0.01)
    monkeypatch.setattr(sandbox_http, "_REQUEST_SLACK_S", 0.5)
    server = FakeSandboxFusion()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def scores(service, programs, tests, **kwargs) -> list[float]:
    reward = make_reward("code_exec", backend="http", url=service.url, **kwargs)
    inputs = [RewardInput("p", fenced(code), {"tests": tests}) for code in programs]
    return compute_rewards(reward, inputs)[0].tolist()


def test_verdicts_are_made_here_and_expected_values_never_sent(service):
    programs = [CORRECT, WRONG, FORGE_REPORT, ALWAYS_EQUAL, READ_EXPECTED]
    assert scores(service, programs, TESTS) == [1.0, 0.0, 0.0, 0.0, 0.0]
    half_right = CORRECT.split("def digits")[0] + "def digits(n):\n    return [n]\n"
    assert scores(service, [half_right], TESTS, partial=True) == [0.5]  # half() is missing
    assert scores(service, [CORRECT_IO, WRONG], CASES) == [1.0, 0.0]
    for body in service.bodies[:2]:  # CORRECT and WRONG, whose text has none of the values
        assert body["language"] == "python" and body["run_timeout"] == 5.0
        assert "tri(10)" in body["code"]
        assert not any(value in body["code"] for value in ("== 6", "55", "[1, 2, 3]", "2.5"))
    assert [b["stdin"] for b in service.bodies[-3:]] == ["3\n", "10\n", "3\n"]  # stops early


def test_failed_requests_are_retried_with_backoff(service):
    service.faults = ["503", "sandbox_error", "garbage"]
    assert scores(service, [CORRECT], TESTS, retries=3) == [1.0]
    assert len(service.bodies) == 4


def test_a_run_that_keeps_failing_scores_zero_and_then_the_service_is_declared_down(
    service, monkeypatch, caplog
):
    monkeypatch.setattr(sandbox_http, "_MAX_CONSECUTIVE_FAILURES", 3)
    service.faults = ["slow", "503"]  # a request past its timeout, then an error: given up
    assert scores(service, [CORRECT], TESTS, retries=1, timeout_s=0.5) == [0.0]
    assert "failed after 2 tries" in caplog.text
    assert scores(service, [CORRECT], TESTS) == [1.0]  # a success resets the count
    service.faults = ["503"] * 20
    with pytest.raises(RewardError, match="3 runs in a row failed"):
        scores(service, [CORRECT] * 3, TESTS, retries=0)


def test_time_limit_exceeded_is_a_timed_out_run(service):
    service.faults = ["tle"]
    assert scores(service, [CORRECT_IO], CASES[:1]) == [0.0]
    assert scores(service, ["while True:\n    pass\n"], CASES[:1], timeout_s=0.5) == [0.0]


def test_concurrency_is_bounded_per_url(service):
    slow = "import time\ntime.sleep(0.3)\n" + CORRECT_IO
    reward = CodeExec(backend="http", url=service.url, max_concurrency=2)
    inputs = [RewardInput("p", fenced(slow), {"tests": CASES[:1]})] * 6
    threads = [threading.Thread(target=reward, args=(inp,)) for inp in inputs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert service.max_in_flight == 2 and len(service.bodies) == 6


def test_the_endpoint_and_the_reward_travel_to_pool_workers():
    assert sandbox_http.endpoint("http://h:8080") == "http://h:8080/run_code"
    assert sandbox_http.endpoint("https://h/api/run_code/") == "https://h/api/run_code"
    reward = CodeExec(backend="http", url="http://h:8080", retries=1)
    assert pickle.loads(pickle.dumps(reward)) == reward
