"""Per-chip memory, roofline times, step time, MFU and tokens/s of a compiled program.

Given a compiled (deviceless) program and a ``TopologySpec``:

* ``memory_breakdown``: ``memory_analysis()`` sizes -> peak HBM per chip, against the chip's
  capacity. Peak = arguments + outputs - aliased (outputs written into donated arguments) +
  temporaries + generated code: XLA's buffer assignment keeps arguments alive for the whole
  call, gives outputs their own buffers unless aliased, and packs every temporary into one
  ``temp`` arena of the size reported.
* ``roofline``: compute time ``flops / (chips x peak)``, HBM time ``bytes / HBM bandwidth`` (bytes
  from ``hlo_hbm_bytes`` of the HLO, or analytic: ``decode_hbm_bytes``), ICI time
  ``ici_time_s`` (ring model) summed over the trip-weighted collectives of ``hlo.py``.
* Overlap: ``step_s = max(compute, HBM, ICI)`` assumes XLA overlaps everything (async
  collectives hidden behind compute, compute and HBM streaming overlapped: the roofline bound,
  optimistic); ``step_conservative_s = max(compute, HBM) + ICI`` assumes no collective is
  hidden (an upper bound short of latency and launch overheads). Real steps land in between,
  nearer the first when collectives are large, async and inside scanned layers.
* MFU = model FLOPs / (chips x peak x step time) (PaLM's definition, Chowdhery et al. 2022,
  App. B: model FLOPs exclude rematerialisation); over the roofline step time it is an upper
  bound (``roofline_mfu_bound``: a compute-bound program's is model over compiled FLOPs);
  tokens/s = tokens per call / step time. ``goodput`` applies a measured efficiency.

Figures are per call; bytes per chip (one device's SPMD program), FLOPs over all chips.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.plan import flops as flops_lib
from jaxrl_llm.plan.hbm import hlo_hbm_bytes
from jaxrl_llm.plan.hlo import (
    COLLECTIVE_KINDS,
    CollectiveOp,
    collective_ops,
    parse_hlo_module,
    while_loops,
)
from jaxrl_llm.plan.topology import TopologySpec

_MEMORY_FIELDS = {
    "argument_bytes": "argument_size_in_bytes",
    "output_bytes": "output_size_in_bytes",
    "alias_bytes": "alias_size_in_bytes",
    "temp_bytes": "temp_size_in_bytes",
    "generated_code_bytes": "generated_code_size_in_bytes",
    "host_argument_bytes": "host_argument_size_in_bytes",
    "host_output_bytes": "host_output_size_in_bytes",
    "host_alias_bytes": "host_alias_size_in_bytes",
    "host_temp_bytes": "host_temp_size_in_bytes",
}


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """HBM a compiled program needs per chip, from ``compiled.memory_analysis()``.

    Attributes:
      argument_bytes, output_bytes, alias_bytes, temp_bytes, generated_code_bytes: the
        ``memory_analysis()`` sizes (``alias``: output bytes living in donated arguments).
      host_*_bytes: the same for host (offloaded) memory, not part of the HBM total.
      total_bytes: ``argument + output - alias + temp + generated_code``.
      capacity_bytes: the chip's HBM (``spec.hbm_bytes_per_chip``), or None without a spec.
      usable_bytes: what the compiler lets a program use (``spec.usable_hbm_bytes_per_chip``).
      fits: ``total_bytes <= usable_bytes`` (None without a spec).
      headroom_bytes: ``usable_bytes - total_bytes`` (negative when it does not fit).
    """

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    host_argument_bytes: int
    host_output_bytes: int
    host_alias_bytes: int
    host_temp_bytes: int
    total_bytes: int
    capacity_bytes: int | None
    usable_bytes: int | None
    fits: bool | None
    headroom_bytes: int | None


def memory_breakdown(compiled: Any, spec: TopologySpec | None = None) -> MemoryBreakdown:
    """Peak HBM per chip of ``compiled`` (a ``jax.stages.Compiled`` or its memory stats).

    Args:
      compiled: anything with ``memory_analysis()``, or the ``CompiledMemoryStats`` it returns.
      spec: the topology to check the total against (``fits``, ``headroom_bytes``).

    Raises:
      ValueError: the backend gives no memory analysis, or a size is missing or negative.
    """
    stats = compiled.memory_analysis() if hasattr(compiled, "memory_analysis") else compiled
    if stats is None:
        raise ValueError("this backend returned no memory_analysis() for the compiled program")
    sizes = {}
    for field, attr in _MEMORY_FIELDS.items():
        value = getattr(stats, attr, 0 if attr.startswith("host_") else None)
        if value is None or int(value) < 0:
            raise ValueError(f"memory_analysis() has no valid {attr}: {value!r}")
        sizes[field] = int(value)
    total = (
        sizes["argument_bytes"]
        + sizes["output_bytes"]
        - sizes["alias_bytes"]
        + sizes["temp_bytes"]
        + sizes["generated_code_bytes"]
    )
    capacity = usable = fits = headroom = None
    if spec is not None:
        capacity, usable = spec.hbm_bytes_per_chip, spec.usable_hbm_bytes_per_chip
        fits, headroom = total <= usable, usable - total
    return MemoryBreakdown(
        **sizes,
        total_bytes=total,
        capacity_bytes=capacity,
        usable_bytes=usable,
        fits=fits,
        headroom_bytes=headroom,
    )


def roofline(
    spec: TopologySpec,
    *,
    flops: float,
    hbm_bytes: float,
    ici_s: float = 0.0,
    model_flops: float | None = None,
    tokens: float | None = None,
    chips: int | None = None,
) -> dict[str, Any]:
    """Roofline times of one call and what follows from them (see the module docstring).

    Args:
      spec: the topology (chips, peak FLOP/s, HBM bandwidth).
      flops: FLOPs of one call over all chips (e.g. ``flops.train_flops``).
      hbm_bytes: bytes one chip reads and writes in HBM during the call.
      ici_s: seconds of collectives per chip (``collectives_ici_time_s``).
      model_flops: FLOPs counted for MFU (default ``flops``; pass the ``6N`` count to leave out
        rematerialisation).
      tokens: tokens one call produces or trains on (for tokens/s), or None.
      chips: chips the call runs on (default ``spec.chips``: the whole slice).

    Returns:
      ``compute_s, hbm_s, ici_s, step_s, step_conservative_s, bound, roofline_mfu_bound,
      roofline_mfu_bound_conservative, tokens_per_s, tokens_per_s_conservative`` (the last
      two None without ``tokens``); the MFUs are over the roofline times: upper bounds.
    """
    for name, value in (("flops", flops), ("hbm_bytes", hbm_bytes), ("ici_s", ici_s)):
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
    model_flops = flops if model_flops is None else model_flops
    peak = (spec.chips if chips is None else chips) * spec.peak_bf16_flops_per_chip
    compute_s = flops / peak
    hbm_s = hbm_bytes / spec.hbm_bandwidth_bytes_per_s
    terms = {"compute": compute_s, "hbm": hbm_s, "ici": ici_s}
    step_s = max(terms.values())
    step_conservative_s = max(compute_s, hbm_s) + ici_s
    return {
        "compute_s": compute_s,
        "hbm_s": hbm_s,
        "ici_s": ici_s,
        "step_s": step_s,
        "step_conservative_s": step_conservative_s,
        "bound": max(terms, key=terms.get),
        "roofline_mfu_bound": model_flops / (peak * step_s) if step_s > 0 else 0.0,
        "roofline_mfu_bound_conservative": (
            model_flops / (peak * step_conservative_s) if step_conservative_s > 0 else 0.0
        ),
        "tokens_per_s": None if tokens is None or step_s == 0 else tokens / step_s,
        "tokens_per_s_conservative": (
            None if tokens is None or step_conservative_s == 0 else tokens / step_conservative_s
        ),
    }


@dataclasses.dataclass(frozen=True)
class ProgramEstimate:
    """Everything ``plan`` reports about one compiled program on one topology.

    Attributes:
      name: the program (``"train_step"``, ``"decode"``, ...).
      topology: ``spec.cloud_name``.
      chips: chips running it.
      flops: FLOPs of one call over all chips (analytic, ``flops.py``).
      model_flops: FLOPs counted for MFU.
      hbm_bytes: HBM bytes read and written per chip per call.
      collective_bytes: per-chip collective result bytes per call, by kind.
      collective_ops: the collectives (``hlo.CollectiveOp``), for a per-op report.
      trip_weighted: collectives (and HLO-derived HBM bytes) weighted by loop trip counts.
      trip_counts_known: every loop's trip count was read from the HLO.
      memory: ``MemoryBreakdown``.
      times: ``roofline(...)`` output (seconds, bound, MFU, tokens/s).
      xla_optimal_seconds: XLA:TPU's own cost-model time (``cost_analysis()`` key
        ``optimal_seconds``; loop bodies counted once), or None (absent, or negative as seen
        on a large train step).
      tokens: tokens per call (for tokens/s), or None.
      ici_link_bandwidth: ``spec.ici_bandwidth_bytes_per_s_per_link`` the ICI times used.
    """

    name: str
    topology: str
    chips: int
    flops: float
    model_flops: float
    hbm_bytes: float
    collective_bytes: Mapping[str, int]
    collective_ops: tuple[CollectiveOp, ...]
    trip_weighted: bool
    trip_counts_known: bool
    memory: MemoryBreakdown
    times: Mapping[str, Any]
    xla_optimal_seconds: float | None
    tokens: float | None
    ici_link_bandwidth: float

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (ops as a list of dicts, with their ICI seconds)."""
        out = dataclasses.asdict(self)
        out["collective_ops"] = [
            {
                **dataclasses.asdict(op),
                "total_bytes": op.total_bytes,
                "ici_s": op.multiplier
                * ici_time_s(op.kind, op.bytes, op.group_size, self.ici_link_bandwidth),
            }
            for op in self.collective_ops
        ]
        out["collective_bytes"] = dict(self.collective_bytes)
        out["times"] = dict(self.times)
        return out


