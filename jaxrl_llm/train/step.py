"""The one jitted optimizer step: loss → gradient (micro-batched) → optax, with shardings.

Every trainer — policy, critic, PRIME's reward model, SFT, preference and reward-model jobs —
builds its update with :func:`make_step` around a ``loss_fn`` and compiles it with
:func:`jit_step` (explicit ``in_shardings`` / ``out_shardings``, the old state donated).

Micro-batches are a ``lax.scan`` inside the step, over strided rows: a fixed count K, or a
:class:`TokenBudget` that picks K from each batch's shape (verl's ``use_dynamic_bsz`` /
``ppo_max_token_len_per_gpu`` idea, with equal-sized micro-batches so the program stays
static). Two ways to accumulate:

- ``accumulate="sum"`` (RL, SFT): the step counts the whole batch's valid tokens and non-empty
  rows from ``batch.completion_mask`` and hands them to every micro-batch as :class:`Totals`;
  a loss normalised by them (every objective is) sums to exactly the full-batch loss and
  gradient, for every aggregation mode. Metrics are summed (``*_min`` / ``*_max`` by min / max).
- ``accumulate="mean"`` (preference jobs): the gradient and metrics are averaged over the K
  micro-batches, as TRL's gradient accumulation does — the full-batch gradient for losses that
  are means over pairs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxrl_llm import parallel
from jaxrl_llm.losses import aggregation
from jaxrl_llm.objectives import entropy_control as entropy_ctl
from jaxrl_llm.train.packing import micro_plan
from jaxrl_llm.train.state import TrainState

Array = jax.Array
PyTree = Any
ACCUMULATE = ("sum", "mean")


class Totals(NamedTuple):
    """Whole-batch normalisers handed to each micro-batch (``accumulate="sum"``)."""

    num_tokens: Array  # scalar f32: valid completion tokens of the whole batch
    num_seqs: Array  # scalar f32: non-empty rows of the whole batch
    entropy_coef: Array | None = None  # scalar f32: an adaptive entropy coefficient's value


class TokenBudget(NamedTuple):
    """Micro-batches sized by tokens: at most ``tokens`` positions per device per micro-batch.

    For a batch of ``B`` rows of ``S`` positions (prompt + completion) sharded over ``d``
    devices, K is the smallest count ``>= minimum`` that divides ``B``, leaves ``B / K``
    divisible by ``d`` and gives ``(B / K / d) * S <= tokens``; when none does, the largest
    such count (the fewest rows per micro-batch); ``minimum`` when no count qualifies (the
    trainer's batch-size checks then say which key does not divide). K is fixed at trace
    time by the batch's shape, so each bucketed shape compiles once. Since every loss is
    normalised by whole-batch totals (``accumulate="sum"``), K changes the schedule, not the
    update.
    """

    tokens: int
    minimum: int = 1

    def micro_batches(self, rows: int, seq_len: int, devices: int = 1) -> int:
        """K for ``rows`` rows of ``seq_len`` positions over ``devices`` batch shards."""
        if self.tokens < 1 or self.minimum < 1:
            raise ValueError(f"TokenBudget needs tokens >= 1 and minimum >= 1, got {self}")
        if rows < 1 or seq_len < 1 or devices < 1:
            raise ValueError(
                f"rows, seq_len and devices must be >= 1, got {rows}, {seq_len}, {devices}"
            )
        candidates = [k for k in range(1, rows + 1) if rows % k == 0 and (rows // k) % devices == 0]
        candidates = [k for k in candidates if k >= self.minimum]
        if not candidates:  # the batch-size checks name the config key that does not divide
            return self.minimum
        for k in candidates:
            if rows // k // devices * seq_len <= self.tokens:
                return k
        return candidates[-1]


def row_length(batch: Any) -> int:
    """Positions per row of a batch: prompt + completion widths, else the mask's width."""
    prompt, completion = (
        getattr(batch, "prompt_tokens", None),
        getattr(batch, "completion_tokens", None),
    )
    if prompt is not None and completion is not None:
        return prompt.shape[1] + completion.shape[1]
    return batch.completion_mask.shape[1]


def micro_batch_count(micro_batches: int | TokenBudget, batch: Any, devices: int = 1) -> int:
    """K for ``batch`` (static: from its shape): the int itself, or the budget's choice."""
    if not isinstance(micro_batches, TokenBudget):
        return micro_batches
    rows = jax.tree.leaves(batch)[0].shape[0]
    return micro_batches.micro_batches(rows, row_length(batch), devices)


def packed_micro_batch_count(plan: Any, micro_batches: int | TokenBudget, padded: int) -> int:
    """The micro-batches a forward runs: a packed batch's plan decides (its leading axis, one
    plan a micro-batch: a token budget counts packed rows, ``train.packing.plan_by_budget``);
    a padded batch runs ``padded``, its own count. A plan made for a fixed count other than
    ``micro_batches`` is refused (static shapes: at trace time)."""
    if plan is None:
        return padded
    count = plan.source.shape[0]
    if not isinstance(micro_batches, TokenBudget) and count != micro_batches:
        raise ValueError(
            f"the packing plan has {count} micro-batch plans; the step runs {micro_batches} "
            "micro-batches (plan with the step's micro-batch count)"
        )
    return count


def merge_micro_batches(stacked: PyTree) -> PyTree:
    """Inverse of :func:`split_micro_batches`: ``[K, B/K, ...]`` leaves → ``[B, ...]``."""

    def merge(x):
        return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])

    return jax.tree.map(merge, stacked)


