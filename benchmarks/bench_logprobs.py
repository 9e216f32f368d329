"""Chunked vs full-logits completion log-probs: peak memory, time, and forward throughput.

A small random Llama (hidden 256, 2 layers, vocab 32000) scores B=8 completions of T=1024
tokens after a 32-token prompt, two ways:

* chunked: ``jaxrl_llm.logprobs.completion_logprobs`` (unembedding + log-softmax over chunks
  of the sequence, chunk body rematerialised);
* full: ``logits(...)`` materialising ``[B, P + T, V]``, then ``log_softmax`` and a gather.

For each, with and without the gradient w.r.t. the params: the peak temporary memory XLA
plans for the compiled program (``jax.jit(f).lower(...).compile().memory_analysis()``), the
median wall time over repeats (compile excluded, ``block_until_ready``), and the largest
difference between the two results. Then forward tokens/s of the jitted ``logits`` against
transformers' PyTorch forward on the same weights (float32, same process, alternating).

Run::

    python benchmarks/bench_logprobs.py            # B=8, T=1024, V=32000 (a few minutes, 2 cores)
    python benchmarks/bench_logprobs.py --quick    # B=4, T=256, V=8000
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from jaxrl_llm.logprobs import completion_logprobs, default_chunk_size
from jaxrl_llm.models import forward, load_pretrained, logits, unembed

PROMPT_LEN = 32


def full_logprobs(params, config, prompt, prompt_mask, completion, completion_mask, *, remat):
    """The baseline: all ``[B, P + T, V]`` logits, then ``log_softmax`` and a gather."""
    tokens = jnp.concatenate([prompt, completion], axis=1)
    mask = jnp.concatenate([prompt_mask, completion_mask], axis=1)
    p, t = prompt.shape[1], completion.shape[1]
    hidden, _ = forward(params, config, tokens, attention_mask=mask, remat=remat)
    z = unembed(params, config, hidden)[:, p - 1 : p - 1 + t]
    logp = jnp.take_along_axis(jax.nn.log_softmax(z), completion[..., None], axis=-1)[..., 0]
    return jnp.where(completion_mask, logp, 0.0)


def _hf_llama(path: str, *, hidden: int, layers: int, vocab: int) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = model.to(torch.float32).eval()
    model.save_pretrained(path)
    return model


def _median_time(fn, repeats: int):
    """(median seconds of ``repeats`` calls, the last result)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _compile(fn, *args):
    """Compiled program and the peak temporary bytes XLA planned for it."""
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, int(compiled.memory_analysis().temp_size_in_bytes)


