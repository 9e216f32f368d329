"""Mixture-of-experts feed-forward: top-k routing, dropless grouped experts, router losses.

A sparse layer replaces the SwiGLU MLP by ``E`` expert MLPs and a router ``W_r: [D, E]``
(Shazeer et al. 2017; Switch, Fedus et al. 2021; Mixtral, Jiang et al. 2024; Qwen-MoE)::

    p_t = softmax(h_t W_r)                      router probabilities, f32
    (w_t, e_t) = top_k(p_t)                     k weights and expert ids per token
    w_t <- w_t / sum(w_t)                       when renormalised (Mixtral, Qwen3-MoE)
    y_t = sum_j w_tj · SwiGLU_{e_tj}(h_t)       [+ sigmoid(h_t g) · SwiGLU_shared(h_t), Qwen2-MoE]

Routing is dropless: every token reaches all of its k experts (no capacity factor, no token
dropped or padded). The ``T·k`` (token, expert) assignments are sorted by expert and the expert
MLPs run as three grouped matmuls over the sorted rows (``jax.lax.ragged_dot``: one GEMM whose
rows are split into ``E`` consecutive groups, group ``e`` multiplied by expert ``e``'s weight),
then the rows are put back in token order and mixed with their routing weights. The router's
logits and softmax are f32 whatever the compute dtype, so the expert choice does not flip with
bf16 rounding.

Shapes: T tokens (``B·S`` flattened), D hidden, E experts, k experts per token, F expert width.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm.models.matmul import dense
from jaxrl_llm.parallel.rules import ACTIVATION_RULES, with_logical_constraint

Array = jax.Array


class SharedExpert(NamedTuple):
    """Qwen2-MoE's always-on expert: ``sigmoid(h g) · W_down(silu(h W_gate) * h W_up)``."""

    w_gate: Array  # [D, F_s]
    w_up: Array  # [D, F_s]
    w_down: Array  # [F_s, D]
    gate: Array  # [D, 1]


def router_logits(hidden: Array, router: Array) -> Array:
    """``z = h W_r`` in f32 whatever the dtypes of ``h`` and ``W_r``: ``[..., D] -> [..., E]``.

    Both operands are upcast before the product (not just accumulated in f32), so the logits of
    a bf16-compute model are those of its bf16 activations under the f32 router weight.
    """
    return jnp.matmul(
        hidden.astype(jnp.float32),
        router.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )


def route(logits: Array, *, top_k: int, normalize: bool) -> tuple[Array, Array]:
    """Top-k routing: ``p = softmax(z)``, ``(w, e) = top_k(p)``, ``w /= sum(w)`` if normalised.

    With ``normalize`` the weights are the softmax over the k chosen logits (Mixtral's form).

    Args:
      logits: ``[T, E]`` router logits (any float dtype; computed in f32).
      top_k: k, the experts per token.
      normalize: renormalise the k weights to sum to 1 (HF ``norm_topk_prob``).

    Returns:
      ``(weights [T, k] f32, experts [T, k] int32)``, experts in decreasing probability.
    """
    if logits.ndim != 2:
        raise ValueError(f"route: logits must be [T, E], got shape {logits.shape}")
    if not 1 <= top_k <= logits.shape[-1]:
        raise ValueError(f"route: top_k={top_k} must be in [1, E={logits.shape[-1]}]")
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def grouped_experts(
    x: Array, weights: Array, experts: Array, w_gate: Array, w_up: Array, w_down: Array
) -> Array:
    """``y_t = sum_j w_tj · W_down[e_tj]^T (silu(x_t W_gate[e_tj]) * x_t W_up[e_tj])``, dropless.

    The ``T·k`` assignments are sorted by expert (stable, so each expert's rows stay in token
    order), the three products are ``jax.lax.ragged_dot`` over the sorted rows with group sizes
    the experts' counts, and the rows are gathered back to ``[T, k, D]`` before the weighted
    sum (in f32).

    Args:
      x: ``[T, D]`` normalised hidden states.
      weights: ``[T, k]`` routing weights (from ``route``).
      experts: ``[T, k]`` int32 expert ids.
      w_gate, w_up: ``[E, D, F]`` expert weights.
      w_down: ``[E, F, D]``.

    Returns:
      ``[T, D]`` in ``x.dtype``.
    """
    tokens, top_k = experts.shape
    num_experts = w_gate.shape[0]
    if x.shape[0] != tokens or weights.shape != experts.shape:
        raise ValueError(
            f"grouped_experts: x {x.shape}, weights {weights.shape} and experts {experts.shape} "
            "must agree on T (and weights/experts on k)"
        )
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignment index, sorted by expert
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    rows = x[order // top_k]
    gate = jax.lax.ragged_dot(rows, w_gate, group_sizes)
    up = jax.lax.ragged_dot(rows, w_up, group_sizes)
    out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, group_sizes)
    # Row r of ``out`` is assignment order[r]: scatter the permutation's inverse, then gather.
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    out = out[inverse].reshape(tokens, top_k, -1)
    mixed = jnp.einsum("tkd,tk->td", out.astype(jnp.float32), weights.astype(jnp.float32))
    return mixed.astype(x.dtype)


