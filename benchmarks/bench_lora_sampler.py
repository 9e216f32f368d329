"""A LoRA policy's rollout: adapters applied on the fly vs merged weights, JAX and PyTorch.

The RL sampler of a LoRA run decodes either the base with its adapters applied at every step
(``model.lora.sampler=adapters``) or a merged copy ``W + (alpha / r) A B`` it rebuilds after
each policy update (``merged``; ``auto`` picks between them, ``train.adapters.merged_sampler``).
This times one rollout both ways, a merge included in the merged side, on the same random Llama
weights and rank-``--rank`` adapters on all seven projections (``B`` drawn non-zero, as after
training), batch 16, prompt 32, ``--new`` greedy tokens (no EOS: every row runs to the end):

* ``jax adapters``: ``sampling.generate`` on the LoRA model (prefill + decode loop);
* ``jax merged``: ``train.adapters.merge_program`` then ``generate`` on the base model;
* ``torch adapters``: the transformers model wrapped by ``peft`` with the same adapters,
  ``generate`` (TRL / OpenRLHF's unmerged path);
* ``torch merged``: ``peft``'s ``merge_and_unload()`` then ``generate``, the merge timed (on a
  fresh wrap of the model each repeat).

Greedy tokens of the four are compared (f32: the same up to float rounding). Times are medians
of ``--repeats`` alternating repeats after a warm-up (JAX compile excluded). Run::

    python benchmarks/bench_lora_sampler.py            # 60M, 128 new tokens (~3 min, 2 cores)
    python benchmarks/bench_lora_sampler.py --quick    # 6M, 32 new tokens
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import peft
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_decode as bd  # noqa: E402

from jaxrl_llm.models import LoraSpec, load_pretrained, lora  # noqa: E402
from jaxrl_llm.train import adapters  # noqa: E402

gen = importlib.import_module("jaxrl_llm.sampling.generate")
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def _adapters(config, rank: int):
    """Rank-``rank`` adapters with ``B`` drawn too (a trained adapter, not PEFT's zero init)."""
    spec = LoraSpec(rank=rank, alpha=2.0 * rank, targets=TARGETS)
    lora_config = dataclasses.replace(config, lora=spec)
    made = lora.init_adapters(lora_config, jax.random.key(1))
    keys = iter(jax.random.split(jax.random.key(2), len(made["layers"])))
    made = {
        "layers": {
            k: 0.02 * jax.random.normal(next(keys), v.shape) if k.endswith("_b") else v
            for k, v in made["layers"].items()
        }
    }
    return lora_config, made


def run(size: str, *, batch: int, prompt: int, new: int, rank: int, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as path:
        hf = bd._hf_model(size, path, "float32")
        config, base = load_pretrained(path, dtype=jnp.float32)
        lora_config, trained = _adapters(config, rank)
        host = jax.tree.map(np.asarray, trained)
        adapter_dir = Path(path) / "adapter"
        lora.save_peft_adapter(adapter_dir, lora_config, host, base_model=path)
        wrapped = peft.PeftModel.from_pretrained(hf, str(adapter_dir)).eval()

        rng = np.random.default_rng(0)
        tokens = rng.integers(1, config.vocab_size, size=(batch, prompt)).astype(np.int32)
        mask = np.ones((batch, prompt), bool)
        sampling = gen.sampling_params(temperature=0.0, eos_ids=(), pad_id=0)
        key = jax.random.key(0)
        merge = adapters.merge_program(lora_config, jax.tree.map(lambda x: x.sharding, base))
        combined = lora.combine(base, trained)

        def jax_rollout(params, cfg):
            state = gen.prefill(params, cfg, tokens, mask, max_new_tokens=new, pad_id=0)
            state = gen.decode(params, cfg, state, key=key, sampling=sampling)
            return np.asarray(jax.block_until_ready(state.tokens))

        def jax_adapters():
            return jax_rollout(combined, lora_config)

        def jax_merged():
            merged = jax.block_until_ready(merge(base, trained))
            return jax_rollout(merged, config)

        inputs = dict(
            input_ids=torch.as_tensor(tokens, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long),
            do_sample=False,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=0,
        )

        def torch_adapters():
            with torch.no_grad():
                return wrapped.generate(**inputs).numpy()[:, prompt:]

        def torch_merged():
            # A fresh wrap each time (merge_and_unload modifies the base in place): its load
            # is not timed, the merge is.
            fresh = bd._hf_model(size, str(Path(path) / "fresh"), "float32")
            model = peft.PeftModel.from_pretrained(fresh, str(adapter_dir)).eval()
            start = time.perf_counter()
            merged = model.merge_and_unload()
            with torch.no_grad():
                out = merged.generate(**inputs).numpy()[:, prompt:]
            return out, time.perf_counter() - start

        sides = {
            "jax adapters": jax_adapters,
            "jax merged": jax_merged,
            "torch adapters": torch_adapters,
        }
        outputs = {name: fn() for name, fn in sides.items()}  # warm-up (compiles)
        outputs["torch merged"], _ = torch_merged()
        times: dict[str, list[float]] = {name: [] for name in (*sides, "torch merged")}
        for _ in range(repeats):
            for name, fn in sides.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
            times["torch merged"].append(torch_merged()[1])
    med = {name: statistics.median(t) for name, t in times.items()}
    want = outputs["jax adapters"][:, -new:]
    print(
        f"\n## {size}, rank {rank} on all seven projections, batch {batch}, prompt {prompt}, "
        f"{new} greedy tokens (f32)\n"
    )
    print("| rollout | s | tokens/s | vs jax adapters | greedy tokens = jax adapters |")
    print("|---|---|---|---|---|")
    for name, seconds in med.items():
        agree = np.mean(np.asarray(outputs[name])[:, -new:] == want)
        print(
            f"| {name} | {seconds:.3f} | {batch * new / seconds:,.0f} | "
            f"{med['jax adapters'] / seconds:.2f}x | {agree:.1%} |"
        )
    print(
        f"\nmerged / adapters: JAX {med['jax adapters'] / med['jax merged']:.2f}x faster, "
        f"PyTorch {med['torch adapters'] / med['torch merged']:.2f}x; JAX merged vs PyTorch "
        f"merged {med['torch merged'] / med['jax merged']:.2f}x, JAX adapters vs PyTorch "
        f"adapters {med['torch adapters'] / med['jax adapters']:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="6M, 32 new tokens, 3 repeats")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    size, new, repeats = ("6M", 32, 3) if args.quick else ("60M", 128, args.repeats)
    print(
        f"# bench_lora_sampler — {platform.node()} ({platform.processor() or platform.machine()}), "
        f"jax {jax.__version__}, torch {torch.__version__}, peft {peft.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    run(size, batch=16, prompt=32, new=new, rank=args.rank, repeats=repeats)


if __name__ == "__main__":
    main()