def _batch(rng, batch: int, length: int, vocab: int):
    prompt = rng.integers(0, vocab, size=(batch, PROMPT_LEN)).astype(np.int32)
    prompt_mask = np.ones((batch, PROMPT_LEN), bool)
    prompt_mask[1::2, : PROMPT_LEN // 2] = False  # left padding on every other row
    completion = rng.integers(0, vocab, size=(batch, length)).astype(np.int32)
    lengths = rng.integers(length // 2, length + 1, size=batch)
    completion_mask = np.arange(length)[None, :] < lengths[:, None]
    return tuple(jnp.asarray(x) for x in (prompt, prompt_mask, completion, completion_mask))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="B=4, T=256, V=8000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--chunk-size", type=int, default=None, help="default: automatic (--quick: 32)"
    )
    parser.add_argument(
        "--remat", default="none", choices=("none", "layer"), help="the model's remat policy"
    )
    args = parser.parse_args(argv)
    batch, length, vocab = (4, 256, 8000) if args.quick else (8, 1024, 32000)
    hidden, layers = 256, 2
    torch.set_num_threads(os.cpu_count() or 1)

    with tempfile.TemporaryDirectory() as path:
        torch_model = _hf_llama(path, hidden=hidden, layers=layers, vocab=vocab)
        config, params = load_pretrained(path, dtype=jnp.float32)
    data = _batch(np.random.default_rng(0), batch, length, vocab)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(batch, length)), jnp.float32)
    chunk = args.chunk_size or (32 if args.quick else default_chunk_size(batch, length, vocab))

    def chunked_fn(params, *data):
        return completion_logprobs(params, config, *data, chunk_size=chunk, remat=args.remat)

    def full_fn(params, *data):
        return full_logprobs(params, config, *data, remat=args.remat)

    def hidden_only_fn(params, *data):
        # Reference point: the transformer alone, no unembedding (what neither variant saves).
        tokens = jnp.concatenate([data[0], data[2]], axis=1)
        mask = jnp.concatenate([data[1], data[3]], axis=1)
        hidden, _ = forward(params, config, tokens, attention_mask=mask, remat=args.remat)
        return jnp.mean(hidden[:, PROMPT_LEN - 1 : PROMPT_LEN - 1 + length], axis=-1)

    def with_grad(fn):
        return jax.value_and_grad(lambda p, *d: jnp.sum(fn(p, *d) * weights))

    rows = []
    values = {}
    for mode, make in (("log-probs", lambda f: f), ("log-probs + grad", with_grad)):
        variants = (
            ("full", full_fn),
            (f"chunked (C={chunk})", chunked_fn),
            ("transformer only, no unembedding", hidden_only_fn),
        )
        for name, fn in variants:
            # Timing the AOT-compiled program excludes compilation without a warm-up call.
            compiled, peak = _compile(make(fn), params, *data)
            # The gradient runs dominate the script's time: one repeat fewer keeps it ~5 min.
            repeats = args.repeats if mode == "log-probs" else max(1, args.repeats - 1)
            seconds, values[(mode, name)] = _median_time(
                lambda c=compiled: c(params, *data), repeats
            )
            rows.append((mode, name, peak, seconds))

    def max_diff(a, b):
        return max(
            float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
        )

    names = [n for m, n, *_ in rows if m == "log-probs"][:2]
    diff_values = max_diff(values[("log-probs", names[0])], values[("log-probs", names[1])])
    diff_grads = max_diff(
        values[("log-probs + grad", names[0])][1], values[("log-probs + grad", names[1])][1]
    )

    # Forward throughput: jitted logits vs transformers, same weights, alternating repeats.
    tokens = jnp.concatenate([data[0], data[2]], axis=1)
    mask = jnp.concatenate([data[1], data[3]], axis=1)
    jax_logits = jax.jit(functools.partial(logits, config=config))
    jax_call = lambda: jax_logits(params, tokens=tokens, attention_mask=mask)  # noqa: E731
    jax.block_until_ready(jax_call())
    torch_tokens = torch.tensor(np.array(tokens), dtype=torch.long)
    torch_mask = torch.tensor(np.array(mask), dtype=torch.long)
    positions = torch.clamp(torch.cumsum(torch_mask, 1) - 1, min=0)

    def torch_call():
        with torch.no_grad():
            return torch_model(
                input_ids=torch_tokens, attention_mask=torch_mask, position_ids=positions
            ).logits

    torch_call()
    jax_times, torch_times = [], []
    for _ in range(args.repeats):
        jax_times.append(_median_time(jax_call, 1)[0])
        start = time.perf_counter()
        torch_call()
        torch_times.append(time.perf_counter() - start)
    n_tokens = tokens.size
    jax_tps = n_tokens / statistics.median(jax_times)
    torch_tps = n_tokens / statistics.median(torch_times)

    full_rows = {m: (p, s) for m, n, p, s in rows if n == "full"}
    print(
        f"## Completion log-probs: chunked vs full logits (B={batch}, P={PROMPT_LEN}, "
        f"T={length}, V={vocab}, hidden {hidden}, {layers} layers, f32, remat={args.remat})\n"
    )
    print("| computation | variant | peak temp memory | vs full | median time | vs full |")
    print("|---|---|---:|---:|---:|---:|")
    for mode, name, peak, seconds in rows:
        full_peak, full_seconds = full_rows[mode]
        print(
            f"| {mode} | {name} | {peak / 2**20:,.1f} MiB | {peak / full_peak:.1%} | "
            f"{seconds * 1e3:,.0f} ms | {seconds / full_seconds:.2f}x |"
        )
    print(f"\nmax |chunked - full|: log-probs {diff_values:.2e}, gradients {diff_grads:.2e}\n")
    print("| forward (logits) | tokens/s | ratio |")
    print("|---|---:|---:|")
    print(f"| jaxrl_llm (jit) | {jax_tps:,.0f} | {jax_tps / torch_tps:.2f}x |")
    print(f"| transformers (PyTorch, sdpa) | {torch_tps:,.0f} | 1.00x |")
    print(f"\ncommand: {shlex.join(['python', 'benchmarks/bench_logprobs.py', *(argv or [])])}")
    print(
        f"machine: {platform.platform()}, {os.cpu_count()} CPUs, {platform.processor()}; "
        f"device: {jax.devices()[0].device_kind} ({jax.default_backend()})"
    )
    print(
        f"versions: python {platform.python_version()}, jax {jax.__version__}, "
        f"flax {_version('flax')}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
    )
    return 0


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
