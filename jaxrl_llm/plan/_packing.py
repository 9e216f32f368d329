"""The packing plans ``train`` makes for a job's forwards (``trainer.packing``), sized by the
length model, so that ``plan`` lowers the packed programs ``train`` runs.

``train`` plans packing on the host from each batch's masks (``train.packing``: first-fit
decreasing per micro-batch and data shard, ``jaxrl_llm.packing.bucket_rows``); ``plan`` has no
masks, only the length model (``plan.goodput``: full prompts of ``p`` tokens, completions of
``f x T`` on average). A forward over ``n = B_f / (K x shards)`` rows per micro-batch and shard
(``B_f`` its rows, ``K`` its micro-batches) holds ``n (p + f T)`` real tokens there, so its
packed rows per shard are

    ``r = bucket_rows(ceil(n (p + f T) / W), n)``,   ``W = P + T``,

what first-fit packing needs **if it reaches the ceiling** (no packed row left part-empty but
the last: an optimistic bound; rows of equal length above ``W / 2`` cannot share a row at all).
The plan's leaves are ``[K, shards, r, W]`` int32, the shard axis over the mesh's batch axes
(``train.packing.place_plan``); a token budget (``trainer.micro_batch_tokens``) picks ``K`` as
``train.packing.plan_by_budget`` does, over packed rows. ``auto`` packs a forward when the
trainer's rule (``train.packing.worth_packing``: packed rows at most ``AUTO_MAX_ROWS`` of the
padded rows) says so for these rows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm import parallel
from jaxrl_llm.packing import PackingPlan, bucket_rows
from jaxrl_llm.plan._job import PlanError
from jaxrl_llm.train import packing as train_packing
from jaxrl_llm.train.rl.config import forward_micro_batching, micro_batching
from jaxrl_llm.train.rl.spec import JobShape
from jaxrl_llm.train.step import TokenBudget

#: Said in the report: how the packed rows are sized.
ASSUMPTION = (
    "packed rows per micro-batch and data shard = bucket_rows(ceil(rows x (p + f T) / (P + T))): "
    "full prompts, the length model's mean completion, and first-fit packing reaching the "
    "ceiling (an optimistic bound on the rows train packs to)"
)


@dataclasses.dataclass(frozen=True)
class PackedForward:
    """The stacked packing plan of one forward, as the length model sizes it.

    Attributes:
      micro_batches: ``K``, the plan's leading axis (the micro-batches the forward runs).
      shards: the mesh's batch shards.
      rows_per_shard: ``r``, packed rows per micro-batch and shard.
      width: ``W = P + T``.
      padded_rows: the rows of the batch it packs (``B`` or a minibatch's).
      packed: whether ``train`` runs it packed (``on``, or ``auto`` and worth it).
    """

    micro_batches: int
    shards: int
    rows_per_shard: int
    width: int
    padded_rows: int
    packed: bool

    @property
    def packed_rows(self) -> int:
        """``R = K x shards x r``: the rows the packed forward computes."""
        return self.micro_batches * self.shards * self.rows_per_shard

    @property
    def rows(self) -> int:
        """The rows the forward computes: ``R`` packed, else the padded rows."""
        return self.packed_rows if self.packed else self.padded_rows

    def abstract(self, mesh: Mesh) -> PackingPlan:
        """The plan as ``train.packing.place_plan`` puts it on ``mesh``: int32 leaves
        ``[K, shards, r, W]``, the shard axis over the batch mesh axes."""
        axes = parallel.batch_mesh_axes(mesh)
        sharding = NamedSharding(mesh, PartitionSpec(None, axes or None))
        shape = (self.micro_batches, self.shards, self.rows_per_shard, self.width)
        leaf = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
        return PackingPlan(leaf, leaf, leaf)

    def report(self) -> dict[str, Any]:
        """JSON-ready: the sizes, the packed and padded rows, whether it runs packed."""
        return {
            "packed": self.packed,
            "micro_batches": self.micro_batches,
            "shards": self.shards,
            "rows_per_shard": self.rows_per_shard,
            "width": self.width,
            "packed_rows": self.packed_rows,
            "padded_rows": self.padded_rows,
        }


@dataclasses.dataclass(frozen=True)
class Packing:
    """``trainer.packing`` as ``plan`` lowers it.

    Attributes:
      mode: ``auto``, ``on`` or ``off``.
      update: the update's plan (a minibatch's rows, ``trainer.micro_batches``), or None
        (``off``, or no length model).
      forwards: the frozen log-prob forwards' plan (the rollout batch, one micro-batch or a
        token budget's), or None.
      reason: why the programs are packed or padded.
      prm_update: PRIME's implicit-PRM update (the whole rollout batch, micro-batched as the
        policy's update), or None (no PRM, or padded).
    """

    mode: str
    update: PackedForward | None
    forwards: PackedForward | None
    reason: str
    prm_update: PackedForward | None = None

    def plan_of(self, forward: PackedForward | None, mesh: Mesh) -> PackingPlan | None:
        """``forward``'s abstract plan when it runs packed, else None (padded)."""
        return forward.abstract(mesh) if forward is not None and forward.packed else None

    def report(self) -> dict[str, Any]:
        """The report's ``packing`` entry."""
        plans = {"update": self.update, "forwards": self.forwards}
        if self.prm_update is not None:
            plans["prm_update"] = self.prm_update
        return {
            "mode": self.mode,
            "packed": any(f is not None and f.packed for f in plans.values()),
            "rows_per_shard": {
                name: f.rows_per_shard for name, f in plans.items() if f is not None and f.packed
            },
            **{name: None if f is None else f.report() for name, f in plans.items()},
            "reason": self.reason,
            "assumption": ASSUMPTION if self.update is not None else None,
        }


