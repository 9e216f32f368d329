"""Mixture-of-experts feed-forward: top-k routing, dropless grouped experts, router losses.

A sparse layer replaces the SwiGLU MLP by ``E`` expert MLPs and a router ``W_r: [D, E]``
(Shazeer et al. 2017; Switch, Fedus et al. 2021; Mixtral, Jiang et al. 2024; Qwen-MoE)::

    p_t = softmax(h_t W_r [+ b_r])              router probabilities, f32 (bias: gpt-oss)
    (w_t, e_t) = top_k(p_t)                     k weights and expert ids per token
    w_t <- w_t / sum(w_t)                       when renormalised (Mixtral, Qwen3-MoE, gpt-oss)
    y_t = sum_j w_tj · SwiGLU_{e_tj}(h_t)       [+ sigmoid(h_t g) · SwiGLU_shared(h_t), Qwen2-MoE]

gpt-oss's experts carry biases and a clamped SwiGLU (``ExpertBiases``, ``ClampedSwiGLU``)::

    g = min(h W_gate + b_gate, l),  u = clip(h W_up + b_up, -l, l)
    SwiGLU_e(h) = W_down^T ((u + 1) · g · sigmoid(a g)) + b_down

Routing is dropless: every token reaches all of its k experts (no capacity factor, no token
dropped or padded). The ``T·k`` (token, expert) assignments are sorted by expert and the expert
MLPs run as three grouped matmuls over the sorted rows (``jax.lax.ragged_dot``: one GEMM whose
rows are split into ``E`` consecutive groups, group ``e`` multiplied by expert ``e``'s weight),
then the rows are put back in token order and mixed with their routing weights (on CPU, where
XLA expands ``ragged_dot`` into a dense product over every expert, ``grouped_matmul`` runs a
loop over row tiles instead: ``tiled_grouped_matmul``). The router's
logits and softmax are f32 whatever the compute dtype, so the expert choice does not flip with
bf16 rounding.

Expert parallelism. On a mesh with an ``expert`` axis of size ``P > 1`` (``mesh.expert``;
``parallel.make_mesh(..., expert=P)``) each device holds ``E / P`` whole experts (the logical
``expert`` axis of the weights is split over it, in storage and in use) and its own
``T / (data·fsdp·P)`` tokens (the expert axis is one more data axis for the batch). The router
logits are computed as above (f32, batch-sharded, returned for the auxiliary losses); routing,
the expert MLPs and the combine run inside ``jax.shard_map`` (``expert_parallel_mlp``), on each
device's own tokens::

    route the local T_l tokens: top-k of the f32 softmax, renormalised
    sort the local T_l·k assignments by expert           (stable: token order within an expert)
    chunk j = the rows for shard j's experts -> [P, C, D] (C = T_l·k slots, zero-padded)
    all_to_all over "expert"                             (row chunks and their local expert ids)
    sort the P·C received rows by local expert, three ragged_dot over the E/P local experts
    unsort, all_to_all back, gather each assignment's row, unsort, combine in f32
    psum over the axes that split the experts' width F (tensor), as a Megatron MLP

The exchange is a dense ``all_to_all`` with a static per-destination capacity of
``C = T_l·k`` rows, every local assignment: dropless by construction (no capacity factor, no
token dropped), at the price of ``P×`` padding in the exchange buffers and in the rows the
grouped matmul is given (rows past the real ones are zeros and are never read back).
``jax.lax.ragged_all_to_all``, which would send only the real rows, is not implemented by
XLA:CPU (jax 0.10.2: ``UNIMPLEMENTED: HLO opcode ragged-all-to-all``), where the tests run.
Without an expert axis (or with ``P = 1``) the layer is exactly the single-program path above.

Shapes: T tokens (``B·S`` flattened), D hidden, E experts, k experts per token, F expert width,
P the expert axis's size.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec

from jaxrl_llm.models.matmul import dense
from jaxrl_llm.parallel.mesh import EXPERT_AXIS
from jaxrl_llm.parallel.rules import (
    ACTIVATION_RULES,
    logical_to_spec,
    mesh_axes_of,
    spec_entry,
    spec_for_mesh,
    with_logical_constraint,
)

Array = jax.Array


class ExpertBiases(NamedTuple):
    """The routed experts' biases (gpt-oss): added to each expert's gate, up and down
    projections."""

    gate: Array  # [E, F]
    up: Array  # [E, F]
    down: Array  # [E, D]


class ClampedSwiGLU(NamedTuple):
    """gpt-oss's expert activation ``(clip(u, -l, l) + 1) · g' · sigmoid(a g')`` with
    ``g' = min(g, l)`` (transformers' ``GptOssExperts._apply_gate``), in place of
    ``silu(g) · u``. Static (hashable) parameters."""

    alpha: float = 1.702  # a, the sigmoid's gain (swiglu_alpha)
    limit: float = 7.0  # l, the clamp (swiglu_limit)


def gated_activation(gate: Array, up: Array, clamp: ClampedSwiGLU | None = None) -> Array:
    """The experts' gated activation: ``silu(g) · u`` (SwiGLU, Shazeer 2020), or with ``clamp``
    (gpt-oss) ``(clip(u, -l, l) + 1) · g' · sigmoid(a g')``, ``g' = min(g, l)``.

    Args:
      gate, up: ``[..., F]`` the gate and up projections (biases included).
      clamp: gpt-oss's ``ClampedSwiGLU``, or None.

    Returns:
      ``[..., F]`` in the inputs' dtype.
    """
    if clamp is None:
        return jax.nn.silu(gate) * up
    gate = jnp.minimum(gate, clamp.limit)
    up = jnp.clip(up, -clamp.limit, clamp.limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * clamp.alpha))


class SharedExpert(NamedTuple):
    """Qwen2-MoE's always-on expert: ``sigmoid(h g) · W_down(silu(h W_gate) * h W_up)``."""

    w_gate: Array  # [D, F_s]
    w_up: Array  # [D, F_s]
    w_down: Array  # [F_s, D]
    gate: Array  # [D, 1]


