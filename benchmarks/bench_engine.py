"""Continuous batching vs one static batch at a time: tokens/s and slot utilisation.

``jaxrl_llm.sampling.engine.Engine`` with ``engine="continuous"`` (finished slots refilled
after each burst of up to ``--burst`` decode steps) against ``engine="static"`` (the same
programs, admitting ``S`` requests only into an empty engine and decoding until all of them
finish: what a static batch does), same model, same requests, same ``S``. Requests have
long-tailed lengths as RL completions do: each request's ``max_new_tokens`` is drawn from a
geometric distribution with mean ``T / 8`` (capped at ``T``), no EOS, so both engines produce
exactly the same tokens and only the scheduling differs. Prompts are random, of ``N/4`` to
``N`` tokens (``--prompt-tokens N``, default 32), ``--samples`` requests per prompt: the samples
admitted together share one prefill, and a sample admitted while another holds its prompt in
a live slot reuses it (``prefill rows`` counts the prompts prefilled, ``reused`` the requests
admitted without one).

The model is a random Llama (hidden 256, 4 layers, 4 heads, vocab 4096: bench_decode's "6M"),
f32, sampled at temperature 1. Each engine runs once untimed (compiles), then ``--repeats``
timed runs alternate between the engines; figures are medians. ``utilisation`` = tokens /
(S x decode steps run). The greedy check at the end runs both engines at temperature 0 and
compares every request's tokens.

Run::

    python benchmarks/bench_engine.py                    # 256 requests, S=32, T=256
    python benchmarks/bench_engine.py --quick            # 64 requests, S=16, T=128
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.sampling import SamplingOptions
from jaxrl_llm.sampling.engine import Engine, EngineSettings, Request

CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=64,
)


def make_requests(
    count: int, samples: int, max_new: int, seed: int = 0, prompt_tokens: int = 32
) -> list[Request]:
    """``count`` requests (``count / samples`` prompts of ``prompt_tokens / 4`` to
    ``prompt_tokens`` tokens), geometric budgets of mean ``T / 8``."""
    rng = np.random.default_rng(seed)
    low = max(prompt_tokens // 4, 1)
    prompts = [
        rng.integers(1, CONFIG.vocab_size, size=int(rng.integers(low, prompt_tokens + 1)))
        for _ in range(count // samples)
    ]
    budgets = np.minimum(rng.geometric(8 / max_new, size=count), max_new)
    return [
        Request(prompts[i // samples], int(budgets[i]), prompt_key=i // samples)
        for i in range(count)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 requests, S=16, T=128")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--samples", type=int, default=8, help="requests per prompt")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--burst", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32, help="longest prompt")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.slots, args.max_new_tokens = 64, 16, 128
    load = os.getloadavg()[0]
    params = init_params(CONFIG, jax.random.key(0), dtype=jnp.float32)
    requests = make_requests(
        args.requests, args.samples, args.max_new_tokens, prompt_tokens=args.prompt_tokens
    )

    def engine(name: str, temperature: float = 1.0) -> Engine:
        return Engine(
            params,
            CONFIG,
            settings=EngineSettings(slots=args.slots, burst=args.burst, engine=name),
            max_new_tokens=args.max_new_tokens,
            max_prompt_len=args.prompt_tokens,
            sampling=SamplingOptions(eos_ids=(), pad_id=0, temperature=temperature),
        )

    engines = {name: engine(name) for name in ("continuous", "static")}
    for each in engines.values():
        each.run(requests)  # compiles
    stats: dict[str, list] = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, each in engines.items():
            stats[name].append(each.run(requests, seed=1)[1])
    # Greedy: both engines give every request the same tokens.
    greedy = {name: engine(name, temperature=0.0).run(requests)[0] for name in engines}
    same = sum(
        np.array_equal(a.tokens, b.tokens) for a, b in zip(greedy["continuous"], greedy["static"])
    )

    med = statistics.median
    print(
        f"## Engine: continuous vs static batching, {args.requests} requests "
        f"({args.requests // args.samples} prompts x {args.samples}, up to "
        f"{args.prompt_tokens} tokens), S={args.slots}, T={args.max_new_tokens}, "
        f"burst {args.burst}\n"
    )
    mean_len = med(s.tokens for s in stats["static"]) / args.requests
    print(f"mean completion {mean_len:.1f} tokens (geometric, mean T/8, capped at T)\n")
    print(
        "| engine | tokens/s | s | decode steps | utilisation | bursts | admissions "
        "| prefill rows | reused |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rate = {}
    for name, runs in stats.items():
        rate[name] = med(s.tokens_per_s for s in runs)
        print(
            f"| {name} | {rate[name]:,.0f} | {med(s.seconds for s in runs):.2f} | "
            f"{med(s.decode_steps for s in runs):,.0f} | "
            f"{med(s.utilisation for s in runs):.1%} | {med(s.bursts for s in runs):.0f} | "
            f"{med(s.admissions for s in runs):.0f} | {med(s.prefill_rows for s in runs):.0f} | "
            f"{med(getattr(s, 'reused_prompts', 0) for s in runs):.0f} |"
        )
    print(f"\ncontinuous / static tokens/s: **{rate['continuous'] / rate['static']:.2f}x**")
    print(f"greedy: {same}/{args.requests} requests identical between the engines")
    print(f"\ncommand: {shlex.join(['python', 'benchmarks/bench_engine.py', *(argv or [])])}")
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"JAX device {jax.devices()[0].device_kind}; jax {jax.__version__}; load average "
        f"{load:.2f} before, {os.getloadavg()[0]:.2f} after; medians of {args.repeats} "
        f"alternating runs after one untimed run each; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    return 0 if same == args.requests else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
