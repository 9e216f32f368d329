"""PPO with a critic: a scalar-head value model, GAE advantages and a clipped value loss.

The recipe of verl's and OpenRLHF's PPO: the critic (the transformer with a scalar head,
initialised from the policy's backbone or from a reward model) values every completion token at
rollout time; GAE turns the token rewards (the outcome reward on the last token minus the k1 KL
penalty) and those values into advantages and returns; then each minibatch updates the policy
with the clipped surrogate and the critic with ``½·max((v − R)², (clip(v) − R)²)``, either with
separate optimizers or with one optimizer over both (``pg + value_coef·vf``). During the first
``critic.warmup_steps`` RL steps only the critic learns.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import models, objectives, parallel
from jaxrl_llm.models import heads, lora
from jaxrl_llm.train import adapters, export, setup
from jaxrl_llm.train.adapters import has_dropout
from jaxrl_llm.train.forward import LogprobProgram
from jaxrl_llm.train.optim import make_model_optimizer
from jaxrl_llm.train.packing import micro_plan, packing_mode
from jaxrl_llm.train.rl.config import micro_batching
from jaxrl_llm.train.rl.policy import make_policy_loss_fn, router_loss, with_totals
from jaxrl_llm.train.rl.programs import ProgramSpec, builder_name
from jaxrl_llm.train.rl.spec import TRAINER_SUPPLIES, RunSpec
from jaxrl_llm.train.rl.trainer import RLTrainer
from jaxrl_llm.train.rl.updates import update_objective
from jaxrl_llm.train.state import create_train_state
from jaxrl_llm.train.step import jit_step, make_step, merge_trees
from jaxrl_llm.types import RolloutBatch, Sequences, sequences_of


def make_value_loss_fn(model_config, objective: objectives.Objective, *, remat: str = "none"):
    """``(value_params, batch, totals, key=None) -> (vf_loss, metrics)``; ``batch`` needs old
    values and returns; ``key``: LoRA dropout's."""

    def loss_fn(params, batch: RolloutBatch, totals, key=None):
        values = heads.token_values(
            params,
            model_config,
            *sequences_of(batch),
            remat=remat,
            dropout_key=key,
            packing=batch.packing,  # the micro-batch's plan (the policy's), or None
        )
        out = objectives.value_loss(objective, values, with_totals(batch, totals))
        return out.loss, out.metrics

    return loss_fn


def make_value_step(
    model_config, objective, optimizer, *, micro_batches=1, remat="none", param_shardings=None
):
    """A pure critic step ``(state, batch) -> (state, metrics)`` on the clipped value loss."""
    return make_step(
        make_value_loss_fn(model_config, objective, remat=remat),
        optimizer,
        micro_batches=micro_batches,
        param_shardings=param_shardings,
        loss_takes_key=has_dropout(model_config),
    )


def make_joint_step(
    model_config,
    objective,
    optimizer,
    *,
    micro_batches=1,
    temperature=1.0,
    chunk_size=None,
    remat="none",
    param_shardings=None,
    value_config=None,
    value_only=False,
    router=None,
    replay_routing=False,
):
    """One optimizer over ``{"policy", "value"}``: loss ``pg_total + value_coef·vf_loss``.

    ``value_config`` is the value model's config when it differs from the policy's (a critic
    initialised from a reward model). ``value_only`` drops the policy term (the critic's
    warm-up): the policy's gradient is then exactly zero, so Adam leaves it in place (unless
    the optimizer applies weight decay). ``router``: a mixture-of-experts policy's router loss
    coefficients (``policy.router_loss``), and ``replay_routing`` its forward replaying the
    batch's recorded routing (``model.routing_replay=rollout``), as in ``make_policy_step``;
    the critic, a model of its own, routes by its own router.
    """
    policy_loss = make_policy_loss_fn(
        model_config,
        objective,
        temperature=temperature,
        chunk_size=chunk_size,
        remat=remat,
        router=router,
        replay_routing=replay_routing,
    )
    value_loss = make_value_loss_fn(
        model_config if value_config is None else value_config, objective, remat=remat
    )

    def loss_fn(params, batch: RolloutBatch, totals, key=None):
        keys = (None, None) if key is None else tuple(jax.random.split(key))
        vf, vf_metrics = value_loss(params["value"], batch, totals, keys[1])
        if value_only:
            total = objective.value.coef * vf
            return total, {**vf_metrics, "total_loss": total}
        pg, pg_metrics = policy_loss(params["policy"], batch, totals, keys[0])
        total = pg + objective.value.coef * vf
        return total, {**pg_metrics, **vf_metrics, "total_loss": total}

    return make_step(
        loss_fn,
        optimizer,
        micro_batches=micro_batches,
        param_shardings=param_shardings,
        loss_takes_key=has_dropout(model_config),
        # An adaptive entropy coefficient follows the policy term's entropy (none while the
        # critic warms up alone).
        adaptive_entropy=objective if objective.entropy.adaptive and not value_only else None,
    )


