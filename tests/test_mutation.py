"""The mutation check runs in CI: every planted bug is caught by the fast tests named for it.

``python -m tests.mutation`` is the same check from the command line (``--list`` shows the
mutants). The harness itself is tested first: a mutant whose tests pass must be reported as a
survivor, so the check cannot pass vacuously.
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import CACHE_ENV
from tests.mutation import mutants, runner


def test_every_mutant_names_tests_and_a_behaviour():
    names = [m.name for m in mutants.MUTANTS]
    assert len(names) == len(set(names))
    assert len(names) >= 8
    for mutant in mutants.MUTANTS:
        assert mutant.behaviour and mutant.tests, mutant.name
        for test in mutant.tests:
            path = runner.ROOT / test.split("::")[0]
            assert path.exists(), f"{mutant.name}: {test}"


def test_a_mutant_whose_tests_pass_survives():
    # An empty name plants nothing in the child: its test passes, so the harness must report
    # a survivor (the check cannot pass vacuously).
    target = "tests/test_mutation.py::test_every_mutant_names_tests_and_a_behaviour"
    result = runner.run_mutant(mutants.Mutant("", "nothing planted", lambda patch: None, (target,)))
    assert result.outcomes == {target: "passed"}
    assert not result.killed and result.survivors == [target]


def test_an_unknown_mutant_is_refused_not_run_unmutated():
    target = "tests/test_mutation.py::test_every_mutant_names_tests_and_a_behaviour"
    result = runner.run_mutant(mutants.Mutant("no_such", "?", lambda patch: None, (target,)))
    assert result.outcomes == {target: "missing"}
    assert not result.killed
    assert "unknown mutant 'no_such'" in result.output


# The whole check (14 child pytest sessions, ~2.5 min of CPU) runs in the default run and so in
# CI (its budget is 40 minutes on 2 cores); set this to 0 to skip it locally. It also runs alone
# as ``python -m tests.mutation``; the harness tests above always run.
FULL_CHECK_ENV = "JAXRL_MUTATION_CHECK"
needs_full_check = pytest.mark.skipif(
    os.environ.get(FULL_CHECK_ENV) == "0",
    reason=f"{FULL_CHECK_ENV}=0 skips the full mutation check (python -m tests.mutation runs it)",
)


def every_mutant_is_killed(half: int, tmp_path_factory) -> None:
    """Runs every other mutant (``half`` 0 or 1) and requires each to be killed. The check is
    split over two test files (here and ``tests/test_mutation_second_half.py``), both run last,
    so the two CI workers share it."""
    # tests/conftest.py runs these last, so the children find the programs the trainer tests
    # compiled in the session's cache (tests/train/helpers.py) instead of recompiling them.
    cache_dir = os.environ.get(CACHE_ENV) or tmp_path_factory.getbasetemp() / "jax_cache"
    names = [m.name for m in mutants.MUTANTS][half::2]
    results = runner.run_all(names, cache_dir=cache_dir)
    assert [r.mutant.name for r in results] == names
    survived = {
        r.mutant.name: {t: r.outcomes[t] for t in r.survivors} for r in results if not r.killed
    }
    assert not survived, survived


@pytest.mark.slow
@needs_full_check
def test_every_mutant_is_killed(tmp_path_factory):
    every_mutant_is_killed(0, tmp_path_factory)
