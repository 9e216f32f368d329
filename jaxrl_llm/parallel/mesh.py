"""Device mesh construction: one ``("data", "fsdp", "tensor")`` mesh over every device.

Expert parallelism (``mesh.expert = e > 1``) adds a fourth axis, ``("data", "fsdp", "expert",
"tensor")``: a mixture-of-experts layer's experts are split over ``expert`` (``E / e`` whole
experts per device, tokens exchanged by all-to-all: ``models.moe``), and for every other layer
the axis is one more data axis (the batch is split over ``data x fsdp x expert``; dense weights
are replicated over it), as MaxText's ``expert`` axis and Megatron's expert-parallel groups
carved out of the data-parallel ranks. With ``e = 1`` (the default) the mesh has no ``expert``
axis at all -- the three-axis mesh of every job without expert parallelism, unchanged -- and the
rule tables' ``expert`` entries drop out (``rules.OPTIONAL_MESH_AXES``). ``expert`` sits next to
``tensor``, the minor (fastest-linked) end, since its all-to-all runs in every MoE layer.

Context parallelism (``mesh.sequence = s > 1``) adds a ``sequence`` axis after ``fsdp``:
``("data", "fsdp", "sequence", [expert,] "tensor")``. A training or scoring forward splits its
sequence over it (``models.context_parallel``: each device holds ``T / s`` positions of every
row and all-gathers the layer's keys and values), and the weights are stored split over
``fsdp x sequence`` (one more FSDP axis: ``rules.PARAM_RULES``). Absent at ``s = 1``.

Axis types. JAX 0.10's own ``jax.make_mesh`` defaults to ``AxisType.Explicit`` ("sharding in
types"): every array carries its sharding in its abstract type and an op whose output sharding is
ambiguous -- e.g. an einsum whose contracting dimension is sharded on both operands, which is
exactly what FSDP + tensor parallelism produce -- raises ``ShardingTypeError`` unless the call
passes ``out_sharding=``. This library follows the GSPMD recipe instead (logical-axis rule tables,
``jax.lax.with_sharding_constraint`` on activations, ``in_shardings``/``out_shardings`` on the
jitted step), which is what ``AxisType.Auto`` is for, so ``make_mesh`` defaults to
``axis_types="auto"``. ``"explicit"`` remains available for code written in the explicit style;
the helpers in :mod:`jaxrl_llm.parallel.rules` handle both (``reshard`` vs. a sharding
constraint). Either way the mesh is activated with ``jax.set_mesh(mesh)``, as a context manager or
globally.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh

MESH_AXES: tuple[str, str, str] = ("data", "fsdp", "tensor")
# The axes of a mesh with expert parallelism (``make_mesh(..., expert=e)``, ``e > 1``).
EXPERT_AXIS = "expert"
EXPERT_MESH_AXES: tuple[str, str, str, str] = ("data", "fsdp", EXPERT_AXIS, "tensor")
# The context-parallel axis (``make_mesh(..., sequence=s)``, ``s > 1``), after ``fsdp``.
SEQUENCE_AXIS = "sequence"

_AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def resolve_mesh_shape(
    data: int, fsdp: int, tensor: int, *, num_devices: int, expert: int = 1, sequence: int = 1
) -> tuple[int, int, int]:
    """Fills a ``-1`` axis so that ``data * fsdp * sequence * expert * tensor == num_devices``.

    Args:
      data: size of the pure data-parallel axis, or -1.
      fsdp: size of the fully-sharded data-parallel axis, or -1.
      tensor: size of the tensor-parallel axis, or -1.
      num_devices: the number of devices the mesh must cover exactly.
      expert: size of the expert-parallel axis (a positive int, never filled).
      sequence: size of the context-parallel axis (a positive int, never filled).

    Returns:
      The three concrete sizes ``(data, fsdp, tensor)``, in ``MESH_AXES`` order (``expert``
      and ``sequence`` are as given).

    Raises:
      ValueError: a size is not a positive int or -1 (``expert``, ``sequence``: not a positive
        int), more than one size is -1, or the sizes cannot multiply to ``num_devices``.
    """
    for name, size in (("expert", expert), ("sequence", sequence)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"mesh axis {name!r} must be a positive int, got {size!r}")
    extra = {k: n for k, n in (("sequence", sequence), ("expert", expert)) if n > 1}
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    for name, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            raise ValueError(f"mesh axis {name!r} must be a positive int or -1, got {size!r}")
    fill = [name for name, size in sizes.items() if size == -1]
    if len(fill) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {sizes}")
    shown = {**sizes, **extra}
    if fill:
        known = math.prod(size for size in sizes.values() if size != -1) * expert * sequence
        if num_devices % known:
            raise ValueError(
                f"cannot fill mesh axis {fill[0]!r}: the other sizes {shown} multiply to {known}, "
                f"which does not divide the {num_devices} devices"
            )
        sizes[fill[0]] = num_devices // known
    total = math.prod(sizes.values()) * expert * sequence
    if total != num_devices:
        product = f"data={sizes['data']} x fsdp={sizes['fsdp']} x tensor={sizes['tensor']}"
        product += "".join(f" x {k}={n}" for k, n in extra.items())
        raise ValueError(
            f"mesh sizes {product} = {total} must equal the number of devices ({num_devices})"
        )
    return sizes["data"], sizes["fsdp"], sizes["tensor"]


def make_mesh(
    data: int = 1,
    fsdp: int = -1,
    tensor: int = 1,
    *,
    expert: int = 1,
    sequence: int = 1,
    devices: Sequence[jax.Device] | None = None,
    axis_types: str | AxisType = "auto",
) -> Mesh:
    """Builds the ``("data", "fsdp", "tensor")`` device mesh over all (or the given) devices.

    ``data * fsdp * expert * tensor == len(devices)``; one of data, fsdp, tensor may be -1 and
    is filled. With ``expert > 1`` the mesh is ``("data", "fsdp", "expert", "tensor")``
    (``EXPERT_MESH_AXES``; see the module docstring), with ``sequence > 1`` it has a
    ``sequence`` axis after ``fsdp``. ``data``
    replicates parameters (pure data parallelism, e.g. across slices), ``fsdp`` shards the batch
    and the parameters' ``embed`` dimension (ZeRO-3 / FSDP, Rajbhandari et al., 2020), ``tensor``
    shards heads and the MLP width (Megatron-LM, Shoeybi et al., 2019); the compiler inserts the
    collectives (GSPMD, Xu et al., 2021). Devices are laid out by ``jax.make_mesh``, which follows
    the physical topology (ICI rings on TPU).

    Args:
      data: data-parallel axis size, or -1 to fill.
      fsdp: FSDP axis size, or -1 to fill (the default: all devices shard the batch and the state).
      tensor: tensor-parallel axis size, or -1 to fill.
      expert: expert-parallel axis size (mixture-of-experts layers; 1: no ``expert`` axis).
      sequence: context-parallel axis size (a training forward's sequence split over it; 1: no
        ``sequence`` axis).
      devices: the devices to use; defaults to ``jax.devices()`` (all processes' devices).
      axis_types: ``"auto"`` (default, see the module docstring) or ``"explicit"``, or a
        ``jax.sharding.AxisType``; applied to all three axes and always passed to JAX.

    Returns:
      A ``jax.sharding.Mesh`` with axis names ``MESH_AXES`` (``EXPERT_MESH_AXES`` when
      ``expert > 1``). Activate it with
      ``jax.set_mesh(mesh)``.

    Raises:
      ValueError: bad sizes (see ``resolve_mesh_shape``) or an unknown ``axis_types``.
    """
    if isinstance(axis_types, AxisType):
        if axis_types not in _AXIS_TYPES.values():
            raise ValueError(f"axis_types must be Auto or Explicit, got {axis_types}")
        axis_type = axis_types
    elif axis_types in _AXIS_TYPES:
        axis_type = _AXIS_TYPES[axis_types]
    else:
        raise ValueError(f"unknown axis_types {axis_types!r}; expected one of {tuple(_AXIS_TYPES)}")
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh needs at least one device, got an empty device list")
    data, fsdp, tensor = resolve_mesh_shape(
        data, fsdp, tensor, num_devices=len(devices), expert=expert, sequence=sequence
    )
    axes = [("data", data), ("fsdp", fsdp)]
    axes += [(SEQUENCE_AXIS, sequence)] if sequence > 1 else []
    axes += [(EXPERT_AXIS, expert)] if expert > 1 else []
    axes += [("tensor", tensor)]
    names = tuple(name for name, _ in axes)
    shape = tuple(size for _, size in axes)
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names), devices=devices)


def current_platform(mesh: Mesh | None = None) -> tuple[str, str]:
    """``(platform, device_kind)`` the code being traced will run on.

    The device of ``mesh`` when given, else of the context mesh (``jax.set_mesh``; an abstract
    mesh of TPU devices when ``plan`` compiles for a topology on this host), else JAX's first
    default device. Code that
    picks a per-backend formulation (attention kernel, CPU matmul backward, layer unrolling,
    micro-batch budget) asks this, not ``jax.default_backend()``.
    """
    device = current_device(mesh)
    return device.platform, device.device_kind


def current_device(mesh: Mesh | None = None) -> Any:
    """The device (or ``AbstractDevice``: ``platform``, ``device_kind``, ``num_cores``) that
    ``current_platform`` describes."""
    if mesh is not None:
        return mesh.devices.flat[0]
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return jax.devices()[0] if device is None else device
