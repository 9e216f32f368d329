"""A plan of a job whose sampler has chips of its own (``mesh.rollout_devices = n``), as
``train`` runs it.

Which chips: ``train.setup.split_devices`` over the slice's devices — on a one-host slice the
first ``n`` sample in the trainer's process, the trainer's mesh takes the rest; on a slice of
several hosts the last ``n`` chips, whole hosts, sample in processes of their own
(``train.rl.remote``: two processes for now, one sampling and one training, the trainer's
mesh as many chips as the sampler's, what ``check_remote_split`` refuses refused here too).

What crosses after each update: the trainer casts its parameters to the compute dtype on its
own layout (``reshard``, a program on the trainer's chips); then
- one host: ``jax.device_put`` into the sampler's serving layout — each sampler chip receives
  its serving shard, ``W / t`` bytes for ``W`` the compute-dtype weights and ``t`` the
  sampler's tensor size (every one of its ``n / t`` replicas gets all ``W``);
- several hosts: shard for shard onto the sampler's chips laid out as the trainer's mesh
  (``W / n`` a chip, ``W`` in all), then the sampler reshards them into its serving layout
  (``serving_reshard``, a program on the sampler's chips).

The copy's time (``weight_sync``) is a bandwidth bound over ICI: the larger of a chip's bytes
over its ports (``ici_links`` links one way) on either side, and the bytes crossing the cut
between the two groups of chips over the links that cross it (counted from the chips'
coordinates). The RL step is ``R + S + U`` (rollout, weight sync, trainer) with
``rollout.max_staleness = 0`` and ``max(R, S + U)`` with ``k >= 1``, the rollout of step
``s + 1`` running beside the update of step ``s`` (benchmarks/RESULTS.md measured this model's
phases on CPU).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jaxrl_llm import models
from jaxrl_llm.plan._job import PlanError, Program, shard_bytes, with_shardings
from jaxrl_llm.plan.topology import TopologySpec
from jaxrl_llm.sampling import serving
from jaxrl_llm.train import setup
from jaxrl_llm.train.rl import remote
from jaxrl_llm.train.rl.serving import separate_layout

PyTree = Any

# The programs that run on the sampler's chips; the others run on the trainer's.
SAMPLER_PROGRAMS = ("serving_reshard", "prefill", "decode_step")


def on_trainer_chips(split: Split | None, name: str) -> bool:
    """Whether program ``name`` runs on the trainer's chips, where the trainer's resident
    state (its frozen models included) lives: every program, but the sampler's when it has
    chips of its own (``split``)."""
    return split is None or name not in SAMPLER_PROGRAMS


ASSUMPTIONS = (
    "mesh.rollout_devices: the weight copy after each update moves at the ICI bandwidth of the "
    "busier side's ports or of the links crossing between the two groups of chips, whichever "
    "is slower (no other traffic); the RL step is rollout + sync + trainer with "
    "rollout.max_staleness=0, max(rollout, sync + trainer) with k >= 1",
)


@dataclasses.dataclass(frozen=True)
class Split:
    """The chips of a job with ``mesh.rollout_devices``.

    Attributes:
      sampler_devices, trainer_devices: the slice's chips of each side.
      remote: the sampler on processes (hosts) of its own.
      sync: the weight copy after each update (``weight_sync``), set once the sampler's
        layout is known.
    """

    sampler_devices: tuple
    trainer_devices: tuple
    remote: bool
    sync: Mapping[str, Any] | None = None


def split_job(cfg, devices: Sequence[Any]) -> Split | None:
    """The ``Split`` of ``cfg.mesh.rollout_devices`` over ``devices`` (None without one).

    Raises:
      PlanError: a count outside ``[1, chips)``, LoRA or a learned reward model (not planned
        with sampler chips yet); ``check_trainer_mesh`` checks the hosts.
    """
    n = cfg.mesh.rollout_devices
    if not n:
        return None
    devices = list(devices)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n < len(devices):
        raise PlanError(
            f"mesh.rollout_devices must be an int in [0, {len(devices)}) (chips that only "
            f"sample; the trainer keeps the rest), got {n!r}"
        )
    for key, set_ in (
        ("model.lora", cfg.model.lora is not None),
        ("reward_model.path", cfg.reward_model.path is not None),
    ):
        if set_:
            raise PlanError(f"{key} with mesh.rollout_devices is not planned yet")
    sampler, trainer = setup.split_devices(n, devices)
    return Split(tuple(sampler), tuple(trainer), setup.process_count(devices) > 1)


def check_trainer_mesh(cfg, split: Split, trainer_mesh) -> None:
    """What ``train`` refuses of a sampler on hosts of its own, on the planned mesh.

    Raises:
      PlanError: ``train.rl.remote.check_remote_split``'s refusals.
    """
    if split.remote:
        devices = [*split.trainer_devices, *split.sampler_devices]
        try:
            remote.check_remote_split(cfg, devices, trainer_mesh.devices.size)
        except ValueError as err:
            raise PlanError(str(err)) from None


def sampler_layout(cfg, model_config, split: Split, spec: TopologySpec) -> serving.ServingLayout:
    """The sampler's layout ``train`` picks on its chips (``separate_layout``), the chip's
    usable HBM its budget (nothing else lives there)."""
    try:
        return separate_layout(
            cfg, model_config, split.sampler_devices, spec.usable_hbm_bytes_per_chip
        )
    except ValueError as err:
        raise PlanError(f"the sampler's layout: {err}") from None


def cut_links(a: Sequence[Any], b: Sequence[Any], spec: TopologySpec) -> int | None:
    """ICI links between chips of ``a`` and chips of ``b``: pairs one step apart along one
    axis of the slice (around it where the axis wraps). None when a device has no
    coordinates (CPU devices)."""
    coords = [getattr(d, "coords", None) for d in (*a, *b)]
    if any(c is None for c in coords):
        return None
    others = {tuple(d.coords) for d in b}
    links = 0
    for device in a:
        here = tuple(device.coords)
        neighbours = set()
        for axis, size in enumerate(spec.shape):
            for step in (-1, 1):
                there = list(here)
                there[axis] += step
                if spec.wrap[axis]:
                    there[axis] %= size
                if tuple(there) != here:
                    neighbours.add(tuple(there))
        links += len(neighbours & others)
    return links


def weight_sync(
    spec: TopologySpec, split: Split, weight_bytes: float, sampler_tensor: int
) -> dict[str, Any]:
    """The weight copy after each update (see the module's docstring): bytes, per-chip bytes
    sent and received, the links crossing between the two groups and the bound's seconds.

    Args:
      weight_bytes: ``W``, the whole model's weights in the compute dtype.
      sampler_tensor: ``t``, the sampler's tensor-parallel size.
    """
    n_s, n_t = len(split.sampler_devices), len(split.trainer_devices)
    if split.remote:  # shard for shard onto a mirror of the trainer's mesh
        crossing, received = weight_bytes, weight_bytes / n_s
    else:  # each sampler chip gets its serving shard
        received = weight_bytes / sampler_tensor
        crossing = received * n_s
    sent = crossing / n_t
    link = spec.ici_bandwidth_bytes_per_s_per_link
    ports = spec.ici_links * link
    links = cut_links(split.trainer_devices, split.sampler_devices, spec)
    bounds = {"ports_s": max(sent, received) / ports}
    if links:
        bounds["cut_s"] = crossing / (links * link)
    return {
        "bytes": crossing,
        "sent_bytes_per_chip": sent,
        "received_bytes_per_chip": received,
        "cut_links": links,
        **bounds,
        "seconds": max(bounds.values()),
    }


def compute_weight_bytes(params: PyTree, model_config) -> int:
    """``W``: the whole model's floating weights in the compute dtype (integers as they are)."""
    compute = jnp.dtype(model_config.compute_dtype)
    total = 0
    for leaf in jax.tree.leaves(params):
        floating = jnp.issubdtype(leaf.dtype, jnp.floating)
        total += math.prod(leaf.shape) * (compute.itemsize if floating else leaf.dtype.itemsize)
    return total


def lower_split_programs(
    programs: dict[str, Program],
    cfg,
    model_config,
    state,
    sizes,
    layout: serving.ServingLayout,
    trainer_mesh,
    split: Split,
    resident: Mapping[str, int],
) -> tuple[PyTree, int]:
    """Adds ``reshard`` (the trainer's cast) and, with the sampler on hosts of its own,
    ``serving_reshard`` (the sampler's reshard of the landed shards); returns the sampler's
    abstract parameters on its layout and their bytes a chip."""
    cast_fn = lambda p: models.cast_params(p, model_config)  # noqa: E731
    trainer_shardings = jax.tree.map(lambda p: p.sharding, state.params)
    cast = jax.eval_shape(cast_fn, state.params)
    cast = with_shardings(cast, trainer_shardings)
    programs["reshard"] = Program(
        name="reshard",
        lowered=jax.jit(cast_fn, out_shardings=trainer_shardings).lower(state.params),
        calls_per_step=1,
        flops=0.0,
        model_flops=0.0,
        tokens=0,
        argument_parts={"parameters": sizes.params},
        resident=dict(resident),
        inner_parts={"sampler_weights": shard_bytes(cast)},
    )
    params = with_shardings(
        jax.tree.map(lambda c: jax.ShapeDtypeStruct(c.shape, c.dtype), cast), layout.shardings
    )
    served = shard_bytes(params)
    if split.remote:
        # ``remote.to_serving``: the landed shards relabelled into the serving mesh's device
        # order (no copy), then resharded by a jitted program: that program is planned.
        landing = Mesh(
            layout.mesh.devices.reshape(trainer_mesh.devices.shape), trainer_mesh.axis_names
        )
        landed = jax.tree.map(
            lambda c, s: jax.ShapeDtypeStruct(
                c.shape, c.dtype, sharding=NamedSharding(landing, s.spec)
            ),
            cast,
            trainer_shardings,
        )
        programs["serving_reshard"] = Program(
            name="serving_reshard",
            lowered=jax.jit(lambda t: t, out_shardings=layout.shardings).lower(landed),
            calls_per_step=1,
            flops=0.0,
            model_flops=0.0,
            tokens=0,
            argument_parts={},
            # The previous step's copy is in use until the new one replaces it.
            resident={"sampler_weights": served},
            inner_parts={"sampler_weights": served},
        )
    return params, served


def split_report(job, programs: Mapping[str, dict], step_key: str = "step_s") -> dict[str, Any]:
    """The RL step of a split job: rollout (sampler chips), trainer and weight-sync seconds,
    how they combine (``rollout.max_staleness``), and each side's idle share."""
    split, k = job.split, job.run.sampler.max_staleness
    rollout = trainer = 0.0
    for name, p in programs.items():
        seconds = p["calls_per_step"] * p["times"][step_key]
        if name in SAMPLER_PROGRAMS:
            rollout += seconds
        else:
            trainer += seconds
    sync = split.sync["seconds"]
    step = max(rollout, sync + trainer) if k else rollout + sync + trainer
    return {
        "sampler_chips": len(split.sampler_devices),
        "trainer_chips": len(split.trainer_devices),
        "sampler_on_hosts_of_its_own": split.remote,
        "max_staleness": k,
        "rollout_s": rollout,
        "trainer_s": trainer,
        "weight_sync_s": sync,
        "weight_sync": dict(split.sync),
        "step_s": step,
        "step_model": "max(rollout, sync + trainer)" if k else "rollout + sync + trainer",
        "sampler_idle": 1.0 - rollout / step if step else 0.0,
        "trainer_idle": 1.0 - (sync + trainer) / step if step else 0.0,
    }


__all__ = [
    "ASSUMPTIONS",
    "SAMPLER_PROGRAMS",
    "Split",
    "check_trainer_mesh",
    "compute_weight_bytes",
    "cut_links",
    "lower_split_programs",
    "on_trainer_chips",
    "sampler_layout",
    "split_job",
    "split_report",
    "weight_sync",
]
