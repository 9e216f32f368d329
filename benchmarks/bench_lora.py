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
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_train_step as bts  # noqa: E402

from jaxrl_llm import bench, models, objectives, parallel  # noqa: E402
from jaxrl_llm.models import LoraSpec  # noqa: E402
from jaxrl_llm.train import adapters  # noqa: E402
from jaxrl_llm.train.optim import make_optimizer  # noqa: E402
from jaxrl_llm.train.rl.policy import make_policy_step  # noqa: E402
from jaxrl_llm.train.state import create_train_state  # noqa: E402
from jaxrl_llm.train.step import jit_step  # noqa: E402

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
PEFT_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tree_bytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def jax_step(checkpoint: str, data, rank: int | None):
    """``(call, state_bytes, temp_bytes)`` of one jitted GRPO update (LoRA when ``rank``)."""
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    config, params = models.load_pretrained(checkpoint, dtype=jnp.float32, mesh=mesh)
    optimizer = make_optimizer(bts.LEARNING_RATE)
    frozen = frozen_shardings = None
    if rank is None:
        state, shardings = create_train_state(
            config, optimizer, key=jax.random.key(0), mesh=mesh, params=params
        )
    else:
        config = dataclasses.replace(config, lora=LoraSpec(rank, 2.0 * rank, TARGETS))
        state, shardings, frozen, frozen_shardings = adapters.create_lora_state(
            config, optimizer, key=jax.random.key(0), mesh=mesh, params=params
        )
    step = jit_step(
        make_policy_step(
            config,
            objectives.make("grpo"),
            optimizer,
            compute_entropy=False,
            param_shardings=shardings.params,
        ),
        shardings,
        frozen=frozen,
        frozen_shardings=frozen_shardings,
    )
    batch = parallel.shard_batch(data, mesh)
    temp = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
    state_bytes = tree_bytes((state.params, state.opt_state)) + (
        tree_bytes(frozen) if frozen is not None else 0
    )
    # A full step's gradients are as large as its weights; they live among the temporaries.
    holder = {"state": state}

    def call() -> float:
        holder["state"], metrics = step(holder["state"], batch)
        jax.block_until_ready((holder["state"], metrics))
        return float(metrics["loss"])

    return call, state_bytes, int(temp)


def torch_step(checkpoint: str, data, rank: int | None, torch_losses):
    """``(call, state_bytes_fn)`` of one eager PyTorch update (peft LoRA when ``rank``)."""
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="sdpa"
    )
    if rank is not None:
        import peft

        model = peft.get_peft_model(
            model,
            peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=PEFT_MODULES),
        )
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=bts.LEARNING_RATE, weight_decay=0.0)
    objective = objectives.make("grpo")
    mask = np.concatenate([data.prompt_mask, data.completion_mask], axis=1)
    tokens = torch.tensor(np.concatenate([data.prompt_tokens, data.completion_tokens], 1)).long()
    attention_mask = torch.tensor(mask).long()
    positions = torch.clamp(torch.cumsum(attention_mask, 1) - 1, min=0)
    completion = torch.tensor(data.completion_tokens).long()
    batch = data._replace(
        **{
            field: torch.tensor(np.asarray(value), dtype=torch.float32)
            for field, value in data._asdict().items()
            if field in ("completion_mask", "old_logprobs", "advantages", "ref_logprobs")
        }
    )
    start, length = data.prompt_tokens.shape[1] - 1, data.completion_tokens.shape[1]

    def call() -> float:
        optimizer.zero_grad(set_to_none=False)
        logits = model(input_ids=tokens, attention_mask=attention_mask, position_ids=positions)
        logits = logits.logits[:, start : start + length].float()
        logprobs = torch.gather(torch.log_softmax(logits, -1), -1, completion[..., None])[..., 0]
        loss = torch_losses.policy_loss(objective, logprobs, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        return float(loss.detach())

    def state_bytes() -> int:
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        grads = sum(p.grad.numel() * p.grad.element_size() for p in trainable if p.grad is not None)
        moments = sum(
            v.numel() * v.element_size()
            for s in optimizer.state.values()
            for v in s.values()
            if torch.is_tensor(v)
        )
        return int(weights + grads + moments)

    return call, state_bytes


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
            call, state_bytes, temp = jax_step(checkpoint, data, rank)
            first, median, loss = timed(call, args.warmup, args.repeats)
            rows.append(
                dict(
                    impl=f"jax {name}",
                    first_s=first,
                    median_s=median,
                    loss=loss,
                    state_bytes=state_bytes,
                    temp_bytes=temp,
                )
            )
            del call
            call, state_fn = torch_step(checkpoint, data, rank, torch_losses)
            first, median, loss = timed(call, args.warmup, args.repeats)
            rows.append(
                dict(
                    impl=f"torch {name}",
                    first_s=first,
                    median_s=median,
                    loss=loss,
                    state_bytes=state_fn(),
                    temp_bytes=None,
                )
            )
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
