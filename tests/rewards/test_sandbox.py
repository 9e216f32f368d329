"""The code verifier against a policy that games it: every attack the adversarial probe found,
as a wrong program that would score 1.0 if the attack worked, next to a correct one.

Each attack program prints (or returns) the right answer only through the attack, so a reward
of 0 means the attack failed; the correct program's 1.0 shows the verifier still works. The
attacks that stop or hang the trainer run in a subprocess standing in for it."""

import contextlib
import json
import logging
import os
import secrets
import signal
import site
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from jaxrl_llm.rewards import (
    CodeExec,
    RewardInput,
    ScoringPool,
    compute_rewards,
    make_reward,
    run_python,
    sandbox,
)

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox is Linux-only")
pytestmark = linux_only

TESTS = [
    "assert tri(3) == 6",
    "assert tri(10) == 55",
    "assert sorted(digits(321)) == [1, 2, 3]",
    "assert abs(half(5) - 2.5) < 1e-9",
]
CORRECT = (
    "def tri(n):\n    return n * (n + 1) // 2\n"
    "def digits(n):\n    return [int(c) for c in str(n)]\n"
    "def half(n):\n    return n / 2\n"
)
WRONG = "def tri(n):\n    return n\ndef digits(n):\n    return [n]\ndef half(n):\n    return n\n"
CASES = [{"input": "3\n", "output": "6\n"}, {"input": "10\n", "output": "55\n"}]
CORRECT_IO = "n = int(input())\nprint(n * (n + 1) // 2)\n"


def fenced(code: str) -> str:
    return f"Solution:\n```python\n{code}```\n"


def scores(programs, tests, **kwargs) -> list[float]:
    reward = CodeExec(**kwargs)
    inputs = [RewardInput("p", fenced(code), {"tests": tests}) for code in programs]
    return compute_rewards(reward, inputs)[0].tolist()


def alive(comm: str) -> list[int]:
    """Host pids whose command name is ``comm``, zombies (dead, not yet reaped) excepted."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError):
            with open(f"/proc/{pid}/stat") as f:
                name, state = f.read().rsplit(")", 1)
            if name.split("(", 1)[1] == comm and state.split()[0] not in "ZX":
                found.append(int(pid))
    return found


# --- The verdict: the program cannot write it, fake it, or read the expected values. -------

FORGE_REPORT = """
import json, os, sys
def _forge():
    frames = [sys.modules["__main__"].__dict__]
    for depth in range(1, 8):
        try:
            frames.append(sys._getframe(depth).f_globals)
        except ValueError:
            break
    for g in frames:
        report = g.get("report") or g.get("_report")
        if report is None:
            continue
        if "token" in g:  # a harness that trusts "<token> <index> pass" lines
            lines = [f"{g['token']} {i} pass" for i in range(len(g["tests"]))]
        else:  # ours: all it can claim is a value per call
            probes = g.get("_payload", {}).get("probes", [])
            lines = [json.dumps({"i": i, "v": True}) for i in range(len(probes))]
        report.write("\\n".join(lines) + "\\n")
        report.flush()
        os._exit(0)
_forge()
"""

ALWAYS_EQUAL = """
import builtins
class Anything:
    def __eq__(self, other):
        return True
    def __lt__(self, other):
        return True
    __hash__ = object.__hash__
def tri(n):
    return Anything()
digits = half = tri
builtins.sorted = builtins.abs = lambda *args, **kwargs: Anything()
"""

READ_EXPECTED = """
import sys
def _expected(call):
    for depth in range(1, 10):
        try:
            g = sys._getframe(depth).f_globals
        except ValueError:
            return None
        sources = list(g.get("tests") or [])
        sources += [p[0] for p in g.get("_payload", {}).get("probes", [])]
        for source in sources:
            for op in ("==", "<"):
                if source.startswith("assert ") and call in source and op in source:
                    return eval(source.split(op, 1)[1].strip())
def tri(n):
    return _expected(f"tri({n})")
def digits(n):
    return _expected(f"digits({n})")
