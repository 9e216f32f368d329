"""PRIME: dense rewards from an implicit process reward model, learned online.

Cui et al. 2025, "Process Reinforcement through Implicit Rewards". The implicit PRM is a
trainable copy of the (warm-started) policy; its per-token reward is
``r_t = β·(log π_prm(y_t) − log π_ref(y_t))``. Each step it is first trained on the step's
outcome labels (``ℓ = BCE(σ(Σ_t r_t), correct)``, the paper's cross-entropy "implicit PRM"
objective), then scores the same rollouts; advantages are RLOO over the dense process rewards
plus RLOO over the outcome rewards, summed into returns (``objectives.compute_advantages``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_llm import objectives
from jaxrl_llm.train import rollout as rollout_lib
from jaxrl_llm.train.loop import RLTrainer
from jaxrl_llm.train.optim import make_optimizer
from jaxrl_llm.train.state import create_train_state
from jaxrl_llm.train.step import _logprobs, jit_step, make_step
from jaxrl_llm.types import RolloutBatch

PRM_UPDATES = ("before", "after")


def implicit_sequence_reward(prm_logprobs, ref_logprobs, mask, *, beta: float) -> jax.Array:
    """``β·Σ_t m_t·(lp_prm − lp_ref)``: the implicit PRM's outcome logit, ``[B]`` f32."""
    mask = jnp.asarray(mask, jnp.float32)
    return beta * jnp.sum((prm_logprobs - ref_logprobs) * mask, axis=1)


def process_rewards(prm_logprobs, ref_logprobs, mask, *, beta: float) -> jax.Array:
    """Dense implicit rewards ``r_t = β·(lp_prm − lp_ref)``, 0 on masked tokens: ``[B, T]``."""
    mask = jnp.asarray(mask, jnp.float32)
    return beta * (jnp.asarray(prm_logprobs, jnp.float32) - ref_logprobs) * mask


def make_prm_loss_fn(
    model_config, *, beta: float, temperature: float = 1.0, chunk_size=None, remat="none"
):
    """``(prm_params, batch) -> (loss, metrics)``: BCE of the implicit outcome logit.

    ``batch.rewards`` holds the outcome labels in ``{0, 1}``; ``batch.ref_logprobs`` the
    reference log-probs. The loss averages over non-empty rows of the whole batch
    (``batch.num_seqs``), so micro-batches accumulate the full-batch gradient.
    """

    def loss_fn(params, batch: RolloutBatch):
        lp = _logprobs(
            model_config,
            params,
            batch,
            temperature=temperature,
            chunk_size=chunk_size,
            remat=remat,
        )
        mask = jnp.asarray(batch.completion_mask, jnp.float32)
        logit = implicit_sequence_reward(lp, batch.ref_logprobs, mask, beta=beta)
        labels = jnp.asarray(batch.rewards, jnp.float32)
        rows = (jnp.sum(mask, axis=1) > 0).astype(jnp.float32)
        denom = jnp.maximum(batch.num_seqs, 1.0)
        bce = optax.sigmoid_binary_cross_entropy(logit, labels) * rows
        loss = jnp.sum(bce) / denom
        hit = ((logit > 0) == (labels > 0.5)).astype(jnp.float32) * rows
        return loss, {"prm/loss": loss, "prm/accuracy": jnp.sum(hit) / denom}

    return loss_fn


class PRIMETrainer(RLTrainer):
    """The RL loop plus PRIME's implicit PRM (objective with ``advantage="prime"``)."""

    def _check_objective(self, objective: objectives.Objective) -> None:
        if objective.advantage != "prime":
            raise ValueError(f"PRIMETrainer needs prime advantages, not {objective.advantage!r}")
        if self.cfg.prime.update not in PRM_UPDATES:
            raise ValueError(
                f"prime.update must be one of {PRM_UPDATES}, got {self.cfg.prime.update!r}"
            )
        if self.cfg.rollout.group_size < 2:
            raise ValueError("PRIME's RLOO baselines need rollout.group_size >= 2")

    def checkpoint_state(self):
        return {"policy": self.state, "prm": self.prm_state}

    def set_checkpoint_state(self, tree) -> None:
        self.state, self.prm_state = tree["policy"], tree["prm"]

    def _setup_extra_networks(self) -> None:
        section = self.cfg.prime
        self.prm_optimizer = make_optimizer(
            section.learning_rate, max_grad_norm=section.max_grad_norm
        )
        # The PRM starts as a copy of the (warm-started) policy, as in the paper.
        self.prm_state, self.prm_shardings = create_train_state(
            self.run.model_config,
            self.prm_optimizer,
            key=jax.random.fold_in(self.key, 9),
            mesh=self.run.mesh,
            params=self.copy_params(self.state.params),
        )

    def _compile(self) -> None:
        super()._compile()
        run, cfg = self.run, self.cfg
        beta = run.objective.prime_beta
        self.prm_step = jit_step(
            make_step(
                make_prm_loss_fn(
                    run.model_config,
                    beta=beta,
                    temperature=cfg.rollout.temperature,
                    chunk_size=cfg.model.chunk_size,
                    remat=cfg.model.remat,
                ),
                self.prm_optimizer,
                micro_batches=cfg.trainer.micro_batches,
                param_shardings=self.prm_shardings.params,
            ),
            self.prm_shardings,
        )
        self.prime_fn = jax.jit(
            lambda rewards, mask, prm_lp, ref: objectives.compute_advantages(
                run.objective,
                rewards,
                mask,
                group_size=cfg.rollout.group_size,
                process_rewards=process_rewards(prm_lp, ref, mask, beta=beta),
            )
        )

    def _update_prm(self, samples, host) -> dict[str, float]:
        labels = np.asarray(samples.correct, np.float32)
        batch = self.run.to_device(host._replace(rewards=labels))
        self.prm_state, metrics = self.prm_step(self.prm_state, batch)
        return {k: float(v) for k, v in jax.device_get(metrics).items() if k.startswith("prm/")}

    def score(self, step, samples, host, device_batch):
        metrics: dict[str, Any] = {}
        if self.cfg.prime.update == "before":
            metrics.update(self._update_prm(samples, host))
        prm_lp = rollout_lib.fetch(self.logprob_fn(self.prm_state.params, device_batch))
        mask = samples.completion_mask
        adv, _ = self.prime_fn(samples.rewards, mask, prm_lp, host.ref_logprobs)
        dense = np.asarray(
            process_rewards(prm_lp, host.ref_logprobs, mask, beta=self.run.objective.prime_beta)
        )
        if self.cfg.prime.update == "after":
            metrics.update(self._update_prm(samples, host))
        valid = np.asarray(mask, bool)
        metrics["prm/process_reward_mean"] = float(dense[valid].mean()) if valid.any() else 0.0
        return host._replace(advantages=np.asarray(adv, np.float32)), metrics


__all__ = [
    "PRIMETrainer",
    "implicit_sequence_reward",
    "make_prm_loss_fn",
    "process_rewards",
]
