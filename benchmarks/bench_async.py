"""The asynchronous loop's step time: measured per phase, modelled, and measured.

Two GRPO runs of the built-in task on 8 fake CPU devices, the sampler on 4 of them
(``mesh.rollout_devices=4``) and the trainer on the other 4, with the same config and seed:
``sync`` (``rollout.max_staleness=0``: rollout, weight sync, log-probs, update, one after the
other) and ``one-step-off`` (``rollout.max_staleness=1``: step s+1's rollout runs on a thread
while step s's trainer work runs). The model is widened (``--hidden``, ``--layers``) and starts
random (no warm-up), so completions run to ``--max-new-tokens`` and the phases are measurable.

From the synchronous run's medians (steps after the first two: compiles) of the rollout ``R``
(decode and scoring), the weight sync ``S`` (``time/reshard``), the trainer's work ``U``
(log-probs, advantages, update) and the rest ``O`` (``time/step - R - S - U``), the model is

    sync step      = R + S + U + O
    one-step-off   = max(R, S + U) + O      (the rollout beside the sync and the update)

and the table sets the modelled speed-up beside the measured one. The 8 fake devices share
this machine's cores, so two programs running "in parallel" here compete for the same cores:
the measured overlap is bounded by that, where separate accelerators would not be.

Run::

    python benchmarks/bench_async.py            # 8 steps each (about 3 min, 2 cores)
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from jaxrl_llm.train import timeline  # noqa: E402
from jaxrl_llm.train.config_io import load_config  # noqa: E402
from jaxrl_llm.train.metrics import read_metrics  # noqa: E402
from jaxrl_llm.train.rl.config import TrainConfig  # noqa: E402
from jaxrl_llm.train.rl.trainer import RLTrainer  # noqa: E402

ROLLOUT = ("time/rollout", "time/scoring")
TRAINER = ("time/logprobs", "time/advantages", "time/update")


def run(run_dir: str, *, staleness: int, steps: int, hidden: int, layers: int, tokens: int):
    cfg = load_config(
        TrainConfig,
        None,
        [
            f"run_dir={run_dir}",
            "sft_warmup.steps=0",
            f"model.tiny.hidden_size={hidden}",
            f"model.tiny.intermediate_size={3 * hidden}",
            f"model.tiny.num_hidden_layers={layers}",
            f"rollout.max_new_tokens={tokens}",
            f"trainer.max_steps={steps}",
            "trainer.eval_every=0",
            "data.eval_size=8",
            "mesh.rollout_devices=4",
            f"rollout.max_staleness={staleness}",
            "objective.overrides={rollout_correction: {is_level: token}}",
            "logging.progress=false",
            "logging.tensorboard=false",
        ],
    )
    RLTrainer(cfg).fit()
    return read_metrics(run_dir), timeline.read(os.path.join(run_dir, timeline.FILE))


def median(rows, keys) -> float:
    return statistics.median(sum(r.get(k, 0.0) for k in keys) for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()
    kw = dict(steps=args.steps, hidden=args.hidden, layers=args.layers, tokens=args.max_new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        sync, _ = run(os.path.join(tmp, "sync"), staleness=0, **kw)
        off, spans = run(os.path.join(tmp, "off"), staleness=1, **kw)
        wall = time.perf_counter() - started
    sync, off = sync[2:], off[2:]
    r, s, u = median(sync, ROLLOUT), median(sync, ("time/reshard",)), median(sync, TRAINER)
    step = median(sync, ("time/step",))
    other = max(step - r - s - u, 0.0)
    modelled = max(r, s + u) + other
    measured = median(off, ("time/step",))
    later = [x for x in spans if x["step"] > 2]
    overlap = timeline.overlap_seconds(
        later, "trainer", {"logprobs", "update"}, "rollout", {"rollout"}
    )
    print(
        f"# jax {jax.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, 8 fake CPU devices (4 sampler + 4 trainer), "
        f"hidden {args.hidden} x {args.layers} layers, {args.max_new_tokens} new tokens, "
        f"{args.steps} steps each ({wall:.0f} s)"
    )
    print("| median s/step | R rollout+scoring | S weight sync | U trainer | O other | step |")
    print("|---|---|---|---|---|---|")
    print(f"| sync | {r:.3f} | {s:.3f} | {u:.3f} | {other:.3f} | {step:.3f} |")
    r1, s1, u1 = median(off, ROLLOUT), median(off, ("time/reshard",)), median(off, TRAINER)
    wait = median(off, ("time/wait_rollout",))
    row = f"| {r1:.3f} | {s1:.3f} | {u1:.3f} | wait {wait:.3f} | {measured:.3f} |"
    print(f"| one-step-off (R on its thread) {row}")
    print()
    print("| loop | step s (median) | speed-up vs sync |")
    print("|---|---|---|")
    print(f"| sync (measured) | {step:.3f} | 1.00x |")
    print(f"| one-step-off, modelled max(R, S+U)+O | {modelled:.3f} | {step / modelled:.2f}x |")
    print(f"| one-step-off (measured) | {measured:.3f} | {step / measured:.2f}x |")
    print(
        f"\nrollout spans overlapping the trainer's logprobs/update after step 2: {overlap:.2f} s "
        f"over {len(off)} steps; staleness {[r['rollout/staleness'] for r in off]}"
    )


if __name__ == "__main__":
    main()
