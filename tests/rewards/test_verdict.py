"""Assert tests split into probes (run by the program) and residuals (judged here): what each
side sees, the plain-data encoding, and reports that fail the whole run. No processes."""

import json
import math

import pytest

from jaxrl_llm.rewards.verdict import (
    ReportError,
    decode_value,
    encode_value,
    judge,
    parse_report,
    split_tests,
)


def report(*values) -> str:
    return "".join(json.dumps({"i": i, "v": encode_value(v)}) + "\n" for i, v in enumerate(values))


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        -3,
        2**200,
        -(2**70),
        1.5,
        math.inf,
        "é\ud800",
        b"\x00\xff",
        1 + 2j,
        [1, (2, 3)],
        {1: "a", (2, 3): [None]},
        {frozenset({1, 2}), 3},
        (),
    ],
)
def test_plain_values_round_trip(value):
    decoded = decode_value(json.loads(json.dumps(encode_value(value))))
    assert decoded == value and type(decoded) is type(value)


def test_nan_round_trips_and_tuples_stay_tuples():
    assert math.isnan(decode_value(json.loads(json.dumps(encode_value(math.nan)))))
    assert decode_value(encode_value((1, 2))) != [1, 2]


class AlwaysEqual:
    def __eq__(self, other):
        return True


@pytest.mark.parametrize("value", [AlwaysEqual(), [AlwaysEqual()], type("MyInt", (int,), {})(3)])
def test_values_that_are_not_plain_data_are_refused(value):
    with pytest.raises(TypeError):
        encode_value(value)


@pytest.mark.parametrize(
    "data", [{"list": [1], "tuple": []}, {"object": 1}, {"set": [{"list": []}]}, [1], {"int": ""}]
)
def test_bad_encodings_are_report_errors(data):
    with pytest.raises(ReportError):
        decode_value(data)


def test_the_program_sees_calls_never_expected_values():
    tests = [
        "assert add(2, 3) == 5",
        "assert abs(area(2.0) - 12.566) < 1e-3",
        "import math\nassert math.isclose(area(1.0), 3.14159, rel_tol=1e-3)",
        "assert sorted(pair([9, 8])) == [8, 9]",
        "assert all(x > 7 for x in pair([9, 8]))",
        "assert Stack().peek() is None",
        "add(0, 0)",
    ]
    plan = split_tests(tests)
    sources = [p.source for p in plan.probes]
    assert sources == [
        "add(2, 3)",
        "area(2.0)",
        "area(1.0)",
        "pair([9, 8])",
        "pair([9, 8])",
        "Stack().peek()",
        "add(0, 0)",
    ]
    for expected in ("5", "12.566", "3.14159", "[8, 9]", "7", "None"):
        assert not any(expected in source for source in sources), expected
    good = report(5, math.pi * 4, math.pi, [9, 8], [9, 8], None)
    assert judge(plan, good + '{"i": 6}\n') == [True] * 7
    wrong = report(6, 0.0, 3.0, [9, 1], [9, 1], 0)
    assert judge(plan, wrong + '{"i": 6, "e": "TypeError"}\n') == [False] * 7


def test_python_semantics_of_the_residual():
    plan = split_tests(["assert f() == 1", "assert f()", "assert not f()", "assert f() != 2"])
    assert judge(plan, report(1.0, 1.0, 1.0, 1.0)) == [True, True, False, True]
    assert judge(plan, report(True, True, True, True)) == [True, True, False, True]
    assert judge(plan, report("1", "", "", 2)) == [False, False, True, False]
    # An error in a probe only fails a test that uses it (short-circuit kept).
    plan = split_tests(["assert f() is None or g() == 1"])
    assert judge(plan, report(None) + '{"i": 1, "e": "ZeroDivisionError"}\n') == [True]


@pytest.mark.parametrize(
    "lines",
    [
        "not json\n",
        '{"i": 0, "v": 1}\n{"i": 0, "v": 1}\n',  # repeated
        '{"i": 7, "v": 1}\n',  # unknown
        '{"i": 0, "v": {"evil": 1}}\n',
        '{"i": 0, "v": 1, "pass": true}\n',
        '{"i": 0, "v": 1}\n{"i": 1, "v": 2}',  # unterminated
        "[" * 100_000 + "\n",
    ],
)
def test_a_malformed_report_fails_every_test(lines):
    plan = split_tests(["assert f() == 1", "assert g() == 2"])
    assert judge(plan, '{"i": 0, "v": 1}\n{"i": 1, "v": 2}\n') == [True, True]
    assert judge(plan, lines) == [False, False]


def test_a_run_stopped_at_its_limit_keeps_complete_lines():
    assert parse_report('{"i": 0, "v": 1}\n{"i": 1, "v"', 2, timed_out=True) == {0: (True, 1)}
    with pytest.raises(ReportError):
        parse_report('{"i": 0, "v": 1}\n{"i": 1, "v"', 2, timed_out=False)


@pytest.mark.parametrize(
    "test",
    [
        "assert 2 ** f() > 0",
        "assert [0] * f() == []",
        "assert len(range(f())) > 0",
        "assert math.factorial(f()) > 0",
        "assert 1 << f()",
    ],
)
def test_costs_driven_by_a_returned_value_are_bounded(test):
    plan = split_tests([test])
    assert judge(plan, report(10**12)) == [False]


@pytest.mark.parametrize(
    "test, message",
    [
        ("result = f(1)\nassert result == 2", "Assign"),
        ("for x in range(3):\n    assert f(x) == x", "For"),
        ("def check(c):\n    assert c(1) == 1\ncheck(f)", "FunctionDef"),
        ("import numpy as np\nassert np.allclose(f(), 1)", "Import"),
        ("assert all(f(x) == x for x in range(3))", "comprehension"),
        ("assert list(map(lambda x: f(x), [1])) == [1]", "lambda"),
        ("assert f(", "not valid Python"),
    ],
)
def test_tests_that_cannot_be_split_are_refused_by_name(test, message):
    with pytest.raises(ValueError, match=message):
        split_tests([test])