def make_value_fn(model_config, *, param_shardings=None):
    """A jitted ``(value_params, seqs, packing=None) -> [B, T]`` of rollout-time values, 0 on
    padding.

    Runs under the parameters' mesh, so the model's activation constraints apply (FSDP:
    batch-sharded activations, weights gathered where used) as in the log-prob forward.
    ``packing``: a one-micro-batch stacked plan of ``seqs``' rows (``train.packing``: leaves
    ``[1, shards, rows, W]``): the critic's backbone runs over packed rows (the same values
    to rounding); None: padded.
    """
    mesh = None if param_shardings is None else jax.tree.leaves(param_shardings)[0].mesh

    def fn(params, seqs: Sequences, packing=None):
        plan = None if packing is None else micro_plan(packing, 0)
        with parallel.mesh_context(mesh):
            values = heads.token_values(
                jax.lax.stop_gradient(params), model_config, *seqs, packing=plan
            )
        return values * seqs.completion_mask

    if param_shardings is None:
        return LogprobProgram(jax.jit(fn))
    return LogprobProgram(jax.jit(fn, in_shardings=(param_shardings, None, None)))


def joint_update(
    run: RunSpec,
    model_config,
    value_config,
    optimizer,
    shardings,
    *,
    frozen=None,
    frozen_shardings=None,
    value_only: bool = False,
) -> ProgramSpec:
    """``critic.optimizer=joint``: the ``update`` program (``make_joint_step`` under
    ``jit_step``: one optimizer over ``{"policy", "value"}``, both models' forward and backward
    on one minibatch), built once for ``train`` and ``plan``; ``value_only``: the critic's
    warm-up step (``critic.warmup_steps``).

    Args:
      run: the resolved job.
      model_config, value_config: the policy's and the critic's ``ModelConfig``.
      optimizer, shardings: the joint state's optimizer and shardings.
      frozen, frozen_shardings: a LoRA run's ``{"policy": base, "value": backbone}``.
    """
    cfg = run.config
    platform = parallel.current_platform(jax.tree.leaves(shardings)[0].mesh)[0]
    step = make_joint_step(
        model_config,
        update_objective(run.objective),
        optimizer,
        micro_batches=micro_batching(cfg.trainer, platform),
        temperature=cfg.rollout.temperature,
        chunk_size=cfg.model.chunk_size,
        remat=cfg.model.remat,
        param_shardings=shardings.params,
        value_config=value_config,
        value_only=value_only,
        router=router_loss(
            model_config, cfg.model.router_aux_loss_coef, cfg.model.router_z_loss_coef
        ),
        replay_routing=cfg.model.replay_mode == "rollout",
    )
    return ProgramSpec(
        "update",
        jit_step(step, shardings, frozen=frozen, frozen_shardings=frozen_shardings),
        run.shape.updates_per_step,
        builder_name(make_joint_step),
        model_config,
    )


def critic_programs(
    run: RunSpec,
    value_config,
    optimizer,
    shardings,
    *,
    value_param_shardings,
    frozen=None,
    frozen_shardings=None,
    joint: bool = False,
) -> dict[str, ProgramSpec]:
    """PPO's critic programs, built once for ``train`` and ``plan`` (``train.rl.programs``).

    * ``values``: the rollout-time values forward (``make_value_fn``), once a step;
    * ``critic_update``: the critic's own step (``make_value_step`` under ``jit_step``),
      ``epochs x minibatches`` calls a step; absent with ``joint`` (``critic.optimizer=joint``,
      where the critic trains in the policy's update).

    Args:
      run: the resolved job.
      value_config: the critic's ``ModelConfig``.
      optimizer, shardings: the critic's own optimizer and train-state shardings (unused with
        ``joint``).
      value_param_shardings: the shardings of the parameters ``values`` takes (a LoRA critic's
        frozen backbone merged in).
      frozen, frozen_shardings: a LoRA critic's frozen backbone (its step's third argument).
    """
    cfg = run.config
    platform = parallel.current_platform(jax.tree.leaves(value_param_shardings)[0].mesh)[0]
    programs = {
        "values": ProgramSpec(
            "values",
            make_value_fn(value_config, param_shardings=value_param_shardings),
            1,
            builder_name(make_value_fn),
            value_config,
        )
    }
    if not joint:
        step = make_value_step(
            value_config,
            run.objective,
            optimizer,
            micro_batches=micro_batching(cfg.trainer, platform),
            remat=cfg.model.remat,
            param_shardings=shardings.params,
        )
        programs["critic_update"] = ProgramSpec(
            "critic_update",
            jit_step(step, shardings, frozen=frozen, frozen_shardings=frozen_shardings),
            run.shape.updates_per_step,
            builder_name(make_value_step),
            value_config,
        )
    return programs


