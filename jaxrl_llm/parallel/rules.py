"""Logical-axis rule tables and their translation to ``PartitionSpec`` / ``NamedSharding``.

Arrays name their dimensions with *logical* axes (``batch``, ``embed``, ``mlp``, ``heads``,
``kv_heads``, ``head_dim``, ``vocab``, ``layers``, ``cache_seq``, ``expert``; ``None`` for an
unnamed dim). A
rule table -- plain data -- sends each logical name to a mesh axis, a tuple of mesh axes (the dim
is split over their product, major to minor), or ``None`` (replicated). Separate tables serve
parameter storage (FSDP shards ``embed``), activations and sampling, as in levanter/haliax and
MaxText. Derive variants with ``{**PARAM_RULES, "embed": None}``.

Nothing here silently falls back to replication: a dimension that its mesh axes do not divide,
an unknown logical name, or a mesh axis used twice in one spec is a ``ValueError``.

Expert parallelism. The ``expert`` mesh axis (``make_mesh(..., expert=e)``, only on meshes
with ``e > 1``) shards the experts' dimension of a mixture-of-experts layer's weights (logical
``expert``: ``[E, D, F]`` -> ``E / e`` experts per device, in storage and in use, so neither the
weights nor their optimizer moments are ever gathered over it) and is one more data axis for the
batch (``batch`` -> ``("data", "fsdp", "expert")``): the attention and every dense layer run on
``B / (data·fsdp·expert)`` rows per device, and the MoE layer exchanges its tokens over
``expert`` by all-to-all (``models.moe``). Dense weights (``embed`` -> ``fsdp``) are replicated
over ``expert``, as over ``data``. ``expert`` is an *optional* mesh axis
(``OPTIONAL_MESH_AXES``): on a mesh without it -- every mesh with ``e = 1`` -- it is dropped
from the specs, exactly as an axis of size 1 would be, so the tables serve both meshes.

Context parallelism. The ``sequence`` mesh axis (``make_mesh(..., sequence=s)``, optional like
``expert``) splits the positions of a training or scoring forward's activations (logical
``sequence``: ``[B, T, D]`` -> ``T / s`` per device, ``models.context_parallel``), stores the
weights split over ``fsdp x sequence`` (``embed`` -> both: they are gathered for use as over
fsdp alone) and, for sampling, splits rows like a data axis.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]
LogicalAxes = tuple[str | None, ...]

LOGICAL_AXES: tuple[str, ...] = (
    "batch",
    "embed",
    "mlp",
    "heads",
    "kv_heads",
    "head_dim",
    "vocab",
    "layers",
    "cache_seq",
    "expert",
    "sequence",
)

# Mesh axes that a rule may name and a mesh may lack: on a mesh without one, a spec drops it (the
# same sharding as the axis at size 1). Every other mesh axis a rule names must be in the mesh.
OPTIONAL_MESH_AXES: tuple[str, ...] = ("expert", "sequence")

# Parameters and optimizer state: FSDP shards the model width, tensor parallelism the
# per-head / MLP / vocabulary dims. A weight [embed, heads, head_dim] thus lives on
# (fsdp x tensor) shards and is all-gathered over fsdp just before use.
PARAM_RULES: Rules = MappingProxyType(
    {
        "batch": ("data", "fsdp", "expert"),
        # Context parallelism's sequence axis is one more FSDP axis for storage.
        "embed": ("fsdp", "sequence"),
        "mlp": "tensor",
        "heads": "tensor",
        "kv_heads": "tensor",
        "head_dim": None,
        "vocab": "tensor",
        "layers": None,
        "cache_seq": None,
        # Mixture-of-experts weights' expert dim: split over the expert axis (expert
        # parallelism; dropped on a mesh without one); the experts' width is tensor-split as
        # "mlp".
        "expert": "expert",
        "sequence": None,
    }
)

# Activations: the batch is split over every data-like axis (expert included); the residual
# stream's width is replicated across tensor shards (Megatron style), while heads, MLP width and
# vocab logits are tensor-sharded between the matmuls that produce and consume them. Experts'
# weights stay split over the expert axis where they are used (no gather over it).
ACTIVATION_RULES: Rules = MappingProxyType(
    {
        "batch": ("data", "fsdp", "expert"),
        "embed": None,
        "mlp": "tensor",
        "heads": "tensor",
        "kv_heads": "tensor",
        "head_dim": None,
        "vocab": "tensor",
        "layers": None,
        "cache_seq": None,
        "expert": "expert",
        # A training forward's positions under context parallelism (models.context_parallel).
        "sequence": "sequence",
    }
)

# Sampling: rows over data+fsdp(+expert), the KV cache split by kv-head over tensor; the cache's
# sequence axis stays whole because every decode step writes one dynamic slot of it.
SAMPLING_RULES: Rules = MappingProxyType(
    {
        # Decoding has no sequence to split: a context-parallel axis splits rows as data does.
        "batch": ("data", "fsdp", "expert", "sequence"),
        "embed": None,
        "mlp": "tensor",
        "heads": "tensor",
        "kv_heads": "tensor",
        "head_dim": None,
        "vocab": "tensor",
        "layers": None,
        "cache_seq": None,
        "expert": "expert",
        "sequence": None,
    }
)


def is_logical_axes(x: Any) -> bool:
    """True for a leaf of a logical-axes tree: a plain tuple of ``str``/``None`` (``()``: scalar).

    NamedTuples are containers, never leaves, so a ``KVCache`` or ``RolloutBatch`` of axis
    tuples maps as a tree.
    """
    return (
        isinstance(x, tuple)
        and not hasattr(x, "_fields")
        and all(a is None or isinstance(a, str) for a in x)
    )


def mesh_axes_of(entry: MeshAxes, *, name: str = "rule") -> tuple[str, ...]:
    """Normalises one rule value (``None``, ``"fsdp"`` or ``("data", "fsdp")``) to a tuple."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, tuple | list) and all(isinstance(a, str) for a in entry):
        return tuple(entry)
    raise ValueError(
        f"{name} must be a mesh axis name, a tuple of mesh axis names or None, got {entry!r}"
    )