def half(n):
    return 2.5 if _expected(f"half({n})") is not None else None
"""


@pytest.mark.parametrize(
    "attack", [FORGE_REPORT, ALWAYS_EQUAL, READ_EXPECTED], ids=["forge", "eq", "read"]
)
def test_the_program_cannot_produce_the_verdict(attack):
    assert scores([attack + WRONG, CORRECT, attack], TESTS) == [0.0, 1.0, 0.0]
    assert scores([attack, CORRECT], TESTS, partial=True) == [0.0, 1.0]


def test_plain_data_only_and_malformed_reports_fail():
    numpy_scalar = "import numpy\ndef tri(n):\n    return numpy.int64(n * (n + 1) // 2)\n"
    junk = CORRECT + "import os\nfor fd in range(3, 10):\n    try:\n        os.write(fd, b'{not')\n"
    junk += "    except OSError:\n        pass\n"
    assert scores([numpy_scalar, junk], TESTS[:2]) == [1.0, 0.0]


# --- What it writes does not outlive it; it cannot reach other runs or the trainer. ----------


def test_files_written_outside_the_private_directory_do_not_persist():
    marker = f"zzz_jaxrl_attack_{secrets.token_hex(4)}"
    # A .pth in site-packages would make every later interpreter skip the tests.
    attack = f"""
import os, sys
for d in set(sys.path + ["/tmp", "/dev/shm", "/var/tmp", os.getcwd()]):
    for name in ("{marker}.pth", "{marker}.txt"):
        try:
            with open(os.path.join(d, name), "w") as f:
                f.write("# a .pth here runs in every later interpreter\\n")
        except OSError:
            pass
with open("scratch.txt", "w") as f:  # its own directory is writable
    f.write("ok")
print(open("scratch.txt").read())
"""
    dirs = set(sys.path + site.getsitepackages() + ["/tmp", "/dev/shm", "/var/tmp", os.getcwd()])
    before = {name for name in os.listdir("/tmp") if name.startswith("jaxrl-sandbox-")}
    try:
        run = run_python(attack)
        assert run.stdout.strip() == "ok", run.stderr
        left = [
            os.path.join(d, f"{marker}{ext}")
            for d in dirs
            for ext in (".pth", ".txt")
            if os.path.exists(os.path.join(d, f"{marker}{ext}"))
        ]
        assert not left
        assert scores([WRONG], TESTS) == [0.0]  # a later wrong program is still wrong
        after = {name for name in os.listdir("/tmp") if name.startswith("jaxrl-sandbox-")}
        assert after <= before  # its per-run directory is gone
    finally:
        for d in dirs:
            for ext in (".pth", ".txt"):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(d, f"{marker}{ext}"))


def test_no_process_outlives_the_run():
    comm = f"jxl{secrets.token_hex(5)}"
    escapee = f"""
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        with open("/proc/self/comm", "w") as f:
            f.write("{comm}")
        time.sleep(30)
    os._exit(0)
time.sleep(0.3)
print(3)
"""
    try:
        assert scores([escapee], CASES) == [0.0]
        time.sleep(0.2)
        assert alive(comm) == []
    finally:
        for pid in alive(comm):
            os.kill(pid, signal.SIGKILL)


def test_a_concurrent_run_cannot_be_read_written_or_killed():
    mark = secrets.token_hex(6)
    victim = f"import time\nn = int(input())\ntime.sleep(1.0)\nprint(n * (n + 1) // 2)  # {mark}\n"
    attacker = f"""
import os, signal, time
end = time.time() + 1.5
while time.time() < end:
    for root in ("/tmp", "/proc"):
        for name in os.listdir(root):
            path = os.path.join(root, name)
            for file in ("stdout", "main.py", "cwd/main.py"):
                target = os.path.join(path, file)
                try:
                    text = open(target).read()
                except OSError:
                    continue
                if file == "stdout":
                    open(target, "w").write("wrong\\n")
                elif "{mark}" in text and name.isdigit():
                    os.kill(int(name), signal.SIGKILL)
    time.sleep(0.01)
