"""The continuous engine's paged KV cache against its contiguous cache: speed and memory.

Same model, requests and sampling as ``bench_engine.py`` (a random 6M Llama, f32; 256 requests
= 32 prompts x 8 samples of 8–32 tokens; geometric completion budgets of mean ``T / 8``, no
EOS, so every configuration produces the same tokens). Four engines:

* ``contiguous``: ``S`` slots, each with its own ``P + T`` cache slots (``S x (P + T)``).
* ``paged``: ``S`` slots over a pool of blocks that never runs out (``kv_blocks`` default): the
  cost of the block-table gather, and how many blocks the run really used (the ``G`` samples
  of a prompt share its blocks; completion blocks are mapped as they grow).
* ``paged 2S, same memory``: ``2S`` slots over a pool of exactly the contiguous cache's size
  (``S x (P + T) / block`` blocks): what the memory buys; the newest requests are preempted
  and recomputed if the pool runs out.
* ``paged, 1/8 of the memory``: ``S`` slots over an eighth of that: preemptions at work.

Each engine runs once untimed (compiles), then ``--repeats`` timed runs alternate; medians.
The check at the end compares every request's tokens with the contiguous engine's.

Run::

    python benchmarks/bench_paged.py                 # 256 requests, S=32, T=256, blocks of 16
    python benchmarks/bench_paged.py --quick         # 64 requests, S=16, T=128
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import CONFIG, make_requests  # noqa: E402

from jaxrl_llm.models import init_params  # noqa: E402
from jaxrl_llm.sampling import SamplingOptions  # noqa: E402
from jaxrl_llm.sampling.engine import Engine, EngineSettings  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 requests, S=16, T=128")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--samples", type=int, default=8, help="requests per prompt")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--burst", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.slots, args.max_new_tokens = 64, 16, 128
    load = os.getloadavg()[0]
    params = init_params(CONFIG, jax.random.key(0), dtype=jnp.float32)
    requests = make_requests(args.requests, args.samples, args.max_new_tokens)
    prompt_width = 32  # the longest prompt's bucket, a multiple of the block size
    width = prompt_width + args.max_new_tokens
    same_memory = args.slots * width // args.block_size

    def engine(slots: int, **paged) -> Engine:
        return Engine(
            params,
            CONFIG,
            settings=EngineSettings(slots=slots, burst=args.burst, **paged),
            max_new_tokens=args.max_new_tokens,
            max_prompt_len=prompt_width,
            sampling=SamplingOptions(eos_ids=(), pad_id=0),
        )

    engines = {
        "contiguous": engine(args.slots),
        "paged": engine(args.slots, kv_block_size=args.block_size),
        f"paged {2 * args.slots} slots, same memory": engine(
            2 * args.slots, kv_block_size=args.block_size, kv_blocks=same_memory
        ),
        "paged, 1/8 of the memory": engine(
            args.slots, kv_block_size=args.block_size, kv_blocks=same_memory // 8
        ),
    }
    for each in engines.values():
        each.run(requests)  # compiles
    stats: dict[str, list] = {name: [] for name in engines}
    results = {}
    for _ in range(args.repeats):
        for name, each in engines.items():
            results[name], run = each.run(requests, seed=1)
            stats[name].append(run)
    base = results["contiguous"]
    same = {
        name: sum(np.array_equal(a.tokens, b.tokens) for a, b in zip(base, got))
        for name, got in results.items()
    }
    slot_bytes = (
        2
        * CONFIG.num_hidden_layers
        * CONFIG.num_key_value_heads
        * CONFIG.head_dim
        * jnp.dtype(jnp.float32).itemsize
    )

    med = statistics.median
    print(
        f"## Paged KV cache: {args.requests} requests ({args.requests // args.samples} prompts "
        f"x {args.samples}), S={args.slots}, T={args.max_new_tokens}, P={prompt_width}, "
        f"blocks of {args.block_size}, burst {args.burst}\n"
    )
    print(
        "| engine | slots | KV pool MiB | peak MiB used | tokens/s | vs contiguous | s | "
        "utilisation | preemptions | same tokens |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    contiguous = med(s.tokens_per_s for s in stats["contiguous"])
    for name, runs in stats.items():
        each = engines[name]
        if each.paged is None:
            pool = each.slots * width * slot_bytes
            peak = pool
        else:
            pool = each.paged[0] * args.block_size * slot_bytes
            peak = max(s.peak_blocks for s in runs) * args.block_size * slot_bytes
        rate = med(s.tokens_per_s for s in runs)
        print(
            f"| {name} | {each.slots} | {pool / 2**20:.1f} | {peak / 2**20:.1f} | {rate:,.0f} | "
            f"{rate / contiguous:.2f}x | {med(s.seconds for s in runs):.2f} | "
            f"{med(s.utilisation for s in runs):.1%} | "
            f"{med(s.preemptions for s in runs):.0f} | {same[name]}/{args.requests} |"
        )
    print(f"\ncommand: {shlex.join(['python', 'benchmarks/bench_paged.py', *(argv or [])])}")
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"JAX device {jax.devices()[0].device_kind}; jax {jax.__version__}; load average "
        f"{load:.2f} before, {os.getloadavg()[0]:.2f} after; medians of {args.repeats} "
        f"alternating runs after one untimed run each; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    return 0 if all(v == args.requests for v in same.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
