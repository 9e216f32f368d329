"""Token-balanced minibatches: the packed positions of the update, rows as drawn vs balanced.

A packed forward runs every (data shard, micro-batch) cell with the same number of packed rows:
the most any cell needs (``jaxrl_llm.packing.plan_packing``). With rows laid out as drawn, the
cell that drew the longest completions sets it for all; ``trainer.packing`` therefore lays each
minibatch out with ``jaxrl_llm.packing.balance_rows`` (verl's sequence-length balancing), so
every cell holds about the same tokens. The planner is host-side NumPy: this measures what the
update's program runs over (packed rows a cell, positions a step), not a time; the update's
compute follows its positions.

Lengths: prompts of ``P`` tokens, completions of a lognormal share of ``T`` (median ``T / 4``,
sigma 0.8: mean near a third of ``T``, a tail to the limit), a random draw order per seed, as
``RLTrainer.train_step`` draws its minibatch.

The second table is the step's frozen forwards (behaviour, reference and teacher log-probs),
which run over the whole batch before any minibatch is drawn: there the rows of a group stay
together (its advantages read them as one), so ``RLTrainer.balanced_groups`` moves whole groups
(``balance_rows`` over the groups' tokens, shards only; the forward's micro-batches take every
``K``-th row of a shard). As drawn, the groups sit in prompt order.

Run::

    python benchmarks/bench_balance.py          # the tables of benchmarks/RESULTS.md (seconds)
"""

from __future__ import annotations

import argparse

import numpy as np

from jaxrl_llm.packing import balance_rows
from jaxrl_llm.train.packing import plan_micro_batches

PROMPT, COMPLETION = 512, 8192
# (data shards, micro-batches, minibatch rows): an 8-chip host, a 16- and a 64-chip slice.
LAYOUTS = ((8, 4, 256), (16, 8, 512), (64, 2, 512))
# The frozen forwards: (data shards, micro-batches, step rows, group size).
GROUP_LAYOUTS = ((8, 4, 256, 8), (16, 8, 512, 16), (32, 2, 512, 8))


def lengths(rows: int, seed: int) -> np.ndarray:
    """Completion lengths ``[rows]`` in ``[1, T]``."""
    rng = np.random.default_rng(seed)
    share = np.clip(rng.lognormal(np.log(0.25), 0.8, rows), 0.0, 1.0)
    return np.maximum(1, (share * COMPLETION).astype(int))


def packed_rows(order: np.ndarray, completion: np.ndarray, shards: int, micro: int) -> int:
    """Packed rows a cell of the minibatch laid out in ``order``."""
    rows = order.size
    prompt_mask = np.ones((rows, PROMPT), bool)
    completion_mask = np.arange(COMPLETION)[None] < completion[order][:, None]
    plan = plan_micro_batches(prompt_mask, completion_mask, micro_batches=micro, shards=shards)
    return plan.source.shape[2]


def measure(shards: int, micro: int, rows: int, seeds: int) -> dict:
    drawn, balanced, real = [], [], []
    for seed in range(seeds):
        completion = lengths(rows, seed)
        order = np.random.default_rng([seed, 1]).permutation(rows)
        tokens = PROMPT + completion[order]
        laid_out = order[balance_rows(tokens, shards=shards, micro_batches=micro)]
        drawn.append(packed_rows(order, completion, shards, micro))
        balanced.append(packed_rows(laid_out, completion, shards, micro))
        real.append(int((PROMPT + completion).sum()))
    width = PROMPT + COMPLETION
    cells = shards * micro
    positions = lambda r: float(np.mean(r)) * cells * width  # noqa: E731
    return {
        "layout": f"{shards} shards x {micro} micro-batches, {rows} rows",
        "padded rows": rows // cells,
        "drawn": drawn,
        "balanced": balanced,
        "real share drawn": float(np.mean(real)) / positions(drawn),
        "real share balanced": float(np.mean(real)) / positions(balanced),
        "positions ratio": positions(drawn) / positions(balanced),
    }


def measure_groups(shards: int, micro: int, rows: int, group: int, seeds: int) -> dict:
    drawn, balanced = [], []
    for seed in range(seeds):
        completion = lengths(rows, seed)  # row g * G + i: member i of group g, prompt order
        tokens = (PROMPT + completion).reshape(-1, group).sum(axis=1)
        moved = balance_rows(tokens, shards=shards)
        laid_out = (moved[:, None] * group + np.arange(group)).reshape(-1)
        drawn.append(packed_rows(np.arange(rows), completion, shards, micro))
        balanced.append(packed_rows(laid_out, completion, shards, micro))
    return {
        "layout": f"{shards} shards x {micro} micro-batches, {rows} rows, groups of {group}",
        "padded rows": rows // (shards * micro),
        "drawn": drawn,
        "balanced": balanced,
        "positions ratio": float(np.mean(drawn)) / float(np.mean(balanced)),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args(argv)
    print(
        "| minibatch | padded rows a cell | packed rows a cell, as drawn | balanced | real tokens "
        "/ positions: drawn | balanced | positions drawn / balanced |"
    )
    print("|---|---:|---|---|---:|---:|---:|")
    for shards, micro, rows in LAYOUTS:
        m = measure(shards, micro, rows, args.seeds)
        print(
            f"| {m['layout']} | {m['padded rows']} | {', '.join(map(str, m['drawn']))} | "
            f"{', '.join(map(str, m['balanced']))} | {m['real share drawn']:.0%} | "
            f"{m['real share balanced']:.0%} | {m['positions ratio']:.2f}× |"
        )
    print()
    print(
        "| frozen forwards | padded rows a cell | packed rows a cell, as drawn | groups balanced "
        "| positions drawn / balanced |"
    )
    print("|---|---:|---|---|---:|")
    for shards, micro, rows, group in GROUP_LAYOUTS:
        m = measure_groups(shards, micro, rows, group, args.seeds)
        print(
            f"| {m['layout']} | {m['padded rows']} | {', '.join(map(str, m['drawn']))} | "
            f"{', '.join(map(str, m['balanced']))} | {m['positions ratio']:.2f}× |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
