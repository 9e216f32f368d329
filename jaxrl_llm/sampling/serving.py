"""The sampler's own parameter layout ("serving layout") and the on-device reshard into it.

The trainer stores its weights FSDP-sharded (``PARAM_RULES``: the model width split over
``fsdp``), which is right for the update -- each layer is gathered once per micro-batch -- and
wrong for decoding, where the same gather would run on every generated token (for Qwen2.5-7B
on 16 v5e chips, 22 GiB of all-gather per chip per token). Decoding wants the weights where
they are used: split by tensor parallelism (heads, MLP width, vocabulary; Megatron-LM) over a
few chips and replicated over the rest, in the compute dtype, as vLLM/SGLang serve them next to
verl's and MaxText's trainers.

The serving layout here is a second mesh over the *same devices in the same order*, with axes
``(data, fsdp=1, tensor=t)``: the trainer's ``PARAM_RULES`` / ``SAMPLING_RULES`` then give the
serving shardings unchanged (``fsdp`` has size 1, so ``embed`` is whole), and the model code's
sharding constraints need no second rule table. ``t`` is chosen (``choose_tensor``) as the
largest size within one host that the model's head counts, MLP width and vocabulary divide,
whose batch shards ``devices / t`` divide the rollout's rows, and whose weight shard plus
KV-cache shard (twice on TPU: ``DECODE_CACHE_COPIES``) fit the memory budget;
``make_reshard`` moves the trainer's parameters into it with one jitted program (casts on each
shard first, then collectives over ICI/NVLink: no host round trip).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm.models import cast_params, logical_axes, param_shapes
from jaxrl_llm.parallel import MESH_AXES, PARAM_RULES, logical_to_sharding

Params = dict[str, Any]

# rollout.tensor_parallel: "auto" (``choose_tensor``), "trainer" (decode on the trainer's
# layout), or a positive int (the serving tensor size).
TENSOR_CHOICES = ("auto", "trainer")
# Share of the free memory the serving weights and KV cache may take when ``auto`` chooses.
BUDGET_FRACTION = 0.9
# KV caches a decode program holds at once, by platform (default 1). XLA:TPU lays the cache out
# slot-major inside the decode loop (major to minor ``[L, S, K, B, H]``: a token's write fills
# whole tiles) while the program's arguments keep the default order, so the donated cache is
# relaid out on entry and back on exit: two copies at the peak (deviceless compile, libtpu
# 0.0.42: the decode program's temporaries are one cache plus the cast weights; with the
# cache's argument and result layouts left to the compiler, ``Layout.AUTO``, they drop by the
# cache, but prefill and decode would then have to hand the cache over in that layout).
DECODE_CACHE_COPIES = {"tpu": 2}


class ServingLayout(NamedTuple):
    """Where the sampler's parameters live: ``mesh`` (axes ``MESH_AXES``), the parameters'
    ``shardings`` on it, the ``tensor`` size, whether it is the trainer's own layout, and
    whether its devices are others than the trainer's (``mesh.rollout_devices``)."""

    mesh: Mesh
    shardings: Any
    tensor: int
    is_trainer_layout: bool
    separate: bool = False


def tensor_sizes(config: Any, devices: int) -> list[int]:
    """Tensor sizes ``t`` (ascending) that divide ``devices`` and every tensor-split dimension
    of ``config``: query and key/value heads, MLP width (each expert's, and a shared
    expert's, in a mixture-of-experts model) and vocabulary."""
    if getattr(config, "num_experts", 0):
        widths = (config.moe_intermediate_size, config.shared_expert_intermediate_size)
        mlp = tuple(w for w in widths if w)
    else:
        mlp = (config.intermediate_size,)
    dims = (config.num_attention_heads, config.num_key_value_heads, *mlp, config.vocab_size)
    return [t for t in range(1, devices + 1) if devices % t == 0 and all(d % t == 0 for d in dims)]