print(0)
"""
    reward = CodeExec()
    inputs = [RewardInput("p", fenced(c), {"tests": CASES[:1]}) for c in (victim, attacker)]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(reward, inputs))
    assert results == [1.0, 0.0]


def test_the_trainers_files_environment_and_network_are_out_of_reach(tmp_path, monkeypatch):
    answer = secrets.token_hex(8)
    (tmp_path / "answers.jsonl").write_text(answer + "\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("JAXRL_SECRET_TOKEN", answer)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve():
        with contextlib.suppress(OSError):
            while True:
                conn, _ = server.accept()
                conn.sendall(answer.encode() + b"\n")
                conn.close()

    threading.Thread(target=serve, daemon=True).start()
    read_files = f"""
import os
for path in ("{tmp_path}/answers.jsonl", f"/proc/{{os.getppid()}}/cwd/answers.jsonl"):
    try:
        print(open(path).read().strip())
        break
    except OSError:
        pass
"""
    read_environ = """
import os
for pid in ["self", str(os.getppid())] + os.listdir("/proc"):
    try:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\\0")
    except OSError:
        continue
    for item in env:
        if item.startswith(b"JAXRL_SECRET_TOKEN="):
            print(item.split(b"=", 1)[1].decode())
            raise SystemExit
"""
    network = f"""
import socket
print(socket.create_connection(("127.0.0.1", {port}), timeout=1).recv(100).decode().strip())
"""
    case = [{"input": "", "output": answer}]
    try:
        assert scores([read_files, read_environ, network, f"print('{answer}')"], case) == [
            0.0,
            0.0,
            0.0,
            1.0,
        ]
        # Pool workers inherit the trainer's environment; the program still must not see it.
        reward = CodeExec()
        inputs = [RewardInput("p", fenced(read_environ), {"tests": case})]
        with ScoringPool(reward, workers=1) as pool:
            assert pool.map(inputs).tolist() == [0.0]
    finally:
        server.close()


def test_limits_hold_for_the_whole_run_not_per_process():
    # Three children, each under the per-process limit, together far above it.
    hog = """
import os, time
read, write = os.pipe()
for _ in range(3):
    if os.fork() == 0:
        block = b"x" * (110 << 20)
        time.sleep(1.5)  # all three hold their block now
        os.write(write, b"1")
        os._exit(0)
os.close(write)
count = 0
while os.read(read, 1):
    count += 1
print(count)
"""
    if "cgroup limits" in sandbox.protections().missing:
        pytest.skip("no cgroup here: limits are per process")
    assert scores([hog], [{"input": "", "output": "3"}], memory_mb=160) == [0.0]


TRAINER = """
import json, sys
from jaxrl_llm.rewards import CodeExec, RewardInput, compute_rewards
programs = json.loads(sys.argv[1])
tests = json.loads(sys.argv[2])
inputs = [RewardInput("p", f"```python\\n{p}```", {"tests": tests}) for p in programs]
print(json.dumps(compute_rewards(CodeExec(timeout_s=3.0), inputs)[0].tolist()))
"""


def test_the_trainer_survives_and_does_not_hang():
    marker = f"TRAINER{secrets.token_hex(4)}"
    kill_parent = f"""
import os, signal
os.kill(os.getppid(), signal.SIGKILL)
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        if b"{marker}" in open(f"/proc/{{pid}}/cmdline", "rb").read():
            os.kill(int(pid), signal.SIGKILL)
    except OSError:
        pass
