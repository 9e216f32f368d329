"""The RL rollout's sampler layout (``rollout.tensor_parallel``), as ``train`` and ``plan``
both choose it (``jaxrl_llm.sampling.serving``)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from jaxrl_llm import parallel
from jaxrl_llm.sampling import serving
from jaxrl_llm.train import setup
from jaxrl_llm.train.rl.config import rollout_rows

log = logging.getLogger(__name__)


def rollout_layout(
    cfg: Any, model_config: Any, mesh: Any, *, kv_slots: int, budget_bytes: float | None
) -> serving.ServingLayout:
    """The sampler's layout for an RL job's rollouts.

    The batch shards must divide the prefill's prompts (``rollout.prompts_per_step``), the
    decode rows (times ``rollout.group_size``), the evaluation's prompts and the continuous
    engine's slots; ``auto`` budgets the KV cache of the decode rows (or slots) of
    ``kv_slots`` positions plus the serving weights against ``BUDGET_FRACTION`` of
    ``budget_bytes`` (per device, what the resident state leaves; None: unknown).
    """
    r = cfg.rollout
    rows = rollout_rows(r)
    counts = (r.prompts_per_step, rows, cfg.data.eval_size) + ((r.slots,) if r.slots else ())
    return serving.serving_layout(
        model_config,
        mesh,
        tensor=r.tensor_parallel,
        rows=counts,
        kv_rows=min(r.slots or rows, rows),
        kv_slots=kv_slots,
        budget_bytes=None if budget_bytes is None else serving.BUDGET_FRACTION * budget_bytes,
    )


def trainer_sampler(
    cfg: Any, model_config: Any, mesh: Any
) -> tuple[serving.ServingLayout, Callable]:
    """``(layout, reshard)`` of a run's sampler, chosen once every resident state is on device
    (``auto`` budgets the free device memory; the cache of ``data.max_prompt_tokens +
    rollout.max_new_tokens`` positions a row). With ``mesh.rollout_devices`` the sampler has
    devices of its own: ``reshard`` casts on the trainer's devices and copies across."""
    if cfg.mesh.rollout_devices:
        return _separate_sampler(cfg, model_config)
    layout = _budgeted_layout(cfg, model_config, mesh)
    if not layout.is_trainer_layout:
        log.info(
            "sampler layout: mesh %s (tensor-parallel %d, compute-dtype weights), resharded on "
            "device every step",
            dict(layout.mesh.shape),
            layout.tensor,
        )
    return layout, serving.make_reshard(model_config, layout)


def _budgeted_layout(cfg: Any, model_config: Any, mesh: Any) -> serving.ServingLayout:
    """:func:`rollout_layout` on ``mesh`` within its devices' free memory, a row's cache
    holding ``data.max_prompt_tokens + rollout.max_new_tokens`` positions."""
    return rollout_layout(
        cfg,
        model_config,
        mesh,
        kv_slots=cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens,
        budget_bytes=serving.free_device_bytes(mesh),
    )


def _separate_sampler(cfg: Any, model_config: Any) -> tuple[serving.ServingLayout, Callable]:
    """The sampler on ``mesh.rollout_devices`` devices of its own (``setup.split_devices``),
    laid out by :func:`separate_layout` within their free memory."""
    devices = setup.split_devices(cfg.mesh.rollout_devices)[0]
    probe = parallel.make_mesh(1, -1, 1, devices=devices)
    layout = separate_layout(cfg, model_config, devices, serving.free_device_bytes(probe))
    log.info(
        "sampler on devices %s: mesh %s (tensor-parallel %d); weights copied from the "
        "trainer's devices after every update",
        [d.id for d in devices],
        dict(layout.mesh.shape),
        layout.tensor,
    )
    return layout, serving.make_reshard(model_config, layout)


def separate_layout(
    cfg: Any, model_config: Any, devices: Sequence[Any], budget_bytes: float | None
) -> serving.ServingLayout:
    """The layout of a sampler on ``devices`` of its own (``mesh.rollout_devices``):
    ``rollout.tensor_parallel`` (``auto``: as on a trainer mesh of those devices within
    ``budget_bytes`` a device, a row's cache holding ``data.max_prompt_tokens +
    rollout.max_new_tokens`` positions; replicated weights when nothing fits). ``plan`` calls
    it with a slice's compile-only devices and the chip's usable HBM.

    Raises:
      ValueError: ``rollout.tensor_parallel=trainer`` (the sampler has devices of its own).
    """
    if cfg.rollout.tensor_parallel == "trainer":
        raise ValueError(
            "rollout.tensor_parallel=trainer: with mesh.rollout_devices the sampler has devices "
            "of its own; use auto or a tensor size"
        )
    rollout_mesh = parallel.make_mesh(1, -1, 1, devices=list(devices))
    kv_slots = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    layout = rollout_layout(
        cfg, model_config, rollout_mesh, kv_slots=kv_slots, budget_bytes=budget_bytes
    )
    if layout.is_trainer_layout:  # an fsdp layout: decode with whole weights per device
        one = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, tensor_parallel=1))
        layout = rollout_layout(one, model_config, rollout_mesh, kv_slots=0, budget_bytes=None)
    return layout._replace(is_trainer_layout=False, separate=True)