def router_logits(hidden: Array, router: Array, bias: Array | None = None) -> Array:
    """``z = h W_r [+ b_r]`` in f32 whatever the dtypes of ``h``, ``W_r`` and ``b_r``:
    ``[..., D] -> [..., E]`` (the bias ``[E]``: gpt-oss's router).

    The operands are upcast before the product (not just accumulated in f32), so the logits of
    a bf16-compute model are those of its bf16 activations under the f32 router weight.
    """
    logits = jnp.matmul(
        hidden.astype(jnp.float32),
        router.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    return logits if bias is None else logits + bias.astype(jnp.float32)


def route(logits: Array, *, top_k: int, normalize: bool) -> tuple[Array, Array]:
    """Top-k routing: ``p = softmax(z)``, ``(w, e) = top_k(p)``, ``w /= sum(w)`` if normalised.

    With ``normalize`` the weights are the softmax over the k chosen logits, computed that way:
    ``(z_top, e) = top_k(z)``, ``w = softmax(z_top)`` (Mixtral's form, and gpt-oss's
    ``GptOssTopKRouter`` order; the same as renormalising the chosen probabilities).

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
    logits = logits.astype(jnp.float32)
    if normalize:
        chosen, experts = jax.lax.top_k(logits, top_k)
        return jax.nn.softmax(chosen, axis=-1), experts.astype(jnp.int32)
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    return weights, experts.astype(jnp.int32)


def replay_route(logits: Array, experts: Array, *, normalize: bool) -> tuple[Array, Array]:
    """Routing replay (R3, Ma et al. 2025): the gate weights of given experts from own logits.

    ``w = softmax(z[e])`` with ``normalize`` (the softmax over the k given logits, ``route``'s
    form), else ``w = softmax(z)[e]``: the weights ``route`` gives when ``e`` is its own top-k
    (bit for bit), and a gradient that reaches the router through ``z``. A token whose ids
    hold a negative one (``-1``: a padding position of a recorded routing) routes freely
    (``route``'s own top-k and weights).

    Args:
      logits: ``[T, E]`` router logits (computed in f32).
      experts: ``[T, k]`` int expert ids in ``[0, E)`` (or negative: route freely).
      normalize: as ``route``.

    Returns:
      ``(weights [T, k] f32, experts [T, k] int32)``: the experts used (the given ones, or
      the free top-k on tokens with a negative id).
    """
    if logits.ndim != 2 or experts.ndim != 2 or experts.shape[0] != logits.shape[0]:
        raise ValueError(
            f"replay_route: logits must be [T, E] and experts [T, k], got {logits.shape} and "
            f"{experts.shape}"
        )
    top_k = experts.shape[1]
    _, own = route(logits, top_k=top_k, normalize=normalize)
    experts = experts.astype(jnp.int32)
    experts = jnp.where(jnp.all(experts >= 0, axis=-1, keepdims=True), experts, own)
    logits = logits.astype(jnp.float32)
    if normalize:
        chosen = jnp.take_along_axis(logits, experts, axis=-1)
        return jax.nn.softmax(chosen, axis=-1), experts
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.take_along_axis(probs, experts, axis=-1), experts


def grouped_experts(
    x: Array,
    weights: Array,
    experts: Array,
    w_gate: Array,
    w_up: Array,
    w_down: Array,
    *,
    biases: ExpertBiases | None = None,
    clamp: ClampedSwiGLU | None = None,
) -> Array:
    """``y_t = sum_j w_tj · W_down[e_tj]^T (silu(x_t W_gate[e_tj]) * x_t W_up[e_tj])``, dropless.

    The ``T·k`` assignments are sorted by expert (stable, so each expert's rows stay in token
    order), the three products are ``jax.lax.ragged_dot`` over the sorted rows with group sizes
    the experts' counts, and the rows are gathered back to ``[T, k, D]`` before the weighted
    sum (in f32). gpt-oss: ``biases`` add ``b_gate[e], b_up[e]`` to the rows' projections and
    ``sum_j w_tj b_down[e_tj]`` to the output; ``clamp`` replaces SwiGLU by its clamped form
    (``gated_activation``).

    Args:
      x: ``[T, D]`` normalised hidden states.
      weights: ``[T, k]`` routing weights (from ``route``).
      experts: ``[T, k]`` int32 expert ids.
      w_gate, w_up: ``[E, D, F]`` expert weights.
      w_down: ``[E, F, D]``.
      biases: the experts' biases (gpt-oss), or None.
      clamp: gpt-oss's ``ClampedSwiGLU``, or None (SwiGLU).

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
    out = _swiglu_experts(
        x[order // top_k], w_gate, w_up, w_down, group_sizes, flat[order], biases, clamp
    )
    # Row r of ``out`` is assignment order[r]: gather by the permutation's inverse.
    mixed = _combine(out[_inverse(order)].reshape(tokens, top_k, -1), weights)
    return _add_down_bias(mixed, weights, experts, biases).astype(x.dtype)


def _swiglu_experts(
    rows: Array,
    w_gate: Array,
    w_up: Array,
    w_down: Array,
    group_sizes: Array,
    row_experts: Array | None = None,
    biases: ExpertBiases | None = None,
    clamp: ClampedSwiGLU | None = None,
) -> Array:
    """``W_down[e]^T act(x W_gate[e] [+ b_gate[e]], x W_up[e] [+ b_up[e]])`` for rows sorted
    into groups by expert (``row_experts [R]``: each row's expert, for the biases; an id past
    the experts, an empty slot, gets zero biases). The down bias is not added here (see
    ``_add_down_bias``)."""
    gate = grouped_matmul(rows, w_gate, group_sizes)
    up = grouped_matmul(rows, w_up, group_sizes)
    if biases is not None:
        gate = gate + _row_bias(biases.gate, row_experts, gate.dtype)
        up = up + _row_bias(biases.up, row_experts, up.dtype)
    return grouped_matmul(gated_activation(gate, up, clamp), w_down, group_sizes)


def grouped_matmul(rows: Array, weights: Array, group_sizes: Array) -> Array:
    """``out[r] = rows[r] @ W[g(r)]``, ``g(r)`` the group of row ``r``: rows ``0 .. n_0 - 1``
    are group 0, the next ``n_1`` group 1, and so on (``jax.lax.ragged_dot``'s contract; rows
    past ``sum(n)`` give zeros).

    XLA:TPU and XLA:GPU compile ``jax.lax.ragged_dot`` to a grouped GEMM, and that is what
    runs there. XLA:CPU expands it to a dense product over every group (``[G, R, K]`` masked
    copies of ``rows``: ``G×`` the FLOPs and memory), so on CPU (``jax.lax.platform_dependent``)
    it is ``tiled_grouped_matmul`` instead: a loop over row tiles of one group each.

    Args:
      rows: ``[R, K]``, sorted into groups.
      weights: ``[G, K, N]``.
      group_sizes: ``[G]`` int, ``n_g`` (summing to at most ``R``).

    Returns:
      ``[R, N]`` in the result dtype of ``rows`` and ``weights``.
    """
    return jax.lax.platform_dependent(
        *_varying_alike(rows, weights, group_sizes),
        cpu=_cpu_grouped_matmul,
        default=jax.lax.ragged_dot,
    )


def _cpu_grouped_matmul(rows: Array, weights: Array, group_sizes: Array) -> Array:
    """``tiled_grouped_matmul`` on operands whole on every device of the context mesh's
    automatic axes: the SPMD partitioner would otherwise reshard the loop's row slices (with
    all-to-alls), where ``ragged_dot`` gets them gathered."""
    rows, weights, group_sizes = (
        _constrain(a, *([None] * a.ndim)) for a in (rows, weights, group_sizes)
    )
    return tiled_grouped_matmul(rows, weights, group_sizes)


def _varying_alike(*arrays: Array) -> tuple[Array, ...]:
    """``arrays`` cast (``jax.lax.pcast``) to vary over the union of the manual mesh axes any
    of them varies over (inside ``jax.shard_map``; a no-op outside): the tile loop's carries and
    its ``custom_vjp`` cotangents then have one type, and the cast's transpose sums the
    gradient of an input that was the same on every device of an axis."""
    arrays = tuple(jnp.asarray(a) for a in arrays)
    union = frozenset().union(*(_varying_axes(a) for a in arrays))
    return tuple(
        jax.lax.pcast(a, tuple(sorted(union - _varying_axes(a))), to="varying")
        if union - _varying_axes(a)
        else a
        for a in arrays
    )


def _varying_axes(x: Array) -> frozenset:
    """The manual mesh axes ``x`` varies over (empty outside ``jax.shard_map``)."""
    axis_type = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(axis_type, "varying", ()))


# Rows per tile of ``tiled_grouped_matmul``: each group's last tile is partly masked, about
# ``G · TILE_ROWS / 2`` wasted rows in all; smaller tiles are smaller, slower GEMMs.
TILE_ROWS = 64


@jax.custom_vjp
def tiled_grouped_matmul(rows: Array, weights: Array, group_sizes: Array) -> Array:
    """``grouped_matmul`` as a loop over row tiles: exact FLOPs up to the tiles' padding.

    Group ``g``'s ``n_g`` rows are cut into ``ceil(n_g / t)`` tiles of ``t = TILE_ROWS`` rows
    (the last one masked past the group's end) and a ``jax.lax.fori_loop`` over the
    ``sum_g ceil(n_g / t)`` tiles (a run-time count) computes ``rows[tile] @ W[g]`` into the
    tile's rows of the output: ``sum_g n_g · K · N`` multiply-adds plus at most ``G·t`` padded
    rows, against ``G · R · K · N`` for the dense expansion. The products accumulate in f32.
    The backward pass (``jax.custom_vjp``) is the same loop: ``d rows[tile] = dy[tile] W[g]^T``
    and ``dW[g] += rows[tile]^T dy[tile]``.

    Args / returns: as ``grouped_matmul``.
    """
    return _tiled_forward(rows, weights, group_sizes)


def _tile_schedule(group_sizes: Array, num_rows: int, tile: int) -> tuple[Array, ...]:
    """``(groups, starts, valid, count)``: tile ``i``'s group, first row and number of real
    rows, for ``i`` below the static bound ``R // t + G`` (only the first ``count`` are real
    tiles)."""
    sizes = group_sizes.astype(jnp.int32)
    tiles = (sizes + tile - 1) // tile
    tile_ends = jnp.cumsum(tiles)
    bound = num_rows // tile + sizes.shape[0]
    index = jnp.arange(bound, dtype=jnp.int32)
    groups = jnp.minimum(
        jnp.searchsorted(tile_ends, index, side="right"), sizes.shape[0] - 1
    ).astype(jnp.int32)
    within = index - (tile_ends[groups] - tiles[groups])
    starts = (jnp.cumsum(sizes) - sizes)[groups] + within * tile
    valid = jnp.clip(sizes[groups] - within * tile, 0, tile)
    return groups, starts, valid, tile_ends[-1]


def _tiled_forward(rows: Array, weights: Array, group_sizes: Array) -> Array:
    rows, weights = jnp.asarray(rows), jnp.asarray(weights)
    num_rows, out_dtype = rows.shape[0], jnp.result_type(rows, weights)
    tile = TILE_ROWS
    groups, starts, valid, count = _tile_schedule(group_sizes, num_rows, tile)
    padded = jnp.pad(rows, ((0, tile), (0, 0)))  # a tile may run past the last row
    live = jnp.arange(tile)

    def body(i, out):
        start = starts[i]
        x = jax.lax.dynamic_slice_in_dim(padded, start, tile)
        y = jnp.matmul(x, weights[groups[i]], preferred_element_type=jnp.float32)
        old = jax.lax.dynamic_slice_in_dim(out, start, tile)
        new = jnp.where((live < valid[i])[:, None], y.astype(out.dtype), old)
        return jax.lax.dynamic_update_slice_in_dim(out, new, start, 0)

    out = jnp.zeros((num_rows + tile, weights.shape[-1]), out_dtype)
    out, _ = _varying_alike(out, rows)
    return jax.lax.fori_loop(0, count, body, out)[:num_rows]


def _tiled_fwd(rows, weights, group_sizes):
    return _tiled_forward(rows, weights, group_sizes), (rows, weights, group_sizes)


def _tiled_bwd(residuals, grad):
    rows, weights, group_sizes = (jnp.asarray(a) for a in residuals)
    num_rows, tile = rows.shape[0], TILE_ROWS
    groups, starts, valid, count = _tile_schedule(group_sizes, num_rows, tile)
    padded = jnp.pad(rows, ((0, tile), (0, 0)))
    padded_grad = jnp.pad(grad, ((0, tile), (0, 0)))
    live = jnp.arange(tile)

    def body(i, carry):
        d_rows, d_weights = carry
        start, group = starts[i], groups[i]
        mask = (live < valid[i])[:, None]
        x = jnp.where(mask, jax.lax.dynamic_slice_in_dim(padded, start, tile), 0)
        dy = jax.lax.dynamic_slice_in_dim(padded_grad, start, tile)
        dx = jnp.matmul(dy, weights[group].T, preferred_element_type=jnp.float32)
        old = jax.lax.dynamic_slice_in_dim(d_rows, start, tile)
        new = jnp.where(mask, dx.astype(d_rows.dtype), old)
        d_rows = jax.lax.dynamic_update_slice_in_dim(d_rows, new, start, 0)
        dw = jnp.matmul(x.T, dy, preferred_element_type=jnp.float32)
        return d_rows, d_weights.at[group].add(dw)

    d_rows = jnp.zeros((num_rows + tile, rows.shape[1]), rows.dtype)
    d_weights = jnp.zeros(weights.shape, jnp.float32)
    d_rows, d_weights, _ = _varying_alike(d_rows, d_weights, rows)
    d_rows, d_weights = jax.lax.fori_loop(0, count, body, (d_rows, d_weights))
    return d_rows[:num_rows], d_weights.astype(weights.dtype), None


tiled_grouped_matmul.defvjp(_tiled_fwd, _tiled_bwd)


def _row_bias(bias: Array, row_experts: Array, dtype: Any) -> Array:
    """``bias[row_experts]``: ``[E, F], [R] -> [R, F]``, zeros for ids outside ``[0, E)``."""
    return jnp.take(bias, row_experts, axis=0, mode="fill", fill_value=0).astype(dtype)


def _add_down_bias(
    mixed: Array, weights: Array, experts: Array, biases: ExpertBiases | None
) -> Array:
    """``mixed + sum_j w_tj b_down[e_tj]`` (f32): the down projections' biases, weighted like
    their experts' outputs (added once per token, after any partial sums over the width)."""
    if biases is None:
        return mixed
    down = jnp.take(biases.down, experts, axis=0).astype(jnp.float32)  # [T, k, D]
    return mixed + _combine(down, weights)


def _inverse(perm: Array) -> Array:
    """The inverse permutation ``inv`` of ``perm``: ``inv[perm[r]] = r``."""
    return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))