def sparse_mlp(
    h: Array,
    router: Array,
    w_gate: Array,
    w_up: Array,
    w_down: Array,
    *,
    top_k: int,
    normalize: bool,
    shared: SharedExpert | None = None,
) -> tuple[Array, Array]:
    """A sparse layer's MLP (see the module docstring) on ``h: [B, S, D]``.

    ``y = sum_j w_j · SwiGLU_{e_j}(h) [+ sigmoid(h g) · SwiGLU_s(h)]`` with ``(w, e)`` the
    top-k routing of ``z = h W_r`` (f32), dropless over the ``B·S`` tokens.

    Args:
      h: ``[B, S, D]`` normalised hidden states (compute dtype).
      router: ``W_r [D, E]`` (its stored dtype: used in f32).
      w_gate, w_up: ``[E, D, F]``; w_down: ``[E, F, D]``.
      top_k: k; normalize: renormalise the k weights (``norm_topk_prob``).
      shared: the shared expert (Qwen2-MoE), or None.

    Returns:
      ``(y [B, S, D] in h.dtype, router logits z [B, S, E] f32)``.
    """
    batch, seq, d = h.shape
    logits = router_logits(h, router)
    weights, experts = route(logits.reshape(batch * seq, -1), top_k=top_k, normalize=normalize)
    tokens = h.reshape(batch * seq, d)
    out = grouped_experts(tokens, weights, experts, w_gate, w_up, w_down).reshape(h.shape)
    if shared is not None:
        gate = _constrain(jax.nn.silu(dense(h, shared.w_gate)), "batch", None, "mlp")
        up = _constrain(dense(h, shared.w_up), "batch", None, "mlp")
        expert = dense(gate * up, shared.w_down)
        out = out + jax.nn.sigmoid(dense(h, shared.gate)) * expert
    return out, logits


def _constrain(x: Array, *axes: str | None) -> Array:
    return with_logical_constraint(x, axes, ACTIVATION_RULES)


def _masked_logits(router_logits: Array, mask: Array | None) -> tuple[Array, Array]:
    """``([N, E] f32 logits, [N] f32 weights)`` over every layer and token, mask broadcast."""
    logits = router_logits.astype(jnp.float32)
    if mask is None:
        weight = jnp.ones(logits.shape[:-1], jnp.float32)
    else:
        mask = jnp.asarray(mask)
        batch_shape = logits.shape[-1 - mask.ndim : -1]
        if mask.shape != batch_shape:
            raise ValueError(
                f"mask {mask.shape} must match the router logits' token dims {batch_shape} "
                f"(router_logits {logits.shape})"
            )
        weight = jnp.broadcast_to(mask.astype(jnp.float32), logits.shape[:-1])
    return logits.reshape(-1, logits.shape[-1]), weight.reshape(-1)


def load_balancing_loss(router_logits: Array, mask: Array | None = None, *, top_k: int) -> Array:
    """Switch / Mixtral load-balancing loss ``E · sum_e f_e P_e`` over all layers and tokens.

    ``f_e = (1/N) sum_n [e in top_k(p_n)]`` is the fraction of routing assignments to expert e
    (summing to k), ``P_e = (1/N) sum_n p_ne`` its mean router probability, over the N real
    (layer, token) pairs; minimal (= k) when both are uniform. Only ``P`` carries a gradient.
    Fedus et al. 2021 (Switch Transformers) eqs. 4-6 with top-k counts, exactly as transformers'
    ``load_balancing_loss_func`` (which a HF MoE model adds as ``router_aux_loss_coef · loss``).

    Args:
      router_logits: ``[L, B, S, E]`` (``forward(..., return_router_logits=True)``) or any
        ``[..., E]``.
      mask: ``[B, S]`` (or the logits' token dims), 1 on real tokens; None = all real.
      top_k: k of the model (``config.num_experts_per_tok``).

    Returns:
      A f32 scalar.
    """
    logits, weight = _masked_logits(router_logits, mask)
    num_experts = logits.shape[-1]
    probs = jax.nn.softmax(logits, axis=-1)
    _, chosen = jax.lax.top_k(probs, top_k)
    counts = jnp.sum(jax.nn.one_hot(chosen, num_experts, dtype=jnp.float32), axis=1)  # [N, E]
    total = jnp.maximum(jnp.sum(weight), 1.0)
    fraction = jnp.sum(counts * weight[:, None], axis=0) / total
    mean_prob = jnp.sum(probs * weight[:, None], axis=0) / total
    return num_experts * jnp.sum(jax.lax.stop_gradient(fraction) * mean_prob)


def router_z_loss(router_logits: Array, mask: Array | None = None) -> Array:
    """Router z-loss ``(1/N) sum_n (log sum_e exp z_ne)^2`` over the real (layer, token) pairs.

    Keeps the router logits small (ST-MoE, Zoph et al. 2022, eq. 5), so their f32 softmax stays
    well conditioned; usually weighted by about 1e-3.

    Args:
      router_logits: ``[L, B, S, E]`` or any ``[..., E]``.
      mask: ``[B, S]`` (or the logits' token dims), 1 on real tokens; None = all real.

    Returns:
      A f32 scalar.
    """
    logits, weight = _masked_logits(router_logits, mask)
    z = jax.nn.logsumexp(logits, axis=-1)
    return jnp.sum(weight * jnp.square(z)) / jnp.maximum(jnp.sum(weight), 1.0)


__all__ = [
    "SharedExpert",
    "grouped_experts",
    "load_balancing_loss",
    "route",
    "router_logits",
    "router_z_loss",
    "sparse_mlp",
]
