"""The mutation check: planted bugs (mutants) that the fast tests must catch.

Each mutant is a behaviour ("critic values → 0", "learning rate × 2", ...) applied by
monkeypatching a public seam of the library in a fresh pytest process, never by editing the
checkout. ``python -m tests.mutation`` runs every mutant against the tests that must catch it
and fails if any of those tests still passes; ``tests/test_mutation.py`` runs it in CI.
"""
