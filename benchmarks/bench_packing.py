"""Packed vs padded: the GRPO update and the log-prob forward on a long-tailed batch.

Reasoning RL is long-tailed: completions run to the limit while their mean sits near a third
of it. A small random Llama (hidden 256, 4 layers, vocab 8000) scores ``B`` completions of at
most ``T`` tokens after prompts of 32-64 tokens, the completion lengths drawn from a gamma
distribution with mean ``0.3 T`` (shape 2), clipped to ``[8, T]``. Two programs, each padded
(``[B, P + T]`` rows) and packed (``trainer.packing``: first-fit-decreasing rows of the same
width, ``train.packing.plan_micro_batches``):

* ``logprobs``: the behaviour / reference forward (``train.forward.make_logprob_fn``);
* ``update``: one GRPO policy step (``bench.grpo_update``: ``train.rl.policy.make_policy_step``
  + ``jit_step``: forward, chunked log-probs, the loss, backward, AdamW).

Times are medians of ``--repeats`` calls after one warm-up call (compile excluded), padded and
packed calls alternating in one process. ``speed-up`` = padded / packed time. ``max |d|`` is the
largest difference between the padded and packed log-probs (float32): the same values.

Run::

    python benchmarks/bench_packing.py             # B=16, T=1024 (a few minutes, 2 cores)
    python benchmarks/bench_packing.py --quick     # B=8, T=256
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import subprocess
import sys
import time

import jax
import numpy as np

from jaxrl_llm import bench, models, parallel
from jaxrl_llm.train.forward import make_logprob_fn
from jaxrl_llm.train.packing import place_plan, plan_micro_batches
from jaxrl_llm.types import RolloutBatch, Sequences

PROMPT = (32, 64)
GROUP_SIZE = 4
MEAN_FRACTION = 0.3


def model_config() -> models.ModelConfig:
    return models.ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=8000,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        compute_dtype="float32",
    )


def long_tailed_batch(batch: int, length: int, vocab: int, seed: int = 0) -> RolloutBatch:
    """Left-padded prompts of 32-64 tokens; completion lengths gamma(2) with mean 0.3 T."""
    rng = np.random.default_rng(seed)
    width = PROMPT[1]
    prompt_len = rng.integers(PROMPT[0], PROMPT[1] + 1, size=batch)
    prompt_mask = np.arange(width)[None, :] >= (width - prompt_len)[:, None]
    drawn = rng.gamma(2.0, MEAN_FRACTION * length / 2.0, size=batch)
    completion_len = np.clip(np.round(drawn), 8, length).astype(int)
    completion_mask = np.arange(length)[None, :] < completion_len[:, None]
    return bench.grpo_rollout_batch(rng, prompt_mask, completion_mask, vocab, group_size=GROUP_SIZE)


def median_seconds(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile + warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(batch: int, length: int, repeats: int) -> dict:
    config = model_config()
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    host = long_tailed_batch(batch, length, config.vocab_size)
    plan_host = plan_micro_batches(
        host.prompt_mask, host.completion_mask, micro_batches=1, shards=1
    )
    plan = place_plan(plan_host, mesh)
    device = parallel.shard_batch(host, mesh)
    seqs = Sequences(
        device.prompt_tokens, device.prompt_mask, device.completion_tokens, device.completion_mask
    )
    params = models.init_params(config, jax.random.key(0))
    forward = make_logprob_fn(config)
    padded_lp = np.asarray(forward(params, seqs))
    packed_lp = np.asarray(forward(params, seqs, plan))
    times = {
        "logprobs": (
            median_seconds(lambda: forward(params, seqs), repeats),
            median_seconds(lambda: forward(params, seqs, plan), repeats),
        )
    }
    update = bench.grpo_update(config, params, mesh, learning_rate=1e-6, key=jax.random.key(1))
    packed_batch = device._replace(packing=plan)
    times["update"] = (
        median_seconds(lambda: update(device), repeats),
        median_seconds(lambda: update(packed_batch), repeats),
    )
    real = int(host.prompt_mask.sum() + host.completion_mask.sum())
    return {
        "batch": batch,
        "length": length,
        "rows": (batch, int(np.prod(plan_host.source.shape[:-1]))),
        "real_fraction": real / (batch * (PROMPT[1] + length)),
        "mean_completion": float(host.completion_mask.sum(axis=1).mean()),
        "max_diff": float(np.abs(padded_lp - packed_lp).max()),
        "times": times,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    batch, length = (8, 256) if args.quick else (16, 1024)
    result = run(batch, length, args.repeats)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(f"command: python {shlex.join(['benchmarks/bench_packing.py', *(argv or sys.argv[1:])])}")
    print(
        f"machine: {platform.processor() or platform.machine()}, {jax.device_count()} device(s); "
        f"jax {jax.__version__}; code {commit}"
    )
    rows = result["rows"]
    print(
        f"B={result['batch']} rows of {PROMPT[1]} + {result['length']} positions, mean completion "
        f"{result['mean_completion']:.0f} tokens, real tokens {100 * result['real_fraction']:.0f}% "
        f"of the padded positions; packed into {rows[1]} rows; max |d| log-probs "
        f"{result['max_diff']:.1e}"
    )
    print("| program | padded s | packed s | speed-up |")
    print("|---|---:|---:|---:|")
    total = [0.0, 0.0]
    for name, (padded, packed) in result["times"].items():
        total[0] += padded
        total[1] += packed
        print(f"| {name} | {padded:.3f} | {packed:.3f} | {padded / packed:.2f}x |")
    print(f"| both | {total[0]:.3f} | {total[1]:.3f} | {total[0] / total[1]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
