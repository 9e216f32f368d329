"""Policy-update step time and tokens/s: jaxrl_llm's jitted GRPO step vs the PyTorch way.

One step = forward over ``[prompt ; completion]``, per-token log-probs, the GRPO loss (clipped
token-ratio surrogate + k3 KL to a reference, seq-mean-token-mean), backward, global-norm
clipping and an AdamW update. Three implementations on the same weights and batch:

* ``jax``: ``make_policy_step`` + ``jit_step`` on a one-device mesh (chunked log-probs,
  the state donated);
* ``jax_mesh``: the same on every device (CPU: 8 fake host devices in a subprocess, where
  ``XLA_FLAGS`` is set before JAX is imported; mesh ``fsdp=8``);
* ``torch``: what a user would otherwise write, as in TRL / verl: transformers'
  ``LlamaForCausalLM`` forward, ``log_softmax`` + ``gather`` of the completion tokens, the loss of
  ``benchmarks/torch_losses.py``, ``loss.backward()``, ``clip_grad_norm_``, ``torch.optim.AdamW``.

Step times are medians of ``--repeats`` calls after ``--warmup`` calls (compile excluded, JAX
outputs ``block_until_ready``). Each implementation runs in its own process (``--interleave``:
both in this one, calls alternating). In one process each framework's step is slowed by the
other's: on a 2-core CPU the 60M JAX step takes 1.47 s alone and 1.8-2.1 s right after
PyTorch steps (PyTorch 1.54 s alone, 1.73 s interleaved), the same with PyTorch's OpenMP
threads set passive. tokens/s counts every
position of the ``B x (P + T)`` batch. ``speed-up`` = torch time / JAX time (> 1: JAX faster).
``loss diff`` = |JAX − torch| of the first step's loss, a check that both compute the same
thing.
Off CPU the table adds MFU = 6·N·tokens / time / (peak · devices), with N the parameters that
do matmuls (all but the input embedding) and the peak from ``--peak-tflops`` or the device kind.

Run::

    python benchmarks/bench_train_step.py                  # tiny + ~60M Llama (~11 min, 2 cores)
    python benchmarks/bench_train_step.py --quick --json out.json     # tiny model only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import bench, objectives, parallel
from jaxrl_llm.models import load_pretrained
from jaxrl_llm.types import RolloutBatch

# Llama-shaped models: (vocab, hidden, intermediate, layers, heads, kv_heads).
MODELS = {
    "tiny": (512, 64, 256, 2, 4, 2),
    "60m": (32000, 512, 1536, 8, 8, 4),
}
# (model, B, T, also on the mesh); the prompt adds PROMPT_LEN positions to every row, and B is a
# multiple of the 8 mesh devices. On 2 CPU cores a 60M step takes 10-40 s per implementation (and
# 3x that on 8 fake devices), so the plan stops at 8 x 256 and runs the mesh on the smaller
# shapes only, to keep the whole run near 10 minutes.
FULL_PLAN = (("tiny", 16, 256, True), ("60m", 8, 128, True), ("60m", 8, 256, False))
# On a GPU the CPU shapes leave the chip idle: add a batch that fills it better.
GPU_PLAN = FULL_PLAN + (("60m", 64, 512, False),)
QUICK_PLAN = (("tiny", 8, 64, True),)
PROMPT_LEN = 32
GROUP_SIZE = 4
LEARNING_RATE = 1e-6
MESH_DEVICES = 8
# bf16 dense peak TFLOP/s per device, matched as a substring of ``device_kind``.
PEAK_TFLOPS = {
    "H100": 989.0,
    "H200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "TPU v4": 275.0,
    "TPU v5 lite": 197.0,
    "TPU v5p": 459.0,
    "TPU v6 lite": 918.0,
}
IMPLS = ("jax", "jax_mesh", "torch")


class Timing(NamedTuple):
    """One implementation on one (model, B, T): times in seconds, the first step's loss.

    ``first_s`` is the first call (JAX: compilation included); the median and the 10th / 90th
    percentiles are over the timed calls.
    """

    impl: str
    devices: int
    first_s: float
    median_s: float
    p10_s: float
    p90_s: float
    tokens_per_s: float
    first_loss: float


def matmul_params(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv: int):
    """``N`` of the ``6·N`` FLOPs per token: every weight but the input embedding (a gather)."""
    head_dim = hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    mlp = 3 * hidden * intermediate
    return layers * (attention + mlp + 2 * hidden) + hidden + hidden * vocab


def mfu(n_params: int, tokens: int, seconds: float, peak_tflops: float, devices: int) -> float:
    """Model FLOPs utilisation ``6·N·tokens / seconds / (peak · devices)`` (Chowdhery et al.)."""
    if seconds <= 0 or peak_tflops <= 0 or devices < 1:
        raise ValueError(
            f"mfu needs seconds > 0, peak > 0, devices >= 1; got {seconds}, {peak_tflops}, "
            f"{devices}"
        )
    return 6.0 * n_params * tokens / seconds / (peak_tflops * 1e12 * devices)


def default_peak_tflops(device_kind: str) -> float | None:
    """The bf16 dense peak of a known accelerator, or None."""
    for name, peak in PEAK_TFLOPS.items():
        if name.lower() in device_kind.lower():
            return peak
    return None


def hf_llama(model: str):
    """transformers' ``LlamaForCausalLM`` of size ``MODELS[model]``, seeded, untied, f32."""
    import torch
    import transformers

    vocab, hidden, intermediate, layers, heads, kv = MODELS[model]
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def host_batch(batch: int, length: int, vocab: int, *, seed: int = 0) -> RolloutBatch:
    """Left-padded prompts, right-padded completions of ``length/2 … length`` tokens, GRPO data."""
    rng = np.random.default_rng(seed)
    prompt_len = rng.integers(PROMPT_LEN // 2, PROMPT_LEN + 1, size=batch)
    prompt_mask = np.arange(PROMPT_LEN)[None, :] >= (PROMPT_LEN - prompt_len)[:, None]
    completion_len = rng.integers(length // 2, length + 1, size=batch)
    completion_mask = np.arange(length)[None, :] < completion_len[:, None]
    return bench.grpo_rollout_batch(rng, prompt_mask, completion_mask, vocab, group_size=GROUP_SIZE)


def jax_step_fn(
    checkpoint: str, data: RolloutBatch, devices: list, dtype: str, *, lora_rank: int | None = None
):
    """``(step, n_devices)``: a no-argument call running one jitted policy update, blocking.

    ``lora_rank``: train rank-r adapters (alpha 2r, every projection) on the frozen base
    instead of every weight. The call carries ``state_bytes`` (parameters, optimizer state and
    a LoRA run's base) and ``temp_bytes()`` (XLA's temporaries of the compiled step).
    """
    mesh = parallel.make_mesh(1, len(devices), 1, devices=devices)
    # f32 master weights; ``dtype`` is the compute dtype (matmuls and activations).
    config, params = load_pretrained(checkpoint, dtype=jnp.float32, mesh=mesh)
    config = dataclasses.replace(config, compute_dtype=dtype)
    # No entropy: the PyTorch step does not compute it either.
    update = bench.grpo_update(
        config,
        params,
        mesh,
        learning_rate=LEARNING_RATE,
        key=jax.random.key(0),
        compute_entropy=False,
        lora_rank=lora_rank,
    )
    batch = parallel.shard_batch(data, mesh)

    def call() -> float:
        _, metrics = jax.block_until_ready(update(batch))
        return float(metrics["loss"])

    call.state_bytes = update.state_bytes
    call.temp_bytes = lambda: update.temp_bytes(batch)  # an extra compile: only when asked
    return call, len(devices)


def torch_step_fn(
    checkpoint: str, data: RolloutBatch, dtype: str, torch_losses, *, lora_rank: int | None = None
):
    """A no-argument call running one eager PyTorch policy update (the TRL / verl recipe).

    ``lora_rank``: the model wrapped by ``peft.get_peft_model`` with rank-r adapters (alpha 2r,
    every projection; TRL's ``peft_config`` path), AdamW over the trainable parameters. The
    call carries ``state_bytes()``: weights + gradients + optimizer moments after a step.
    """
    import torch
    import transformers

    device = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
    # f32 weights and AdamW; bf16 compute through autocast (what TRL / accelerate's bf16 does).
    model = transformers.LlamaForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="sdpa"
    ).to(device)
    if lora_rank is not None:
        import peft

        modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        config = peft.LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=modules)
        model = peft.get_peft_model(model, config)
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable, lr=LEARNING_RATE, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
    )
    objective = objectives.make("grpo")
    mask = np.concatenate([data.prompt_mask, data.completion_mask], axis=1)
    tokens = torch.tensor(np.concatenate([data.prompt_tokens, data.completion_tokens], 1)).long()
    attention_mask = torch.tensor(mask).long()
    positions = torch.clamp(torch.cumsum(attention_mask, 1) - 1, min=0)
    completion = torch.tensor(data.completion_tokens).long().to(device)
    tokens, attention_mask, positions = (x.to(device) for x in (tokens, attention_mask, positions))
    batch = data._replace(
        **{
            field: torch.tensor(np.asarray(value), dtype=torch.float32, device=device)
            for field, value in data._asdict().items()
            if field in ("completion_mask", "old_logprobs", "advantages", "ref_logprobs")
        }
    )
    start, length = data.prompt_tokens.shape[1] - 1, data.completion_tokens.shape[1]

    def call() -> float:
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            logits = model(
                input_ids=tokens, attention_mask=attention_mask, position_ids=positions
            ).logits
        logits = logits[:, start : start + length].float()
        logprobs = torch.gather(torch.log_softmax(logits, -1), -1, completion[..., None])[..., 0]
        loss = torch_losses.policy_loss(objective, logprobs, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        return float(loss.detach())

    def state_bytes() -> int:
        tensors = [*model.parameters(), *(p.grad for p in trainable if p.grad is not None)]
        tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return int(sum(t.numel() * t.element_size() for t in tensors))

    call.state_bytes = state_bytes
    return call


def _time(calls: dict[str, Any], warmup: int, repeats: int) -> dict[str, tuple]:
    """Warm-up then interleaved timed calls; ``{name: (seconds, first loss, first call s)}``."""
    first, first_s = {}, {}
    for name, call in calls.items():
        start = time.perf_counter()
        first[name] = call()
        first_s[name] = time.perf_counter() - start
    for _ in range(warmup - 1):
        for call in calls.values():
            call()
    times: dict[str, list] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: (times[name], first[name], first_s[name]) for name in calls}


