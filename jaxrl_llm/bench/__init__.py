"""Timing harness for policy losses: loss + gradient under ``jax.jit``, against PyTorch eager.

A researcher times a preset, or any composition of the loss pieces, the same way the
``jaxrl-llm bench losses`` table does::

    from jaxrl_llm import bench, objectives
    bench.time_loss(objectives.make("dapo"), B=64, T=1024)
    bench.time_loss(lambda lp, batch: my_loss(lp, batch), B=64, T=1024)

Every figure excludes compilation (reported apart), waits on ``block_until_ready`` and is a
median over repeats. Effective bandwidth counts the bytes the step must move at least: the
input arrays read once plus the ``[B, T]`` gradient written once; it is compared with the
bandwidth of a plain jitted copy (``x + 1``) of one ``[B, T]`` float32 array measured in the
same run, so "% copy" is how close the loss comes to a single streaming pass.

The PyTorch column runs the formulations of ``benchmarks/torch_losses.py`` (verl
``core_algos.py`` style, eager, ``loss.backward()``) on the same arrays. PyTorch is optional:
without it (or without that file) the column says n/a.

``timing`` times one step (JAX and PyTorch), ``report`` formats the table with the machine
next to it, ``cli`` runs every preset at every shape for ``jaxrl-llm bench``;
``policy_update`` is the whole GRPO update (batch and jitted step) that
``benchmarks/bench_train_step.py`` and ``benchmarks/bench_packing.py`` time. Every public name
is exported here.
"""

from jaxrl_llm.bench.cli import (
    DEFAULT_SHAPES,
    bench_main,
    loss_presets,
    parse_presets,
    parse_shapes,
    run_losses,
)
from jaxrl_llm.bench.policy_update import PolicyUpdate, grpo_rollout_batch, grpo_update
from jaxrl_llm.bench.report import (
    BenchRow,
    environment,
    format_report,
    format_table,
    num_cores,
    write_results,
)
from jaxrl_llm.bench.timing import (
    TOKEN_ADVANTAGE_ESTIMATORS,
    LossFn,
    LossTiming,
    copy_bandwidth,
    load_torch_impl,
    objective_batch,
    random_batch,
    sample_times,
    step_bytes,
    time_loss,
    time_torch_loss,
    timing_from_samples,
)

__all__ = [
    "DEFAULT_SHAPES",
    "TOKEN_ADVANTAGE_ESTIMATORS",
    "BenchRow",
    "LossFn",
    "LossTiming",
    "PolicyUpdate",
    "write_results",
    "bench_main",
    "copy_bandwidth",
    "environment",
    "format_report",
    "format_table",
    "grpo_rollout_batch",
    "grpo_update",
    "load_torch_impl",
    "num_cores",
    "objective_batch",
    "loss_presets",
    "parse_presets",
    "parse_shapes",
    "random_batch",
    "run_losses",
    "sample_times",
    "step_bytes",
    "time_loss",
    "time_torch_loss",
    "timing_from_samples",
]
