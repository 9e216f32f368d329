"""Seconds per completion of the code_exec reward: the old in-interpreter verifier against the
sandboxed one (verdict in the trainer, OS isolation), on the same machine in the same run.

The old path is ``jaxrl_llm/rewards/code.py`` at ``--old-ref`` (default: the last commit that
ran the tests in the program's interpreter), loaded from git into a temporary module. Each path
scores the same completions, one at a time (the pool's per-row cost), for assert tests and for
stdin/stdout cases, after one warm-up call (the sandbox probes the machine once per process).
Reports medians over ``--repeats`` and their ratio new / old, with the CPU, kernel, Python and
the sandbox level next to the figures.

    .venv/bin/python benchmarks/code_sandbox.py [--completions 20] [--repeats 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from jaxrl_llm.rewards import CodeExec, RewardInput, sandbox

OLD_REF = "89cbee6"  # the last commit whose code_exec ran tests in the program's interpreter

ASSERTS = ["assert tri(3) == 6", "assert tri(10) == 55", "assert tri(0) == 0", "assert tri(1) == 1"]
CASES = [{"input": "3\n", "output": "6\n"}, {"input": "10\n", "output": "55\n"}]
FUNCTION = "```python\ndef tri(n):\n    return n * (n + 1) // 2\n```"
SCRIPT = "```python\nn = int(input())\nprint(n * (n + 1) // 2)\n```"


def load_old(ref: str):
    source = subprocess.run(
        ["git", "show", f"{ref}:jaxrl_llm/rewards/code.py"],
        check=True,
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    ).stdout
    path = os.path.join(tempfile.mkdtemp(prefix="old-code-exec-"), "old_code_exec.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("old_code_exec", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def per_completion(reward, inputs, repeats: int) -> float:
    """Median over ``repeats`` of the seconds per completion of scoring ``inputs``."""
    reward(inputs[0])  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for inp in inputs:
            assert reward(inp) == 1.0
        times.append((time.perf_counter() - start) / len(inputs))
    return statistics.median(times)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--completions", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--old-ref", default=OLD_REF)
    args = parser.parse_args()
    old = load_old(args.old_ref)
    rows = {}
    for kind, tests, completion in (("asserts", ASSERTS, FUNCTION), ("io", CASES, SCRIPT)):
        inputs = [RewardInput("p", completion, {"tests": tests})] * args.completions
        old_s = per_completion(old.CodeExec(), inputs, args.repeats)
        new_s = per_completion(CodeExec(), inputs, args.repeats)
        rows[kind] = {"old_s": round(old_s, 4), "new_s": round(new_s, 4)}
        rows[kind]["ratio"] = round(new_s / old_s, 2)
    found = sandbox.protections()
    report = {
        "per_completion": rows,
        "sandbox_level": found.level,
        "missing": list(found.missing),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "old_ref": args.old_ref,
        "completions": args.completions,
        "repeats": args.repeats,
    }
    for kind, row in rows.items():
        print(
            f"{kind:8s} old {row['old_s'] * 1e3:7.1f} ms  new {row['new_s'] * 1e3:7.1f} ms"
            f"  per completion  (new/old {row['ratio']:.2f}x)"
        )
    print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
