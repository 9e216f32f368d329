"""``plan``'s auxiliary trained models: PPO's critic and PRIME's implicit PRM.

Each is built from the description its trainer builds from (``train.rl.ppo.CriticLayout``,
``train.rl.prime.prm_params_axes`` / ``fresh_prm_params``): an abstract state resident all
step (the ``aux_model`` memory part) and the programs that read or train it.

PPO's critic (``PPOTrainer.setup_extra_networks``) is the policy's architecture with a scalar
head, or with ``critic.init=reward_model`` the architecture of the scalar-head model at
``critic.path`` (its ``config.json``, ``plan._frozen_model.side_model_config``), in
``model.param_dtype``. With ``critic.optimizer=separate`` it has its own state and AdamW
(``values``, ``critic_update``); with ``joint`` one state holds ``{"policy", "value"}`` under
the trainer's optimizer, and the update program is the joint step (``make_joint_step``: policy
loss + ``value_coef`` x value loss), no ``critic_update``. The joint state is split for the
memory parts, each byte counted once: the policy's parameters, their moments and the state's
counters (``parameters``, ``optimizer_state``), the critic's parameters and moments
(``aux_model``).

With ``model.lora`` (``PPOTrainer``, ``PRIMETrainer``) the auxiliary model
trains adapters too: the critic its own adapters and scalar head over a frozen backbone -- the
policy's base itself with ``critic.init=policy`` (``adapters.backbone_view``: the same arrays,
counted once, in ``frozen_base``) or ``critic.path``'s backbone in the compute dtype with
``critic.init=reward_model`` (its own, counted in ``aux_model``); the PRM its own adapters over
the policy's base. Their programs take the frozen half as the trainer passes it (the update's
frozen parameters, ``merge_trees`` of the two halves for the values forward).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxrl_llm import models
from jaxrl_llm.models import heads
from jaxrl_llm.plan._frozen_model import side_model_config
from jaxrl_llm.plan._job import (
    PlanError,
    StateBytes,
    _optimizer_bytes,
    shard_bytes,
)
from jaxrl_llm.train import adapters, setup
from jaxrl_llm.train.optim import make_model_optimizer
from jaxrl_llm.train.rl.ppo import CriticLayout
from jaxrl_llm.train.rl.prime import fresh_prm_params, prm_params_axes
from jaxrl_llm.train.state import TrainState, abstract_train_state
from jaxrl_llm.train.step import merge_trees

ASSUMPTIONS = (
    "critic.optimizer=joint: one AdamW (trainer.*) over the policy and the critic, the update "
    "being the joint step; the critic's warm-up steps (critic.warmup_steps: the value loss "
    "alone) are not planned, only the steady state",
)


@dataclasses.dataclass(frozen=True)
class Aux:
    """The auxiliary model's abstract state (PPO's critic, PRIME's PRM).

    Attributes:
      optimizer: its optimizer (the trainer's with ``joint``).
      state, shardings: its ``TrainState`` and ``NamedSharding``s; with ``joint`` the one
        state over ``{"policy": ..., "value": ...}``.
      config: its ``ModelConfig`` (the critic's: the policy's or ``critic.path``'s).
      joint: ``critic.optimizer=joint``.
      source: ``critic.path`` when the critic starts from a reward model, else None.
      frozen, frozen_shardings: a LoRA model's frozen half as its update takes it (the
        critic's ``{"backbone": ...}``, the PRM's base; with ``joint`` ``{"policy": base,
        "value": ...}``), None without LoRA.
      own_frozen: the per-chip bytes of a frozen half that is not the policy's base (a
        reward model's backbone under a LoRA critic), else 0.
    """

    optimizer: Any
    state: TrainState
    shardings: TrainState
    config: models.ModelConfig
    joint: bool = False
    source: str | None = None
    frozen: Any = None
    frozen_shardings: Any = None
    own_frozen: int = 0

    @property
    def params(self) -> Any:
        """The auxiliary model's parameters (the critic's share of a joint state)."""
        return self.state.params["value"] if self.joint else self.state.params

    @property
    def param_shardings(self) -> Any:
        return self.shardings.params["value"] if self.joint else self.shardings.params

    @property
    def model_frozen(self) -> tuple[Any, Any]:
        """``(frozen, shardings)`` of the auxiliary model alone (a joint state's ``value``)."""
        if self.joint and self.frozen is not None:
            return self.frozen["value"], self.frozen_shardings["value"]
        return self.frozen, self.frozen_shardings

    def full(self, trained: Any, shardings: bool = False) -> Any:
        """The model's whole parameters (``PPOTrainer.value_params``): ``trained`` with its
        frozen half (its shardings' with ``shardings``)."""
        frozen = self.model_frozen[1 if shardings else 0]
        return trained if frozen is None else merge_trees(frozen, trained)


def policy_view(tree: TrainState) -> TrainState:
    """The policy's share of a joint state (or of its shardings): its parameters, the state's
    step and key; the optimizer state, over both models, is left out (``with_aux_bytes``)."""
    return TrainState(step=tree.step, params=tree.params["policy"], opt_state=None, rng=tree.rng)


def critic_config(cfg, model_config: models.ModelConfig) -> models.ModelConfig:
    """The critic's architecture: the policy's, or ``critic.path``'s with
    ``critic.init=reward_model`` (``PPOTrainer._initial_value_params``)."""
    if cfg.critic.init != "reward_model":
        return model_config
    return side_model_config(cfg.critic.path, "critic.path", model_config, cfg.model)


def aux_state(cfg, objective, model_config, mesh, optimizer=None, policy_frozen=None) -> Aux | None:
    """The job's auxiliary model (``optimizer``: the trainer's, for a joint critic;
    ``policy_frozen``: a LoRA policy's ``plan._lora.Frozen``), or None.

    Raises:
      PlanError: a ``critic.path`` plan cannot read or the trainer refuses, or a weight the
        mesh does not divide.
    """
    dtype = setup.param_dtype(cfg.model)
    try:
        if objective.needs_critic:  # PPO
            return _critic_state(cfg, model_config, mesh, optimizer, dtype, policy_frozen)
        if objective.needs_process_rewards:  # PRIME: a trainable copy of the policy
            own = make_model_optimizer(cfg.prime)
            state = abstract_train_state(
                model_config,
                own,
                mesh=mesh,
                init_params=lambda key: fresh_prm_params(model_config, key, dtype),
                params_axes=prm_params_axes(model_config),
            )
            if policy_frozen is None:
                return Aux(own, *state, model_config)
            # LoRA: its own adapters over the policy's base
            return Aux(
                own,
                *state,
                model_config,
                frozen=policy_frozen.base,
                frozen_shardings=policy_frozen.shardings,
            )
    except PlanError:
        raise
    except ValueError as err:  # a weight dimension the mesh does not divide
        what = "the critic's" if objective.needs_critic else "the PRM's"
        raise PlanError(f"{what} parameter layout on mesh {dict(mesh.shape)}: {err}") from None
    return None


def _critic_state(cfg, model_config, mesh, optimizer, dtype, policy_frozen) -> Aux:
    """PPO's critic (``PPOTrainer.setup_extra_networks``), separate or joint, full or LoRA:
    the state ``CriticLayout`` describes, and a LoRA critic's frozen backbone -- the policy's
    base itself (``critic.init=policy``: the same arrays) or ``critic.path``'s backbone in
    the compute dtype (its own)."""
    critic = cfg.critic
    config = critic_config(cfg, model_config)
    if policy_frozen is not None:
        config = dataclasses.replace(config, lora=model_config.lora)
    layout = CriticLayout(model_config, config, critic.optimizer == "joint")
    own = optimizer if layout.joint else make_model_optimizer(critic)
    state = abstract_train_state(
        layout.state_config,
        own,
        mesh=mesh,
        init_params=lambda key: layout.fresh_state_params(key, dtype),
        params_axes=layout.state_axes,
    )
    source = critic.path if critic.init == "reward_model" else None
    if policy_frozen is None:
        return Aux(own, *state, config, joint=layout.joint, source=source)
    own_bytes = 0
    if critic.init == "reward_model":
        frozen, frozen_shardings = adapters.frozen_scalar_layout(config, mesh, param_dtype=dtype)
        own_bytes = shard_bytes(frozen)
    else:
        frozen = adapters.backbone_view(policy_frozen.base)
        frozen_shardings = adapters.backbone_view(policy_frozen.shardings)
    if layout.joint:
        frozen = {"policy": policy_frozen.base, "value": frozen}
        frozen_shardings = {"policy": policy_frozen.shardings, "value": frozen_shardings}
    return Aux(
        own,
        *state,
        config,
        joint=layout.joint,
        source=source,
        frozen=frozen,
        frozen_shardings=frozen_shardings,
        own_frozen=own_bytes,
    )


def _is_value(path) -> bool:
    return any(getattr(key, "key", None) == "value" for key in path)


def with_aux_bytes(sizes: StateBytes, aux: Aux | None) -> StateBytes:
    """``sizes`` with the auxiliary model's bytes (its parameters with a frozen half of its
    own, a LoRA critic's reward-model backbone); a joint state's optimizer state split by
    model: the critic's moments to ``aux_optimizer``, the rest (the policy's moments and the
    optimizer's counters) to ``optimizer``, beside the state's step and key."""
    if aux is None:
        return sizes
    if not aux.joint:
        return dataclasses.replace(
            sizes,
            aux_params=shard_bytes(aux.state.params) + aux.own_frozen,
            aux_optimizer=_optimizer_bytes(aux.state),
        )
    leaves = jax.tree_util.tree_flatten_with_path(aux.state.opt_state)[0]
    value_moments = shard_bytes([leaf for path, leaf in leaves if _is_value(path)])
    return dataclasses.replace(
        sizes,
        optimizer=_optimizer_bytes(aux.state) - value_moments,
        aux_params=shard_bytes(aux.params) + aux.own_frozen,
        aux_optimizer=value_moments,
    )


def critic_report(job) -> dict[str, Any] | None:
    """The report's ``critic`` entry (PPO): its optimizer, where it starts, its size."""
    aux = job.aux
    if aux is None or not job.objective.needs_critic:
        return None
    config = aux.config
    return {
        "optimizer": "joint" if aux.joint else "separate",
        "init": job.cfg.critic.init,
        "path": aux.source,
        "architecture": config.architecture,
        "lora": config.lora is not None,  # adapters and head trained over a frozen backbone
        "params": models.param_count(heads.backbone_config(config)) + config.hidden_size,
        "aux_params_bytes": job.state.aux_params,
        "aux_optimizer_bytes": job.state.aux_optimizer,
    }


__all__ = [
    "ASSUMPTIONS",
    "Aux",
    "aux_state",
    "critic_report",
    "policy_view",
    "with_aux_bytes",
]