def run_plan(
    plan, checkpoints: str, *, impls, devices, dtype: str, warmup: int, repeats: int
) -> list[dict]:
    """Times ``impls`` (subset of ``jax`` / ``torch`` / ``jax_mesh``) for every plan entry."""
    torch_losses = None
    if "torch" in impls:
        torch_losses, reason = bench.load_torch_impl()
        if torch_losses is None:
            raise ValueError(f"the PyTorch baseline is unavailable: {reason}")
    results = []
    for model, batch, length, _ in plan:
        data = host_batch(batch, length, MODELS[model][0])
        checkpoint = os.path.join(checkpoints, model)
        calls, counts = {}, {}
        for impl in impls:
            if impl == "torch":
                calls[impl], counts[impl] = torch_step_fn(checkpoint, data, dtype, torch_losses), 1
            else:
                calls[impl], counts[impl] = jax_step_fn(checkpoint, data, devices[impl], dtype)
        tokens = batch * (PROMPT_LEN + length)
        for impl, (seconds, loss, first_s) in _time(calls, warmup, repeats).items():
            median = statistics.median(seconds)
            p10, p90 = (float(v) for v in np.percentile(seconds, [10, 90]))
            timing = Timing(impl, counts[impl], first_s, median, p10, p90, tokens / median, loss)
            results.append({"model": model, "B": batch, "T": length, **timing._asdict()})
    return results