@dataclasses.dataclass(frozen=True)
class CriticLayout:
    """PPO's critic state as ``PPOTrainer`` builds it and ``plan`` counts it: which parameter
    tree the critic's ``TrainState`` holds, its logical axes and its fresh initialisation.

    Separate (``critic.optimizer=separate``): the state holds the critic's trained
    parameters under its own optimizer; joint: one state over ``{"policy": ..., "value":
    ...}`` under the trainer's. Full: the trained parameters are a scalar-head model
    (``heads.ScalarParams``); LoRA (``value.lora`` set): ``{"backbone": adapters, "score":
    [D, 1]}`` over a frozen backbone (and a joint policy's trained half is its adapters).

    Attributes:
      policy: the policy's ``ModelConfig``.
      value: the critic's (the policy's, or ``critic.path``'s; ``lora`` set for a LoRA critic).
      joint: ``critic.optimizer=joint``.
    """

    policy: models.ModelConfig
    value: models.ModelConfig
    joint: bool = False

    @property
    def lora(self) -> bool:
        return self.value.lora is not None

    @property
    def state_config(self) -> models.ModelConfig:
        """The ``ModelConfig`` the state is created with (the policy's for a joint state)."""
        return self.policy if self.joint else self.value

    @property
    def value_axes(self) -> Any:
        """Logical axes of the critic's trained parameters."""
        axes = heads.scalar_logical_axes(self.value)
        if not self.lora:
            return axes
        backbone = models.logical_axes(heads.backbone_config(self.value))
        return {"backbone": lora.split(backbone)[1], "score": axes["score"]}

    @property
    def state_axes(self) -> Any:
        """Logical axes of the state's parameters (``create_train_state``'s ``params_axes``)."""
        if not self.joint:
            return self.value_axes
        policy = models.logical_axes(self.policy)
        return {
            "policy": lora.split(policy)[1] if self.lora else policy,
            "value": self.value_axes,
        }

    def state_params(self, policy: Any, value: Any) -> Any:
        """The state's parameter tree from the policy's and the critic's trained halves."""
        return {"policy": policy, "value": value} if self.joint else value

    def fresh_value(self, key: jax.Array, dtype=jnp.float32, backbone: Any = None) -> Any:
        """Fresh trained critic parameters: a scalar head (``N(0, 0.02²)``) over ``backbone``
        (None: a random one); LoRA: PEFT-initialised adapters (``B = 0``) and such a head."""
        if not self.lora:
            return heads.init_scalar_params(self.value, key, backbone=backbone, dtype=dtype)
        adapter_key, score_key = jax.random.split(key)
        score = heads.DEFAULT_SCORE_STD * jax.random.normal(
            score_key, (self.value.hidden_size, 1), jnp.float32
        )
        return {
            "backbone": lora.init_adapters(
                heads.backbone_config(self.value), adapter_key, dtype=dtype
            ),
            "score": score.astype(dtype),
        }

    def fresh_state_params(self, key: jax.Array, dtype=jnp.float32) -> Any:
        """The state's parameters freshly initialised (``plan`` reads their shapes): with
        ``joint`` a random policy (LoRA: fresh adapters) beside :meth:`fresh_value`."""
        policy_key, value_key = jax.random.split(key)
        value = self.fresh_value(value_key, dtype)
        if not self.joint:
            return value
        if self.lora:
            policy = lora.init_adapters(self.policy, policy_key, dtype=dtype)
        else:
            policy = models.init_params(self.policy, policy_key, dtype=dtype)
        return self.state_params(policy, value)


def explained_variance(values: np.ndarray, returns: np.ndarray, mask: np.ndarray) -> float:
    """``1 − Var[R − V] / Var[R]`` over valid tokens (1 = perfect critic, ≤ 0 = useless).

    Returns NaN-free 0.0 when the returns do not vary.
    """
    m = np.asarray(mask, bool)
    r, v = np.asarray(returns, np.float64)[m], np.asarray(values, np.float64)[m]
    if r.size == 0:
        return 0.0
    var_r = r.var()
    if var_r <= 1e-12:
        return 0.0
    return float(1.0 - (r - v).var() / var_r)


