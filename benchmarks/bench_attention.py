"""Causal self-attention per implementation: CPU time against PyTorch, TPU memory (deviceless).

CPU time. ``jaxrl_llm.models.attention.dot_product_attention`` with ``implementation="xla"``
(``jax.nn.dot_product_attention`` with a ``[B, 1, S, S]`` mask, what ``layers.py`` ran before)
and ``"einsum"`` (query blocks of head-major matmuls, hand-written backward; ``"auto"`` on CPU),
forward and forward + backward (gradient of ``sum(w * out)`` w.r.t. q, k, v), jitted, against
``torch.nn.functional.scaled_dot_product_attention`` (same bool mask, ``enable_gqa=True``)
forward and ``backward()``. f32; every row has 20 left-pad tokens. Each round times every
variant once, interleaved, after two warm-up calls; the table gives the median over rounds
(the first round dropped) and ``torch / jax`` (> 1: JAX faster). The CPU may be shared: run it
several times and look at the spread.

TPU memory (``--tpu-memory``, needs ``pip install "jax[tpu]"``): deviceless ahead-of-time
compilation for a v5e 2x2 slice (``jax.experimental.topologies``) of forward + backward at
B=8 (batch over the 4 chips), N=32, K=8, H=128, bf16, for several S; prints XLA's planned
temporary bytes per chip for ``"splash"`` and ``"xla"``.

GPU (``--gpu``, an NVIDIA GPU): bf16 forward and forward + backward at LLM shapes (N=32, K=8,
H=128, 64 left-pad tokens a row) for ``"cudnn"`` (``"auto"`` there) and ``"xla"``, against
PyTorch's ``scaled_dot_product_attention`` on the same GPU with the same bool mask (what
transformers' ``sdpa`` attention runs for padded batches). Before timing, each implementation's
output and q/k/v gradients on the real rows are compared with a float64 NumPy reference
(relative Frobenius error; bf16 lands between 1e-3 and 1e-2). Medians of ``--rounds`` after
warm-up, every call ending in ``block_until_ready`` / ``torch.cuda.synchronize``.

Run::

    python benchmarks/bench_attention.py                  # 3 shapes, 15 rounds (~2 min, 2 cores)
    python benchmarks/bench_attention.py --gpu            # on an NVIDIA GPU: cudnn / xla / torch
    python benchmarks/bench_attention.py --quick          # B=8, S=256, N=12, K=4, H=64 only
    python benchmarks/bench_attention.py --tpu-memory     # adds the deviceless TPU table
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

from jaxrl_llm.models.attention import attention_mask, dot_product_attention

# (label, B, S, N, K, H): the brief's shape, the benchmarks' "tiny" model (B=16, prompt 32 +
# completion 256; hidden 64, 4 heads of 16) and the "60m" model (8 heads of 64, 4 kv heads).
SHAPES = (
    ("B8 S256 N12 K4 H64", 8, 256, 12, 4, 64),
    ("tiny model layer", 16, 288, 4, 2, 16),
    ("60m model layer", 8, 288, 8, 4, 64),
)
JAX_IMPLEMENTATIONS = ("xla", "einsum")
PAD = 20


def _inputs(batch: int, seq: int, heads: int, kv_heads: int, dim: int, pad: int = PAD):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(batch, seq, heads, dim)).astype(np.float32)
    k = rng.normal(size=(batch, seq, kv_heads, dim)).astype(np.float32)
    v = rng.normal(size=(batch, seq, kv_heads, dim)).astype(np.float32)
    w = rng.normal(size=(batch, seq, heads, dim)).astype(np.float32)
    valid = np.ones((batch, seq), bool)
    valid[:, :pad] = False
    return q, k, v, w, valid


def _jax_calls(impl: str, q, k, v, w, valid) -> tuple[Callable, Callable]:
    scale = q.shape[-1] ** -0.5
    args = [jnp.asarray(x) for x in (q, k, v)]
    w, valid = jnp.asarray(w), jnp.asarray(valid)

    def attend(q, k, v):
        return dot_product_attention(q, k, v, key_valid=valid, scale=scale, implementation=impl)

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v) * w)

    forward = jax.jit(attend).lower(*args).compile()
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    return (lambda: jax.block_until_ready(forward(*args))), (
        lambda: jax.block_until_ready(step(*args))
    )


def _torch_calls(q, k, v, w, valid) -> tuple[Callable, Callable, Callable]:
    scale = q.shape[-1] ** -0.5

    def heads_first(x, grad=False):
        return torch.tensor(x).transpose(1, 2).contiguous().requires_grad_(grad)

    tq, tk, tv = (heads_first(x, grad=True) for x in (q, k, v))
    tw = heads_first(w)
    mask = torch.tensor(np.asarray(attention_mask(jnp.asarray(valid), jnp.arange(q.shape[1]))))

    def attend():
        return torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv, attn_mask=mask, scale=scale, enable_gqa=True
        )

    def forward():
        with torch.no_grad():
            return attend()

    def step():
        tq.grad = tk.grad = tv.grad = None
        (attend() * tw).sum().backward()
        return tq.grad, tk.grad, tv.grad

    return forward, step, attend


def _time(fn: Callable) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_cpu(shape, rounds: int) -> list[tuple[str, str, float, float]]:
    """Rows ``(shape label, variant, forward s, forward+backward s)``; checks the outputs."""
    label, *dims = shape
    q, k, v, w, valid = _inputs(*dims)
    calls = {impl: _jax_calls(impl, q, k, v, w, valid) for impl in JAX_IMPLEMENTATIONS}
    torch_forward, torch_step, torch_attend = _torch_calls(q, k, v, w, valid)
    calls["torch sdpa"] = (torch_forward, torch_step)
    # Same attention: the JAX outputs against PyTorch's on the real query rows.
    want = torch_attend().detach().transpose(1, 2).numpy()[valid]
    for impl in JAX_IMPLEMENTATIONS:
        got = np.asarray(calls[impl][0]())[valid]
        diff = float(np.max(np.abs(got - want)))
        if diff > 1e-4:
            raise AssertionError(f"{label}: {impl} differs from torch by {diff:.2e}")
    for forward, step in calls.values():
        for _ in range(2):
            forward()
            step()
    times = {name: ([], []) for name in calls}
    for _ in range(rounds):
        for name, (forward, step) in calls.items():
            times[name][0].append(_time(forward))
            times[name][1].append(_time(step))
    return [
        (label, name, statistics.median(f[1:]), statistics.median(b[1:]))
        for name, (f, b) in times.items()
    ]


GPU_SHAPES = (
    ("B8 S1024 N32 K8 H128", 8, 1024, 32, 8, 128),
    ("B4 S4096 N32 K8 H128", 4, 4096, 32, 8, 128),
)
GPU_PAD = 64


def _reference64(q, k, v, w, valid, scale):
    """float64 NumPy attention (causal + key padding, GQA) and the gradients of ``sum(w * o)``.

    Batched ``np.matmul`` over ``[B, N]`` (BLAS); a pad query sees its own slot (finite, and
    outside the compared rows).
    """
    q, k, v, w = (np.asarray(x, np.float64).transpose(0, 2, 1, 3) for x in (q, k, v, w))
    groups = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)  # [B, N, S, H]
    seq = q.shape[2]
    allowed = np.tril(np.ones((seq, seq), bool))[None] & valid[:, None, :]  # [B, S, S]
    allowed |= np.eye(seq, dtype=bool)[None]
    s = np.where(allowed[:, None], q @ k.transpose(0, 1, 3, 2) * scale, -np.inf)
    s -= s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    o = p @ v
    dp = w @ v.transpose(0, 1, 3, 2)
    ds = p * (dp - np.sum(dp * p, -1, keepdims=True))
    dq = ds @ k * scale
    dk = ds.transpose(0, 1, 3, 2) @ q * scale
    dv = p.transpose(0, 1, 3, 2) @ w

    def back(x, fold=False):  # [B, N, S, H] -> [B, S, N or K, H]
        if fold:
            x = x.reshape(x.shape[0], -1, groups, *x.shape[2:]).sum(2)
        return x.transpose(0, 2, 1, 3)

    return back(o), back(dq), back(dk, True), back(dv, True)


def _relative_error(got, want, rows) -> float:
    got, want = np.asarray(got, np.float64)[rows], want[rows]
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _gpu_median(fn: Callable, rounds: int) -> float:
    for _ in range(3):
        fn()
    return statistics.median(_time(fn) for _ in range(rounds))


def bench_gpu(shape, rounds: int) -> list[tuple[str, str, float, float, str]]:
    """Rows ``(shape, variant, forward s, fwd+bwd s, errors)`` on the GPU, bf16."""
    label, batch, seq, heads, kv_heads, dim = shape
    q, k, v, w, valid = _inputs(batch, seq, heads, kv_heads, dim, pad=GPU_PAD)
    scale = dim**-0.5
    # bf16 inputs: the reference sees the same rounded values.
    q, k, v, w = (
        np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (q, k, v, w)
    )
    # The float64 reference on the first row and its first 8 query heads (those of the first
    # 8 / (N / K) kv heads) only: its [B, N, S, S] is large.
    nq, nk = 8, 8 * kv_heads // heads
    ref = _reference64(q[:1, :, :nq], k[:1, :, :nk], v[:1, :, :nk], w[:1, :, :nq], valid[:1], scale)
    rows_ref = valid[:1]
    # Every array is an argument: closed-over arrays become constants XLA folds at compile time.
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, w)] + [jnp.asarray(valid)]
    out = []
    for impl in ("cudnn", "xla"):

        def attend(q, k, v, w, valid, impl=impl):
            return dot_product_attention(q, k, v, key_valid=valid, scale=scale, implementation=impl)

        def loss(q, k, v, w, valid, attend=attend):
            return jnp.sum((attend(q, k, v, w, valid) * w).astype(jnp.float32))

        forward = jax.jit(attend).lower(*args).compile()
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
        o = forward(*args)
        grads = step(*args)
        errors = [
            _relative_error(np.asarray(x[:1, :, : r.shape[2]].astype(jnp.float32)), r, rows_ref)
            for x, r in zip((o, *grads), ref)
        ]
        t_f = _gpu_median(lambda f=forward: jax.block_until_ready(f(*args)), rounds)
        t_b = _gpu_median(lambda f=step: jax.block_until_ready(f(*args)), rounds)
        out.append((label, impl, t_f, t_b, "/".join(f"{e:.1e}" for e in errors)))
        del o, grads

    def heads_first(x, grad=False):
        t = torch.tensor(x).transpose(1, 2).contiguous().to("cuda", torch.bfloat16)
        return t.requires_grad_(grad)

    tq, tk, tv = (heads_first(x, grad=True) for x in (q, k, v))
    tw = heads_first(w)
    mask = torch.tensor(np.asarray(attention_mask(jnp.asarray(valid), jnp.arange(seq)))).cuda()

    def attend():
        return torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv, attn_mask=mask, scale=scale, enable_gqa=True
        )

    def forward():
        with torch.no_grad():
            attend()
        torch.cuda.synchronize()

    def step():
        tq.grad = tk.grad = tv.grad = None
        (attend() * tw).float().sum().backward()
        torch.cuda.synchronize()

    step()
    got = [attend().detach(), tq.grad, tk.grad, tv.grad]
    errors = [
        _relative_error(x[:1, : r.shape[2]].float().transpose(1, 2).cpu().numpy(), r, rows_ref)
        for x, r in zip(got, ref)
    ]
    out.append(
        (
            label,
            "torch sdpa",
            _gpu_median(forward, rounds),
            _gpu_median(step, rounds),
            "/".join(f"{e:.1e}" for e in errors),
        )
    )
    return out


def bench_tpu_memory(seqs: tuple[int, ...]) -> list[tuple[int, str, int | str]]:
    """Rows ``(S, implementation, temp bytes per chip or the compile error)`` from deviceless
    v5e 2x2 compiles."""
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    topology = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
    mesh = Mesh(
        np.array(topology.devices).reshape(1, 4, 1),
        ("data", "fsdp", "tensor"),
        axis_types=(AxisType.Auto,) * 3,
    )
    rows_sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    out = []
    for seq in seqs:
        shapes = [(8, seq, 32, 128), (8, seq, 8, 128), (8, seq, 8, 128)]
        args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=rows_sharding) for s in shapes]
        args.append(jax.ShapeDtypeStruct((8, seq), jnp.bool_, sharding=rows_sharding))
        for impl in ("splash", "xla"):

            def step(q, k, v, key_valid, impl=impl):
                def loss(q, k, v):
                    o = dot_product_attention(
                        q, k, v, key_valid=key_valid, scale=128**-0.5, implementation=impl
                    )
                    return jnp.sum(o.astype(jnp.float32))

                return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

            try:
                with jax.set_mesh(mesh):
                    compiled = jax.jit(step).lower(*args).compile()
            except jax.errors.JaxRuntimeError as err:  # e.g. temporaries beyond the 16 GiB HBM
                out.append((seq, impl, str(err).split("\n")[0]))
                continue
            out.append((seq, impl, int(compiled.memory_analysis().temp_size_in_bytes)))
    return out


def main_gpu(args, argv) -> int:
    device = jax.devices()[0]
    if device.platform != "gpu" or not torch.cuda.is_available():
        raise SystemExit(f"--gpu needs an NVIDIA GPU for JAX and PyTorch, got {device.platform}")
    rows = []
    for shape in GPU_SHAPES:
        rows.extend(bench_gpu(shape, args.rounds))
    torch_step = {label: b for label, name, _, b, _ in rows if name == "torch sdpa"}
    print(f"## Causal self-attention on {device.device_kind}, bf16, {GPU_PAD} left pads a row\n")
    print(
        "| shape | implementation | forward ms | fwd+bwd ms | torch / this (fwd+bwd) | "
        "rel. error vs f64: out/dq/dk/dv |"
    )
    print("|---|---|---:|---:|---:|---|")
    for label, name, forward, step, errors in rows:
        print(
            f"| {label} | {name} | {forward * 1e3:.2f} | {step * 1e3:.2f} | "
            f"{torch_step[label] / step:.2f} | {errors} |"
        )
    print(f"\nmedian of {args.rounds} calls after 3 warm-up calls each")
    print(f"\ncommand: {shlex.join(['python', 'benchmarks/bench_attention.py', *(argv or [])])}")
    print(
        f"versions: python {platform.python_version()}, jax {jax.__version__}, "
        f"torch {torch.__version__}, cuda {torch.version.cuda}, "
        f"cudnn {torch.backends.cudnn.version()} (torch's)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the first shape only")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tpu-memory", action="store_true", help="deviceless TPU memory table")
    parser.add_argument(
        "--gpu", action="store_true", help="bf16 on an NVIDIA GPU (cudnn/xla/torch)"
    )
    args = parser.parse_args(argv)
    if args.gpu:
        return main_gpu(args, argv)
    torch.set_num_threads(os.cpu_count() or 1)
    load = os.getloadavg()[0]

    rows = []
    for shape in SHAPES[:1] if args.quick else SHAPES:
        rows.extend(bench_cpu(shape, args.rounds))
    torch_step = {label: b for label, name, _, b in rows if name == "torch sdpa"}
    print("## Causal self-attention on CPU, f32: jitted JAX vs PyTorch eager\n")
    print("| shape | implementation | forward ms | fwd+bwd ms | torch / this (fwd+bwd) |")
    print("|---|---|---:|---:|---:|")
    for label, name, forward, step in rows:
        print(
            f"| {label} | {name} | {forward * 1e3:.1f} | {step * 1e3:.1f} | "
            f"{torch_step[label] / step:.2f} |"
        )
    print(f"\nmedian of {args.rounds - 1} interleaved rounds after 2 warm-up calls each")

    if args.tpu_memory:
        print("\n## Deviceless TPU v5e 2x2: temp memory per chip, fwd+bwd, B=8 N=32 K=8 H=128\n")
        print("| S | splash | xla | xla / splash |")
        print("|---:|---:|---:|---:|")
        memory = bench_tpu_memory((1024, 2048, 4096, 8192))
        by_seq: dict[int, dict[str, int | str]] = {}
        for seq, impl, temp in memory:
            by_seq.setdefault(seq, {})[impl] = temp
        for seq, temps in by_seq.items():
            cells = [f"{t / 2**20:,.1f} MiB" if isinstance(t, int) else t for t in temps.values()]
            numbers = [t for t in temps.values() if isinstance(t, int)]
            # XLA:TPU may place all of splash's (small) temporaries outside the counted space.
            ratio = (
                f"{numbers[1] / numbers[0]:,.0f}x" if len(numbers) == 2 and numbers[0] else "n/a"
            )
            print(f"| {seq} | {' | '.join(cells)} | {ratio} |")

    print(f"\ncommand: {shlex.join(['python', 'benchmarks/bench_attention.py', *(argv or [])])}")
    print(
        f"machine: {platform.platform()}, {os.cpu_count()} CPUs, {platform.processor()}; "
        f"load average at start {load:.2f}; torch threads {torch.get_num_threads()}"
    )
    print(
        f"versions: python {platform.python_version()}, jax {jax.__version__}, "
        f"torch {torch.__version__}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
