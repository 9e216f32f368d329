"""Runs mutants in child pytest processes and reads which of their tests failed."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from typing import TextIO

from tests.mutation.mutants import MUTANTS, Mutant

ROOT = pathlib.Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class Result:
    mutant: Mutant
    outcomes: dict[str, str]  # test node id -> passed | failed | skipped | missing
    returncode: int
    seconds: float
    output: str

    @property
    def survivors(self) -> list[str]:
        return [t for t in self.mutant.tests if self.outcomes.get(t) != "failed"]

    @property
    def killed(self) -> bool:
        return bool(self.mutant.tests) and not self.survivors


def _outcomes(junit: pathlib.Path) -> dict[str, str]:
    """``{"tests/a/test_b.py::test_c[param]": outcome}`` from a JUnit XML report."""
    out: dict[str, str] = {}
    if not junit.exists():
        return out
    for case in ET.parse(junit).iter("testcase"):
        module = case.get("classname", "")
        name = case.get("name", "")
        parts = module.split(".")
        # classname is "tests.a.test_b" or "tests.a.test_b.TestClass".
        for split in range(len(parts), 0, -1):
            path = ROOT.joinpath(*parts[:split]).with_suffix(".py")
            if path.exists():
                node = "/".join(parts[:split]) + ".py::" + "::".join([*parts[split:], name])
                break
        else:
            node = f"{module}::{name}"
        if case.find("failure") is not None or case.find("error") is not None:
            out[node] = "failed"
        elif case.find("skipped") is not None:
            out[node] = "skipped"
        else:
            out[node] = "passed"
    return out


#: Names a compilation cache directory the child runs share (tests/train/helpers.py).
SHARED_CACHE_ENV = "JAXRL_TEST_JAX_CACHE"


def run_mutant(mutant: Mutant, cache_dir: str | os.PathLike | None = None) -> Result:
    """One child pytest with ``mutant`` planted, running exactly the tests that must catch it.

    ``cache_dir``: a JAX compilation cache shared with the caller's session (the children then
    skip recompiling what the unmutated suite compiled).
    """
    with tempfile.TemporaryDirectory() as tmp:
        junit = pathlib.Path(tmp) / "junit.xml"
        env = {**os.environ, "JAXRL_MUTANT": mutant.name}
        if cache_dir is not None:
            env[SHARED_CACHE_ENV] = os.fspath(cache_dir)
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.mutation.plugin",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            *mutant.tests,
        ]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        outcomes = _outcomes(junit)
    found = {t: outcomes.get(t, "missing") for t in mutant.tests}
    return Result(mutant, found, proc.returncode, seconds, proc.stdout + proc.stderr)


def run_all(
    names: list[str] | None = None,
    *,
    list_only: bool = False,
    out: TextIO | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> list[Result]:
    """Runs the named mutants (default all); writes one line per mutant to ``out``."""
    by_name = {m.name: m for m in MUTANTS}
    unknown = sorted(set(names or ()) - set(by_name))
    if unknown:
        raise SystemExit(f"unknown mutant(s) {unknown}; known: {sorted(by_name)}")
    chosen = [by_name[n] for n in names] if names else list(MUTANTS)
    if list_only:
        for m in chosen:
            print(f"{m.name:28s} {m.behaviour}", file=out)
            for t in m.tests:
                print(f"    {t}", file=out)
        return []
    results = []
    for mutant in chosen:
        result = run_mutant(mutant, cache_dir)
        results.append(result)
        if out is not None:
            status = "killed" if result.killed else "SURVIVED"
            print(
                f"{status:9s} {mutant.name:28s} {len(mutant.tests)} tests, "
                f"{result.seconds:5.1f} s  ({mutant.behaviour})",
                file=out,
                flush=True,
            )
            for test in result.survivors:
                print(f"          {result.outcomes[test]:8s} {test}", file=out)
            if not result.killed and out is not None:
                print(result.output[-3000:], file=out)
    return results
