"""A whole GRPO step, jaxrl_llm vs TRL's ``GRPOTrainer``, on the same checkpoint, prompts, reward.

One step = generate ``--prompts`` x ``--group-size`` completions of at most ``--max-new-tokens``
tokens, score them with the arithmetic task's exact-match reward, compute the behaviour /
reference log-probs the objective needs, and run one optimizer update (GRPO: token-ratio
PPO clip 0.2, k3 KL 0.04 to a frozen reference in the loss, seq-mean-token-mean, group-std
advantages). Both sides start from one ~3M-parameter Llama checkpoint built here with random
weights (a character tokenizer over the arithmetic alphabet, ``transformers`` weights), see
the same arithmetic prompts and use the same reward function (``jaxrl_llm.rewards``'
``math_match``).

* ``jaxrl_llm``: ``jaxrl-llm train configs/grpo.yaml model.path=CHECKPOINT ...`` in a
  subprocess; step times are the ``time/step`` entries of its ``metrics.jsonl``.
* ``trl``: ``trl.GRPOTrainer`` with ``loss_type="grpo"``, ``beta=0.04``,
  ``per_device_train_batch_size = prompts x group``, ``num_generations = group``, one update
  per generation batch, no gradient checkpointing (TRL's default turns it on; off is faster
  here), in a subprocess on all cores; step times from a ``TrainerCallback``.

Reported: the median step time after ``--skip`` steps (JAX compiles in its first steps), and
the ratio TRL / jaxrl_llm (> 1: jaxrl_llm faster), with jaxrl_llm's phases.

Long-tailed completions (``--mean-fraction F``): the checkpoint is rewritten so that every
token ends the completion with the probability that makes the mean length ``F x T``
(``make_long_tailed``: truncated geometric lengths, as long-tailed as reasoning RL's), and
jaxrl_llm runs as a user runs such lengths (``LONG_TAILED``: the continuous engine, packing).

Run::

    python benchmarks/bench_grpo_step.py                 # 10 steps each (~4 min, 2 cores)
    python benchmarks/bench_grpo_step.py --steps 4 --json out.json
    python benchmarks/bench_grpo_step.py --mean-fraction 0.3 --max-new-tokens 512 --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# ~3M parameters: (vocab from the tokenizer, hidden, intermediate, layers, heads, kv heads).
MODEL = dict(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)
LEARNING_RATE = 1e-6
KL_COEF = 0.04


def stop_probability(mean_fraction: float, max_new_tokens: int) -> float:
    """The per-token end-of-sequence probability ``p`` whose lengths ``min(Geometric(p), T)``
    (the end token counted) have mean ``mean_fraction x T``: ``(1 - (1 - p)^T) / p = f T``."""
    if not 1 / max_new_tokens < mean_fraction < 1:
        raise ValueError(f"--mean-fraction must be in (1/T, 1); got {mean_fraction}")
    target, low, high = mean_fraction * max_new_tokens, 1e-9, 1.0
    for _ in range(200):  # the mean falls as p rises
        p = (low + high) / 2
        low, high = (p, high) if (1 - (1 - p) ** max_new_tokens) / p > target else (low, p)
    return (low + high) / 2


def make_long_tailed(model, tokenizer, alphabet: str, stop: float) -> None:
    """Rewrites ``model`` (in place) so that every position's next token is the end token with
    probability ``stop`` and otherwise a uniform character of ``alphabet``: completion lengths
    are then ``min(Geometric(stop), T)`` for both implementations, as long-tailed as reasoning
    RL's. The layers keep their random weights and compute as before but write nothing to the
    residual stream (``o_proj`` and ``down_proj`` zero), whose only direction (every token's
    embedding) the unembedding reads: the same logits at every position."""
    import math

    import torch

    hidden = model.config.hidden_size
    chars = tokenizer.convert_tokens_to_ids(list(alphabet))
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        # RMSNorm(e_0) = e_0 / sqrt(1/D + eps): the final hidden state's one entry.
        h = 1.0 / math.sqrt(1.0 / hidden + model.config.rms_norm_eps)
        logits = torch.full((model.config.vocab_size,), -30.0)  # special tokens: never
        logits[chars] = 0.0
        logits[eos] = math.log(stop * len(chars) / (1 - stop))
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, 0] = logits / h


def build_checkpoint(directory: str, stop: float | None = None, max_positions: int = 256) -> int:
    """A random-weight Llama with the arithmetic character tokenizer (with ``stop``: its
    lengths made long-tailed by ``make_long_tailed``); returns its parameters."""
    import torch
    import transformers

    from jaxrl_llm.data.char_tokenizer import ARITHMETIC_ALPHABET, build_char_tokenizer

    tokenizer = build_char_tokenizer(ARITHMETIC_ALPHABET, save_dir=directory)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        **MODEL,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if stop is not None:
        make_long_tailed(model, tokenizer, ARITHMETIC_ALPHABET, stop)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


# What a user sets for long-tailed completions (docs/training.md, docs/sampling.md): the
# continuous engine (a finished row's slot takes the next request; 32 slots: on CPU a decode
# step reads every slot's whole cache, so fewer slots decode these lengths faster) and packed
# training-side forwards (``auto``: when packing saves a quarter of the rows).
LONG_TAILED = ("rollout.engine=continuous", "rollout.slots=32", "trainer.packing=auto")


def jax_settings(args) -> list[str]:
    """jaxrl_llm's settings beyond the shared workload: ``LONG_TAILED`` with
    ``--mean-fraction``, then every ``--jax KEY=VALUE``."""
    return [*(LONG_TAILED if args.mean_fraction else ()), *args.jax]


def run_jax(checkpoint: str, args, workdir: str) -> dict:
    """``jaxrl-llm train`` for ``args.steps`` GRPO steps; its per-step times and phases."""
    run_dir = os.path.join(workdir, "jax_run")
    overrides = [
        f"model.path={checkpoint}",
        f"run_dir={run_dir}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.group_size={args.group_size}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"trainer.max_steps={args.steps}",
        f"trainer.learning_rate={LEARNING_RATE}",
        "sft_warmup.steps=0",
        f"data.eval_size={args.prompts}",
        f"checkpoint.every_steps={args.steps + 1}",
        f"seed={args.seed}",
        *jax_settings(args),
    ]
    command = [sys.executable, "-m", "jaxrl_llm.cli", "train", str(ROOT / "configs/grpo.yaml")]
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    start = time.perf_counter()
    proc = subprocess.run(command + overrides, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"jaxrl-llm train failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "time/step" in r]
    if len(steps) != args.steps:
        raise RuntimeError(f"expected {args.steps} step records, found {len(steps)}")
    phases = ("rollout", "logprobs", "advantages", "update")
    timed = steps[args.skip :]
    return {
        "step_s": [r["time/step"] for r in steps],
        "phases_s": {p: statistics.median(r.get(f"time/{p}", 0.0) for r in timed) for p in phases},
        "completion_length_mean": statistics.mean(r["completion_length_mean"] for r in steps),
        "wall_s": wall,
    }


def trl_worker(checkpoint: str, args, out: str) -> None:
    """Runs TRL's GRPOTrainer here (a subprocess) and writes its step times to ``out``."""
    import datasets
    import torch
    import transformers
    import trl

    from jaxrl_llm import data
    from jaxrl_llm.rewards import RewardInput, make_reward

    torch.set_num_threads(os.cpu_count() or 1)
    reward = make_reward("math_match")
    examples = data.arithmetic_examples(4000, seed=args.seed)
    dataset = datasets.Dataset.from_list(
        [{"prompt": e.prompt, "answer": e.answer} for e in examples]
    )

    def math_match(prompts, completions, answer, **_):
        return [
            float(reward(RewardInput(p, c, {"answer": a})))
            for p, c, a in zip(prompts, completions, answer)
        ]

    config = trl.GRPOConfig(
        output_dir=os.path.join(os.path.dirname(out), "trl_run"),
        per_device_train_batch_size=args.prompts * args.group_size,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        max_steps=args.steps,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        beta=KL_COEF,
        loss_type="grpo",
        scale_rewards="group",
        temperature=1.0,
        gradient_checkpointing=False,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=args.seed,
    )
    times: list[float] = []
    lengths: list[float] = []
    spans: dict[str, list[float]] = {"generate": [], "prepare": []}

    def timed(name, method):
        """Wraps a bound method of the trainer to record its wall time per call."""

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                spans[name].append(time.perf_counter() - start)

        return wrapper

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            times.append(time.perf_counter() - self.start)

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    trainer = trl.GRPOTrainer(
        model=checkpoint,
        reward_funcs=[math_match],
        args=config,
        train_dataset=dataset,
        processing_class=transformers.AutoTokenizer.from_pretrained(checkpoint),
        callbacks=[Timer()],
    )
    # Phases: generation (`_generate`), then scoring + reference log-probs (the rest of
    # `_generate_and_score_completions`), then the policy update (the rest of the step).
    trainer._generate = timed("generate", trainer._generate)
    trainer._generate_and_score_completions = timed(
        "prepare", trainer._generate_and_score_completions
    )
    trainer.train()
    if not (len(spans["generate"]) == len(spans["prepare"]) == len(times)):
        raise RuntimeError(f"TRL phase timers saw {spans} for {len(times)} steps")
    skip = args.skip
    phases = {
        "rollout": statistics.median(spans["generate"][skip:]),
        "score+ref logprobs": statistics.median(
            p - g for p, g in zip(spans["prepare"][skip:], spans["generate"][skip:])
        ),
        "update": statistics.median(t - p for t, p in zip(times[skip:], spans["prepare"][skip:])),
    }
    versions = {"trl": trl.__version__, "torch": torch.__version__}
    with open(out, "w") as f:
        json.dump(
            {"step_s": times, "phases_s": phases, "completion_length_mean": lengths, **versions}, f
        )