def _worker_subprocess(args, checkpoints: str, impl: str) -> list[dict]:
    """Times ``impl`` in a child process (``jax_mesh`` on CPU: ``MESH_DEVICES`` fake devices)."""
    env = {**os.environ}
    if impl == "jax_mesh" and jax.default_backend() == "cpu":
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
        flags.append(f"--xla_force_host_platform_device_count={MESH_DEVICES}")
        env.update(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, f"{impl}.json")
        command = [sys.executable, os.path.abspath(__file__), "--worker", impl, checkpoints]
        command += ["--json", out, "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
        command += ["--dtype", args.dtype] + (["--quick"] if args.quick else [])
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(
                f"the {impl} benchmark subprocess failed (rc={proc.returncode}):\n"
                f"{proc.stderr[-4000:]}"
            )
        with open(out) as f:
            return json.load(f)["results"]


def format_table(results: list[dict], *, peak_tflops: float | None) -> str:
    """One markdown row per (model, B, T), the implementations side by side."""
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in results:
        by_key.setdefault((r["model"], r["B"], r["T"]), {})[r["impl"]] = r
    header = ["model", "params", "B", "T", "tokens/step"]
    for impl in IMPLS:
        header += [f"{impl} ms", f"{impl} tok/s"]
    header += ["speed-up 1 dev", "speed-up mesh", "loss diff"]
    if peak_tflops is not None:
        header += ["MFU 1 dev", "MFU mesh"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 4 + "---:|" * (len(header) - 4)]
    for (model, batch, length), impls in by_key.items():
        n = matmul_params(*MODELS[model])
        tokens = batch * (PROMPT_LEN + length)
        cells = [model, f"{n / 1e6:.1f}M", str(batch), str(length), f"{tokens:,}"]
        for impl in IMPLS:
            r = impls.get(impl)
            cells += (
                [f"{r['median_s'] * 1e3:,.1f}", f"{r['tokens_per_s']:,.0f}"] if r else ["n/a"] * 2
            )
        torch_r = impls.get("torch")
        for impl in ("jax", "jax_mesh"):
            r = impls.get(impl)
            ok = r is not None and torch_r is not None
            cells.append(f"{torch_r['median_s'] / r['median_s']:.2f}×" if ok else "n/a")
        if "jax" in impls and torch_r is not None:
            cells.append(f"{abs(impls['jax']['first_loss'] - torch_r['first_loss']):.1e}")
        else:
            cells.append("n/a")
        if peak_tflops is not None:
            for impl in ("jax", "jax_mesh"):
                r = impls.get(impl)
                cells.append(
                    f"{mfu(n, tokens, r['median_s'], peak_tflops, r['devices']):.1%}"
                    if r
                    else "n/a"
                )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def environment(dtype: str, repeats: int, warmup: int) -> dict[str, str]:
    import torch

    env = bench.environment()
    env["versions"] += f", torch {torch.__version__}"
    env["threads"] = f"XLA: all cores; torch: {torch.get_num_threads()}"
    env["dtype"] = f"f32 master weights and AdamW, {dtype} compute, f32 loss math"
    env["timing"] = f"median of {repeats} steps after {warmup} warm-up step(s)"
    return env


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model at one shape only")
    parser.add_argument("--json", help="also write the results and environment to this file")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed steps (default: 3; --quick: 5)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (>= 1)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    parser.add_argument("--peak-tflops", type=float, default=None, help="per-device peak (MFU)")
    parser.add_argument("--no-mesh", action="store_true", help="skip the multi-device runs")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="time JAX and PyTorch in one process, calls alternating (default: a process each)",
    )
    parser.add_argument(
        "--worker", nargs=2, metavar=("IMPL", "CHECKPOINTS"), help=argparse.SUPPRESS
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.warmup < 1 or (args.repeats is not None and args.repeats < 1):
        parser.error(f"--warmup and --repeats must be >= 1, got {args.warmup}, {args.repeats}")
    backend = jax.default_backend()
    args.dtype = args.dtype or ("float32" if backend == "cpu" else "bfloat16")
    args.repeats = args.repeats or (5 if args.quick else 3)
    plan = QUICK_PLAN if args.quick else (FULL_PLAN if backend == "cpu" else GPU_PLAN)
    timing = {"dtype": args.dtype, "warmup": args.warmup, "repeats": args.repeats}
    if args.worker:
        impl, checkpoints = args.worker
        if impl == "jax_mesh":
            plan = [entry for entry in plan if entry[3]]
        devices = {"jax": jax.devices()[:1], "jax_mesh": jax.devices()}
        results = run_plan(plan, checkpoints, impls=(impl,), devices=devices, **timing)
        with open(args.json, "w") as f:
            json.dump({"results": results}, f)
        return 0
    impls = ("jax",) + (() if args.no_torch else ("torch",))
    devices = {"jax": jax.devices()[:1], "jax_mesh": jax.devices()}
    mesh_impls = ()
    if not args.no_mesh and (backend == "cpu" or len(jax.devices()) > 1):
        mesh_impls = ("jax_mesh",)
    peak = None
    if backend != "cpu":
        peak = args.peak_tflops or default_peak_tflops(jax.devices()[0].device_kind)
    elif args.peak_tflops:
        peak = args.peak_tflops
    env = environment(args.dtype, args.repeats, args.warmup)
    env["processes"] = (
        "JAX and PyTorch interleaved in one process"
        if args.interleave
        else "one per implementation"
    )
    with tempfile.TemporaryDirectory() as checkpoints:
        for model in dict.fromkeys(entry[0] for entry in plan):
            hf_llama(model).save_pretrained(os.path.join(checkpoints, model))
        if args.interleave:
            results = run_plan(plan, checkpoints, impls=impls, devices=devices, **timing)
        else:
            results = [r for impl in impls for r in _worker_subprocess(args, checkpoints, impl)]
        for impl in mesh_impls:
            results += _worker_subprocess(args, checkpoints, impl)
    env["load average (1 min) at end"] = f"{os.getloadavg()[0]:.2f}"
    title = "quick (tiny model)" if args.quick else "tiny and ~60M Llama"
    print(f"## Policy-update step: jaxrl_llm vs PyTorch — {title}\n")
    print(format_table(results, peak_tflops=peak))
    print(
        f"\nprompt {PROMPT_LEN} + completion T tokens per row"
        + (f"; mesh: fsdp={MESH_DEVICES} fake CPU devices" if backend == "cpu" else "")
        + (f"; mesh: fsdp={jax.device_count()}" if backend != "cpu" and mesh_impls else "")
        + "; speed-up = torch ms / JAX ms"
        + (f"; MFU vs {peak:g} TFLOP/s per device" if peak else "")
    )
    command = shlex.join(["python", "benchmarks/bench_train_step.py", *(argv or [])])
    print(f"\n- command: {command}")
    for key, value in env.items():
        print(f"- {key}: {value}")
    if args.json:
        payload = {"command": command, "environment": env, "peak_tflops": peak, "results": results}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
