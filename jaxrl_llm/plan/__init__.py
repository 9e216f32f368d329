"""Ahead-of-time planning for Cloud TPU: topologies, HLO collectives, FLOPs, roofline estimates.

``jaxrl-llm plan CONFIG --topology NAME`` compiles the training and sampling programs for a TPU
slice without one attached (deviceless: ``jax.experimental.topologies`` + libtpu) and reports,
per chip, HBM use against capacity, FLOPs, trip-weighted collective bytes, roofline times and
estimated step time, MFU (the roofline's upper bound and the expected one), goodput and decode
tokens/s. This package holds the reusable pieces:

* ``topology``: ``resolve_topology(name) -> TopologySpec``, ``get_devices(spec)`` and
  ``try_compile(lowered)`` (a compile that reports running out of HBM instead of raising);
* ``hlo``: optimized-HLO parsing (collectives with trip-count multipliers, loop trip counts);
* ``flops``: analytic matmul FLOPs of the decoder (forward, train step, decode, ``6N``; LoRA's
  adapters and its frozen-base update);
* ``estimate``: ``memory_breakdown``, ICI ring times, HLO HBM traffic, ``roofline``,
  ``estimate_program`` and ``estimate.estimate`` (its JSON-ready dict; not re-exported here, so
  that ``jaxrl_llm.plan.estimate`` stays the module);
* ``programs``: the RL step's programs as ``jaxrl-llm train`` builds them, lowered with
  abstract arguments for a topology (``build_job``), compiled and planned (``plan_job``: the
  JSON-ready report), per-chip memory by part (``memory_parts``);
* ``goodput``: what the roofline does not know: the length model (padded, real and packed
  positions), the measured matmul efficiency per chip generation (``MATMUL_EFFICIENCY``,
  ``matmul_efficiency``), the expected time and MFU, goodput and MFU over real tokens;
* ``cli``: ``plan_main``, the ``jaxrl-llm plan`` command (docs/plan.md).
"""

from jaxrl_llm.plan.estimate import (
    MemoryBreakdown,
    ProgramEstimate,
    collectives_ici_time_s,
    decode_hbm_bytes,
    estimate_program,
    hlo_hbm_bytes,
    ici_time_s,
    memory_breakdown,
    roofline,
)
from jaxrl_llm.plan.flops import (
    adapter_params,
    attention_pairs,
    decode_flops,
    forward_flops,
    forward_flops_breakdown,
    matmul_params,
    model_flops_per_token,
    param_count,
    train_flops,
)
from jaxrl_llm.plan.goodput import MATMUL_EFFICIENCY, matmul_efficiency
from jaxrl_llm.plan.hlo import (
    COLLECTIVE_KINDS,
    CollectiveOp,
    WhileLoop,
    collective_bytes,
    collective_ops,
    parse_hlo_module,
    while_loops,
)
from jaxrl_llm.plan.programs import (
    JobShape,
    PlanError,
    build_job,
    compile_job,
    decode_hbm_bytes_per_chip,
    memory_parts,
    plan_job,
    unique_collectives,
)
from jaxrl_llm.plan.topology import (
    CompileOutcome,
    TopologySpec,
    get_devices,
    libtpu_available,
    parse_hbm_oom,
    resolve_topology,
    try_compile,
)

__all__ = [
    "COLLECTIVE_KINDS",
    "MATMUL_EFFICIENCY",
    "CollectiveOp",
    "CompileOutcome",
    "JobShape",
    "MemoryBreakdown",
    "PlanError",
    "ProgramEstimate",
    "TopologySpec",
    "WhileLoop",
    "adapter_params",
    "attention_pairs",
    "build_job",
    "collective_bytes",
    "collective_ops",
    "collectives_ici_time_s",
    "compile_job",
    "decode_flops",
    "decode_hbm_bytes",
    "decode_hbm_bytes_per_chip",
    "estimate_program",
    "forward_flops",
    "forward_flops_breakdown",
    "get_devices",
    "hlo_hbm_bytes",
    "ici_time_s",
    "libtpu_available",
    "matmul_efficiency",
    "matmul_params",
    "memory_breakdown",
    "memory_parts",
    "model_flops_per_token",
    "param_count",
    "parse_hbm_oom",
    "parse_hlo_module",
    "plan_job",
    "resolve_topology",
    "roofline",
    "train_flops",
    "try_compile",
    "unique_collectives",
    "while_loops",
]
