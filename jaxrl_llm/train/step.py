"""The jitted policy update: log-probs → objective → gradient → optax, with micro-batching.

``make_policy_step`` builds a pure ``(state, batch) -> (state, metrics)``; ``jit_step`` compiles it
with explicit ``in_shardings`` / ``out_shardings`` and donates the old state. Micro-batches are a
``lax.scan`` inside the step that passes the whole batch's token and sequence counts to every
micro-batch, so the accumulated gradient equals the full-batch gradient for every aggregation mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxrl_llm import aggregation, logprobs, objectives
from jaxrl_llm.train.state import TrainState
from jaxrl_llm.types import RolloutBatch

Array = jax.Array
PyTree = Any
Step = Callable[[TrainState, RolloutBatch], tuple[TrainState, dict[str, Array]]]

_MODEL_FIELDS = ("prompt_tokens", "prompt_mask", "completion_tokens")


def _reduce_metric(name: str, values: Array) -> Array:
    # Metrics are normalised by the global counts, so micro-batch values sum to the batch value.
    if name.endswith("_max"):
        return jnp.max(values)
    if name.endswith("_min"):
        return jnp.min(values)
    return jnp.sum(values)


def split_micro_batches(batch: RolloutBatch, micro_batches: int) -> RolloutBatch:
    """``[B, ...]`` leaves → ``[K, B/K, ...]``; micro-batch k holds rows ``k, k+K, k+2K, ...``.

    Strided rows keep every micro-batch spread over all batch shards (a contiguous split would put
    a whole micro-batch on a few devices).
    """
    batch_size = batch.completion_mask.shape[0]
    if batch_size % micro_batches:
        raise ValueError(
            f"micro_batches={micro_batches} does not divide the batch size B={batch_size}"
        )

    def split(x):
        x = x.reshape(batch_size // micro_batches, micro_batches, *x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    return jax.tree.map(split, batch)


def _mesh_of(shardings: PyTree):
    return jax.tree.leaves(shardings)[0].mesh


def _is_explicit(mesh) -> bool:
    return mesh is not None and any(t == AxisType.Explicit for t in mesh.axis_types)


LossFn = Callable[[PyTree, RolloutBatch], tuple[Array, dict[str, Array]]]


def make_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    micro_batches: int = 1,
    param_shardings: PyTree | None = None,
) -> Step:
    """A pure optimizer step around any ``loss_fn(params, batch) -> (loss, metrics)``.

    The step sets ``batch.num_tokens`` / ``batch.num_seqs`` to the whole batch's counts before
    calling ``loss_fn`` on each of the K micro-batches, so a loss that normalises by them (every
    objective does) accumulates exactly the full-batch gradient. Metrics are summed over
    micro-batches (``*_min`` / ``*_max`` reduce by min / max).

    Args:
      loss_fn: differentiable in its first argument.
      optimizer: the optax transformation whose state is in ``TrainState.opt_state``.
      micro_batches: K; the batch is processed in K strided micro-batches under ``lax.scan``.
      param_shardings: the parameters' ``NamedSharding``s. On a mesh with explicit axes the
        gradient computation runs with automatic sharding propagation and its gradient is
        returned in these shardings.

    Returns:
      ``step(state, batch) -> (state, metrics)``.
    """
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    grad_fn = jax.grad(loss_fn, has_aux=True)

    def gradients(params, batch: RolloutBatch):
        if micro_batches == 1:
            return grad_fn(params, batch)
        # The global normalisers are scalars shared by every micro-batch, not scanned over.
        counts = {"num_tokens": batch.num_tokens, "num_seqs": batch.num_seqs}
        micro = split_micro_batches(batch._replace(num_tokens=None, num_seqs=None), micro_batches)

        def body(acc, mb):
            grads, metrics = grad_fn(params, mb._replace(**counts))
            return jax.tree.map(jnp.add, acc, grads), metrics

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, stacked = jax.lax.scan(body, zeros, micro)
        return grads, {k: _reduce_metric(k, v) for k, v in stacked.items()}

    def step(state: TrainState, batch: RolloutBatch):
        for field in _MODEL_FIELDS:
            if getattr(batch, field) is None:
                raise ValueError(f"the step needs batch.{field}")
        num_tokens, num_seqs = aggregation.normalisers(batch.completion_mask)
        batch = batch._replace(num_tokens=num_tokens, num_seqs=num_seqs)
        params = state.params
        if param_shardings is not None and _is_explicit(_mesh_of(param_shardings)):
            specs = jax.tree.map(lambda s: s.spec, param_shardings)
            # Inside, sharding propagates automatically (FSDP gathers need no annotations); the
            # gradient comes back typed like the parameters, the metrics replicated.
            auto = jax.sharding.auto_axes(gradients, out_sharding=(specs, PartitionSpec()))
            grads, metrics = auto(params, batch)
        else:
            grads, metrics = gradients(params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, params)
        new_params = optax.apply_updates(params, updates)
        metrics = dict(metrics)
        metrics["grad_norm"] = optax.tree.norm(grads)
        metrics["num_tokens"] = jnp.asarray(num_tokens, jnp.float32)
        rng, _ = jax.random.split(state.rng)
        new_state = TrainState(step=state.step + 1, params=new_params, opt_state=opt_state, rng=rng)
        return new_state, metrics

    return step


def _logprobs(model_config, params, batch: RolloutBatch, **kwargs):
    return logprobs.completion_logprobs(
        params,
        model_config,
        batch.prompt_tokens,
        batch.prompt_mask,
        batch.completion_tokens,
        batch.completion_mask,
        **kwargs,
    )


def make_policy_loss_fn(
    model_config,
    objective: objectives.Objective,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    remat: str = "none",
    compute_entropy: bool = True,
) -> LossFn:
    """``(params, batch) -> (loss, metrics)``: log-probs → ``objectives.policy_loss``.

    See :func:`make_policy_step` for the arguments.
    """
    need_entropy = compute_entropy or objective.entropy_coef > 0

    def loss_fn(params, batch: RolloutBatch):
        out = _logprobs(
            model_config,
            params,
            batch,
            temperature=temperature,
            chunk_size=chunk_size,
            remat=remat,
            return_entropy=need_entropy,
        )
        token_logprobs, entropy = out if need_entropy else (out, None)
        result = objectives.policy_loss(objective, token_logprobs, batch, entropy=entropy)
        return result.loss, result.metrics

    return loss_fn


def make_policy_step(
    model_config,
    objective: objectives.Objective,
    optimizer: optax.GradientTransformation,
    *,
    micro_batches: int = 1,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    remat: str = "none",
    compute_entropy: bool = True,
    param_shardings: PyTree | None = None,
) -> Step:
    """A pure policy-update step: log-probs → ``objectives.policy_loss`` → gradient → optax.

    Args:
      model_config: the policy's ``ModelConfig`` (static).
      objective: the ``Objective`` (static).
      optimizer: the optax transformation whose state is in ``TrainState.opt_state``.
      micro_batches: gradient-accumulation micro-batches (see :func:`make_step`).
      temperature: sampling temperature, applied to the recomputed log-probs (so the ratio
        starts at 1 when the policy has not moved).
      chunk_size: sequence chunk of the log-prob computation (memory ``O(B·chunk·V)``).
      remat: the model's remat policy: ``"none"`` or ``"layer"`` (recompute each layer in the
        backward pass instead of keeping its activations).
      compute_entropy: also compute the per-token entropy (metric; needed for an entropy bonus).
      param_shardings: see :func:`make_step`.

    Returns:
      ``step(state, batch) -> (state, metrics)``; ``batch`` is a ``RolloutBatch`` with prompt and
      completion tokens, masks, ``old_logprobs``, ``advantages`` and, when the objective needs
      them, ``ref_logprobs``.
    """
    loss_fn = make_policy_loss_fn(
        model_config,
        objective,
        temperature=temperature,
        chunk_size=chunk_size,
        remat=remat,
        compute_entropy=compute_entropy,
    )
    return make_step(
        loss_fn, optimizer, micro_batches=micro_batches, param_shardings=param_shardings
    )


def make_sft_step(
    model_config,
    optimizer: optax.GradientTransformation,
    *,
    micro_batches: int = 1,
    chunk_size: int | None = None,
    remat: str = "none",
    param_shardings: PyTree | None = None,
) -> Step:
    """A supervised step: token-mean NLL ``−Σ m·log π(y_t) / N_tok`` of the completions.

    ``batch`` needs prompt / completion tokens and masks only.
    """

    def loss_fn(params, batch: RolloutBatch):
        token_logprobs = _logprobs(model_config, params, batch, chunk_size=chunk_size, remat=remat)
        nll = aggregation.aggregate(
            -token_logprobs, batch.completion_mask, "token-mean", num_tokens=batch.num_tokens
        )
        return nll, {"nll": nll}

    return make_step(
        loss_fn, optimizer, micro_batches=micro_batches, param_shardings=param_shardings
    )


def jit_step(step: Step, state_shardings: TrainState, batch_shardings: PyTree | None = None):
    """Compiles a step with explicit shardings, donating the incoming state.

    Args:
      step: from :func:`make_policy_step`.
      state_shardings: ``TrainState`` of ``NamedSharding`` (from ``create_train_state``).
      batch_shardings: ``RolloutBatch`` of ``NamedSharding`` (from ``batch_shardings``), or
        ``None`` to take the shardings of the (already sharded) batch arrays.

    Returns:
      The jitted step; metrics come back replicated.
    """
    replicated = NamedSharding(_mesh_of(state_shardings), PartitionSpec())
    return jax.jit(
        step,
        in_shardings=(state_shardings, batch_shardings),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )


def make_logprob_fn(
    model_config,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    param_shardings: PyTree | None = None,
):
    """A jitted ``(params, batch) -> [B, T]`` for old-policy or reference log-probs.

    Frozen parameters (a reference model) are passed in with their own shardings; the output
    is sharded like the batch.
    """

    def fn(params, batch: RolloutBatch):
        return _logprobs(
            model_config,
            jax.lax.stop_gradient(params),
            batch,
            temperature=temperature,
            chunk_size=chunk_size,
        )

    if param_shardings is None:
        return jax.jit(fn)
    return jax.jit(fn, in_shardings=(param_shardings, None))