# loss_fn(params, batch, totals) -> (loss, metrics); totals is None with accumulate="mean".
LossFn = Callable[[PyTree, Any, Totals | None], tuple[Array, dict[str, Array]]]
Step = Callable[[TrainState, Any], tuple[TrainState, dict[str, Array]]]


def split_micro_batches(batch: PyTree, micro_batches: int) -> PyTree:
    """``[B, ...]`` leaves → ``[K, B/K, ...]``; micro-batch k holds rows ``k, k+K, k+2K, ...``.

    Strided rows keep every micro-batch spread over all batch shards (a contiguous split would
    put a whole micro-batch on a few devices).
    """
    leaves = jax.tree.leaves(batch)
    rows = leaves[0].shape[0]
    if rows % micro_batches:
        raise ValueError(f"micro_batches={micro_batches} does not divide the batch size B={rows}")

    def split(x):
        return jnp.swapaxes(x.reshape(rows // micro_batches, micro_batches, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def _reduce_summed_metric(name: str, values: Array) -> Array:
    if name.endswith("_max"):
        return jnp.max(values)
    if name.endswith("_min"):
        return jnp.min(values)
    return jnp.sum(values)


def _mesh_of(shardings: PyTree):
    return jax.tree.leaves(shardings)[0].mesh


def _is_explicit(mesh) -> bool:
    return mesh is not None and any(t == AxisType.Explicit for t in mesh.axis_types)


def totals_of(completion_mask: Array) -> Totals:
    """The :class:`Totals` of a ``[B, T]`` completion mask."""
    num_tokens, num_seqs = aggregation.normalisers(completion_mask)
    return Totals(jnp.asarray(num_tokens, jnp.float32), jnp.asarray(num_seqs, jnp.float32))


def make_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    micro_batches: int | TokenBudget = 1,
    accumulate: str = "sum",
    param_shardings: PyTree | None = None,
    loss_takes_key: bool = False,
    adaptive_entropy: Any = None,
) -> Step:
    """A pure optimizer step ``(state, batch) -> (state, metrics)`` around any loss.

    Args:
      loss_fn: ``(params, batch, totals) -> (loss, metrics)``, differentiable in ``params``;
        ``totals`` is the whole batch's :class:`Totals` (``accumulate="sum"``) or None.
      optimizer: the optax transformation whose state is ``TrainState.opt_state``.
      micro_batches: K; the batch is processed in K strided micro-batches under ``lax.scan``.
        A :class:`TokenBudget` picks K from each batch's shape (and the batch shards of
        ``param_shardings``' mesh); the metrics then add ``micro_batches``.
      accumulate: ``"sum"`` (global normalisers; ``batch.completion_mask`` required) or
        ``"mean"`` (average of the micro-batch gradients).
      param_shardings: the parameters' ``NamedSharding``s. On a mesh with explicit axes the
        gradient computation runs with automatic sharding propagation and its gradient is
        returned in these shardings.
      loss_takes_key: call ``loss_fn(params, batch, totals, key)`` with a PRNG key for this
        step and micro-batch (from ``state.rng``; e.g. LoRA dropout), reproducible on resume.

    A batch with a ``packing`` plan (``train.packing.plan_micro_batches``: leaves ``[K, ...]``,
    one plan a micro-batch) hands each micro-batch its own plan in the same field.

    Returns:
      The step ``(state, batch, frozen=None) -> (state, metrics)``; its metrics add
      ``grad_norm`` (and ``num_tokens`` with ``accumulate="sum"``). ``frozen``: parameters the
      loss reads but nothing updates (a LoRA run's base): the loss sees
      ``merge_trees(frozen, state.params)``, the gradient covers ``state.params`` only.
    """
    micro_batches_arg = micro_batches
    budget = micro_batches if isinstance(micro_batches, TokenBudget) else None
    if budget is None and not isinstance(micro_batches, int):
        raise ValueError(f"micro_batches must be an int or a TokenBudget, got {micro_batches!r}")
    if budget is None and micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    if accumulate not in ACCUMULATE:
        raise ValueError(f"accumulate must be one of {ACCUMULATE}, got {accumulate!r}")
    batch_devices = (
        1 if param_shardings is None else parallel.batch_shards(_mesh_of(param_shardings))
    )

    def count(batch) -> int:
        return micro_batch_count(micro_batches, batch, batch_devices)

    def gradients(params, batch, totals, frozen, key):
        def loss(p, b, t, k):
            # A frozen tree is read too; only ``params`` are differentiated.
            p = p if frozen is None else merge_trees(frozen, p)
            return loss_fn(p, b, t, k) if loss_takes_key else loss_fn(p, b, t)

        grad_fn = jax.grad(loss, has_aux=True)
        plan = getattr(batch, "packing", None)  # [K, ...] leaves: one plan a micro-batch
        if plan is not None:
            batch = batch._replace(packing=None)
        micro_batches = packed_micro_batch_count(plan, micro_batches_arg, count(batch))
        if micro_batches == 1:
            if plan is not None:
                batch = batch._replace(packing=micro_plan(plan, 0))
            return grad_fn(params, batch, totals, key)

        def body(acc, xs):
            micro, index, micro_packing = xs
            if micro_packing is not None:
                micro = micro._replace(packing=micro_packing)
            grads, metrics = grad_fn(params, micro, totals, jax.random.fold_in(key, index))
            return jax.tree.map(jnp.add, acc, grads), metrics

        zeros = jax.tree.map(jnp.zeros_like, params)
        parts = (split_micro_batches(batch, micro_batches), jnp.arange(micro_batches), plan)
        grads, stacked = jax.lax.scan(body, zeros, parts)
        if accumulate == "mean":
            grads = jax.tree.map(lambda g: g / micro_batches, grads)
            return grads, {k: jnp.mean(v, axis=0) for k, v in stacked.items()}
        return grads, {k: _reduce_summed_metric(k, v) for k, v in stacked.items()}

    def step(state: TrainState, batch, frozen: PyTree | None = None):
        totals = totals_of(batch.completion_mask) if accumulate == "sum" else None
        if adaptive_entropy is not None:  # an Objective with entropy_target: its coefficient
            coef = entropy_ctl.applied_coef(adaptive_entropy, state.entropy_control)
            totals = totals._replace(entropy_coef=coef)
        params = state.params
        rng, key = jax.random.split(state.rng)
        if param_shardings is not None and _is_explicit(_mesh_of(param_shardings)):
            specs = jax.tree.map(lambda s: s.spec, param_shardings)
            # Inside, sharding propagates automatically (FSDP gathers need no annotations); the
            # gradient comes back typed like the parameters, the metrics replicated.
            auto = jax.sharding.auto_axes(gradients, out_sharding=(specs, PartitionSpec()))
            grads, metrics = auto(params, batch, totals, frozen, key)
        else:
            grads, metrics = gradients(params, batch, totals, frozen, key)
        updates, opt_state = optimizer.update(grads, state.opt_state, params)
        metrics = dict(metrics)
        metrics["grad_norm"] = optax.tree.norm(grads)
        if budget is not None:
            plan = getattr(batch, "packing", None)
            used = packed_micro_batch_count(plan, micro_batches_arg, count(batch))
            metrics["micro_batches"] = jnp.asarray(used, jnp.int32)
        if totals is not None:
            metrics["num_tokens"] = totals.num_tokens
        control = state.entropy_control
        if adaptive_entropy is not None:
            control = entropy_ctl.update_control(adaptive_entropy, control, metrics)
        new_state = TrainState(
            step=state.step + 1,
            params=optax.apply_updates(params, updates),
            opt_state=opt_state,
            rng=rng,
            entropy_control=control,
        )
        return new_state, metrics

    return step


def jit_step(
    step: Step,
    state_shardings: TrainState,
    batch_shardings: PyTree | None = None,
    *,
    frozen: PyTree | None = None,
    frozen_shardings: PyTree | None = None,
):
    """Compiles a step with explicit shardings, donating the incoming state.

    Args:
      step: from :func:`make_step`.
      state_shardings: ``TrainState`` of ``NamedSharding`` (from ``create_train_state``).
      batch_shardings: the batch's ``NamedSharding``s, or ``None`` to take the shardings of
        the (already sharded) batch arrays.
      frozen: the step's frozen parameters (a LoRA run's base), passed to every call (never
        donated); with ``frozen_shardings``, their ``NamedSharding``s.

    Returns:
      The jitted ``(state, batch) -> (state, metrics)``; metrics come back replicated.
    """
    mesh = _mesh_of(state_shardings)
    replicated = NamedSharding(mesh, PartitionSpec())

    def step_on_mesh(state, batch, *frozen):
        # The model's activation constraints resolve against the state's mesh.
        with parallel.mesh_context(mesh):
            return step(state, batch, *frozen)

    has_frozen = frozen is not None or frozen_shardings is not None
    jitted = jax.jit(
        step_on_mesh,
        in_shardings=(state_shardings, batch_shardings, *([frozen_shardings] * has_frozen)),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )
    return _WithFrozen(jitted, frozen) if has_frozen else jitted


class _WithFrozen:
    """A jitted ``(state, batch, frozen)`` step called (and lowered) as ``(state, batch)``."""

    def __init__(self, jitted, frozen):
        self.jitted, self.frozen = jitted, frozen

    def __call__(self, state, batch):
        return self.jitted(state, batch, self.frozen)

    def lower(self, state, batch):
        return self.jitted.lower(state, batch, self.frozen)


def merge_trees(frozen: PyTree, params: PyTree) -> PyTree:
    """The nested dict holding both trees' leaves (``params`` wins where both have a key)."""
    if not isinstance(frozen, dict) or not isinstance(params, dict):
        return params
    out = dict(frozen)
    for key, value in params.items():
        out[key] = merge_trees(frozen[key], value) if key in frozen else value
    return out
