"""Sequence packing for the trainers' forwards: when to pack, and the plans of micro-batches.

A training-side forward (the policy update, the behaviour and reference log-probs) runs its
batch in ``K`` strided micro-batches (``train.step``): micro-batch ``k`` holds rows ``k, k + K,
...``, each spread over every data shard. Packing plans are made on the host, where the rollout's
masks already are (``jaxrl_llm.packing.plan_packing``: first-fit decreasing per data shard), one
per micro-batch, padded to the largest micro-batch's packed rows and stacked: a plan's leaves are
``[K, shards, rows, W]``, the shard axis placed like the batch's rows, so each device packs and
unpacks its own rows. The forward then runs over ``K x shards x rows`` packed rows instead of
``B`` padded ones, and every loss reads the same ``[B, T]`` log-probs (to rounding: the packed
forward is the padded one with padding removed).

``trainer.packing``: ``on`` packs every batch, ``off`` none, and ``auto`` a batch whose packed
rows are at most :data:`AUTO_MAX_ROWS` of its padded rows (long-tailed lengths), so a batch of
near-full rows keeps its padded program.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm import packing, parallel
from jaxrl_llm.packing import PackingPlan

MODES = ("auto", "on", "off")
#: ``auto`` packs when the packed rows are at most this share of the padded rows.
AUTO_MAX_ROWS = 0.75


def plan_micro_batches(
    prompt_mask: Any, completion_mask: Any, *, micro_batches: int, shards: int
) -> PackingPlan:
    """The packing plan of each of ``micro_batches`` strided micro-batches, stacked: leaves
    ``[K, shards, rows, P + T]`` (NumPy), every micro-batch padded to the same ``rows``.

    Args:
      prompt_mask: ``[B, P]`` host mask (left-padded prompts).
      completion_mask: ``[B, T]`` host mask (right-padded completions; the attended tokens).
      micro_batches: ``K`` (divides ``B``; ``B / K`` divisible by ``shards``).
      shards: the mesh's batch shards.

    Raises:
      ValueError: ``K`` or ``shards`` that do not divide the rows (naming them), or masks that
        are not one run per row (``packing.plan_packing``).
    """
    mask = packing.sequence_mask(prompt_mask, completion_mask)
    rows = mask.shape[0]
    if micro_batches < 1 or rows % micro_batches or (rows // micro_batches) % shards:
        raise ValueError(
            f"packing needs micro_batches={micro_batches} to divide the batch's {rows} rows "
            f"into micro-batches that {shards} batch shards divide"
        )
    plans = [
        packing.plan_packing(mask[k::micro_batches], shards=shards) for k in range(micro_batches)
    ]
    width = max(p.source.shape[1] for p in plans)

    def padded(x: np.ndarray, fill: int) -> np.ndarray:
        extra = width - x.shape[1]
        return np.pad(x, ((0, 0), (0, extra), (0, 0)), constant_values=fill)

    return PackingPlan(
        np.stack([padded(p.source, -1) for p in plans]),
        np.stack([padded(p.segment_ids, 0) for p in plans]),
        np.stack([padded(p.positions, 0) for p in plans]),
    )


def plan_by_budget(
    prompt_mask: Any, completion_mask: Any, *, tokens: int, minimum: int, shards: int
) -> PackingPlan:
    """The packed micro-batches of a token budget (``train.step.TokenBudget``, verl's dynamic
    batch size, over packed rows): the fewest ``K >= minimum`` strided micro-batches whose
    packed rows hold at most ``tokens`` positions per device (``rows_per_shard x W``), else
    the most micro-batches the rows allow. ``K`` is the plan's leading axis, which the step
    follows."""
    rows = len(completion_mask)
    width = prompt_mask.shape[1] + completion_mask.shape[1]
    counts = [
        k for k in range(max(minimum, 1), rows + 1) if rows % k == 0 and (rows // k) % shards == 0
    ]
    if not counts:  # the batch-size checks name what does not divide
        counts = [max(minimum, 1)]
    plan = None
    for k in counts:
        plan = plan_micro_batches(prompt_mask, completion_mask, micro_batches=k, shards=shards)
        if plan.source.shape[2] * width <= tokens:
            return plan
    return plan


def packing_mode(value: Any) -> str:
    """``trainer.packing`` as one of :data:`MODES`: YAML reads ``on`` / ``off`` as booleans.

    Raises:
      ValueError: anything else, naming the key.
    """
    if value is True or value is False:
        return "on" if value else "off"
    if value not in MODES:
        raise ValueError(f"trainer.packing must be one of auto, on, off; got {value!r}")
    return value


def worth_packing(plan: PackingPlan, rows: int, mode: str) -> bool:
    """Whether ``mode`` (``packing_mode``) packs a batch of ``rows`` padded rows planned as
    ``plan``."""
    if packing_mode(mode) != "auto":
        return packing_mode(mode) == "on"
    packed = int(np.prod(plan.source.shape[:-1]))
    return packed <= AUTO_MAX_ROWS * rows


def place_plan(plan: PackingPlan, mesh) -> PackingPlan:
    """``plan``'s arrays (the same global NumPy plan on every process) on device, the shard
    axis (1) over ``mesh``'s batch axes."""
    if mesh is None:
        return jax.tree.map(jax.numpy.asarray, plan)
    axes = parallel.batch_mesh_axes(mesh)
    sharding = NamedSharding(mesh, PartitionSpec(None, axes or None))

    def place(x: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(place, plan)


def micro_plan(plan: PackingPlan, index: Any) -> PackingPlan:
    """Micro-batch ``index``'s plan (leaves ``[shards, rows, W]``) of a stacked plan."""
    return jax.tree.map(lambda x: x[index], plan)


__all__ = [
    "AUTO_MAX_ROWS",
    "MODES",
    "micro_plan",
    "packing_mode",
    "place_plan",
    "plan_by_budget",
    "plan_micro_batches",
    "worth_packing",
]