def weight_bytes(config: Any, dtype: Any) -> int:
    """Bytes of all the model's parameters in ``dtype``."""
    itemsize = jnp.dtype(dtype).itemsize
    return sum(math.prod(s.shape) * itemsize for s in jax.tree.leaves(param_shapes(config)))


def cache_bytes(config: Any, rows: int, slots: int, dtype: Any) -> int:
    """Bytes of a KV cache of ``rows x slots`` positions (keys and values, every layer)."""
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    return rows * slots * per_token * jnp.dtype(dtype).itemsize


def choose_tensor(
    config: Any,
    *,
    devices: int,
    local_devices: int,
    rows: tuple[int, ...],
    kv_rows: int,
    kv_slots: int,
    dtype: Any,
    budget_bytes: float | None,
    cache_copies: int = 1,
) -> int | None:
    """The serving tensor size ``auto`` picks, or None when none fits.

    A size ``t`` qualifies when it is in ``tensor_sizes`` and the batch shards ``devices / t``
    divide every count in ``rows`` (the prefill's prompts, the decode rows). A decode step is
    HBM-bound: each device reads its ``weights / t`` and its share of the cache per token, so
    the largest ``t`` is the fastest as long as its per-layer all-reduces stay on one host's
    links (ICI within a TPU host, NVLink within a GPU node), as MaxText and vLLM serve. The
    order tried is therefore: qualifying sizes up to ``local_devices``, largest first, then
    larger (cross-host) sizes, smallest first; the first with ``weights / t + cache_copies x
    cache / devices <= budget_bytes`` per device wins (the cache's rows split over the batch
    shards, its kv-heads over ``t``; ``cache_copies``: the caches the decode program holds at
    once, ``DECODE_CACHE_COPIES``). Without a budget (no device memory limit is known, e.g. on
    CPU) the first in that order.
    """
    weights = weight_bytes(config, dtype)
    cache = cache_bytes(config, kv_rows, kv_slots, dtype)
    sizes = [t for t in tensor_sizes(config, devices) if not any(r % (devices // t) for r in rows)]
    order = [t for t in reversed(sizes) if t <= local_devices]
    order += [t for t in sizes if t > local_devices]
    for t in order:
        if budget_bytes is None or weights / t + cache_copies * cache / devices <= budget_bytes:
            return t
    return None


def serving_mesh(mesh: Mesh, tensor: int) -> Mesh:
    """``mesh``'s devices, same order, as ``(data = devices / tensor, fsdp = 1, tensor)``.

    Keeping the device order keeps the device assignment, so one jitted program can take
    arguments on ``mesh`` and return them on the serving mesh; the tensor axis is the minor
    one (neighbouring devices in ``mesh``'s order, an ICI ring on TPU).
    """
    if mesh.size % tensor:
        raise ValueError(f"serving tensor size {tensor} does not divide {mesh.size} devices")
    devices = np.asarray(mesh.devices).reshape(mesh.size // tensor, 1, tensor)
    # (A trainer mesh with an expert axis has four axes, all of one type; the serving mesh has
    # none: the sampler holds every expert, tensor-split.)
    return Mesh(devices, MESH_AXES, axis_types=(mesh.axis_types[0],) * len(MESH_AXES))


def serving_layout(
    config: Any,
    mesh: Mesh,
    *,
    tensor: int | str = "auto",
    rows: tuple[int, ...] = (),
    kv_rows: int = 0,
    kv_slots: int = 0,
    budget_bytes: float | None = None,
) -> ServingLayout:
    """The sampler's layout on ``mesh``'s devices.

    Args:
      config: the model config (its ``compute_dtype`` is the serving dtype).
      mesh: the trainer's mesh (axes ``MESH_AXES``).
      tensor: ``"trainer"`` (the trainer's mesh and ``PARAM_RULES`` shardings), a positive
        int (that serving tensor size), or ``"auto"`` (the trainer's layout when its mesh has
        no fsdp axis, else ``choose_tensor``, else the trainer's layout when nothing
        qualifies).
      rows: counts the batch shards must divide (prompts per prefill, decode rows).
      kv_rows, kv_slots: the KV cache the budget must also hold.
      budget_bytes: per-device bytes for the serving weights and cache, the cache counted
        ``DECODE_CACHE_COPIES`` times on the mesh's platform (None: unlimited).

    Raises:
      ValueError: an unknown ``tensor`` choice, or an int that does not divide the devices,
        the model's tensor-split dimensions or ``rows``' batch shards.

    A trainer mesh already shaped ``(data, 1, tensor)`` is its own serving layout (one
    device, or a data x tensor mesh): the sampler then uses it as it is.
    """
    if isinstance(tensor, bool) or not (
        tensor in TENSOR_CHOICES or (isinstance(tensor, int) and tensor >= 1)
    ):
        raise ValueError(
            f"rollout.tensor_parallel must be 'auto', 'trainer' or a positive int, got {tensor!r}"
        )
    shapes = param_shapes(config)
    sizes = dict(mesh.shape)
    # The weights are gathered per token over fsdp (and a context-parallel sequence axis).
    if tensor == "auto" and sizes["fsdp"] * sizes.get("sequence", 1) == 1:
        tensor = "trainer"  # already a serving layout: nothing to gather per token
    if tensor == "auto":
        dtype = config.compute_dtype or jnp.float32
        first = mesh.devices.flat[0].process_index
        platform = mesh.devices.flat[0].platform
        tensor = choose_tensor(
            config,
            devices=mesh.size,
            local_devices=sum(d.process_index == first for d in mesh.devices.flat),
            rows=rows,
            kv_rows=kv_rows,
            kv_slots=kv_slots,
            dtype=dtype,
            budget_bytes=budget_bytes,
            cache_copies=DECODE_CACHE_COPIES.get(platform, 1),
        )
        tensor = "trainer" if tensor is None else tensor
    if tensor == "trainer" or dict(mesh.shape) == {
        "data": mesh.size // tensor,
        "fsdp": 1,
        "tensor": tensor,
    }:  # (the trainer's layout is already the serving one, e.g. on one device)
        shardings = logical_to_sharding(logical_axes(config), mesh, PARAM_RULES, shapes=shapes)
        return ServingLayout(mesh, shardings, dict(mesh.shape)["tensor"], True)
    if tensor not in tensor_sizes(config, mesh.size):
        raise ValueError(
            f"rollout.tensor_parallel={tensor} must divide the {mesh.size} devices, the "
            f"{config.num_attention_heads} query heads, {config.num_key_value_heads} key/value "
            f"heads, MLP width {config.intermediate_size} and vocabulary {config.vocab_size}; "
            f"sizes that do: {tensor_sizes(config, mesh.size)}"
        )
    shards = mesh.size // tensor
    bad = [r for r in rows if r % shards]
    if bad:
        raise ValueError(
            f"rollout.tensor_parallel={tensor} leaves {shards} batch shards, which do not "
            f"divide the rollout's {bad[0]} rows (prompts_per_step and prompts x group_size)"
        )
    smesh = serving_mesh(mesh, tensor)
    shardings = logical_to_sharding(logical_axes(config), smesh, PARAM_RULES, shapes=shapes)
    return ServingLayout(smesh, shardings, tensor, False)


def make_reshard(config: Any, layout: ServingLayout):
    """``params -> params`` in the compute dtype on ``layout`` (on device).

    The cast runs on each source shard before the collectives, so they move compute-dtype
    bytes. For the trainer's layout the parameters are returned as they are (the sampler casts
    them once per call, as before).
    """
    if layout.is_trainer_layout:
        return lambda params: params
    return cast_to(config, layout.shardings, separate=layout.separate)


def cast_to(config: Any, shardings: Any, *, separate: bool = False):
    """``tree -> tree`` in the compute dtype on ``shardings``: one jitted program when they
    are on the tree's devices (the serving mesh orders the trainer's devices, so one device
    assignment covers both); with ``separate`` (the sampler on devices of its own) the cast
    runs on the source devices and ``jax.device_put`` copies the result across.

    A tree's stacked ``layers`` (``[L, ...]`` leaves, the layer dim whole in ``shardings``)
    move one layer at a time (a scan over L), so the program's temporaries hold one layer in
    flight, not the whole stack gathered at once."""
    if not separate:
        return jax.jit(
            lambda tree: _layer_by_layer(cast_params(tree, config), shardings, config),
            out_shardings=shardings,
        )
    cast = jax.jit(lambda tree: cast_params(tree, config))
    return lambda tree: jax.device_put(cast(tree), shardings)


def _constrain(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, sharding)


def _layer_by_layer(tree: Any, shardings: Any, config: Any) -> Any:
    """``tree`` with its stacked ``layers`` resharded to ``shardings["layers"]`` a layer at a
    time (unchanged when there are none, or their layer dim is split)."""
    layers = tree.get("layers") if isinstance(tree, dict) else None
    targets = shardings.get("layers") if isinstance(shardings, dict) else None
    leaves = jax.tree.leaves(targets)
    if not isinstance(layers, dict) or not leaves:
        return tree
    if any(not hasattr(t, "spec") or (len(t.spec) and t.spec[0] is not None) for t in leaves):
        return tree
    per_layer = jax.tree.map(lambda t: NamedSharding(t.mesh, PartitionSpec(*t.spec[1:])), targets)
    axes = logical_axes(config).get("layers")
    if not isinstance(axes, dict) or set(axes) != set(layers):  # e.g. a LoRA adapter tree
        axes = jax.tree.map(lambda x: (None,) * x.ndim, layers)
    # The FSDP-stored dim (``embed``) of each weight, its layer dim dropped, or None.
    fsdp_dims = jax.tree.map(
        lambda a: a.index("embed") - 1 if "embed" in a else -1,
        axes,
        is_leaf=lambda a: isinstance(a, tuple),
    )

    def move(_, layer):
        return None, jax.tree.map(_move_layer, layer, fsdp_dims, per_layer)

    _, moved = jax.lax.scan(move, None, layers)
    return {**tree, "layers": moved}


def _move_layer(x: jax.Array, fsdp_dim: int, target: NamedSharding) -> jax.Array:
    """One layer's weight from its stored (FSDP) sharding to its serving one in two clean
    collectives: the dim FSDP splits (``fsdp_dim``; ``-1``: none), whole in serving, first lies
    on the serving mesh's ``data`` axis with the serving split in place (an all-to-all within
    each data group), then is gathered over ``data``. Each device so receives about its
    serving shard, not the whole layer (a direct move gathers the layer first)."""
    sizes = dict(target.mesh.shape)

    def axes(entry: Any) -> tuple[str, ...]:  # the entry's mesh axes of size > 1
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        return tuple(a for a in names if sizes[a] > 1)

    spec = [*target.spec, *[None] * (x.ndim - len(target.spec))]
    data = sizes.get("data", 1)
    used = {a for entry in spec for a in axes(entry)}
    dim = fsdp_dim
    if dim >= 0 and data > 1 and "data" not in used and not axes(spec[dim]):
        if x.shape[dim] % data == 0:
            staged = PartitionSpec(*spec[:dim], "data", *spec[dim + 1 :])
            x = _constrain(x, NamedSharding(target.mesh, staged))
    return _constrain(x, target)


def free_device_bytes(mesh: Mesh) -> float | None:
    """The least free memory over ``mesh``'s local devices (None where it is not reported)."""
    free = []
    for device in mesh.devices.flat:
        if device.process_index != jax.process_index():
            continue
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return None
        free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return min(free) if free else None


__all__ = [
    "BUDGET_FRACTION",
    "DECODE_CACHE_COPIES",
    "TENSOR_CHOICES",
    "ServingLayout",
    "cache_bytes",
    "cast_to",
    "choose_tensor",
    "free_device_bytes",
    "make_reshard",
    "serving_layout",
    "serving_mesh",
    "tensor_sizes",
    "weight_bytes",
]