def spec_entry(mesh_axes: tuple[str, ...]) -> MeshAxes:
    """The ``PartitionSpec`` entry for a tuple of mesh axes: ``None``, ``"a"`` or ``("a", "b")``."""
    if not mesh_axes:
        return None
    return mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes


def present_mesh_axes(mesh_axes: Sequence[str], axis_names: Sequence[str]) -> tuple[str, ...]:
    """``mesh_axes`` less the optional ones (``OPTIONAL_MESH_AXES``) missing from a mesh whose
    axes are ``axis_names``; other missing axes are kept (and later refused by the caller)."""
    return tuple(a for a in mesh_axes if a in axis_names or a not in OPTIONAL_MESH_AXES)


def spec_for_mesh(spec: PartitionSpec, axis_names: Sequence[str]) -> PartitionSpec:
    """``spec`` with the optional mesh axes that the mesh lacks dropped (``present_mesh_axes``)."""
    entries = (present_mesh_axes(mesh_axes_of(e), axis_names) for e in spec)
    return PartitionSpec(*(spec_entry(axes) for axes in entries))


def logical_to_spec(axes: Sequence[str | None], rules: Rules) -> PartitionSpec:
    """Maps logical axis names to a ``PartitionSpec``: ``spec[i] = rules[axes[i]]``.

    ``None`` in ``axes`` (an unnamed dimension) gives ``None`` (replicated). The GSPMD sharding
    annotation (Xu et al., 2021) in the logical-axis style of t5x/levanter. The spec names
    every mesh axis of the rules, optional ones included; ``spec_for_mesh`` fits it to a mesh
    (``logical_to_sharding`` and ``with_logical_constraint`` do).

    Args:
      axes: one logical name (or ``None``) per array dimension, e.g.
        ``("layers", "embed", "heads", "head_dim")``.
      rules: a rule table such as ``PARAM_RULES``.

    Returns:
      A ``PartitionSpec`` with ``len(axes)`` entries.

    Raises:
      ValueError: ``axes`` is not a sequence of names, a name is missing from ``rules``, a rule
        value is malformed, or one mesh axis would shard two dimensions.
    """
    if isinstance(axes, str) or not all(a is None or isinstance(a, str) for a in axes):
        raise ValueError(f"logical axes must be a tuple of names or None, got {axes!r}")
    entries: list[MeshAxes] = []
    used: dict[str, int] = {}
    for dim, name in enumerate(axes):
        if name is None:
            entries.append(None)
            continue
        if name not in rules:
            raise ValueError(
                f"unknown logical axis {name!r} in {tuple(axes)}; the rule table maps "
                f"{tuple(rules)}"
            )
        mesh_axes = mesh_axes_of(rules[name], name=f"rule for logical axis {name!r}")
        for mesh_axis in mesh_axes:
            if mesh_axis in used:
                raise ValueError(
                    f"logical axes {tuple(axes)} map mesh axis {mesh_axis!r} to both dim "
                    f"{used[mesh_axis]} ({axes[used[mesh_axis]]!r}) and dim {dim} ({name!r}); "
                    "a mesh axis can shard only one dimension of an array"
                )
            used[mesh_axis] = dim
        entries.append(spec_entry(mesh_axes))
    return PartitionSpec(*entries)


