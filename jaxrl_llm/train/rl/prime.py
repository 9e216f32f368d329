"""PRIME: dense rewards from an implicit process reward model, learned online.

Cui et al. 2025, "Process Reinforcement through Implicit Rewards". The implicit PRM is a
trainable copy of the (warm-started) policy; its per-token reward is
``r_t = β·(log π_prm(y_t) − log π_ref(y_t))``. Each step it is first trained on the step's
outcome labels (``ℓ = BCE(σ(Σ_t r_t), correct)``, the paper's cross-entropy "implicit PRM"
objective), then scores the same rollouts; advantages are RLOO over the dense process rewards
plus RLOO over the outcome rewards, summed into returns (``objectives.compute_advantages``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import models, objectives, parallel
from jaxrl_llm.losses import implicit_prm
from jaxrl_llm.models import lora
from jaxrl_llm.train import adapters, setup
from jaxrl_llm.train import packing as packing_lib
from jaxrl_llm.train.forward import sequence_logprobs
from jaxrl_llm.train.optim import make_model_optimizer
from jaxrl_llm.train.rl.config import micro_batching
from jaxrl_llm.train.rl.programs import ProgramSpec, builder_name
from jaxrl_llm.train.rl.spec import TRAINER_SUPPLIES, RunSpec
from jaxrl_llm.train.rl.trainer import RLTrainer
from jaxrl_llm.train.state import create_train_state
from jaxrl_llm.train.step import jit_step, make_step
from jaxrl_llm.types import RolloutBatch, sequences_of


def make_prm_loss_fn(
    model_config, *, beta: float, temperature: float = 1.0, chunk_size=None, remat="none"
):
    """``(prm_params, batch, totals) -> (loss, metrics)``: ``implicit_prm.prm_loss``.

    ``batch.rewards`` holds the outcome labels in ``{0, 1}``; ``batch.ref_logprobs`` the
    reference log-probs; ``batch.packing`` the micro-batch's packing plan (the log-probs run
    over packed rows: the same values), or None. The loss averages over the whole batch's
    non-empty rows, so micro-batches accumulate the full-batch gradient.
    """

    def loss_fn(params, batch: RolloutBatch, totals, key=None):
        lp = sequence_logprobs(
            params,
            model_config,
            sequences_of(batch),
            packing=batch.packing,  # this micro-batch's plan, or None (padded)
            temperature=temperature,
            chunk_size=chunk_size,
            remat=remat,
            dropout_key=key,
        )
        out = implicit_prm.prm_loss(
            lp,
            batch.ref_logprobs,
            batch.completion_mask,
            batch.rewards,
            beta=beta,
            num_seqs=None if totals is None else totals.num_seqs,
        )
        return out.loss, out.metrics

    return loss_fn


def prm_programs(
    run: RunSpec,
    model_config,
    optimizer,
    shardings,
    *,
    logprobs: ProgramSpec,
    frozen=None,
    frozen_shardings=None,
) -> dict[str, ProgramSpec]:
    """PRIME's implicit-PRM programs, built once for ``train`` and ``plan``
    (``train.rl.programs``): ``prm_update`` (``make_prm_loss_fn`` through ``make_step``, on
    the whole rollout batch, once a step) and ``prm_logprobs`` (the policy's ``logprobs``
    program on the PRM's parameters, once a step).

    Args:
      run: the resolved job.
      model_config: the policy's (and so the PRM's) ``ModelConfig``.
      optimizer, shardings: the PRM's optimizer and train-state shardings.
      logprobs: the policy's ``logprobs`` program (``policy_programs``).
      frozen, frozen_shardings: a LoRA run's frozen base (the PRM's adapters train over it).
    """
    cfg = run.config
    platform = parallel.current_platform(jax.tree.leaves(shardings)[0].mesh)[0]
    step = make_step(
        make_prm_loss_fn(
            model_config,
            beta=run.objective.advantage.prime_beta,
            temperature=cfg.rollout.temperature,
            chunk_size=cfg.model.chunk_size,
            remat=cfg.model.remat,
        ),
        optimizer,
        micro_batches=micro_batching(cfg.trainer, platform),
        param_shardings=shardings.params,
        loss_takes_key=adapters.has_dropout(model_config),
    )
    return {
        "prm_update": ProgramSpec(
            "prm_update",
            jit_step(step, shardings, frozen=frozen, frozen_shardings=frozen_shardings),
            1,
            builder_name(make_prm_loss_fn),
            model_config,
        ),
        "prm_logprobs": dataclasses.replace(logprobs, name="prm_logprobs", calls_per_step=1),
    }


def prm_params_axes(model_config) -> Any:
    """Logical axes of the PRM state's parameters: the policy's (the PRM is a trained copy of
    the policy), or with ``model.lora`` its own adapters' (over the policy's frozen base)."""
    axes = models.logical_axes(model_config)
    return axes if model_config.lora is None else lora.split(axes)[1]


def fresh_prm_params(model_config, key: jax.Array, dtype=jnp.float32) -> Any:
    """The PRM state's parameters, fresh (``plan`` reads their shapes; ``PRIMETrainer``
    starts a full PRM as a copy of the policy instead): a random policy, or with
    ``model.lora`` PEFT-initialised adapters (``B = 0``: the PRM starts as the policy)."""
    if model_config.lora is None:
        return models.init_params(model_config, key, dtype=dtype)
    return lora.init_adapters(model_config, key, dtype=dtype)


class PRIMETrainer(RLTrainer):
    """The RL loop plus PRIME's implicit PRM (objective with ``advantage="prime"``)."""

    SUPPLIES = TRAINER_SUPPLIES["prime"]

    def check_objective(self, objective: objectives.Objective) -> None:
        if not objective.needs_process_rewards:
            raise ValueError(
                f"PRIMETrainer trains an implicit PRM for an estimator that needs process "
                f"rewards (prime), not {objective.advantage.name!r}"
            )
        super().check_objective(objective)

    def checkpoint_state(self):
        return {"policy": self.state, "prm": self.prm_state}

    def set_checkpoint_state(self, tree) -> None:
        self.state, self.prm_state = tree["policy"], tree["prm"]

    def setup_extra_networks(self) -> None:
        section = self.cfg.prime
        self.prm_optimizer = make_model_optimizer(section)
        key = jax.random.fold_in(self.key, 9)
        if self.base is not None:
            # LoRA: its own adapters (B = 0: it starts as the policy) over the policy's base.
            adapter_key, key = jax.random.split(key)
            params = adapters.fresh_adapters(
                self.run.model_config,
                key=adapter_key,
                mesh=self.run.mesh,
                param_dtype=self.spec.precision.param,
            )[0]
        else:  # the PRM starts as a copy of the (warm-started) policy, as in the paper
            params = self.copy_params(self.state.params)
        self.prm_state, self.prm_shardings = create_train_state(
            self.run.model_config,
            self.prm_optimizer,
            key=key,
            mesh=self.run.mesh,
            params=params,
            params_axes=prm_params_axes(self.run.model_config),
        )

    @property
    def prm_params(self):
        """The PRM's parameters (LoRA: the policy's frozen base with the PRM's adapters)."""
        if self.base is None:
            return self.prm_state.params
        return lora.combine(self.base, self.prm_state.params)

    def compile(self) -> None:
        super().compile()
        built = prm_programs(
            self.spec,
            self.run.model_config,
            self.prm_optimizer,
            self.prm_shardings,
            logprobs=self.programs["logprobs"],
            frozen=self.base,
            frozen_shardings=self.base_shardings,
        )
        self.programs.update(built)
        self.prm_step = built["prm_update"].fn
        self.prm_logprob_fn = built["prm_logprobs"].fn

    def prm_packing_plans(self, samples, seqs, forwards):
        """``(forward, update)``: the packing plans of the PRM's log-prob forward (the plan the
        step's frozen forwards ran with, ``forwards.plan``: the same rows and micro-batching)
        and of its update (micro-batched as the policy's update: ``RLTrainer.packing_plan``),
        or None each (padded). A multi-turn batch (``samples.loss_mask``) runs padded: its
        ``seqs.completion_mask`` is the loss mask, which need not be one run of tokens a row."""
        if (
            samples.loss_mask is not None
            or packing_lib.packing_mode(self.cfg.trainer.packing) == "off"
        ):
            return None, None
        prompt_mask = parallel.fetch(seqs.prompt_mask)  # the bucketed prompts' host mask
        mask = np.asarray(samples.completion_mask)
        return forwards.plan, self.packing_plan(prompt_mask, mask, self.micro_batches)

    def _update_prm(self, seqs, ref, labels, plan=None) -> dict[str, float]:
        batch = RolloutBatch(
            completion_mask=seqs.completion_mask,
            old_logprobs=None,
            advantages=None,
            ref_logprobs=ref,
            prompt_tokens=seqs.prompt_tokens,
            prompt_mask=seqs.prompt_mask,
            completion_tokens=seqs.completion_tokens,
            rewards=labels,
            packing=plan,
        )
        self.prm_state, metrics = self.prm_step(self.prm_state, batch)
        return {k: float(v) for k, v in jax.device_get(metrics).items() if k.startswith("prm/")}

    def score(self, step, samples, seqs, forwards, rewards):
        old, ref = forwards.old, forwards.ref
        metrics: dict[str, Any] = {}
        labels = setup.to_device(np.asarray(samples.correct, np.float32), self.run.mesh)
        forward_plan, update_plan = self.prm_packing_plans(samples, seqs, forwards)
        if self.cfg.prime.update == "before":
            metrics.update(self._update_prm(seqs, ref, labels, update_plan))
        prm_lp = self.prm_logprob_fn(self.prm_params, seqs, forward_plan)
        dense = implicit_prm.process_rewards(
            prm_lp, ref, seqs.completion_mask, beta=self.run.objective.advantage.prime_beta
        )
        adv, _ = self.advantage_fn(rewards, seqs.completion_mask, process_rewards=dense)
        if self.cfg.prime.update == "after":
            metrics.update(self._update_prm(seqs, ref, labels, update_plan))
        host_dense = parallel.fetch(dense)
        valid = np.asarray(samples.completion_mask, bool)
        metrics["prm/process_reward_mean"] = float(host_dense[valid].mean()) if valid.any() else 0.0
        return self.rollout_batch(seqs, old, ref, rewards, adv), metrics


__all__ = [
    "PRIMETrainer",
    "fresh_prm_params",
    "make_prm_loss_fn",
    "prm_params_axes",
    "prm_programs",
]
