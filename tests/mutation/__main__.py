"""``python -m tests.mutation [NAME ...]``: every mutant (or those named) against its tests.

For each mutant, a fresh ``python -m pytest`` process plants it (``tests.mutation.plugin``)
and runs the tests that must catch it; the mutant is *killed* when every one of them fails.
Prints one line per mutant and exits 1 if any survived (a listed test passed), or if a run
errored before its tests ran. Tests skipped under a mutant count as survivors too.
"""

from __future__ import annotations

import argparse
import sys

from tests.mutation.runner import run_all


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutation", description=__doc__)
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args(argv)
    results = run_all(args.names or None, list_only=args.list, out=sys.stdout)
    return 0 if all(r.killed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