def _check_fits(
    where: str,
    axes: Sequence[str | None],
    spec: PartitionSpec,
    shape: Sequence[int] | None,
    mesh_shape: Mapping[str, int],
) -> None:
    """Raises unless the mesh has the axes, the rank matches and every sharded dim divides."""
    if shape is not None and len(axes) != len(shape):
        raise ValueError(
            f"{where}: logical axes {tuple(axes)} name {len(axes)} dims but the array has shape "
            f"{shape} (rank {len(shape)})"
        )
    for dim, entry in enumerate(spec):
        mesh_axes = mesh_axes_of(entry)
        missing = [a for a in mesh_axes if a not in mesh_shape]
        if missing:
            raise ValueError(
                f"{where}: mesh axes {missing} (for logical axis {axes[dim]!r}) are not in the "
                f"mesh, whose axes are {tuple(mesh_shape)}"
            )
        if shape is None:
            continue
        size = shape[dim]
        shards = math.prod(mesh_shape[a] for a in mesh_axes)
        if size % shards:
            sizes = " x ".join(f"{a}={mesh_shape[a]}" for a in mesh_axes)
            raise ValueError(
                f"{where}: dim {dim} ({axes[dim]!r}) of size {size} in shape {shape} is not "
                f"divisible by mesh axis {spec_entry(mesh_axes)!r} of size {shards} ({sizes})"
            )


def _shape_of(x: Any) -> tuple[int, ...]:
    if hasattr(x, "shape"):
        return tuple(x.shape)
    return tuple(x)


def _is_shape_leaf(x: Any) -> bool:
    return hasattr(x, "shape") or (
        isinstance(x, tuple)
        and not hasattr(x, "_fields")
        and all(isinstance(d, int) and not isinstance(d, bool) for d in x)
    )


def _structure_error(axes_paths: list[str], shape_paths: list[str]) -> ValueError:
    missing = [p for p in axes_paths if p not in set(shape_paths)]
    extra = [p for p in shape_paths if p not in set(axes_paths)]
    return ValueError(
        "logical-axes tree and shapes tree differ: "
        f"only in the axes tree: {missing[:5] or 'none'}; "
        f"only in the shapes tree: {extra[:5] or 'none'}"
        + ("" if missing or extra else " (same paths in a different order or container type)")
    )


