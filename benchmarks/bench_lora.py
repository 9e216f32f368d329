"""LoRA vs full fine-tuning: GRPO policy-step time and training-state memory, JAX and PyTorch.

The step is ``bench_train_step.py``'s (forward over ``[prompt ; completion]``, per-token
log-probs, the GRPO loss, backward, global-norm clipping, AdamW), on the same weights and batch,
four ways:

* ``jax full``: every weight trained (``make_policy_step`` + ``jit_step``, f32 state);
* ``jax lora``: ``model.lora`` — adapters (rank ``--rank``, alpha ``2·rank``, all seven
  projections) trained, the base frozen beside the state (``train.adapters``);
* ``torch full``: transformers' ``LlamaForCausalLM`` + ``torch.optim.AdamW`` (the TRL / verl
  recipe);
* ``torch lora``: the same model wrapped by ``peft.get_peft_model`` with the same adapters,
  AdamW over the trainable parameters (TRL's ``peft_config`` path).

Memory is the persistent training state: weights + gradients + optimizer moments (bytes,
counted from the arrays: JAX's state and frozen base, PyTorch's parameters, ``.grad`` and
``optimizer.state`` after a step); for JAX also XLA's temporary buffers of the compiled step
(``memory_analysis().temp_size_in_bytes``: activations and gradients live inside the step).
Times are medians of ``--repeats`` calls after ``--warmup`` (JAX: compile excluded), each
implementation timed on its own (not interleaved).

Run::

    python benchmarks/bench_lora.py                 # 60M, B=8, T=128 (about 3 min, 2 cores)
    python benchmarks/bench_lora.py --model tiny    # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_train_step as bts  # noqa: E402

from jaxrl_llm import bench  # noqa: E402


def timed(call, warmup: int, repeats: int) -> tuple[float, float, float]:
    """``(first call s, median s, first loss)``."""
    start = time.perf_counter()
    loss = call()
    first = time.perf_counter() - start
    for _ in range(warmup - 1):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times), loss


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(bts.MODELS), default="60m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch_losses, reason = bench.load_torch_impl()
    if torch_losses is None:
        raise SystemExit(f"the PyTorch baseline is unavailable: {reason}")
    data = bts.host_batch(args.batch, args.length, bts.MODELS[args.model][0])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = os.path.join(tmp, args.model)
        bts.hf_llama(args.model).save_pretrained(checkpoint)
        for name, rank in (("full", None), ("lora", args.rank)):
            call, _ = bts.jax_step_fn(
                checkpoint, data, jax.devices()[:1], "float32", lora_rank=rank
            )
            first, median, loss = timed(call, args.warmup, args.repeats)
            rows.append(
                dict(impl=f"jax {name}", first_s=first, median_s=median, loss=loss,
                     state_bytes=call.state_bytes, temp_bytes=call.temp_bytes())
            )  # fmt: skip
            del call
            call = bts.torch_step_fn(checkpoint, data, "float32", torch_losses, lora_rank=rank)
            first, median, loss = timed(call, args.warmup, args.repeats)
            rows.append(
                dict(impl=f"torch {name}", first_s=first, median_s=median, loss=loss,
                     state_bytes=call.state_bytes(), temp_bytes=None)
            )  # fmt: skip
            del call
    tokens = args.batch * (bts.PROMPT_LEN + args.length)
    by = {r["impl"]: r for r in rows}
    print(
        f"{args.model}, B={args.batch}, T={bts.PROMPT_LEN}+{args.length}, rank {args.rank} "
        f"(alpha {2 * args.rank}, q k v o gate up down); jax {jax.__version__}, "
        f"{platform.processor() or platform.machine()}"
    )
    print("| impl | step (median s) | tokens/s | vs torch same mode | state MiB | XLA temp MiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        mode = r["impl"].split()[1]
        torch_s = by[f"torch {mode}"]["median_s"]
        temp = "" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2**20:.0f}"
        print(
            f"| {r['impl']} | {r['median_s']:.3f} | {tokens / r['median_s']:,.0f} | "
            f"{torch_s / r['median_s']:.2f}x | {r['state_bytes'] / 2**20:.0f} | {temp} |"
        )
    for framework in ("jax", "torch"):
        full, lora = by[f"{framework} full"], by[f"{framework} lora"]
        print(
            f"{framework}: LoRA step {full['median_s'] / lora['median_s']:.2f}x faster, "
            f"state {full['state_bytes'] / lora['state_bytes']:.2f}x smaller"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