def packed_rows_per_shard(
    rows: int, width: int, prompt_tokens: int, completion_tokens: float
) -> int:
    """``bucket_rows(ceil(rows x (p + f T) / W), rows)``: the packed rows of ``rows`` padded
    rows of one micro-batch and shard (``completion_tokens = f T``; see module)."""
    needed = math.ceil(round(rows * (prompt_tokens + completion_tokens) / width, 9))
    return bucket_rows(needed, rows)


def plan_forward(
    micro: int | TokenBudget,
    rows: int,
    width: int,
    shards: int,
    prompt_tokens: int,
    completion_tokens: float,
) -> tuple[int, int]:
    """``(K, r)`` of a forward over ``rows`` rows micro-batched as ``micro``: a fixed ``K``,
    or a token budget's fewest ``K >= minimum`` (dividing ``rows`` into micro-batches the
    shards divide) whose packed rows hold at most ``tokens`` positions per device
    (``r x W``), else the most micro-batches (``train.packing.plan_by_budget``)."""

    def rows_of(k: int) -> int:
        per_shard = max(rows // (k * shards), 1)
        return packed_rows_per_shard(per_shard, width, prompt_tokens, completion_tokens)

    if not isinstance(micro, TokenBudget):
        return micro, rows_of(micro)
    counts = [
        k
        for k in range(max(micro.minimum, 1), rows + 1)
        if rows % k == 0 and (rows // k) % shards == 0
    ] or [max(micro.minimum, 1)]
    for k in counts:
        if rows_of(k) * width <= micro.tokens:
            return k, rows_of(k)
    return counts[-1], rows_of(counts[-1])


def job_packing(
    cfg: Any, shape: JobShape, mesh: Mesh, prompt_tokens: int, platform: str, prm: bool = False
) -> Packing:
    """The ``Packing`` of a job on ``mesh`` (``cfg.trainer.packing``, the length model
    ``cfg.rollout.expected_length_fraction``, ``prompt_tokens`` real tokens a prompt; ``prm``:
    PRIME's implicit-PRM update is planned too).

    Raises:
      PlanError: a bad ``trainer.packing``, or ``on`` without a length model (naming
        ``rollout.expected_length_fraction`` and ``--lengths-from``).
    """
    try:
        mode = train_packing.packing_mode(cfg.trainer.packing)
    except ValueError as err:
        raise PlanError(str(err)) from None
    if mode == "off":
        return Packing(mode, None, None, "trainer.packing=off: padded programs")
    fraction = cfg.rollout.expected_length_fraction
    if fraction is None:
        if mode == "on":
            raise PlanError(
                "trainer.packing=on: plan sizes the packed rows from a length model; set "
                "rollout.expected_length_fraction (or pass --lengths-from RUN_DIR)"
            )
        return Packing(
            mode,
            None,
            None,
            "trainer.packing=auto without a length model: padded programs lowered (set "
            "rollout.expected_length_fraction or --lengths-from to plan the packed ones)",
        )
    width, completion = shape.seq_len, fraction * shape.completion_len
    shards = parallel.batch_shards(mesh)

    def forward(micro, rows: int) -> PackedForward:
        k, r = plan_forward(micro, rows, width, shards, prompt_tokens, completion)
        sized = PackedForward(k, shards, r, width, rows, packed=False)
        abstract = PackingPlan(*(jax.ShapeDtypeStruct((k, shards, r, width), jnp.int32),) * 3)
        packed = train_packing.worth_packing(abstract, rows, mode)  # the trainer's rule
        return dataclasses.replace(sized, packed=packed)

    update = forward(micro_batching(cfg.trainer, platform), shape.minibatch_rows)
    forwards = forward(forward_micro_batching(cfg.trainer, platform), shape.rows)
    prm_update = None
    if prm:  # PRIME: the PRM's update over the whole batch (``PRIMETrainer.prm_packing_plans``)
        prm_update = forward(micro_batching(cfg.trainer, platform), shape.rows)
    if mode == "on":
        reason = "trainer.packing=on: packed programs, rows from the length model"
    else:
        share = f"at most {train_packing.AUTO_MAX_ROWS:.0%} of the padded rows"
        reason = (
            f"trainer.packing=auto: a forward is packed when its packed rows are {share} "
            f"(the trainer's rule), by the length model (f = {fraction:.3g})"
        )
    return Packing(mode, update, forwards, reason, prm_update)


__all__ = ["ASSUMPTION", "PackedForward", "Packing", "job_packing", "packed_rows_per_shard"]