def _combine(out: Array, weights: Array) -> Array:
    """``y_t = sum_j w_tj out_tj`` in f32: ``[T, k, D], [T, k] -> [T, D]``."""
    return jnp.einsum("tkd,tk->td", out.astype(jnp.float32), weights.astype(jnp.float32))


def expert_parallel_mesh() -> Any:
    """The context mesh (``jax.set_mesh``) when it has an ``expert`` axis of size > 1 that is
    not already manual (inside a ``jax.shard_map`` over it), else None: whether ``sparse_mlp``
    runs its experts expert-parallel."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names or mesh.shape[EXPERT_AXIS] == 1:
        return None
    if EXPERT_AXIS in getattr(mesh, "manual_axes", ()):
        return None
    return mesh


def _mesh_spec(mesh: Any, *axes: str | None) -> PartitionSpec:
    """``ACTIVATION_RULES`` spec of logical ``axes`` on ``mesh``, less its manual axes and
    those of size 1 (which split nothing, and would make the ``shard_map``'s values vary)."""
    manual, sizes = set(getattr(mesh, "manual_axes", ())), dict(mesh.shape)
    spec = spec_for_mesh(logical_to_spec(axes, ACTIVATION_RULES), mesh.axis_names)
    keep = [tuple(a for a in mesh_axes_of(e) if a not in manual and sizes[a] > 1) for e in spec]
    return PartitionSpec(*(spec_entry(axes) for axes in keep))


def expert_parallel_mlp(
    x: Array,
    logits: Array,
    w_gate: Array,
    w_up: Array,
    w_down: Array,
    *,
    top_k: int,
    normalize: bool,
    mesh: Any = None,
    biases: ExpertBiases | None = None,
    clamp: ClampedSwiGLU | None = None,
    experts: Array | None = None,
) -> Array:
    """Routing and ``grouped_experts`` with the experts split over the ``expert`` mesh axis.

    ``y_t = sum_j w_tj · SwiGLU_{e_tj}(x_t)`` with ``(w, e) = route(z_t)``, computed inside
    ``jax.shard_map``: the tokens (and their logits) split over the batch's mesh axes
    (``ACTIVATION_RULES["batch"]``: data, fsdp, expert), each device routing its own tokens
    (top-k and renormalisation in f32, as ``route``), the weights ``[E, D, F]`` as the rules
    place them in use (``E`` over ``expert``, ``F`` over ``tensor``, ``D`` whole), the rows
    exchanged over ``expert`` by ``all_to_all`` (see the module docstring), the combine in f32,
    and the partial sums over the width's axes (tensor) added by ``psum``.

    Args:
      x: ``[T, D]`` normalised hidden states; ``T`` must divide into the batch's shards.
      logits: ``[T, E]`` router logits (``router_logits``; used in f32).
      w_gate, w_up: ``[E, D, F]``; w_down: ``[E, F, D]``; ``E`` must divide by the expert axis.
      top_k, normalize: as ``route``.
      mesh: the mesh (default: the context mesh, ``jax.set_mesh``); it must have an ``expert``
        axis.
      biases: the experts' biases (gpt-oss; the gate / up ones split like their weights, the
        down ones whole on every device and added after the ``psum``), or None.
      clamp: gpt-oss's ``ClampedSwiGLU``, or None.
      experts: ``[T, k]`` int32 expert ids to replay instead of the top-k (``replay_route``:
        the weights still from ``logits``; split over the batch's axes like ``x``), or None.

    Returns:
      ``[T, D]`` in ``x.dtype``, sharded like ``x``.

    Raises:
      ValueError: no ``expert`` axis, ``T`` or ``E`` not divisible, shapes that disagree, or
        rule tables that shard the experts' ``D`` or split ``E`` over other axes.
    """
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if getattr(mesh, "empty", False) or EXPERT_AXIS not in mesh.axis_names:
        raise ValueError(
            f"expert_parallel_mlp needs a mesh with an {EXPERT_AXIS!r} axis (make_mesh(..., "
            f"expert=P)); the mesh axes are {tuple(getattr(mesh, 'axis_names', ()))}"
        )
    tokens, num_experts = logits.shape
    if x.shape[0] != tokens or w_gate.shape[0] != num_experts:
        raise ValueError(
            f"expert_parallel_mlp: x {x.shape} and logits {logits.shape} must agree on T, and "
            f"logits and w_gate {w_gate.shape} on E"
        )
    shards = dict(mesh.shape)
    rows_spec = _mesh_spec(mesh, "batch", None)
    in_spec = _mesh_spec(mesh, "expert", "embed", "mlp")
    out_spec = _mesh_spec(mesh, "expert", "mlp", "embed")
    if in_spec[0] != EXPERT_AXIS or out_spec[0] != EXPERT_AXIS or in_spec[1] or out_spec[2]:
        raise ValueError(
            f"expert parallelism needs the experts' weights split over {EXPERT_AXIS!r} alone on "
            f"their expert dim and whole on D, but ACTIVATION_RULES give {in_spec} / {out_spec}"
        )
    row_shards = math.prod(shards[a] for a in mesh_axes_of(rows_spec[0]))
    parts = shards[EXPERT_AXIS]
    if tokens % row_shards or num_experts % parts:
        raise ValueError(
            f"expert parallelism: the {tokens} tokens must divide into the {row_shards} batch "
            f"shards ({rows_spec[0]}) and the {num_experts} experts into the {parts} shards of "
            f"the {EXPERT_AXIS!r} axis"
        )
    # The axes splitting F (tensor): each device's down projection is a partial sum over them.
    width_axes = mesh_axes_of(out_spec[1])

    replay = experts is not None

    def local(x, logits, w_gate, w_up, w_down, *extra):
        given = extra[0] if replay else None
        biases = extra[-1] if len(extra) > replay else None
        if given is None:
            weights, experts = route(logits, top_k=top_k, normalize=normalize)
        else:
            weights, experts = replay_route(logits, given, normalize=normalize)
        out = _exchange_and_compute(
            x, experts, (w_gate, w_up, w_down), num_experts, parts, biases, clamp
        )
        mixed = _combine(out, weights)
        if width_axes:
            mixed = jax.lax.psum(mixed, width_axes)
        return _add_down_bias(mixed, weights, experts, biases).astype(x.dtype)

    manual = set(getattr(mesh, "manual_axes", ()))
    specs: tuple[Any, ...] = (rows_spec, rows_spec, in_spec, in_spec, out_spec)
    args: tuple[Any, ...] = (x, logits, w_gate, w_up, w_down)
    if experts is not None:
        if experts.shape != (tokens, top_k):
            raise ValueError(
                f"expert_parallel_mlp: experts must be [T, k] = {(tokens, top_k)}, got "
                f"{experts.shape}"
            )
        specs, args = (*specs, rows_spec), (*args, experts.astype(jnp.int32))
    if biases is not None:
        bias_spec = _mesh_spec(mesh, "expert", "mlp")
        specs = (*specs, ExpertBiases(bias_spec, bias_spec, PartitionSpec(None, None)))
        args = (*args, biases)
    if AxisType.Explicit in tuple(mesh.axis_types):  # sharding in types: move them first
        args = tuple(jax.sharding.reshard(a, s) for a, s in zip(args, specs, strict=True))
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=specs,
        out_specs=rows_spec,
        axis_names=frozenset(a for a in mesh.axis_names if a not in manual),
    )(*args)


