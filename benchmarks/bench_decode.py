"""Prefill and decode throughput of jaxrl_llm.sampling against transformers ``generate``.

Both sides run the same random Llama weights in float32, greedy, KV cache on, batch 16,
prompt 32, 128 new tokens (no EOS, so every row runs to the end), in the same process and
alternating repeat by repeat so machine noise hits both alike. Compile time is excluded (one
warm-up call each), every JAX timing ends with ``block_until_ready``, figures are medians.

* JAX prefill: the jitted prefill (prompt forward + cache write + last logits).
  JAX decode: the jitted ``lax.while_loop`` (128 sample + forward steps).
* HF prefill: ``generate(max_new_tokens=1)``; HF decode: ``generate(128) - generate(1)``
  (127 single-token forwards), i.e. the same split including generate's own per-step work.

Each decode step is also compared with the memory-bandwidth bound
``(weight bytes + KV-cache bytes) / copy bandwidth``, the bandwidth measured between the
repeats by a large jitted ``x + 1`` (read + write). Run::

    python benchmarks/bench_decode.py            # both sizes, ~3-8 min on 2 CPU cores
    python benchmarks/bench_decode.py --quick    # the small model only, fewer repeats
    XLA_FLAGS=--xla_cpu_multi_thread_eigen=false python benchmarks/bench_decode.py

On a 2-vCPU machine XLA's multi-threaded Eigen dots lose more to thread hand-offs than they
gain on these small matrices (batch-16 decode); the last line runs them single-threaded.
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

gen = importlib.import_module("jaxrl_llm.sampling.generate")

SIZES = {
    # name: (hidden, layers, heads, kv_heads, intermediate, vocab)
    "6M": (256, 4, 4, 4, 1024, 4096),
    "60M": (512, 8, 8, 8, 1376, 32000),
}


def _hf_model(name: str, path: str) -> torch.nn.Module:
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
    return model


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth_probe():
    """A function timing one jitted ``x + 1`` over 256 MiB of f32; returns bytes/s (read+write)."""
    x = jnp.zeros((64 * 2**20,), jnp.float32)
    step = jax.jit(lambda a: a + 1.0)
    step(x).block_until_ready()

    def probe() -> float:
        seconds = _median_time(lambda: step(x).block_until_ready(), 3)
        return 2 * x.nbytes / seconds

    return probe


def bench_size(
    name: str, *, batch: int, prompt: int, new: int, repeats: int, bandwidth_probe
) -> dict:
    with tempfile.TemporaryDirectory() as path:
        hf = _hf_model(name, path)
        config, params = load_pretrained(path, dtype=jnp.float32)
    num_params = sum(x.size for x in jax.tree.leaves(params))
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, config.vocab_size, size=(batch, prompt)).astype(np.int32)
    mask = np.ones((batch, prompt), bool)
    sampling = gen.sampling_params(temperature=0.0, eos_ids=(), pad_id=0)
    key = jax.random.key(0)

    def jax_prefill():
        state = gen.prefill(params, config, tokens, mask, max_new_tokens=new, pad_id=0)
        return jax.block_until_ready(state)

    def jax_decode(state):
        state = gen.decode(params, config, state, key=key, sampling=sampling)
        return jax.block_until_ready(state)

    hf_inputs = dict(
        input_ids=torch.as_tensor(tokens, dtype=torch.long),
        attention_mask=torch.as_tensor(mask, dtype=torch.long),
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
    )

    def hf_generate(max_new):
        with torch.no_grad():
            return hf.generate(**hf_inputs, max_new_tokens=max_new, min_new_tokens=max_new)

    # Warm-up: compiles (JAX) and first-call set-up (transformers).
    ours = np.asarray(jax_decode(jax_prefill()).tokens)
    hf_generate(1)

    jax_pre, jax_dec, hf_one, hf_full, bandwidth = [], [], [], [], []
    for repeat in range(repeats):
        start = time.perf_counter()
        state = jax_prefill()
        jax_pre.append(time.perf_counter() - start)
        start = time.perf_counter()
        jax_decode(state)
        jax_dec.append(time.perf_counter() - start)
        del state
        bandwidth.append(bandwidth_probe())
        start = time.perf_counter()
        hf_generate(1)
        hf_one.append(time.perf_counter() - start)
        start = time.perf_counter()
        theirs = hf_generate(new)
        hf_full.append(time.perf_counter() - start)
        if repeat == 0:  # the two sides agree token for token
            theirs = theirs.numpy()[:, prompt:]
            if theirs.shape != (batch, new):
                raise RuntimeError(f"transformers stopped early: {theirs.shape}")
            agree = float(np.mean(ours == theirs))

    med = statistics.median
    hf_dec = [full - one for full, one in zip(hf_full, hf_one)]
    result = dict(
        name=name,
        params=num_params,
        agree=agree,
        jax_prefill_tps=batch * prompt / med(jax_pre),
        hf_prefill_tps=batch * prompt / med(hf_one),
        jax_decode_tps=batch * new / med(jax_dec),
        hf_decode_tps=batch * (new - 1) / med(hf_dec),
        jax_total_s=med(jax_pre) + med(jax_dec),
        hf_total_s=med(hf_full),
        jax_step_s=med(jax_dec) / new,
        bandwidth=med(bandwidth),
    )
    cache_bytes = (
        2
        * config.num_hidden_layers
        * batch
        * (prompt + new)
        * config.num_key_value_heads
        * config.head_dim
        * 4
    )
    result["step_bytes"] = num_params * 4 + cache_bytes
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6M model only, 3 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="default 5 (6M), 3 (60M)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=128)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    # A 60M transformers generate takes 10-60 s on 2 busy cores: 3 repeats bound the run time.
    repeats = {"6M": 3 if args.quick else 5, "60M": 3}
    if args.repeats:
        repeats = dict.fromkeys(repeats, args.repeats)
    sizes = ["6M"] if args.quick else ["6M", "60M"]

    probe = copy_bandwidth_probe()
    results = [
        bench_size(
            n,
            batch=args.batch,
            prompt=args.prompt,
            new=args.new,
            repeats=repeats[n],
            bandwidth_probe=probe,
        )
        for n in sizes
    ]

    device = jax.devices()[0]
    print(f"# bench_decode: batch {args.batch}, prompt {args.prompt}, {args.new} new tokens,")
    counts = ", ".join(f"{n}: {repeats[n]}" for n in sizes)
    print(f"greedy, f32, medians of alternating repeats ({counts}; compile excluded)\n")
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"JAX device {device.device_kind}; jax {jax.__version__}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), transformers {transformers.__version__}; "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; 1-min load average "
        f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n"
    )
    print(
        "| model | params | prefill tok/s JAX | prefill tok/s HF | prefill × | "
        "decode tok/s JAX | decode tok/s HF | decode × | end-to-end × | greedy agree |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['name']} | {r['params'] / 1e6:.1f}M | {r['jax_prefill_tps']:,.0f} | "
            f"{r['hf_prefill_tps']:,.0f} | {r['jax_prefill_tps'] / r['hf_prefill_tps']:.2f} | "
            f"{r['jax_decode_tps']:,.0f} | {r['hf_decode_tps']:,.0f} | "
            f"{r['jax_decode_tps'] / r['hf_decode_tps']:.2f} | "
            f"{r['hf_total_s'] / r['jax_total_s']:.2f} | {r['agree']:.0%} |"
        )
    print(
        "\nmemory-bandwidth bound: copy bandwidth = jitted x + 1 on 256 MiB (read + write), "
        "timed between the repeats"
    )
    for r in results:
        bound = r["step_bytes"] / r["bandwidth"]
        print(
            f"{r['name']}: {r['step_bytes'] / 2**20:.0f} MiB per decode step (weights + full "
            f"KV cache) at {r['bandwidth'] / 1e9:.1f} GB/s -> bound {bound * 1e3:.1f} ms/step; "
            f"measured {r['jax_step_s'] * 1e3:.1f} ms/step = {bound / r['jax_step_s']:.0%} "
            "of the bound"
        )


if __name__ == "__main__":
    main()