def estimate_program(
    compiled: Any,
    spec: TopologySpec,
    *,
    flops: float,
    name: str = "program",
    model_flops: float | None = None,
    hbm_bytes: float | None = None,
    tokens: float | None = None,
    trip_weighted_collectives: bool = True,
) -> ProgramEstimate:
    """A ``ProgramEstimate`` of ``compiled`` (a deviceless ``jax.jit(...).lower(...).compile()``).

    Args:
      compiled: the compiled program (``as_text``, ``memory_analysis``, ``cost_analysis``).
      spec: its topology.
      flops: analytic FLOPs of one call over all chips.
      name: the program's name in the report.
      model_flops: FLOPs for MFU (default ``flops``).
      hbm_bytes: HBM bytes per chip per call (e.g. ``decode_hbm_bytes(...) / chips``); default
        ``hlo_hbm_bytes`` of the optimized HLO.
      tokens: tokens per call, for tokens/s.
      trip_weighted_collectives: weight collectives (and the default HBM bytes) by trip counts.
    """
    module = parse_hlo_module(compiled.as_text())
    ops = tuple(collective_ops(module))
    if not trip_weighted_collectives:
        ops = tuple(dataclasses.replace(op, multiplier=1) for op in ops)
    by_kind = dict.fromkeys(COLLECTIVE_KINDS, 0)
    for op in ops:
        by_kind[op.kind] += op.total_bytes
    if hbm_bytes is None:
        hbm_bytes = hlo_hbm_bytes(module, trip_weighted=trip_weighted_collectives)
    ici_s = collectives_ici_time_s(ops, spec.ici_bandwidth_bytes_per_s_per_link)
    loops = while_loops(module)
    times = roofline(
        spec, flops=flops, hbm_bytes=hbm_bytes, ici_s=ici_s, model_flops=model_flops, tokens=tokens
    )
    return ProgramEstimate(
        name=name,
        topology=spec.cloud_name,
        chips=spec.chips,
        flops=float(flops),
        model_flops=float(flops if model_flops is None else model_flops),
        hbm_bytes=float(hbm_bytes),
        collective_bytes=by_kind,
        collective_ops=ops,
        trip_weighted=trip_weighted_collectives,
        trip_counts_known=all(loop.trip_count is not None for loop in loops),
        memory=memory_breakdown(compiled, spec),
        times=times,
        xla_optimal_seconds=_optimal_seconds(compiled),
        tokens=tokens,
        ici_link_bandwidth=spec.ici_bandwidth_bytes_per_s_per_link,
    )