def _exchange_and_compute(
    x: Array,
    experts: Array,
    expert_weights: tuple[Array, Array, Array],
    num_experts: int,
    parts: int,
    biases: ExpertBiases | None = None,
    clamp: ClampedSwiGLU | None = None,
) -> Array:
    """One device's share of ``expert_parallel_mlp``, inside the ``shard_map``.

    ``x [T_l, D]`` and ``experts [T_l, k]`` are this device's tokens; ``expert_weights``
    ``(w_gate, w_up, w_down)``, each ``[E/P, ...]``, its experts (those of expert-axis shard
    ``j`` are ``j·E/P ... (j+1)·E/P - 1``), and ``biases`` their gate / up biases (the down
    ones are added by the caller). Returns each assignment's expert output ``[T_l, k, D]``
    (this device's rows, computed where their experts live), down biases not included.
    """
    w_gate, w_up, w_down = expert_weights
    tokens, top_k = experts.shape
    local = w_gate.shape[0]  # E / P
    capacity = tokens * top_k  # rows one destination can get from this device: all of them
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignments sorted by expert, so by shard
    sorted_experts = flat[order]
    rows = x[order // top_k]  # [C, D]
    counts = jnp.bincount(flat, length=num_experts).reshape(parts, local).sum(-1)  # to shard j
    starts = jnp.cumsum(counts) - counts
    slot = jnp.arange(capacity)
    index = jnp.minimum(starts[:, None] + slot, capacity - 1)  # [P, C]: sorted row per slot
    valid = slot < counts[:, None]
    send = jnp.where(valid[..., None], rows[index], 0)  # [P, C, D]
    # The expert of each slot as its destination numbers them; ``local`` marks an empty slot.
    shard_first = jnp.arange(parts, dtype=flat.dtype)[:, None] * local
    ids = jnp.where(valid, sorted_experts[index] - shard_first, local)
    received = jax.lax.all_to_all(send, EXPERT_AXIS, 0, 0)  # [P, C, D]: [s] from shard s
    received_ids = jax.lax.all_to_all(ids, EXPERT_AXIS, 0, 0).reshape(-1)
    by_expert = jnp.argsort(received_ids, stable=True)  # empty slots last
    group_sizes = jnp.bincount(received_ids, length=local).astype(jnp.int32)
    computed = _swiglu_experts(
        received.reshape(parts * capacity, -1)[by_expert],
        w_gate,
        w_up,
        w_down,
        group_sizes,
        received_ids[by_expert],
        biases,
        clamp,
    )
    computed = computed[_inverse(by_expert)].reshape(parts, capacity, -1)
    back = jax.lax.all_to_all(computed, EXPERT_AXIS, 0, 0)  # [j]: this device's rows from j
    # Sorted row r went to shard dest[r], slot r - starts[dest[r]].
    dest = jnp.searchsorted(starts + counts, slot, side="right")
    returned = back.reshape(parts * capacity, -1)[dest * capacity + slot - starts[dest]]
    return returned[_inverse(order)].reshape(tokens, top_k, -1)


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
    router_bias: Array | None = None,
    biases: ExpertBiases | None = None,
    clamp: ClampedSwiGLU | None = None,
    routing: Array | None = None,
) -> tuple[Array, Array]:
    """A sparse layer's MLP (see the module docstring) on ``h: [B, S, D]``.

    ``y = sum_j w_j · SwiGLU_{e_j}(h) [+ sigmoid(h g) · SwiGLU_s(h)]`` with ``(w, e)`` the
    top-k routing of ``z = h W_r [+ b_r]`` (f32), dropless over the ``B·S`` tokens. On a
    context mesh with an ``expert`` axis of size > 1 the routed experts run expert-parallel
    (``expert_parallel_mlp``); the shared expert is a dense MLP either way.

    Args:
      h: ``[B, S, D]`` normalised hidden states (compute dtype).
      router: ``W_r [D, E]`` (its stored dtype: used in f32).
      w_gate, w_up: ``[E, D, F]``; w_down: ``[E, F, D]``.
      top_k: k; normalize: renormalise the k weights (``norm_topk_prob``).
      shared: the shared expert (Qwen2-MoE), or None.
      router_bias: ``b_r [E]`` (gpt-oss; used in f32), or None.
      biases: the experts' biases (gpt-oss), or None.
      clamp: gpt-oss's ``ClampedSwiGLU`` instead of SwiGLU, or None.
      routing: ``[B, S, k]`` int expert ids to replay (``replay_route``: these experts, their
        weights from this layer's own logits; a token with a negative id routes freely), or
        None: the top-k.

    Returns:
      ``(y [B, S, D] in h.dtype, router logits z [B, S, E] f32)``.
    """
    batch, seq, d = h.shape
    if routing is not None and routing.shape != (batch, seq, top_k):
        raise ValueError(
            f"sparse_mlp: routing must be [B, S, k] = {(batch, seq, top_k)}, got {routing.shape}"
        )
    given = None if routing is None else routing.reshape(batch * seq, top_k)
    mesh = expert_parallel_mesh()
    if mesh is not None:  # the small router whole on every device (its E is expert-split)
        router = _constrain(router, None, None)
        router_bias = None if router_bias is None else _constrain(router_bias, None)
    logits = router_logits(h, router, router_bias)
    flat_logits, tokens = logits.reshape(batch * seq, -1), h.reshape(batch * seq, d)
    if mesh is None:
        if given is None:
            weights, experts = route(flat_logits, top_k=top_k, normalize=normalize)
        else:
            weights, experts = replay_route(flat_logits, given, normalize=normalize)
        out = grouped_experts(
            tokens, weights, experts, w_gate, w_up, w_down, biases=biases, clamp=clamp
        )
    else:  # routing, experts and combine on each device's own tokens
        out = expert_parallel_mlp(
            tokens,
            flat_logits,
            w_gate,
            w_up,
            w_down,
            top_k=top_k,
            normalize=normalize,
            mesh=mesh,
            biases=biases,
            clamp=clamp,
            experts=given,
        )
    out = out.reshape(h.shape)
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
      router_logits: ``[L, B, S, E]`` (``forward(..., outputs=("router_logits",))``) or any
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
    "ClampedSwiGLU",
    "ExpertBiases",
    "SharedExpert",
    "expert_parallel_mlp",
    "expert_parallel_mesh",
    "gated_activation",
    "grouped_experts",
    "grouped_matmul",
    "load_balancing_loss",
    "replay_route",
    "route",
    "router_logits",
    "router_z_loss",
    "sparse_mlp",
    "tiled_grouped_matmul",
]
