"""Vocabulary parallelism over the fsdp axis: the embedding lookup and the log-softmax over
tables whose vocabulary is split over ``fsdp`` where they are used.

On a mesh with no tensor split (``tensor = 1``), ``PARAM_RULES`` store the embedding
``E [V, D]`` and the unembedding ``W_U [D, V]`` split over fsdp by their width ``D``; gathered
whole for use (``models.layers.gathered``), a 152k x 3584 table is 1 GiB in bf16 on every
chip, and its gradient, all-reduced whole, 2 GiB more in f32. Here each device instead holds
``V / f`` whole vocabulary rows (``to_vocab_shard``: one all-to-all of its own ``V x D / f``
shard, no gather) and the activations move, as in Megatron's vocabulary-parallel layers:

* lookup: ``x_b = sum_j [y_b in rows_j] E_j[y_b - o_j]`` -- the fsdp group's tokens are
  all-gathered (ints), each device looks up the ones it owns (0 elsewhere) and the partial
  ``[B_f, S, D]`` sums are reduce-scattered back to their rows. Backward: the cotangent is
  all-gathered and scatter-added into the local rows, so ``dE_j`` needs no collective.
* unembedding (``logprobs``): a chunk's hidden states ``[B_f, C, D]`` are all-gathered, each
  device computes its logits ``[B_f, C, V / f]`` and the log-sum-exp, entropy and target logit
  are combined by ``psum`` of ``[B_f, C]`` values. Backward: ``dW_j = h^T dz_j`` is local;
  ``dh`` is reduce-scattered (never an activation-sized all-reduce).

Storage (and so the optimizer state, the checkpoints and the sampler's reshard) is unchanged;
``vocab_parallel_axis`` says when the scheme applies (any other mesh keeps the gathered table).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec

from jaxrl_llm.parallel.rules import ACTIVATION_RULES, logical_to_spec, spec_for_mesh

Array = jax.Array

AXIS = "fsdp"


# The name scope of the table all-to-alls (in their HLO ``op_name``).
SCOPE = "vocab_parallel"


def vocab_parallel_axis(vocab: int, width: int, rows: int | None = None) -> str | None:
    """``"fsdp"`` when the context mesh splits a ``[V, D]`` table's vocabulary over fsdp for
    use, else None (no mesh, fsdp = 1, a tensor, expert or sequence axis > 1, manual or
    Explicit axes, or ``V``, ``D`` or ``rows`` -- the batch -- not divisible by the shards)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.axis_names:
        return None
    shape = dict(mesh.shape)
    fsdp = shape[AXIS]
    if fsdp == 1 or any(shape.get(a, 1) != 1 for a in ("tensor", "expert", "sequence")):
        return None
    if getattr(mesh, "manual_axes", ()) or any(t != AxisType.Auto for t in mesh.axis_types):
        return None
    batch_shards = 1
    for axis in batch_axes():
        batch_shards *= shape.get(axis, 1)
    if vocab % fsdp or width % fsdp or (rows is not None and rows % batch_shards):
        return None
    return AXIS


def batch_axes() -> tuple[str, ...]:
    """The mesh axes that split the batch on the context mesh (``ACTIVATION_RULES``)."""
    mesh = jax.sharding.get_abstract_mesh()
    spec = spec_for_mesh(logical_to_spec(("batch",), ACTIVATION_RULES), mesh.axis_names)
    entry = spec[0]
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def batch_spec(*rest: None) -> PartitionSpec:
    """``PartitionSpec`` of a batch-leading array: rows over the batch axes, ``rest`` whole."""
    return PartitionSpec(batch_axes() or None, *rest)


def to_vocab_shard(local: Array, vocab_dim: int) -> Array:
    """Inside ``shard_map``: a table shard split by its width (``[V, D / f]`` or ``[D / f, V]``)
    to the same table split by vocabulary (``[V / f, D]`` or ``[D, V / f]``), by one tiled
    all-to-all over fsdp (its transpose returns the gradient in the stored layout)."""
    width_dim = 1 - vocab_dim
    with jax.named_scope(SCOPE):  # names the op in the HLO (``plan`` tells it from the experts')
        return jax.lax.all_to_all(local, AXIS, vocab_dim, width_dim, tiled=True)


def in_scope(op_name: str) -> bool:
    """Whether an HLO op's ``op_name`` metadata comes from the vocabulary-parallel tables (its
    forward or its transposes: ``transpose(jvp(vocab_parallel))/...``)."""
    return SCOPE in op_name


def vocab_offset(local_vocab: int) -> Array:
    """Inside ``shard_map``: the first vocabulary id of this device's rows, ``j * V / f``."""
    return jax.lax.axis_index(AXIS) * local_vocab


def embed_lookup(table: Array, tokens: Array) -> Array:
    """``x[b, s] = E[tokens[b, s]]`` with ``E [V, D]`` (stored split over fsdp by ``D``) used
    split by vocabulary over fsdp: ``[B, S]`` int -> ``[B, S, D]`` rows over the batch axes.

    Over ``f`` chunks of the sequence (so the fsdp group's partial sums, ``[B_f, S / f, D]``,
    are no bigger than a device's output ``[B_f / f, S, D]``): the group's tokens are
    all-gathered, each device looks up the ids it owns (0 for the others) and the partial sums
    are reduce-scattered to their rows. The backward all-gathers the cotangent and scatter-adds
    it into the local rows (``dE`` is never communicated over fsdp). Call only where
    ``vocab_parallel_axis(V, D, B)`` is not None.
    """

    def local(table: Array, tokens: Array) -> Array:
        rows = to_vocab_shard(table, 0)  # [V / f, D]
        offset = vocab_offset(rows.shape[0])
        batch, length = tokens.shape
        chunks = min(jax.lax.axis_size(AXIS), length)
        size = -(-length // chunks)
        # Padding ids (-1) are owned by no device: their rows are 0, then cut off.
        padded = jnp.pad(tokens, [(0, 0), (0, chunks * size - length)], constant_values=-1)
        pieces = jnp.moveaxis(padded.reshape(batch, chunks, size), 1, 0)  # [n, B_l, S / n]

        # Ids this device does not own read an appended zero row, so the backward keeps only
        # the ids (not a [B_f, S / n, D] mask) and scatter-adds their rows' gradient.
        padded_rows = jnp.pad(rows, [(0, 1), (0, 0)])  # [V / f + 1, D]

        def lookup(carry, ids):
            ids = jax.lax.all_gather(ids, AXIS, axis=0, tiled=True) - offset  # [B_f, S / n]
            owned = (ids >= 0) & (ids < rows.shape[0])
            x = padded_rows[jnp.where(owned, ids, rows.shape[0])]
            return carry, jax.lax.psum_scatter(x, AXIS, scatter_dimension=0, tiled=True)

        _, x = jax.lax.scan(lookup, None, pieces)  # [n, B_l, S / n, D]
        x = jnp.moveaxis(x, 0, 1).reshape(batch, chunks * size, -1)
        return x[:, :length]

    with jax.named_scope(SCOPE):  # names its collectives (``plan`` reads them)
        return jax.shard_map(
            local,
            in_specs=(PartitionSpec(None, AXIS), batch_spec(None)),
            out_specs=batch_spec(None, None),
        )(table, tokens)


__all__ = [
    "AXIS",
    "SCOPE",
    "batch_axes",
    "batch_spec",
    "embed_lookup",
    "in_scope",
    "to_vocab_shard",
    "vocab_offset",
    "vocab_parallel_axis",
]