print(0)
"""
    own_output = "import os\npath = os.readlink('/proc/self/fd/1')\nos.unlink(path)\n"
    named_pipe = own_output + "os.mkfifo(path)\n"
    programs = [kill_parent, own_output, named_pipe, CORRECT_IO]
    command = [sys.executable, "-c", TRAINER, json.dumps(programs), json.dumps(CASES), marker]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [0.0, 0.0, 0.0, 1.0]


# --- Protections reported, and the fallback still works. -------------------------------------


def test_missing_protections_are_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(sandbox, "_announced", False)
    monkeypatch.setattr(sandbox, "_choice", ("process", False, ("pid namespace", "cgroup limits")))
    with caplog.at_level(logging.INFO, logger="jaxrl_llm.rewards.sandbox"):
        CodeExec()
        CodeExec(partial=True)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "missing pid namespace, cgroup limits" in warnings[0].message
    assert sandbox.protections() == sandbox.Protections(
        "process", ("pid namespace", "cgroup limits")
    )


def test_the_weakest_level_still_scores_and_stops_programs(monkeypatch):
    monkeypatch.setattr(sandbox, "_choice", ("process", False, sandbox.PROTECTIONS))
    comm = f"jxl{secrets.token_hex(5)}"
    stray = "import os, time\nif os.fork() == 0:\n    os.setsid()\n"
    stray += f"    open('/proc/self/comm', 'w').write('{comm}')\n    time.sleep(30)\n"
    try:
        assert scores([CORRECT, WRONG, "while True:\n    pass\n"], TESTS, timeout_s=1.0) == [
            1.0,
            0.0,
            0.0,
        ]
        assert scores([stray + CORRECT_IO], CASES) == [1.0]
        time.sleep(0.2)
        # Without a PID namespace a setsid child escapes the group kill; the cgroup catches it.
        if "cgroup limits" not in sandbox._probe()[2]:
            assert alive(comm) == []
    finally:
        for pid in alive(comm):
            os.kill(pid, signal.SIGKILL)


def test_this_machine_gets_what_it_can(capsys):
    found = sandbox.protections()
    with capsys.disabled():
        print(f"\nsandbox: level {found.level}, missing {list(found.missing) or 'nothing'}")
    if os.geteuid() == 0 and found.level == "namespaces":
        uid = run_python("import os\nprint(os.getuid(), os.getpid())").stdout.split()
        assert int(uid[0]) != 0 and uid[1] == "2"  # a fresh uid, pid 2 of its own namespace


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"backend": "docker"}, r"backend must be one of \['local', 'http'\], got 'docker'"),
        ({"backend": "http"}, "backend 'http' needs url"),
        ({"backend": "http", "url": "localhost:8080"}, "http"),
        ({"url": "http://localhost:8080"}, "only used with backend 'http'"),
        ({"backend": "http", "url": "http://h", "retries": -1}, "retries must be an int >= 0"),
        ({"backend": "http", "url": "http://h", "max_concurrency": 0}, "max_concurrency"),
    ],
)
def test_bad_backend_settings_are_one_line_errors(kwargs, message):
    for build in (lambda: CodeExec(**kwargs), lambda: make_reward("code_exec", **kwargs)):
        with pytest.raises(ValueError, match=message) as info:
            build()
        assert "\n" not in str(info.value)


def test_an_interpreter_under_tmp_keeps_every_protection(tmp_path):
    """A virtualenv under ``/tmp`` (CI's, or a user's): its site-packages are bound into the
    program's view on top of its private ``/tmp``, not hidden by it, so the full sandbox still
    starts (it used to fall back to a plain process), the program imports from there, and its
    working directory holds only its own file."""
    packages = tmp_path / "site-packages"
    packages.mkdir()
    (packages / "probe_mod.py").write_text("X = 'from the /tmp site-packages'\n")
    script = f"""
import sys, sysconfig
packages = {str(packages)!r}
paths = sysconfig.get_paths()
sysconfig.get_paths = lambda *a, **k: {{**paths, "purelib": packages, "platlib": packages}}
sys.path.append(packages)
from jaxrl_llm.rewards import sandbox
found = sandbox.protections()
run = sandbox.run_sandboxed("import os, probe_mod\\nprint(probe_mod.X, os.listdir('.'))\\n")
print(found.level, list(found.missing), run.returncode, run.stdout.strip())
"""
    assert str(packages).startswith("/tmp/")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    if os.geteuid() != 0 and sandbox.protections().level != "namespaces":
        pytest.skip("no namespaces for this user here")
    want = "namespaces [] 0 from the /tmp site-packages ['main.py']"
    assert done.stdout.strip().splitlines()[-1] == want, done.stderr