class PPOTrainer(RLTrainer):
    """The RL loop plus a critic (objective with ``advantage="gae"``, e.g. the ``ppo`` preset)."""

    SUPPLIES = TRAINER_SUPPLIES["ppo"]

    def check_objective(self, objective: objectives.Objective) -> None:
        if not objective.needs_critic:
            raise ValueError(
                f"PPOTrainer trains a critic for an estimator that needs values (gae), not "
                f"{objective.advantage.name!r}"
            )
        super().check_objective(objective)

    @property
    def joint(self) -> bool:
        return self.cfg.critic.optimizer == "joint"

    @property
    def policy_trained(self):
        return self.state.params["policy"] if self.joint else self.state.params

    #: A LoRA critic's frozen ``{"backbone": base}`` (the policy's base, or a reward
    #: model's) and its shardings; None: every critic weight is trained.
    value_frozen: Any = None
    value_frozen_shardings: Any = None

    @property
    def value_params(self):
        """The critic's parameters (a LoRA critic's frozen backbone with its adapters)."""
        params = self.state.params["value"] if self.joint else self.value_state.params
        return params if self.value_frozen is None else merge_trees(self.value_frozen, params)

    def _value_shardings(self, trained):
        if self.value_frozen is None:
            return trained
        return merge_trees(self.value_frozen_shardings, trained)

    def checkpoint_state(self):
        return self.state if self.joint else {"policy": self.state, "critic": self.value_state}

    def set_checkpoint_state(self, tree) -> None:
        if self.joint:
            self.state = tree
        else:
            self.state, self.value_state = tree["policy"], tree["critic"]

    def _initial_value_params(self):
        run, critic = self.run, self.cfg.critic
        key = jax.random.fold_in(self.key, 7)
        if critic.init == "reward_model":
            return setup.load_model(
                critic.path,
                self.spec.precision,
                head="scalar",
                mesh=run.mesh,
                lora=run.model_config.lora,
                policy=run.model_config,
                key="critic.path",
            )
        if self.base is not None:  # LoRA: the policy's frozen base, shared (no copy)
            return run.model_config, None
        backbone = self.state.params if critic.init == "policy" else None
        params = heads.init_scalar_params(
            run.model_config, key, backbone=backbone, dtype=self.spec.precision.param
        )
        return run.model_config, params

    def _lora_value_params(self, loaded):
        """A LoRA critic (``model.lora``): fresh adapters and a head trained over a frozen
        backbone — the policy's base itself (``critic.init=policy``: no copy) or the reward
        model's (``critic.init=reward_model``, in the compute dtype)."""
        run, dtype = self.run, self.spec.precision.param
        score_key, adapter_key = jax.random.split(jax.random.fold_in(self.key, 10))
        if loaded is None:
            self.value_frozen = adapters.backbone_view(self.base)
            self.value_frozen_shardings = adapters.backbone_view(self.base_shardings)
            score = heads.DEFAULT_SCORE_STD * jax.random.normal(
                score_key, (self.value_config.hidden_size, 1), jnp.float32
            )
        else:
            self.value_frozen, self.value_frozen_shardings, score = adapters.frozen_scalar_base(
                self.value_config, loaded, key=score_key, mesh=run.mesh, param_dtype=dtype
            )
        return adapters.scalar_lora_params(
            self.value_config, score, key=adapter_key, mesh=run.mesh, param_dtype=dtype
        )[0]

    def setup_extra_networks(self) -> None:
        run, critic = self.run, self.cfg.critic
        self.value_config, value_params = self._initial_value_params()
        layout = CriticLayout(run.model_config, self.value_config, self.joint)
        if self.base is not None:
            value_params = self._lora_value_params(value_params)
        key = jax.random.fold_in(self.key, 8)
        if self.joint:
            self.state, self.joint_shardings = create_train_state(
                layout.state_config,
                self.optimizer,
                key=key,
                mesh=run.mesh,
                params=layout.state_params(self.state.params, value_params),
                params_axes=layout.state_axes,
                entropy_control=self.state.entropy_control,
            )
            return
        optimizer = make_model_optimizer(critic)
        self.value_optimizer = optimizer
        self.value_state, self.value_shardings = create_train_state(
            layout.state_config,
            optimizer,
            key=key,
            mesh=run.mesh,
            params=value_params,
            params_axes=layout.state_axes,
        )

    def compile(self) -> None:
        super().compile()
        run, cfg = self.run, self.cfg
        if self.joint:
            frozen = {}
            if self.base is not None:
                frozen = {
                    "frozen": {"policy": self.base, "value": self.value_frozen},
                    "frozen_shardings": {
                        "policy": self.base_shardings,
                        "value": self.value_frozen_shardings,
                    },
                }
            joint = functools.partial(
                joint_update,
                self.spec,
                run.model_config,
                self.value_config,
                self.optimizer,
                self.joint_shardings,
                **frozen,
            )
            self.programs["update"] = joint()  # the joint step replaces the policy's
            self.joint_fn = self.programs["update"].fn
            if cfg.critic.warmup_steps:
                self.joint_value_fn = joint(value_only=True).fn
        value_shardings = (
            self.joint_shardings.params["value"] if self.joint else self.value_shardings.params
        )
        critic = critic_programs(
            self.spec,
            self.value_config,
            None if self.joint else self.value_optimizer,
            None if self.joint else self.value_shardings,
            value_param_shardings=self._value_shardings(value_shardings),
            frozen=self.value_frozen,
            frozen_shardings=self.value_frozen_shardings,
            joint=self.joint,
        )
        self.programs.update(critic)
        self.values_fn = critic["values"].fn
        if not self.joint:
            self.value_fn_step = critic["critic_update"].fn

    def score(self, step, samples, seqs, forwards, rewards):
        old, ref = forwards.old, forwards.ref
        plan = self.values_packing_plan(samples, seqs)
        args = (self.value_params, seqs) if plan is None else (self.value_params, seqs, plan)
        values = self.values_fn(*args)
        adv, returns = self.advantage_fn(
            rewards, seqs.completion_mask, old_logprobs=old, ref_logprobs=ref, values=values
        )
        host_values, host_returns = parallel.fetch(values), parallel.fetch(returns)
        mask = samples.completion_mask
        valid = np.asarray(mask, bool)
        metrics = {
            "critic/explained_variance": explained_variance(host_values, host_returns, mask),
            "critic/values_mean": float(host_values[valid].mean()) if valid.any() else 0.0,
            "critic/returns_mean": float(host_returns[valid].mean()) if valid.any() else 0.0,
        }
        batch = self.rollout_batch(seqs, old, ref, rewards, adv, old_values=values, returns=returns)
        return batch, metrics

    def values_packing_plan(self, samples, seqs):
        """The packing plan of the rollout-time values forward (one micro-batch:
        ``RLTrainer.packing_plan``), or None (padded). A multi-turn batch
        (``samples.loss_mask``) runs padded: its ``seqs.completion_mask`` is the loss mask,
        which need not be one run of tokens a row."""
        if samples.loss_mask is not None or packing_mode(self.cfg.trainer.packing) == "off":
            return None
        prompt_mask = parallel.fetch(seqs.prompt_mask)  # the bucketed prompts' host mask
        return self.packing_plan(prompt_mask, np.asarray(samples.completion_mask), 1)

    def update(self, step: int, minibatch: RolloutBatch) -> dict[str, Any]:
        warming_up = step < self.cfg.critic.warmup_steps
        if self.joint:
            step_fn = self.joint_value_fn if warming_up else self.joint_fn
            self.state, metrics = step_fn(self.state, minibatch)
            return metrics
        metrics: dict[str, Any] = {}
        if not warming_up:
            self.state, metrics = self.update_fn(self.state, minibatch)
        # The critic's step micro-batches as the policy's: the same packing plans serve it.
        self.value_state, value_metrics = self.value_fn_step(self.value_state, minibatch)
        value_metrics = dict(value_metrics)
        value_metrics["vf_grad_norm"] = value_metrics.pop("grad_norm")
        value_metrics.pop("num_tokens", None)
        return {**metrics, **value_metrics}

    def export(self, directory) -> None:
        super().export(directory)
        # The critic is saved in the Hugging Face scalar-head layout, like a reward model (a
        # LoRA critic with its adapters merged).
        export.export_scalar_model(
            self.run_dir / "critic",
            lora.base_config(self.value_config),
            adapters.merged_scalar(self.value_config, self.value_params),
            self.run.tokenizer,
        )


__all__ = [
    "CriticLayout",
    "critic_programs",
    "joint_update",
    "PPOTrainer",
    "explained_variance",
    "make_joint_step",
    "make_value_fn",
    "make_value_loss_fn",
    "make_value_step",
]