def logical_to_sharding(tree: Any, mesh: Mesh, rules: Rules, *, shapes: Any = None) -> Any:
    """Maps a pytree of logical-axes tuples to the matching pytree of ``NamedSharding``.

    ``sharding(leaf) = NamedSharding(mesh, logical_to_spec(leaf, rules))`` (less the optional
    mesh axes ``mesh`` lacks: ``spec_for_mesh``). The recipe for
    state born sharded (MaxText): ``jax.eval_shape(init)`` → logical axes → these shardings →
    ``jax.jit(init, out_shardings=...)``.

    Args:
      tree: a pytree whose leaves are logical-axes tuples, e.g. ``logical_axes(config)``:
        ``{"embed": ("vocab", "embed"), "layers": {"wq": ("layers", "embed", "heads",
        "head_dim")}}``.
      mesh: the device mesh.
      rules: a rule table such as ``PARAM_RULES``.
      shapes: optionally the matching pytree of arrays, ``jax.ShapeDtypeStruct`` s or shape
        tuples; each leaf's rank and divisibility is then checked.

    Returns:
      A pytree with the structure of ``tree`` whose leaves are ``NamedSharding`` s.

    Raises:
      ValueError: naming the leaf's path (``jax.tree_util.keystr``) when a rule is unknown or
        malformed, a mesh axis is used twice or is missing from the mesh, a rank does not match,
        or a dimension is not divisible by its mesh axes; or when ``shapes`` does not match
        ``tree``'s structure.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_logical_axes)
    for path, leaf in leaves:
        if not is_logical_axes(leaf):
            raise ValueError(
                f"{jax.tree_util.keystr(path) or 'tree'}: expected a tuple of logical axis names "
                f"(str or None), got {leaf!r}"
            )
    leaf_shapes: list[tuple[int, ...] | None] = [None] * len(leaves)
    if shapes is not None:
        shape_leaves = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape_leaf)[0]
        axes_paths = [jax.tree_util.keystr(p) for p, _ in leaves]
        shape_paths = [jax.tree_util.keystr(p) for p, _ in shape_leaves]
        if axes_paths != shape_paths:
            raise _structure_error(axes_paths, shape_paths)
        leaf_shapes = [_shape_of(s) for _, s in shape_leaves]
    mesh_shape = dict(mesh.shape)
    shardings = []
    for (path, axes), shape in zip(leaves, leaf_shapes):
        where = jax.tree_util.keystr(path) or "tree"
        try:
            spec = spec_for_mesh(logical_to_spec(axes, rules), mesh.axis_names)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        _check_fits(where, axes, spec, shape, mesh_shape)
        shardings.append(NamedSharding(mesh, spec))
    return jax.tree_util.tree_unflatten(treedef, shardings)


def _axis_type_of(mesh: Any, axis: str) -> AxisType:
    return dict(zip(mesh.axis_names, mesh.axis_types))[axis]


def with_logical_constraint(x: jax.Array, axes: Sequence[str | None], rules: Rules) -> jax.Array:
    """Constrains an activation's sharding by logical axes, with the mesh from context.

    ``x ↦ with_sharding_constraint(x, logical_to_spec(axes, rules))`` on ``Auto`` mesh axes and
    ``x ↦ reshard(x, spec)`` on ``Explicit`` ones (where a sharding constraint only asserts).
    Mesh axes that are ``Manual`` (inside ``jax.shard_map``) are dropped from the spec, since the
    data is already per-device along them, and so are optional mesh axes the mesh lacks. A
    no-op when no mesh is set (``jax.set_mesh``) or the mesh has a single device, so model code
    calls it unconditionally.

    Args:
      x: an array of any shape, e.g. hidden states ``[B, S, D]``.
      axes: one logical name (or ``None``) per dim of ``x``, e.g. ``("batch", None, "embed")``.
      rules: a rule table such as ``ACTIVATION_RULES``.

    Returns:
      ``x`` with the requested sharding (same shape, dtype and values).

    Raises:
      ValueError: the rank does not match, a dimension does not divide its mesh axes, a mesh
        axis is unknown to the context mesh, or the spec mixes ``Auto`` and ``Explicit`` axes.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    spec = spec_for_mesh(logical_to_spec(axes, rules), mesh.axis_names)
    manual = set(getattr(mesh, "manual_axes", ()))
    spec = PartitionSpec(
        *(spec_entry(tuple(a for a in mesh_axes_of(e) if a not in manual)) for e in spec)
    )
    _check_fits(f"with_logical_constraint{tuple(axes)}", axes, spec, x.shape, dict(mesh.shape))
    kinds = {_axis_type_of(mesh, a) for e in spec for a in mesh_axes_of(e)}
    if not kinds:
        # A fully replicated spec still constrains; pick the call the mesh's axes accept.
        kinds = {t for a, t in zip(mesh.axis_names, mesh.axis_types) if a not in manual}
    if not kinds:
        return x
    if kinds == {AxisType.Explicit}:
        return jax.sharding.reshard(x, spec)
    if kinds == {AxisType.Auto}:
        return jax.lax.with_sharding_constraint(x, spec)
    raise ValueError(
        f"with_logical_constraint{tuple(axes)}: spec {spec} mixes Explicit and Auto mesh axes "
        f"{tuple(mesh.axis_names)}; build the mesh with a single axis type"
    )


def mesh_context(mesh: Mesh | None):
    """A context making ``mesh`` the abstract mesh of code traced inside it (``nullcontext``
    for None), so ``with_logical_constraint`` in the model takes effect in a jitted function
    whose shardings name ``mesh``. Usable inside ``jax.jit`` (unlike ``jax.set_mesh``)."""
    if mesh is None:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
