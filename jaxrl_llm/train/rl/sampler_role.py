"""Where an RL run's sampler lives, decided once, and everything that follows from it.

The sampler is a role the trainer talks to; which of three places holds it is read from the
config once (``SamplerRole.of``), and the trainer asks the role, never the config:

- ``shared``: on the trainer's own devices (``mesh.rollout_devices: 0``), in the trainer's
  layout or a serving layout resharded on device (``train.rl.serving.trainer_sampler``);
- ``separate``: on devices of its own in this process (``mesh.rollout_devices: N`` on one
  process), the weights copied across after every update;
- ``remote``: on processes of its own (``mesh.rollout_devices`` spanning the last processes,
  ``train.rl.remote``), the weights sent device to device and the scored batches returned
  through the job's coordination service.

The role answers: the sampler's layout on this process (``layout``), how the trainer's weights
reach it (``send``), which pipeline brings the scored batches back (``pipeline``), and where a
held-out evaluation samples (``evaluation``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxrl_llm.sampling import serving
from jaxrl_llm.train.rl import remote
from jaxrl_llm.train.rl.pipeline import Pipeline, RolloutPipeline
from jaxrl_llm.train.rl.serving import trainer_sampler

SAMPLER_PLACES = ("shared", "separate", "remote")


@dataclasses.dataclass(frozen=True)
class SamplerRole:
    """The run's sampler as the trainer sees it (see the module).

    Attributes:
      place: one of ``SAMPLER_PLACES``.
      layout: the sampler's ``ServingLayout`` on this process's devices (``remote``: the
        layout the sampler processes use, mirrored here for the weights' partition specs).
      send: the trainer's parameters -> the sampler's (a reshard on device, a copy across
        devices, or ``remote.TrainerLink``'s send to the sampler processes).
    """

    place: str
    layout: serving.ServingLayout
    send: Callable[[Any], Any]

    @classmethod
    def of(cls, cfg: Any, model_config: Any, mesh: Any) -> SamplerRole:
        """The role of ``cfg``'s sampler for a policy of ``model_config`` trained on ``mesh``
        (call once every resident state is on device: ``auto`` layouts budget what is free)."""
        layout, send = trainer_sampler(cfg, model_config, mesh)
        if remote.is_remote(cfg):
            link = remote.TrainerLink(model_config, mesh, cfg.mesh.rollout_devices)
            return cls("remote", layout, link)
        return cls("separate" if cfg.mesh.rollout_devices else "shared", layout, send)

    def pipeline(
        self, produce: Callable, *, max_staleness: int, mesh: Any, partial: bool, prompts: Any
    ) -> Pipeline:
        """The pipeline that brings the scored batches: the sampler processes' (``remote``),
        else this process's ``produce`` inline or ``max_staleness`` steps ahead on a thread."""
        if self.place == "remote":
            return remote.RemotePipeline(max_staleness, prompts)
        return RolloutPipeline(produce, max_staleness, mesh, partial, prompts=prompts)

    def evaluation(
        self, policy_params: Any, sampler_params: Callable[[], Any], trainer_mesh: Any
    ) -> tuple[Any, Any]:
        """``(params, mesh)`` a held-out evaluation samples with: the sampler's weights on its
        layout, or (``remote``: the sampler's devices are another process's) the policy's on
        the trainer's mesh."""
        if self.place == "remote":
            return policy_params, trainer_mesh
        return sampler_params(), self.layout.mesh


__all__ = ["SAMPLER_PLACES", "SamplerRole"]
