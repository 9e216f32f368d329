"""One Qwen3-MoE sparse layer, forward + backward: jitted JAX against transformers' PyTorch.

The layer is transformers' ``Qwen3MoeSparseMoeBlock`` (router ``softmax -> top-k ->
renormalise``, then ``E`` SwiGLU experts) built from a local ``Qwen3MoeConfig``, and
``jaxrl_llm.models.moe.sparse_mlp`` with the same weights copied from it (f32 both sides)::

    router  gate.weight [E, D]            -> W_r = gate.weight^T       [D, E]
    experts gate_up_proj [E, 2F, D]       -> W_gate, W_up = halves^T   [E, D, F] each
            down_proj [E, D, F]           -> W_down = down_proj^T      [E, F, D]

One step is ``L = sum(y * c)`` for a fixed random cotangent ``c`` and its gradient w.r.t. the
input ``h [B, S, D]`` and every weight (router included): ``jax.jit(jax.value_and_grad(L))``
against ``L.backward()``. transformers' experts run in two implementations, both timed:
``eager`` (the module's own loop over the experts hit, what a standalone block runs) and
``grouped_mm`` (``torch.nn.functional.grouped_mm`` over expert-sorted rows, what a
``PreTrainedModel`` selects by default). Before timing, the JAX output and gradients are
compared with each PyTorch variant's (max abs difference over the max abs value, must be
< 1e-4). Timing: two warm-up calls each, then ``--rounds`` rounds that call every variant once,
interleaved; the table gives the median over rounds and ``this / torch eager`` (< 1: faster).
PyTorch uses as many threads as the machine has CPUs, as XLA:CPU does (``--threads 1``: one
thread each, for a loaded machine, where PyTorch's OpenMP threads wait on each other). The CPU
may be shared: compare ratios from one run, and look at the load average printed below the
table.

Default sizes: Qwen3-30B-A3B's layer (D=2048, F=768, E=128, k=8: F/D = 3/8, E/k = 16) scaled
down to D=768, F=288, E=64, k=4 (the same two ratios) over B·S = 2048 tokens.

Run::

    python benchmarks/bench_moe_layer.py                     # the default layer, 5 rounds
    python benchmarks/bench_moe_layer.py --tokens 4096 --experts 32 --top-k 4 --rounds 20
    python benchmarks/bench_moe_layer.py --quick             # a tiny layer (tests)
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from jaxrl_llm.models.moe import sparse_mlp

TORCH_IMPLEMENTATIONS = ("eager", "grouped_mm")
TOLERANCE = 1e-4
GRAD_NAMES = ("out", "dh", "d_router", "d_gate", "d_up", "d_down")


def build_torch(
    hidden: int, intermediate: int, experts: int, top_k: int, implementation: str, seed: int
) -> Qwen3MoeSparseMoeBlock:
    """transformers' sparse block (``norm_topk_prob``), its weights N(0, 0.02²) from ``seed``
    (the router N(0, 1/D), so that routing is far from uniform)."""
    config = Qwen3MoeConfig(
        hidden_size=hidden,
        moe_intermediate_size=intermediate,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        experts_implementation=implementation,
    )
    block = Qwen3MoeSparseMoeBlock(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        block.gate.weight.normal_(0.0, hidden**-0.5, generator=gen)
        block.experts.gate_up_proj.normal_(0.0, 0.02, generator=gen)
        block.experts.down_proj.normal_(0.0, 0.02, generator=gen)
    return block


def jax_weights(block: Qwen3MoeSparseMoeBlock) -> dict[str, jax.Array]:
    """The block's weights in ``sparse_mlp``'s layout (see the module docstring)."""
    gate_up = block.experts.gate_up_proj.detach().numpy()  # [E, 2F, D]
    width = gate_up.shape[1] // 2
    return {
        "router": jnp.asarray(block.gate.weight.detach().numpy().T),
        "w_gate": jnp.asarray(gate_up[:, :width].transpose(0, 2, 1)),
        "w_up": jnp.asarray(gate_up[:, width:].transpose(0, 2, 1)),
        "w_down": jnp.asarray(block.experts.down_proj.detach().numpy().transpose(0, 2, 1)),
    }


def jax_step(top_k: int, h: np.ndarray, cot: np.ndarray, weights: dict) -> Callable:
    """A compiled ``(h, c, weights) -> (L, (dh, dweights), y)``; returns a no-argument call."""

    def loss(h, weights, cot):
        y, _ = sparse_mlp(
            h,
            weights["router"],
            weights["w_gate"],
            weights["w_up"],
            weights["w_down"],
            top_k=top_k,
            normalize=True,
        )
        return jnp.sum(y * cot), y

    args = (jnp.asarray(h), weights, jnp.asarray(cot))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    compiled = step.lower(*args).compile()
    return lambda: jax.block_until_ready(compiled(*args))


def torch_step(block: Qwen3MoeSparseMoeBlock, h: np.ndarray, cot: np.ndarray) -> Callable:
    """A no-argument call running ``L.backward()``; returns ``(y, dh, grads by name)``."""
    th = torch.tensor(h, requires_grad=True)
    tc = torch.tensor(cot)
    params = dict(block.named_parameters())

    def step():
        th.grad = None
        for p in params.values():
            p.grad = None
        y = block(th)
        (y * tc).sum().backward()
        return y, th.grad, {name: p.grad for name, p in params.items()}

    return step


def _as_jax_layout(y, dh, grads: dict) -> dict[str, np.ndarray]:
    gate_up = grads["experts.gate_up_proj"].numpy()
    width = gate_up.shape[1] // 2
    return {
        "out": y.detach().numpy(),
        "dh": dh.numpy(),
        "d_router": grads["gate.weight"].numpy().T,
        "d_gate": gate_up[:, :width].transpose(0, 2, 1),
        "d_up": gate_up[:, width:].transpose(0, 2, 1),
        "d_down": grads["experts.down_proj"].numpy().transpose(0, 2, 1),
    }


def parity(jax_result, torch_result) -> dict[str, float]:
    """Max abs difference over max abs value, per output / gradient."""
    (_, y), (dh, dw) = jax_result
    got = {
        "out": y,
        "dh": dh,
        "d_router": dw["router"],
        "d_gate": dw["w_gate"],
        "d_up": dw["w_up"],
        "d_down": dw["w_down"],
    }
    want = _as_jax_layout(*torch_result)
    errors = {}
    for name in GRAD_NAMES:
        g, w = np.asarray(got[name], np.float64), np.asarray(want[name], np.float64)
        errors[name] = float(np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-30))
    return errors


def _time(fn: Callable) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(
    *, tokens: int, hidden: int, intermediate: int, experts: int, top_k: int, rounds: int
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """``(median seconds by variant, parity errors by torch variant)``; raises on a mismatch."""
    rng = np.random.default_rng(0)
    batch = 2 if tokens % 2 == 0 else 1
    h = rng.normal(size=(batch, tokens // batch, hidden)).astype(np.float32)
    cot = rng.normal(size=h.shape).astype(np.float32)
    blocks = {
        impl: build_torch(hidden, intermediate, experts, top_k, impl, seed=0)
        for impl in TORCH_IMPLEMENTATIONS
    }
    calls = {"jax (jaxrl_llm)": jax_step(top_k, h, cot, jax_weights(blocks["eager"]))}
    for impl, block in blocks.items():
        calls[f"torch {impl}"] = torch_step(block, h, cot)
    jax_result = calls["jax (jaxrl_llm)"]()
    errors = {}
    for impl in TORCH_IMPLEMENTATIONS:
        errors[impl] = parity(jax_result, calls[f"torch {impl}"]())
        worst = max(errors[impl].values())
        if not worst < TOLERANCE:
            raise AssertionError(f"jax and torch {impl} differ: {errors[impl]}")
    for fn in calls.values():
        fn()
        fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            times[name].append(_time(fn))
    return {name: statistics.median(t) for name, t in times.items()}, errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="B·S tokens (B=2)")
    parser.add_argument("--hidden", type=int, default=768, help="D")
    parser.add_argument("--intermediate", type=int, default=288, help="F, each expert's width")
    parser.add_argument("--experts", type=int, default=64, help="E")
    parser.add_argument("--top-k", type=int, default=4, help="k")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="PyTorch's threads; 1 also makes XLA:CPU single-threaded (default: every CPU)",
    )
    parser.add_argument("--quick", action="store_true", help="T=64, D=32, F=16, E=8, k=2")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.hidden, args.intermediate, args.experts, args.top_k = 64, 32, 16, 8, 2
    for name in ("tokens", "hidden", "intermediate", "experts", "top_k", "rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} must be <= --experts {args.experts}")
    if args.threads == 1:  # read when JAX starts its CPU client (at the first computation)
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        )
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    medians, errors = run(
        tokens=args.tokens,
        hidden=args.hidden,
        intermediate=args.intermediate,
        experts=args.experts,
        top_k=args.top_k,
        rounds=args.rounds,
    )
    base = medians["torch eager"]
    print(
        f"## Qwen3-MoE sparse layer, forward + backward on CPU, f32: T={args.tokens} "
        f"D={args.hidden} F={args.intermediate} E={args.experts} k={args.top_k}\n"
    )
    print("| implementation | fwd+bwd ms | this / torch eager | this / torch grouped_mm |")
    print("|---|---:|---:|---:|")
    for name, seconds in medians.items():
        print(
            f"| {name} | {seconds * 1e3:.1f} | {seconds / base:.2f} | "
            f"{seconds / medians['torch grouped_mm']:.2f} |"
        )
    print(
        f"\nratio jax / torch eager: {medians['jax (jaxrl_llm)'] / base:.2f}; "
        f"jax / torch grouped_mm: {medians['jax (jaxrl_llm)'] / medians['torch grouped_mm']:.2f}"
    )
    print(f"median of {args.rounds} interleaved rounds after 2 warm-up calls each")
    print("\nparity (max |jax - torch| / max |torch|, must be < 1e-4):")
    for impl, errs in errors.items():
        print(f"- torch {impl}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    end = os.getloadavg()
    print(f"\ncommand: {shlex.join(['python', 'benchmarks/bench_moe_layer.py', *(argv or [])])}")
    print(
        f"machine: {platform.platform()}, {os.cpu_count()} CPUs; load average (1 min) "
        f"{load[0]:.2f} at start, {end[0]:.2f} at end; torch threads {torch.get_num_threads()}"
    )
    print(
        f"versions: python {platform.python_version()}, jax {jax.__version__}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