def estimate(
    compiled: Any,
    spec: TopologySpec,
    *,
    flops: float,
    trip_weighted_collectives: bool = True,
    name: str = "program",
    model_flops: float | None = None,
    hbm_bytes: float | None = None,
    tokens: float | None = None,
) -> dict[str, Any]:
    """``estimate_program(...).as_dict()``: the JSON-ready report of one program."""
    return estimate_program(
        compiled,
        spec,
        flops=flops,
        name=name,
        model_flops=model_flops,
        hbm_bytes=hbm_bytes,
        tokens=tokens,
        trip_weighted_collectives=trip_weighted_collectives,
    ).as_dict()


def _optimal_seconds(compiled: Any) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # some backends have no cost model
        return None
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    seconds = float(cost.get("optimal_seconds", -1.0)) if isinstance(cost, Mapping) else -1.0
    return seconds if seconds >= 0 else None


def ici_time_s(kind: str, result_bytes: float, group_size: int, link_bandwidth: float) -> float:
    """Seconds one collective spends on ICI, on a bidirectional ring of ``n = group_size`` chips.

    With ``W`` = one direction of one link, a ring chip sends and receives ``2W`` at once
    (ring algorithms, Patarasuk & Yuan 2009; "How to Scale Your Model", Austin et al. 2025):
    all-gather (result R = the gathered buffer) ``(n-1)/n R / 2W``; reduce-scatter (result R =
    one shard of an ``n R`` buffer) ``(n-1) R / 2W``; all-reduce ``2 (n-1)/n R / 2W``;
    all-to-all ``max((n-1)/n, n/4) R / 2W`` (``n/4``: mean hops on a ring); collective-permute
    ``R / W``. Hop latency is ignored (a bandwidth bound); a group spread over several torus
    axes may use more links than one ring, so for it this is pessimistic.
    """
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {COLLECTIVE_KINDS}")
    if not link_bandwidth > 0 or result_bytes < 0 or group_size < 0:
        raise ValueError(
            f"bad bandwidth/bytes/group: {link_bandwidth}, {result_bytes}, {group_size}"
        )
    n, ring = group_size, 2.0 * link_bandwidth
    if n <= 1:
        return 0.0
    factor = {
        "all-gather": (n - 1) / n,
        "reduce-scatter": n - 1,
        "all-reduce": 2 * (n - 1) / n,
        "all-to-all": max((n - 1) / n, n / 4),
        "collective-permute": 2.0,  # R / W = 2 R / 2W
    }[kind]
    return factor * result_bytes / ring


