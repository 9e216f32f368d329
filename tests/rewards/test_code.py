"""The code-execution reward and its sandbox: hand-written programs with known outcomes."""

import json
import os
import time

import pytest

from jaxrl_llm.data import Example
from jaxrl_llm.rewards import (
    CodeExec,
    RewardError,
    RewardInput,
    compute_rewards,
    example_tests,
    extract_code,
    make_reward,
    run_assert_tests,
    run_python,
)

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
SUM_CASES = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6"}]
SUM_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution:\n```{tag}\n{code}```\nDone."


def score(completion: str, tests, **kwargs) -> float:
    return CodeExec(**kwargs)(RewardInput("p", completion, {"answer": "", "tests": tests}))


@pytest.mark.parametrize(
    "text, code",
    [
        (fenced("x = 1\n"), "x = 1\n"),
        ("```python\na\n```\n```python\nb\n```", "b\n"),  # the last python block
        ("```python\na\n```\n```text\nout\n```", "a\n"),  # python beats a later block
        ("```\nplain\n```", "plain\n"),  # no python block: the last block
        ("```py\nshort\n```", "short\n"),
        ("```Python3\nupper\n```", "upper\n"),
        ("no code here", None),
        ("```python\nunterminated", None),
        ("```python\n   \n```", None),  # blank
    ],
)
def test_extract_code(text, code):
    assert extract_code(text) == code


def test_passing_and_failing_asserts():
    assert score(fenced(ADD), ADD_TESTS) == 1.0
    off_by_one = "def add(a, b):\n    return a + b + (a == 2)\n"  # fails only add(2, 2)
    assert score(fenced(off_by_one), ADD_TESTS) == 0.0
    # partial: 2 of 3 tests pass -> incorrect + (correct - incorrect) * 2/3
    assert score(fenced(off_by_one), ADD_TESTS, partial=True) == pytest.approx(2 / 3)
    assert score(
        fenced(off_by_one), ADD_TESTS, partial=True, correct=2.0, incorrect=-1.0
    ) == pytest.approx(1.0)


def test_each_assert_is_isolated():
    # A failure in the middle does not hide the tests after it.
    tests = ["assert add(1, 2) == 3", "assert add(1, 2) == 4", "raise KeyError", "add(0, 0)"]
    assert run_assert_tests(ADD, tests) == [True, False, False, True]
    tests = ["assert add(1, 'x') == 3", "assert add(1, 1) == 2.0", "assert add(True, 0)"]
    assert run_assert_tests(ADD, tests) == [False, True, True]  # Python's own == and truth


@pytest.mark.parametrize(
    "code, why",
    [
        ("def add(a, b)\n    return a + b\n", "syntax error"),
        ("import sys\nsys.exit(0)\n" + ADD, "sys.exit before defining"),
        ("import os\nos._exit(0)\n", "exits without running the tests"),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n", "crash"),
        ("raise RuntimeError('at import')\n" + ADD, "exception while loading"),
    ],
)
def test_programs_that_break_score_incorrect(code, why):
    assert score(fenced(code), ADD_TESTS, incorrect=-0.5) == -0.5, why


def test_stdin_stdout_cases():
    assert score(fenced(SUM_PROGRAM), SUM_CASES) == 1.0
    spaced = "a, b = map(int, input().split())\nprint(f'  {a + b}   ')\nprint()\n"
    assert score(fenced(spaced), SUM_CASES) == 1.0  # surrounding whitespace is ignored
    first_only = "a, b = map(int, input().split())\nprint(3)\n"
    assert score(fenced(first_only), SUM_CASES) == 0.0
    assert score(fenced(first_only), SUM_CASES, partial=True) == pytest.approx(0.5)
    crash_after = SUM_PROGRAM + "raise SystemExit(1)\n"  # right output, non-zero exit
    assert score(fenced(crash_after), SUM_CASES) == 0.0


def test_no_code_block_is_incorrect():
    assert score("def add(a, b): return a + b", ADD_TESTS, incorrect=-1.0) == -1.0


def test_infinite_loop_is_stopped_at_the_timeout():
    start = time.monotonic()
    assert score(fenced("while True:\n    pass\n"), ADD_TESTS, timeout_s=0.5) == 0.0
    assert time.monotonic() - start < 2.0
    # Tests reported before a hanging one keep their result.
    spin = ADD + "def spin():\n    while True:\n        pass\n"
    tests = ["assert add(1, 2) == 3", "spin()", "assert add(2, 2) == 4"]
    start = time.monotonic()
    partial = score(fenced(spin), tests, timeout_s=0.5, partial=True)
    assert partial == pytest.approx(1 / 3) and time.monotonic() - start < 2.0


def test_memory_limit():
    hog = "data = bytearray(400 * 2**20)\n" + ADD
    assert score(fenced(hog), ADD_TESTS, memory_mb=128) == 0.0
    assert "MemoryError" in run_python(hog, memory_mb=128).stderr


def test_environment_is_constant_and_directory_fresh(monkeypatch):
    monkeypatch.setenv("JAXRL_TEST_SECRET", "hunter2")
    probe = "import os\nprint(sorted(os.environ), os.listdir('.'))\n"
    run = run_python(probe)
    assert run.returncode == 0 and not run.timed_out
    names = ["MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"]
    assert run.stdout.strip() == f"{names} ['main.py']"
    assert os.getcwd() not in run_python("import os\nprint(os.getcwd())").stdout


def test_output_is_capped():
    run = run_python("while True:\n    print('x' * 4096)\n", timeout_s=2.0)
    assert not run.timed_out and run.returncode != 0  # the file-size limit stopped it
    assert 0 < len(run.stdout) <= 16 * 2**20


def test_tests_from_examples_mappings_and_json():
    example = Example("write add", "", extra={"tests": ADD_TESTS})
    assert CodeExec()(RewardInput("p", fenced(ADD), example)) == 1.0
    assert example_tests({"tests": json.dumps(SUM_CASES)}) == ("io", SUM_CASES)
    assert example_tests({"tests": "assert True"}) == ("asserts", ["assert True"])
    assert make_reward("code_exec", timeout_s=2.0).name == "code_exec"


@pytest.mark.parametrize(
    "example, message",
    [
        (Example("p", "a"), r"'tests' field \(example.extra\['tests'\]"),
        ({"answer": "a"}, r"'tests' field \(example\['tests'\]"),
        ({"tests": []}, "non-empty list"),
        ({"tests": ["assert 1", {"input": "", "output": ""}]}, "only assert snippets"),
        ({"tests": [{"input": "1"}]}, "only assert snippets"),
    ],
)
def test_bad_tests_field(example, message):
    with pytest.raises(ValueError, match=message):
        CodeExec()(RewardInput("p", "no code", example))


def test_missing_tests_become_a_reward_error():
    with pytest.raises(RewardError, match="'code_exec'.*'tests' field"):
        compute_rewards(CodeExec(), [RewardInput("p", fenced(ADD), {"answer": "1"})])


@pytest.mark.parametrize(
    "kwargs, message",
    [({"timeout_s": 0}, "timeout_s"), ({"memory_mb": 0}, "memory_mb"), ({"memory_mb": 1.5}, "int")],
)
def test_settings_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CodeExec(**kwargs)
