"""``plan``'s reading of collectives and loops in the optimized HLO: each XLA:TPU async
collective counted once, the decode loop's body as one trip, XLA's own cost-model time."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl_llm.plan import hlo as hlo_lib


def _fused_computations(module: hlo_lib.HloModule) -> set[str]:
    return {
        name
        for comp in module.computations.values()
        for ins in comp.instructions
        if ins.opcode == "fusion"
        for name in ins.called("calls")
    }


def _channel(module: hlo_lib.HloModule, op: hlo_lib.CollectiveOp) -> str | None:
    comp = module.computations.get(op.computation)
    ins = None if comp is None else comp.by_name.get(op.name)
    if ins is None:
        return None
    channel = ins.attribute("channel_id")
    if channel is None and ins.opcode == "fusion":  # an XLA:TPU all-reduce-scatter fusion
        for callee in ins.called("calls"):
            inner = module.computations.get(callee)
            for sub in () if inner is None else inner.instructions:
                channel = channel or sub.attribute("channel_id")
    return channel


def unique_collectives(
    module: hlo_lib.HloModule, ops: Sequence[hlo_lib.CollectiveOp]
) -> list[hlo_lib.CollectiveOp]:
    """``ops`` with each collective counted once.

    XLA:TPU's async collective fusion copies one collective (one ``channel_id``) into each
    fusion of its start, continuation and done steps; ``hlo.collective_ops`` lists every copy
    (e.g. one all-gather of an MLP weight eight times). Copies sharing a kind and channel id, at
    least one inside a fused computation, are one collective: kept once, with the largest loop
    multiplier among them. Collectives without a channel id, and same-channel ops that all sit
    outside fusions, are kept as they are.
    """
    fused = _fused_computations(module)
    groups: dict[tuple[str, str], list[int]] = {}
    for index, op in enumerate(ops):
        channel = _channel(module, op)
        if channel is not None:
            groups.setdefault((op.kind, channel), []).append(index)
    drop: set[int] = set()
    for members in groups.values():
        if len(members) > 1 and any(ops[i].computation in fused for i in members):
            keep = max(members, key=lambda i: ops[i].multiplier)
            drop.update(i for i in members if i != keep)
    return [op for i, op in enumerate(ops) if i not in drop]


def _optimal_seconds(compiled: Any) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - some backends have no cost model
        return None
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    seconds = float(cost.get("optimal_seconds", -1.0)) if isinstance(cost, Mapping) else -1.0
    return seconds if seconds >= 0 else None


def loop_body_module(module: hlo_lib.HloModule) -> hlo_lib.HloModule:
    """The module seen from the body of its entry's one data-dependent ``while`` loop (the
    decode loop: ``step < T and any(~done)``), so that walking it counts one trip.

    Raises:
      ValueError: the entry has no such loop, or more than one.
    """
    entry = module.computations[module.entry]
    bodies = [
        ins.attribute("body")
        for ins in entry.instructions
        if ins.opcode == "while" and hlo_lib.loop_trip_count(module, entry, ins)[0] is None
    ]
    if len(bodies) != 1 or bodies[0] not in module.computations:
        raise ValueError(
            f"expected one data-dependent while loop in the entry computation, found {bodies}"
        )
    return dataclasses.replace(module, entry=bodies[0])


__all__ = ["loop_body_module", "unique_collectives"]