def run_trl(checkpoint: str, args, workdir: str) -> dict:
    out = os.path.join(workdir, "trl.json")
    command = [sys.executable, os.path.abspath(__file__), "--trl-worker", checkpoint, out]
    command += ["--steps", str(args.steps), "--prompts", str(args.prompts)]
    command += ["--group-size", str(args.group_size), "--max-new-tokens", str(args.max_new_tokens)]
    command += ["--seed", str(args.seed), "--skip", str(args.skip)]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"the TRL worker failed:\n{proc.stderr[-4000:]}")
    with open(out) as f:
        result = json.load(f)
    result["completion_length_mean"] = statistics.mean(result["completion_length_mean"] or [0])
    return {**result, "wall_s": wall}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip", type=int, default=2, help="first steps left out (compile)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mean-fraction",
        type=float,
        help="long-tailed completions: the checkpoint stops each token with the probability "
        "that makes the mean length this fraction of --max-new-tokens (make_long_tailed), and "
        "jaxrl_llm runs with " + " ".join(LONG_TAILED),
    )
    parser.add_argument(
        "--jax", action="append", default=[], metavar="KEY=VALUE", help="a jaxrl_llm override"
    )
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--trl-worker", nargs=2, metavar=("CHECKPOINT", "OUT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.trl_worker:
        trl_worker(args.trl_worker[0], args, args.trl_worker[1])
        return 0
    if args.steps <= args.skip:
        parser.error(f"--steps ({args.steps}) must exceed --skip ({args.skip})")
    with tempfile.TemporaryDirectory() as workdir:
        checkpoint = os.path.join(workdir, "checkpoint")
        stop = None
        if args.mean_fraction:
            stop = stop_probability(args.mean_fraction, args.max_new_tokens)
        positions = max(256, 2 * (args.max_new_tokens + 64))
        n_params = build_checkpoint(checkpoint, stop, positions)
        jax_result = run_jax(checkpoint, args, workdir)
        trl_result = run_trl(checkpoint, args, workdir)
    jax_s = statistics.median(jax_result["step_s"][args.skip :])
    trl_s = statistics.median(trl_result["step_s"][args.skip :])
    import platform

    import jax

    lines = [
        f"- command: `python benchmarks/bench_grpo_step.py {' '.join(argv or sys.argv[1:])}`",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"load average at end {os.getloadavg()[0]:.2f}",
        f"- versions: python {platform.python_version()}, jax {jax.__version__}, "
        f"torch {trl_result['torch']}, trl {trl_result['trl']}",
        f"- checkpoint: Llama, {n_params / 1e6:.2f}M parameters, random weights; "
        f"{args.prompts} prompts x {args.group_size} completions of <= {args.max_new_tokens} "
        f"tokens per step; median of steps {args.skip + 1}-{args.steps}",
        *(
            [
                f"- long-tailed: each token ends the completion with probability {stop:.5f} "
                f"(mean length {args.mean_fraction} x {args.max_new_tokens})"
            ]
            if stop is not None
            else []
        ),
        f"- jaxrl_llm settings: {' '.join(jax_settings(args)) or 'configs/grpo.yaml as it is'}",
        "",
        "| implementation | s / step | completion length (mean) | vs TRL |",
        "|---|---:|---:|---:|",
        f"| jaxrl_llm | {jax_s:.2f} | {jax_result['completion_length_mean']:.1f} | "
        f"{trl_s / jax_s:.2f}x |",
        f"| TRL GRPOTrainer | {trl_s:.2f} | {trl_result['completion_length_mean']:.1f} | 1.00x |",
        "",
        "jaxrl_llm phases (median s): "
        + ", ".join(f"{k} {v:.2f}" for k, v in jax_result["phases_s"].items()),
        "TRL phases (median s): "
        + ", ".join(f"{k} {v:.2f}" for k, v in trl_result["phases_s"].items()),
    ]
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax_result, "trl": trl_result, "params": n_params}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