def collectives_ici_time_s(ops: Iterable[CollectiveOp], link_bandwidth: float) -> float:
    """Sum of ``ici_time_s`` over ``ops``, each times its loop multiplier."""
    return sum(
        op.multiplier * ici_time_s(op.kind, op.bytes, op.group_size, link_bandwidth) for op in ops
    )


# Ops moving no HBM data themselves (loops, calls and branches are walked instead).
def decode_hbm_bytes(
    config: ModelConfig,
    batch: int,
    kv_len: int,
    *,
    param_bytes: int = 2,
    cache_bytes: int = 2,
) -> int:
    """HBM bytes one decode step reads and writes, over all chips (divide by chips when the
    weights and the cache are sharded, not replicated).

    ``matmul_params x param_bytes`` (every weight a token passes through, read once a step; the
    embedding lookup reads B rows; a mixture of experts reads every expert its ``B`` tokens
    reach, ``flops.decode_weight_params``) ``+ 2 L B K kv_len H x cache_bytes`` (the K and V
    caches read) ``+ 2 L B K H x cache_bytes`` (this token's keys and values written).
    """
    if batch < 1 or kv_len < 1:
        raise ValueError(f"batch and kv_len must be >= 1, got {batch}, {kv_len}")
    layers, kv, h = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    weights = round(flops_lib.decode_weight_params(config, batch) * param_bytes)
    cache_read = 2 * layers * batch * kv * kv_len * h * cache_bytes
    cache_write = 2 * layers * batch * kv * h * cache_bytes
    embed_rows = batch * config.hidden_size * param_bytes
    return weights + cache_read + cache_write + embed_rows


__all__ = [
    "MemoryBreakdown",
    "ProgramEstimate",
    "decode_hbm_bytes",
    "estimate",
    "estimate_program",
    "hlo_hbm_bytes",
    "ici_time_s",
    "collectives_ici_time_s",
    "memory_breakdown",
    "roofline",
]
