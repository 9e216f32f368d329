"""Timing of loss + gradient steps: jitted JAX, and the eager PyTorch formulations.

Random batches that reach every surrogate branch, the repeat / median / percentile summary,
the copy-bandwidth roofline, and the loading of ``benchmarks/torch_losses.py``.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import objectives
from jaxrl_llm.types import RolloutBatch

LossFn = Callable[[jax.Array, RolloutBatch], jax.Array]

# Estimators whose advantages are per token ([B, T]); every other preset gets one per row.
TOKEN_ADVANTAGE_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline", "gae", "prime")
_DEFAULT_TORCH_IMPL = Path(__file__).resolve().parents[2] / "benchmarks" / "torch_losses.py"
# With repeats=None, sample for about this long (between the bounds below).
_TIME_BUDGET_S = 1.0
_MIN_REPEATS, _MAX_REPEATS, _WARMUP = 5, 100, 2


class LossTiming(NamedTuple):
    """Timing of one loss + gradient step (seconds; bandwidth in GB/s = 1e9 bytes/s).

    Attributes:
      compile_s: trace + lower + compile time (eager PyTorch: the first, warm-up call).
      median_s: median step time over the repeats.
      p10_s: 10th percentile of the step time (spread).
      p90_s: 90th percentile of the step time (spread).
      bytes: bytes the step must move: inputs read once + the gradient written once.
      gbps: effective bandwidth ``bytes / median_s / 1e9``.
    """

    compile_s: float
    median_s: float
    p10_s: float
    p90_s: float
    bytes: int
    gbps: float


def _check_dims(B: int, T: int) -> None:
    for name, value in (("B", B), ("T", T)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def random_batch(
    *,
    B: int,
    T: int,
    seed: int = 0,
    token_advantages: bool = False,
    with_reference: bool = True,
    noise: float = 0.1,
) -> tuple[np.ndarray, RolloutBatch]:
    """A random rollout batch (host NumPy float32) that exercises every surrogate branch.

    ``lp = −Exp(1)``, ``old = lp + noise·t₃``, ``ref = lp + noise·t₃'`` with ``t₃`` Student-t
    (3 dof): mostly near each other, with the heavy tail reaching PPO's clip, the dual clip
    (``r > 3``) and CISPO's cap (``r > 5``) on a few tokens of a large batch. Completion
    lengths are ragged, uniform in ``[1, T]``; advantages are standard normal, ``[B]`` or
    (``token_advantages``) ``[B, T]`` zeroed on padding.

    Args:
      B: rows.
      T: completion width.
      seed: NumPy seed; the same seed gives the same arrays.
      token_advantages: ``[B, T]`` instead of ``[B]`` advantages.
      with_reference: include ``ref_logprobs``.
      noise: scale of the ``old`` / ``ref`` perturbation.

    Returns:
      ``(logprobs [B, T], RolloutBatch)`` with ``completion_mask`` as float32 0/1.
    """
    _check_dims(B, T)
    rng = np.random.default_rng(seed)
    logprobs = -rng.exponential(1.0, (B, T)).astype(np.float32)
    old = (logprobs + noise * rng.standard_t(3, (B, T))).astype(np.float32)
    ref = (logprobs + noise * rng.standard_t(3, (B, T))).astype(np.float32)
    lengths = rng.integers(1, T + 1, size=B)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    if token_advantages:
        advantages = (rng.standard_normal((B, T)) * mask).astype(np.float32)
    else:
        advantages = rng.standard_normal(B).astype(np.float32)
    batch = RolloutBatch(
        completion_mask=mask,
        old_logprobs=old,
        advantages=advantages,
        ref_logprobs=ref if with_reference else None,
    )
    return logprobs, batch


def objective_batch(
    objective: objectives.Objective, *, B: int, T: int, seed: int = 0, noise: float = 0.1
) -> tuple[np.ndarray, RolloutBatch]:
    """:func:`random_batch` holding what ``objective``'s loss reads: reference log-probs only
    when KL is in the loss, per-token advantages for the token-level estimators."""
    kl_in_loss = objective.kl.kind is not None and objective.kl.placement == "loss"
    return random_batch(
        B=B,
        T=T,
        seed=seed,
        token_advantages=objective.advantage.name in TOKEN_ADVANTAGE_ESTIMATORS,
        with_reference=kl_in_loss,
        noise=noise,
    )


def step_bytes(logprobs: np.ndarray, batch: RolloutBatch) -> int:
    """Bytes a loss + gradient step moves at least: every input array once + the gradient."""
    inputs = [logprobs, *(leaf for leaf in batch if leaf is not None)]
    return int(sum(np.asarray(x).nbytes for x in inputs) + np.asarray(logprobs).nbytes)


def sample_times(
    step: Callable[[], Any], *, repeats: int | None = None
) -> tuple[float, np.ndarray]:
    """Wall-clock times of ``step()`` (which must return only when its work is done).

    Args:
      step: one synchronous step.
      repeats: timed calls after the warm-up; None: as many as fit in about a second
        (5 to 100).

    Returns:
      ``(first_call_s, times_s)``: the first warm-up call and the timed calls.
    """
    if repeats is not None and (not isinstance(repeats, int) or repeats < 1):
        raise ValueError(f"repeats must be a positive int or None, got {repeats!r}")
    warmup = []
    for _ in range(_WARMUP):
        start = time.perf_counter()
        step()
        warmup.append(time.perf_counter() - start)
    if repeats is None:
        estimate = max(min(warmup), 1e-6)
        repeats = int(np.clip(_TIME_BUDGET_S / estimate, _MIN_REPEATS, _MAX_REPEATS))
    times = np.empty(repeats)
    for i in range(repeats):
        start = time.perf_counter()
        step()
        times[i] = time.perf_counter() - start
    return warmup[0], times


def timing_from_samples(times: np.ndarray, *, compile_s: float, num_bytes: int) -> LossTiming:
    """Summarises step times: median, 10th / 90th percentiles, effective GB/s."""
    median = float(np.median(times))
    p10, p90 = (float(v) for v in np.percentile(times, [10, 90]))
    return LossTiming(
        compile_s=float(compile_s),
        median_s=median,
        p10_s=p10,
        p90_s=p90,
        bytes=int(num_bytes),
        gbps=num_bytes / max(median, 1e-12) / 1e9,
    )


def _loss_fn(objective_or_fn: objectives.Objective | LossFn) -> LossFn:
    if isinstance(objective_or_fn, objectives.Objective):
        objective = objective_or_fn
        return lambda logprobs, batch: objectives.policy_loss(objective, logprobs, batch).loss
    if not callable(objective_or_fn):
        raise ValueError(
            "time_loss needs an Objective or a callable fn(logprobs, batch) -> scalar loss, "
            f"got {type(objective_or_fn).__name__}"
        )

    def scalar_loss(logprobs, batch):
        loss = objective_or_fn(logprobs, batch)
        if jnp.shape(loss) != ():
            raise ValueError(f"the loss function must return a scalar, got shape {jnp.shape(loss)}")
        return loss

    return scalar_loss


def time_loss(
    objective_or_fn: objectives.Objective | LossFn,
    *,
    B: int,
    T: int,
    repeats: int | None = None,
    seed: int = 0,
    data: tuple[np.ndarray, RolloutBatch] | None = None,
) -> LossTiming:
    """Times ``jax.jit(jax.value_and_grad(loss))`` on a random ``[B, T]`` batch.

    The step returns the scalar loss and its ``[B, T]`` gradient w.r.t. the log-probs;
    compilation is timed apart (lower + compile), then two warm-up calls, then ``repeats``
    timed calls, each waiting on ``block_until_ready``.

    Args:
      objective_or_fn: an :class:`~jaxrl_llm.objectives.Objective` (its ``policy_loss``) or
        a callable ``fn(logprobs [B, T], batch: RolloutBatch) -> scalar``; a callable gets
        reference log-probs and ``[B]`` advantages.
      B: rows.
      T: completion width.
      repeats: timed calls; None: as many as fit in about a second (5 to 100).
      seed: seed of :func:`random_batch`.
      data: ``(logprobs, batch)`` to time on instead of a random batch (B, T must match).

    Returns:
      :class:`LossTiming`.

    Raises:
      ValueError: on non-positive sizes or repeats, a non-callable, a non-scalar loss, or
        ``data`` whose shape is not ``[B, T]``.
    """
    _check_dims(B, T)
    loss_fn = _loss_fn(objective_or_fn)
    if data is None:
        if isinstance(objective_or_fn, objectives.Objective):
            data = objective_batch(objective_or_fn, B=B, T=T, seed=seed)
        else:
            data = random_batch(B=B, T=T, seed=seed)
    logprobs, batch = data
    if np.shape(logprobs) != (B, T):
        raise ValueError(f"data logprobs have shape {np.shape(logprobs)}, expected {(B, T)}")
    num_bytes = step_bytes(logprobs, batch)
    logprobs, batch = jax.device_put((logprobs, batch))

    step = jax.jit(jax.value_and_grad(loss_fn))
    start = time.perf_counter()
    compiled = step.lower(logprobs, batch).compile()
    compile_s = time.perf_counter() - start
    _, times = sample_times(
        lambda: jax.block_until_ready(compiled(logprobs, batch)), repeats=repeats
    )
    return timing_from_samples(times, compile_s=compile_s, num_bytes=num_bytes)


def copy_bandwidth(num_bytes: int = 1 << 26, *, repeats: int = 20) -> float:
    """Bandwidth of a jitted streaming pass ``y = x + 1`` over ``num_bytes`` of float32, GB/s.

    Counts ``2·num_bytes`` (one read, one write): the roofline a memory-bound loss step of
    arrays this size can approach on this machine.

    Args:
      num_bytes: size of the array copied (rounded down to whole float32, at least one).
      repeats: timed calls (median taken).

    Returns:
      GB/s (1e9 bytes per second).
    """
    if not isinstance(num_bytes, int) or num_bytes < 4:
        raise ValueError(f"num_bytes must be an int >= 4, got {num_bytes!r}")
    x = jnp.zeros((num_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0).lower(x).compile()
    _, times = sample_times(lambda: jax.block_until_ready(copy(x)), repeats=repeats)
    return 2 * x.nbytes / max(float(np.median(times)), 1e-12) / 1e9


def load_torch_impl(path: str | os.PathLike | None = None) -> tuple[ModuleType | None, str]:
    """Loads the PyTorch formulations (``benchmarks/torch_losses.py`` by default).

    Returns:
      ``(module, "")``, or ``(None, reason)`` when PyTorch or the file is unavailable.
    """
    path = Path(_DEFAULT_TORCH_IMPL if path is None else path)
    if not path.is_file():
        return None, f"no PyTorch formulation file at {path}"
    if importlib.util.find_spec("torch") is None:
        return None, "torch is not installed"
    spec = importlib.util.spec_from_file_location(f"_jaxrl_llm_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, ""


def time_torch_loss(
    torch_impl: ModuleType,
    objective: objectives.Objective,
    data: tuple[np.ndarray, RolloutBatch],
    *,
    repeats: int | None = None,
) -> LossTiming:
    """Times the eager PyTorch formulation (forward + ``loss.backward()``) on ``data``."""
    logprobs, batch = data
    step = torch_impl.make_step(objective, logprobs, batch)
    first, times = sample_times(step, repeats=repeats)
    return timing_from_samples(times, compile_s=first, num_bytes=step_bytes(logprobs, batch))
