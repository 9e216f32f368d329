"""Prefill and decode throughput of jaxrl_llm.sampling against transformers ``generate``.

Both sides run the same random Llama weights in float32 (``--dtype bfloat16``: bf16) with a KV
cache, on the same device (transformers on CUDA when JAX's backend is a GPU), batch 16, prompt 32,
128 new tokens (no EOS, so every row runs to the end), greedy and sampled (temperature 1, no
top-k / top-p truncation on either side), in the same process and alternating repeat by repeat
so machine noise hits both alike. Compile time is excluded (one warm-up call each), every JAX
timing ends with ``block_until_ready``, figures are medians.

* JAX prefill: the jitted prefill (prompt forward + cache write + last logits).
  JAX decode: the jitted ``lax.while_loop`` (128 sample + forward steps).
* HF prefill: ``generate(max_new_tokens=1)``; HF decode: ``generate(128) - generate(1)``
  (127 single-token forwards), i.e. the same split including generate's own per-step work.

Each decode step is then set against two floors: the bytes it must stream (weights read by the
step, i.e. without the embedding table, plus the K/V of the slots it attends to: the prompt and
the tokens before it, on average ``P + (T + 1) / 2`` slots a step) at the streaming bandwidth
of an in-place jitted ``x + 1`` on 256 MiB; and the matmul FLOPs of the step
(``2 * B * params read``) at the f32 rate of a ``[B, D] @ [D, F]`` matmul of the step's own
shape. Both rates are probed between the repeats, and the best of the run counts (a probe
slowed by machine noise would make the floor slower, hence easier to reach). Run::

    python benchmarks/bench_decode.py                 # both sizes, ~5-10 min on 2 CPU cores
    python benchmarks/bench_decode.py --quick         # the small model only, fewer repeats
    python benchmarks/bench_decode.py --out benchmarks/results_decode.md   # also append there

Both frameworks are very sensitive to other processes on so few cores (PyTorch's OpenMP
threads most of all), so the header prints the load average before and after.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from jaxrl_llm.models import load_pretrained
from jaxrl_llm.sampling import layout

gen = importlib.import_module("jaxrl_llm.sampling.generate")

SIZES = {
    # name: (hidden, layers, heads, kv_heads, intermediate, vocab)
    "6M": (256, 4, 4, 4, 1024, 4096),
    "60M": (512, 8, 8, 8, 1376, 32000),
}
MODES = {"greedy": 0.0, "sampled": 1.0}
# transformers runs where JAX does: the GPU when JAX's default backend is one, else the CPU.
TORCH_DEVICE = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def _sync() -> None:
    if TORCH_DEVICE == "cuda":
        torch.cuda.synchronize()


def _hf_model(name: str, path: str, dtype: str) -> torch.nn.Module:
    hidden, layers, heads, kv_heads, intermediate, vocab = SIZES[name]
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    return model.to(TORCH_DEVICE, getattr(torch, dtype))


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bandwidth_probe():
    """A function timing an in-place jitted ``x + 1`` over 256 MiB of f32; returns bytes/s.

    The buffer is donated, so no fresh (page-faulting) memory is written: read + write of
    already-mapped memory, the traffic pattern of a decode step's weight and cache reads.
    """
    state = {"x": jnp.zeros((64 * 2**20,), jnp.float32)}
    step = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    state["x"] = step(state["x"]).block_until_ready()

    def run() -> None:
        state["x"] = step(state["x"]).block_until_ready()

    def probe() -> float:
        return 2 * state["x"].nbytes / _median_time(run, 5)

    return probe


def matmul_probe(batch: int, rows: int, cols: int, dtype: str = "float32"):
    """A function timing a jitted ``[batch, rows] @ [rows, cols]`` in ``dtype`` (8 weights
    cycled, 20 rounds, best of 3 calls); returns FLOP/s. Compiled once, here."""
    weights = [jax.random.normal(jax.random.key(i), (rows, cols), dtype) for i in range(8)]
    x = jax.random.normal(jax.random.key(9), (batch, rows), dtype)

    @jax.jit
    def chain(weights, x):
        def body(_, acc):
            h = x + acc * 1e-9  # depends on the carry: no hoisting out of the loop
            return acc + sum(jnp.sum(h @ w, dtype=jnp.float32) for w in weights)

        return jax.lax.fori_loop(0, 20, body, jnp.float32(0))

    chain(weights, x).block_until_ready()

    def probe() -> float:
        best = min(_median_time(lambda: chain(weights, x).block_until_ready(), 1) for _ in range(3))
        return 2 * batch * rows * cols * 8 * 20 / best

    return probe


def bench_size(
    name: str, *, batch: int, prompt: int, new: int, repeats: int, probe, dtype: str = "float32"
) -> list:
    with tempfile.TemporaryDirectory() as path:
        hf = _hf_model(name, path, dtype)
        config, params = load_pretrained(path, dtype=getattr(jnp, dtype))
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, config.vocab_size, size=(batch, prompt)).astype(np.int32)
    mask = np.ones((batch, prompt), bool)
    key = jax.random.key(0)
    hf_inputs = dict(
        input_ids=torch.as_tensor(tokens, dtype=torch.long, device=TORCH_DEVICE),
        attention_mask=torch.as_tensor(mask, dtype=torch.long, device=TORCH_DEVICE),
        use_cache=True,
        pad_token_id=0,
    )

    # The floors' rates, measured between the repeats (as the machine is then); the best counts.
    rate_probe = matmul_probe(batch, config.hidden_size, config.intermediate_size, dtype)

    def jax_prefill():
        state = gen.prefill(params, config, tokens, mask, max_new_tokens=new, pad_id=0)
        return jax.block_until_ready(state)

    rows = []
    for mode, temperature in MODES.items():
        sampling = gen.sampling_params(temperature=temperature, eos_ids=(), pad_id=0)
        hf_mode = dict(do_sample=False)
        if temperature > 0:
            hf_mode = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)

        def jax_decode(state, sampling=sampling):
            state = gen.decode(params, config, state, key=key, sampling=sampling)
            return jax.block_until_ready(state)

        def hf_generate(max_new, hf_mode=hf_mode):
            with torch.no_grad():
                out = hf.generate(
                    **hf_inputs, **hf_mode, max_new_tokens=max_new, min_new_tokens=max_new
                )
            _sync()
            return out

        ours = np.asarray(jax_decode(jax_prefill()).tokens)  # warm-up: compiles
        hf_generate(1)
        jax_pre, jax_dec, hf_one, hf_full, bandwidth, rate = [], [], [], [], [], []
        agree = float("nan")
        for repeat in range(repeats):
            start = time.perf_counter()
            state = jax_prefill()
            jax_pre.append(time.perf_counter() - start)
            start = time.perf_counter()
            jax_decode(state)
            jax_dec.append(time.perf_counter() - start)
            del state
            bandwidth.append(probe())
            rate.append(rate_probe())
            start = time.perf_counter()
            hf_generate(1)
            hf_one.append(time.perf_counter() - start)
            start = time.perf_counter()
            theirs = hf_generate(new)
            hf_full.append(time.perf_counter() - start)
            theirs = theirs.cpu().numpy()[:, prompt:]
            if theirs.shape != (batch, new):
                raise RuntimeError(f"transformers stopped early: {theirs.shape}")
            if repeat == 0 and temperature == 0:  # greedy: the two sides agree token for token
                agree = float(np.mean(ours == theirs))

        med = statistics.median
        hf_dec = [full - one for full, one in zip(hf_full, hf_one)]
        rows.append(
            dict(
                name=name,
                mode=mode,
                agree=agree,
                jax_prefill_tps=batch * prompt / med(jax_pre),
                hf_prefill_tps=batch * prompt / med(hf_one),
                jax_decode_tps=batch * new / med(jax_dec),
                hf_decode_tps=batch * (new - 1) / med(hf_dec),
                jax_total_s=med(jax_pre) + med(jax_dec),
                hf_total_s=med(hf_full),
                jax_step_s=med(jax_dec) / new,
                hf_step_s=med(hf_dec) / (new - 1),
                bandwidth=max(bandwidth),
                matmul_rate=max(rate),
            )
        )

    # What one decode step must read: every weight but the embedding table (a gather of B rows),
    # and the K/V of the slots it attends to (step t: the prompt and t + 1 tokens; on average
    # P + (T + 1) / 2 slots).
    read = sum(x.size for x in jax.tree.leaves(params)) - params["embed"].size
    itemsize = jnp.dtype(dtype).itemsize
    cache_bytes = 2 * config.num_hidden_layers * batch * (prompt + (new + 1) / 2) * config.head_dim
    cache_bytes *= config.num_key_value_heads * itemsize
    for row in rows:
        row.update(params=read + params["embed"].size, step_bytes=read * itemsize + cache_bytes)
        row.update(step_flops=2 * batch * read)
    return rows


def render(results: list, *, args, repeats: dict, load_before: float) -> str:
    device = jax.devices()[0]
    counts = ", ".join(f"{n}: {r}" for n, r in repeats.items())
    lines = [
        f"bench_decode: batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, "
        f"{args.dtype}, transformers on {TORCH_DEVICE}, "
        f"greedy and sampled (T=1, no truncation); medians of alternating repeats ({counts}); "
        f"compile excluded; JAX decode windows: {args.windows}",
        "",
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"JAX device {device.device_kind}; jax {jax.__version__}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), transformers {transformers.__version__}; "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; 1-min load average "
        f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after",
        "",
        "| model | params | mode | prefill tok/s JAX | prefill tok/s HF | prefill × | "
        "decode tok/s JAX | decode tok/s HF | decode × | end-to-end × | greedy agree |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        agree = "n/a" if np.isnan(r["agree"]) else f"{r['agree']:.0%}"
        lines.append(
            f"| {r['name']} | {r['params'] / 1e6:.1f}M | {r['mode']} | "
            f"{r['jax_prefill_tps']:,.0f} | {r['hf_prefill_tps']:,.0f} | "
            f"{r['jax_prefill_tps'] / r['hf_prefill_tps']:.2f} | {r['jax_decode_tps']:,.0f} | "
            f"{r['hf_decode_tps']:,.0f} | {r['jax_decode_tps'] / r['hf_decode_tps']:.2f} | "
            f"{r['hf_total_s'] / r['jax_total_s']:.2f} | {agree} |"
        )
    lines += [
        "",
        "decode-step floors: bytes = weights read per step (not the embedding table) + the "
        "K/V of the slots a step attends to (on average P + (T + 1) / 2), at the streaming "
        "bandwidth of an in-place jitted x + 1 on 256 MiB "
        "(read + write); FLOPs = 2 * B * weights read, at the rate of one "
        f"[B, D] @ [D, F] {args.dtype} matmul here; both rates the best of probes between "
        "the repeats",
    ]
    for r in results:
        mem = r["step_bytes"] / r["bandwidth"]
        flop = r["step_flops"] / r["matmul_rate"]
        lines.append(
            f"- {r['name']} {r['mode']}: {r['jax_step_s'] * 1e3:.1f} ms/step (HF "
            f"{r['hf_step_s'] * 1e3:.1f}); {r['step_bytes'] / 2**20:.0f} MiB at "
            f"{r['bandwidth'] / 1e9:.1f} GB/s -> {mem * 1e3:.1f} ms; "
            f"{r['step_flops'] / 1e6:.0f} MFLOP at {r['matmul_rate'] / 1e9:.0f} GFLOP/s -> "
            f"{flop * 1e3:.1f} ms; measured = {max(mem, flop) / r['jax_step_s']:.0%} of the "
            "larger floor"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6M model only, 3 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="default 5 (6M), 3 (60M)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--out", default=None, help="also append the markdown to this file")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--windows",
        choices=("auto", "off"),
        default="auto",
        help="off: JAX decodes in one loop over the whole cache (no decode windows)",
    )
    parser.add_argument("--sizes", nargs="+", choices=tuple(SIZES), default=None)
    args = parser.parse_args()
    if args.windows == "off":
        layout.decode_windows = lambda *_, **__: ()
    load_before = os.getloadavg()[0]
    # A 60M transformers generate takes 5-60 s on 2 busy cores: 3 repeats bound the run time.
    sizes = args.sizes or (["6M"] if args.quick else ["6M", "60M"])
    repeats = {"6M": 3 if args.quick else 5, "60M": 3}
    repeats = {n: args.repeats or repeats[n] for n in sizes}
    probe = bandwidth_probe()
    results = []
    for name in sizes:
        results += bench_size(
            name,
            batch=args.batch,
            prompt=args.prompt,
            new=args.new,
            repeats=repeats[name],
            probe=probe,
            dtype=args.dtype,
        )
    text = render(results, args=args, repeats=repeats, load_before=load_before)
    print(text)
    if args.out:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        with open(args.out, "a") as f:
            f.write(f"\n### Run {stamp}\n\n{text}\n")


if __name__ == "__main__":
    main()
