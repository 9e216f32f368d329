"""Assert tests judged outside the program: split each test, run only its calls, compare here.

A test such as ``assert add(2, 3) == 5`` must not run in the program's interpreter: there the
program can read ``5``, patch ``==`` or the builtins, or write a pass report itself. So
``split_tests`` parses every test (``ast``) and cuts it in two:

* **probes**, the parts that need the program: each maximal sub-expression that names something
  the program defines (``add(2, 3)``, ``Stack().peek()``), minus the structure around it. Only
  these reach the program's process, which evaluates each one and prints its value as *plain
  data* (``encode_value``: ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``,
  ``bytes`` and ``list`` / ``tuple`` / ``set`` / ``frozenset`` / ``dict`` of those) on stdout.
* **the residual**, the rest of the test with each probe replaced by ``__probe(k)``: the
  comparisons, arithmetic, containers, constants (the expected values) and a fixed set of pure
  builtins (``sorted``, ``abs``, ``len``, ``math.isclose``, ...). ``judge`` evaluates it in the
  trainer's process on the decoded plain values, with Python's own semantics
  (``assert f(x) == 1`` accepts ``1.0`` and ``True``, as before).

So the program never sees an expected value, and whatever it prints it can only claim *values*,
never a verdict: a wrong value stays wrong, an object whose ``__eq__`` is always true is not
plain data, and patching the program's builtins changes nothing the trainer evaluates.

Supported tests: a sequence of ``assert`` statements (their message is ignored), expression
statements (``add(0, 0)``: passes when it raises nothing), ``pass``, ``raise`` (fails),
``import math`` / ``from math import ...``. Comprehensions and lambdas in the residual may
iterate over probe values (``all(x > 0 for x in f(a))``), but a program call that depends on a
comprehension or lambda variable (``all(f(x) == 2 * x for x in range(5))``) cannot be split
statically. Such tests, and any other statement (assignments, loops, ``def``, other imports),
raise a ``ValueError`` naming the test: running them in the program's interpreter would let a
wrong program pass, and scoring them as failed would silently zero a dataset. Write them as one
``assert`` per case.

Differences from running the tests in the program: every probe of a test is evaluated in the
child, in order, even one that Python's short-circuiting would skip (an error there only counts
when the residual uses the value); values that are not plain data (a custom class, a generator,
a numpy array; numpy scalars are converted) fail the tests that use them. The residual runs on
values the program chose, so operations whose cost grows with a value (``**``, ``<<``,
repetition ``*``, ``range``, ``math.factorial`` / ``comb`` / ``perm``) are guarded when they
touch a probe, and fail instead of running away.

Reading the child's report: one line per probe, ``{"i": k, "v": <encoded>}``, ``{"i": k}``
(a statement probe that finished) or ``{"i": k, "e": "<exception name>"}``. A line that is not
valid JSON, names an unknown or repeated probe, or holds a value that does not decode to plain
data fails every test of the run (``ReportError``), as does an unterminated last line unless the
run was stopped at its time limit (then that probe counts as not reported).
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import json
import math
import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

_MAX_DEPTH = 100  # nesting of a decoded value
_MAX_BIG_INT_HEX = 1 << 20  # hex digits of one encoded big int
_MAX_ITEMS = 10_000_000  # result of a guarded repetition or range
_MAX_EXPONENT_BITS = 16  # guarded ** and <<: exponents / shifts below 65536
_MAX_FACTORIAL = 100_000

_PROBE = "__probe"
_GUARD = "__guard"


class ReportError(ValueError):
    """The child's report cannot be trusted as a whole (malformed, truncated, ambiguous)."""


class Probe(NamedTuple):
    """One expression the program's process evaluates.

    Attributes:
      source: the expression (``add(2, 3)``), in the program's namespace.
      statement: evaluated for its effect only (its value is not reported).
    """

    source: str
    statement: bool


class TestPlan(NamedTuple):
    """The split of an example's assert tests.

    Attributes:
      probes: what the program's process evaluates, in order.
      checks: per test, its steps in order: a compiled residual expression that must be truthy,
        a probe index (a statement that must not raise) or ``None`` (a ``raise``: fails).
      names: per test, the names its ``from math import ...`` lines bind.
    """

    probes: tuple[Probe, ...]
    checks: tuple[tuple[Any, ...], ...]
    names: tuple[dict[str, Any], ...]


# ---------------------------------------------------------------------------------------------
# Plain-data encoding (used in the child: keep it self-contained, see HARNESS).


def encode_value(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON-ready data, containers tagged: ``(1, [2])`` → ``{"tuple": [1, {"list":
    [2]}]}``. Raises ``TypeError`` on anything that is not plain data."""
    kind = type(value)
    if depth > _MAX_DEPTH:
        raise TypeError("too deep")
    if value is None or kind is bool or kind is str or kind is float:
        return value
    if kind is int:
        return value if -(1 << 63) <= value < (1 << 63) else {"int": format(value, "x")}
    if kind in (list, tuple, set, frozenset):
        return {kind.__name__: [encode_value(item, depth + 1) for item in value]}
    if kind is dict:
        pairs = [[encode_value(k, depth + 1), encode_value(v, depth + 1)] for k, v in value.items()]
        return {"dict": pairs}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    if kind.__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return encode_value(value.item(), depth)
    raise TypeError(f"not plain data: {kind.__name__}")


def decode_value(data: Any, depth: int = 0) -> Any:
    """The inverse of ``encode_value`` on ``json.loads`` output; ``ReportError`` when ``data``
    is not such an encoding."""
    if depth > _MAX_DEPTH:
        raise ReportError("value nested too deep")
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is not dict or len(data) != 1:
        raise ReportError(f"not an encoded value: {type(data).__name__}")
    ((tag, body),) = data.items()
    try:
        if tag == "int" and type(body) is str and 0 < len(body) <= _MAX_BIG_INT_HEX:
            return int(body, 16)
        if tag == "bytes" and type(body) is str:
            return bytes.fromhex(body)
        if tag == "complex" and type(body) is list and len(body) == 2:
            if all(type(part) in (int, float) for part in body):
                return complex(*body)
        if type(body) is list and tag in ("list", "tuple", "set", "frozenset"):
            items = [decode_value(item, depth + 1) for item in body]
            return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
        if tag == "dict" and type(body) is list:
            pairs = []
            for pair in body:
                if type(pair) is not list or len(pair) != 2:
                    raise ReportError("bad dict entry")
                pairs.append((decode_value(pair[0], depth + 1), decode_value(pair[1], depth + 1)))
            return dict(pairs)
    except (TypeError, ValueError) as err:  # unhashable key / set item, bad hex
        raise ReportError(f"bad {tag} value: {err}") from err
    raise ReportError(f"bad encoded value tag {tag!r}")


# ---------------------------------------------------------------------------------------------
# The child: evaluates the probes after the program and prints one line per probe.

HARNESS = r"""
import json, os, sys
_payload = json.loads(PAYLOAD)
_report = os.fdopen(os.dup(1), "w", encoding="utf-8")
_null = os.open(os.devnull, os.O_RDWR)
os.dup2(_null, 0)
os.dup2(_null, 1)
_namespace = {"__name__": "__main__"}
try:
    exec(compile(_payload["code"], "main.py", "exec"), _namespace)
except BaseException:
    os._exit(1)
_encode = ENCODE
for _index, (_source, _statement) in enumerate(_payload["probes"]):
    try:
        if _statement:
            exec(compile(_source, f"<test {_index}>", "exec"), _namespace)
            _line = {"i": _index}
        else:
            _value = eval(compile(_source, f"<test {_index}>", "eval"), _namespace)
            _line = {"i": _index, "v": _encode(_value)}
        _text = json.dumps(_line)
    except BaseException as _err:
        _text = json.dumps({"i": _index, "e": type(_err).__name__[:100]})
    _report.write(_text + "\n")
    _report.flush()
os._exit(0)
"""


_PRELUDE = (
    f"from __future__ import annotations\n_MAX_DEPTH = {_MAX_DEPTH}\n"
    f"{inspect.getsource(encode_value)}"
)


def harness_source(code: str, probes: Sequence[Probe]) -> str:
    """The script run in the sandbox for assert tests: the program, then each probe."""
    payload = json.dumps({"code": code, "probes": [[p.source, p.statement] for p in probes]})
    body = HARNESS.replace("PAYLOAD", repr(payload)).replace("ENCODE", "encode_value")
    return f"{_PRELUDE}\n{body}"


# ---------------------------------------------------------------------------------------------
# Splitting tests (in the trainer).


def _guarded_repeat(count: Any, other: Any) -> None:
    if type(count) in (int, bool) and isinstance(other, str | bytes | list | tuple):
        if count > 0 and len(other) * count > _MAX_ITEMS:
            raise OverflowError("guarded repetition too large")


def _guard(op: str, left: Any, right: Any) -> Any:
    """``left <op> right`` on values a program chose, refusing results that would run away."""
    if op == "pow":
        if type(right) is int and type(left) is int and abs(left) > 1:
            if right.bit_length() > _MAX_EXPONENT_BITS:
                raise OverflowError("guarded exponent too large")
        return left**right
    if op == "lshift":
        if type(right) is int and right.bit_length() > _MAX_EXPONENT_BITS:
            raise OverflowError("guarded shift too large")
        return left << right
    _guarded_repeat(left, right)
    _guarded_repeat(right, left)
    return left * right


def _guarded_range(*args: Any) -> range:
    result = range(*args)
    if len(result) > _MAX_ITEMS:
        raise OverflowError("guarded range too large")
    return result


def _guarded_pow(base: Any, exponent: Any, mod: Any = None) -> Any:
    if mod is None:
        return _guard("pow", base, exponent)
    return pow(base, exponent, mod)


def _small_ints(limit: int, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def guarded(*args: Any) -> Any:
        if any(type(a) is int and a > limit for a in args):
            raise OverflowError(f"guarded {fn.__name__} argument too large")
        return fn(*args)

    return guarded


_SAFE_BUILTIN_NAMES = (
    "abs all any ascii bin bool bytes callable chr complex dict divmod enumerate filter float "
    "format frozenset hash hex int isinstance issubclass iter len list map max min next oct ord "
    "repr reversed round set slice sorted str sum tuple type zip True False None "
    "ArithmeticError AssertionError AttributeError Exception IndexError KeyError LookupError "
    "OverflowError StopIteration TypeError ValueError ZeroDivisionError"
).split()
_SAFE_MATH = types.SimpleNamespace(
    **{name: getattr(math, name) for name in dir(math) if not name.startswith("_")}
)
_SAFE_MATH.factorial = _small_ints(_MAX_FACTORIAL, math.factorial)
_SAFE_MATH.comb = _small_ints(_MAX_FACTORIAL, math.comb)
_SAFE_MATH.perm = _small_ints(_MAX_FACTORIAL, math.perm)
_SAFE_MATH.pow = _small_ints(1 << _MAX_EXPONENT_BITS, math.pow)

_BUILTINS = {name: getattr(builtins, name) for name in _SAFE_BUILTIN_NAMES}
_BUILTINS.update(range=_guarded_range, pow=_guarded_pow)
_SAFE_NAMES = frozenset(_BUILTINS) | {"math"}
_GUARDED_OPS = {ast.Pow: "pow", ast.LShift: "lshift", ast.Mult: "mul"}

_STRUCTURAL = (
    ast.Compare,
    ast.BoolOp,
    ast.UnaryOp,
    ast.BinOp,
    ast.IfExp,
    ast.Tuple,
    ast.List,
    ast.Set,
    ast.Dict,
    ast.Subscript,
    ast.Slice,
    ast.Starred,
    ast.JoinedStr,
    ast.FormattedValue,
)
_SCOPES = (ast.GeneratorExp, ast.ListComp, ast.SetComp, ast.DictComp, ast.Lambda)


class UnsupportedTest(ValueError):
    """A test that cannot be split into probes and a residual (see the module docstring)."""


def _bound_names(node: ast.AST) -> set[str]:
    """Names bound inside ``node`` by comprehensions and lambdas."""
    bound: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.comprehension):
            bound |= {n.id for n in ast.walk(sub.target) if isinstance(n, ast.Name)}
        elif isinstance(sub, ast.Lambda):
            bound |= {a.arg for a in ast.walk(sub.args) if isinstance(a, ast.arg)}
    return bound


class _Splitter:
    """Rewrites one test's expressions: program-dependent parts become ``__probe(k)``."""

    def __init__(self, probes: list[Probe], safe: frozenset[str]):
        self.probes, self.safe = probes, safe

    def program_names(self, node: ast.AST, local: frozenset[str]) -> set[str]:
        inner = local | _bound_names(node)
        return {
            n.id
            for n in ast.walk(node)
            if isinstance(n, ast.Name) and n.id not in self.safe and n.id not in inner
        }

    def probe(self, node: ast.expr, local: frozenset[str]) -> ast.expr:
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        if names & (local | _bound_names(node)):
            raise UnsupportedTest(
                f"{ast.unparse(node)!r} calls the program with a comprehension or lambda "
                "variable; write one assert per case"
            )
        self.probes.append(Probe(ast.unparse(node), statement=False))
        index = ast.Constant(len(self.probes) - 1)
        return ast.Call(ast.Name(_PROBE, ast.Load()), [index], [])

    def split(self, node: ast.expr, local: frozenset[str] = frozenset()) -> ast.expr:
        if not self.program_names(node, local):
            return node  # the test's own code: evaluated here
        if isinstance(node, ast.Call) and self.safe_function(node.func):
            node.args = [self.split(a, local) for a in node.args]
            for keyword in node.keywords:
                keyword.value = self.split(keyword.value, local)
            return node
        if isinstance(node, _SCOPES):
            return self.split_scope(node, local)
        if not isinstance(node, _STRUCTURAL):
            return self.probe(node, local)
        for field, value in ast.iter_fields(node):
            if isinstance(value, ast.expr):
                setattr(node, field, self.split(value, local))
            elif isinstance(value, list):
                setattr(
                    node,
                    field,
                    [self.split(v, local) if isinstance(v, ast.expr) else v for v in value],
                )
        if isinstance(node, ast.BinOp) and type(node.op) in _GUARDED_OPS:
            guard = ast.Constant(_GUARDED_OPS[type(node.op)])
            return ast.Call(ast.Name(_GUARD, ast.Load()), [guard, node.left, node.right], [])
        return node

    def split_scope(self, node: ast.expr, local: frozenset[str]) -> ast.expr:
        """A comprehension or lambda: only its first iterable may hold probes."""
        if isinstance(node, ast.Lambda):
            raise UnsupportedTest(f"{ast.unparse(node)!r} uses the program inside a lambda")
        first, *rest = node.generators
        first.iter = self.split(first.iter, local)
        inner = local | _bound_names(node)
        parts: list[ast.AST] = [*rest, *first.ifs]
        parts += [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        for part in parts:
            if self.program_names(part, inner):
                raise UnsupportedTest(
                    f"{ast.unparse(node)!r} uses the program inside a comprehension; "
                    "only its first iterable may call the program"
                )
        return node

    def safe_function(self, func: ast.expr) -> bool:
        if isinstance(func, ast.Name):
            return func.id in self.safe
        return (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "math"
            and "math" in self.safe
            and hasattr(_SAFE_MATH, func.attr)
        )


def _split_one(test: str, probes: list[Probe]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    try:
        module = ast.parse(test)
    except SyntaxError as err:
        raise UnsupportedTest(f"test {test!r:.200} is not valid Python: {err}") from err
    names: dict[str, Any] = {}
    steps: list[Any] = []
    for statement in module.body:
        splitter = _Splitter(probes, _SAFE_NAMES | frozenset(names))
        if isinstance(statement, ast.Assert):
            residual = ast.Expression(splitter.split(statement.test))
            ast.fix_missing_locations(residual)
            steps.append(compile(residual, "<test>", "eval"))
        elif isinstance(statement, ast.Expr):
            if splitter.program_names(statement.value, frozenset()):
                probes.append(Probe(ast.unparse(statement), statement=True))
                steps.append(len(probes) - 1)
            else:
                residual = ast.Expression(ast.BoolOp(ast.Or(), [statement.value, ast.Constant(1)]))
                ast.fix_missing_locations(residual)
                steps.append(compile(residual, "<test>", "eval"))
        elif isinstance(statement, ast.Raise):
            steps.append(None)
        elif isinstance(statement, ast.Pass):
            pass
        elif isinstance(statement, ast.Import) and all(
            a.name == "math" and a.asname is None for a in statement.names
        ):
            pass
        elif isinstance(statement, ast.ImportFrom) and statement.module == "math":
            for alias in statement.names:
                if alias.name == "*" or not hasattr(_SAFE_MATH, alias.name):
                    raise UnsupportedTest(f"test {test!r:.200}: from math import {alias.name}")
                names[alias.asname or alias.name] = getattr(_SAFE_MATH, alias.name)
        else:
            raise UnsupportedTest(
                f"test {test!r:.200}: {type(statement).__name__} statements cannot be judged "
                "outside the program; use assert statements (see docs/rewards.md)"
            )
    return tuple(steps), names


@functools.lru_cache(maxsize=4096)
def _split_cached(tests: tuple[str, ...]) -> TestPlan:
    probes: list[Probe] = []
    checks, names = [], []
    for test in tests:
        steps, bound = _split_one(test, probes)
        checks.append(steps)
        names.append(bound)
    return TestPlan(tuple(probes), tuple(checks), tuple(names))


def split_tests(tests: Sequence[str]) -> TestPlan:
    """The probes and residual checks of assert ``tests`` (module docstring).

    ``["assert add(2, 3) == 5"]`` → probes ``[Probe("add(2, 3)", False)]`` and the check
    ``__probe(0) == 5``.

    Raises:
      ValueError: (``UnsupportedTest``) naming a test that cannot be split.
    """
    return _split_cached(tuple(tests))


def parse_report(text: str, n_probes: int, *, timed_out: bool) -> dict[int, tuple[bool, Any]]:
    """The child's report: probe index → ``(ok, value)``; see the module docstring.

    Raises:
      ReportError: on any malformed, unknown or repeated line.
    """
    lines = text.split("\n")
    if lines[-1]:
        if not timed_out:
            raise ReportError("unterminated report line")
    lines = lines[:-1]
    results: dict[int, tuple[bool, Any]] = {}
    for line in lines:
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError) as err:
            raise ReportError(f"report line is not JSON: {line[:80]!r}") from err
        if type(entry) is not dict or type(entry.get("i")) is not int:
            raise ReportError(f"bad report line {line[:80]!r}")
        index = entry["i"]
        if not 0 <= index < n_probes or index in results:
            raise ReportError(f"unknown or repeated probe {index}")
        keys = set(entry) - {"i"}
        if keys == {"v"}:
            results[index] = (True, decode_value(entry["v"]))
        elif keys == set():
            results[index] = (True, None)
        elif keys == {"e"} and type(entry["e"]) is str:
            results[index] = (False, None)
        else:
            raise ReportError(f"bad report line {line[:80]!r}")
    return results


class _Missing(Exception):
    """A probe the child did not report, or that raised."""


def judge(plan: TestPlan, report: str, *, timed_out: bool = False) -> list[bool]:
    """Which tests pass, given the child's ``report`` of ``plan.probes``.

    A malformed report fails every test; see the module docstring.
    """
    try:
        results = parse_report(report, len(plan.probes), timed_out=timed_out)
    except (ReportError, RecursionError, MemoryError):
        return [False] * len(plan.checks)

    def probe(index: int) -> Any:
        ok, value = results.get(index, (False, None))
        if not ok:
            raise _Missing(index)
        return value

    passed = []
    for steps, names in zip(plan.checks, plan.names):
        namespace = {"__builtins__": _BUILTINS, "math": _SAFE_MATH, _PROBE: probe, _GUARD: _guard}
        namespace.update(names)
        passed.append(all(_step_passes(step, namespace, results) for step in steps))
    return passed


def _step_passes(step: Any, namespace: dict[str, Any], results: dict) -> bool:
    if step is None:
        return False
    if isinstance(step, int):
        return results.get(step, (False, None))[0]
    try:
        return bool(eval(step, namespace))  # noqa: S307  (the dataset's test, on plain data)
    except Exception:  # noqa: BLE001  (an assert that raises fails, whatever it raised)
        return False
