"""The timed GRPO policy update of the step benchmarks: its rollout batch and its jitted step.

``benchmarks/bench_train_step.py`` (jaxrl_llm against PyTorch) and
``benchmarks/bench_packing.py`` (packed against padded rows) time the same update:
``grpo_rollout_batch`` fills GRPO data in for any prompt and completion masks, and
``grpo_update`` builds ``train.rl.policy.make_policy_step`` + ``train.step.jit_step`` on a
fresh train state (every weight, or LoRA adapters on a frozen base) over a mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxrl_llm import models, objectives
from jaxrl_llm.losses import advantages
from jaxrl_llm.train import adapters
from jaxrl_llm.train.optim import make_optimizer
from jaxrl_llm.train.rl.policy import make_policy_step
from jaxrl_llm.train.state import TrainState, create_train_state
from jaxrl_llm.train.step import jit_step
from jaxrl_llm.types import RolloutBatch


def grpo_rollout_batch(
    rng: np.random.Generator,
    prompt_mask: np.ndarray,
    completion_mask: np.ndarray,
    vocab: int,
    *,
    group_size: int,
) -> RolloutBatch:
    """GRPO data on the rows ``[prompt_mask ; completion_mask]``, drawn from ``rng``.

    ``old_t = -log V + 0.1 e_t`` and ``ref_t = old_t + 0.05 e'_t`` (``e, e'`` standard normal)
    on completion tokens, 0 on padding: a random model's log-probs sit near ``-log V``, so the
    ratios start near 1. Rewards are 0 / 1 draws and the advantages their ``advantages.grpo``
    over groups of ``group_size`` rows; token ids are uniform in ``[1, V)`` on real positions,
    0 on padding. The draws come in that order (old, ref, rewards, prompt tokens, completion
    tokens), so one ``rng`` state gives one batch.

    Args:
      rng: the NumPy generator to draw from.
      prompt_mask: ``[B, P]`` bool, 1 on real (left-padded) prompt tokens.
      completion_mask: ``[B, T]`` bool, 1 on real (right-padded) completion tokens.
      vocab: ``V``, the model's vocabulary size (> 1).
      group_size: rows per GRPO group (divides ``B``).

    Returns:
      A host ``RolloutBatch``: int32 tokens, float32 ``[B, T]`` log-probs and ``[B]``
      advantages, the masks as given.
    """
    if np.ndim(prompt_mask) != 2 or np.ndim(completion_mask) != 2:
        raise ValueError(
            f"prompt_mask and completion_mask must be [B, P] and [B, T], got shapes "
            f"{np.shape(prompt_mask)} and {np.shape(completion_mask)}"
        )
    batch, length = completion_mask.shape
    if prompt_mask.shape[0] != batch:
        raise ValueError(
            f"prompt_mask has {prompt_mask.shape[0]} rows but completion_mask has {batch}"
        )
    if vocab < 2:
        raise ValueError(f"vocab must be >= 2 (token ids are drawn from [1, V)), got {vocab}")
    base = -np.log(vocab) + 0.1 * rng.standard_normal((batch, length))
    ref = base + 0.05 * rng.standard_normal((batch, length))
    rewards = rng.integers(0, 2, size=batch).astype(np.float32)
    return RolloutBatch(
        completion_mask=completion_mask,
        old_logprobs=np.where(completion_mask, base, 0.0).astype(np.float32),
        advantages=np.asarray(advantages.grpo(rewards, group_size=group_size), np.float32),
        ref_logprobs=np.where(completion_mask, ref, 0.0).astype(np.float32),
        prompt_tokens=np.where(prompt_mask, rng.integers(1, vocab, prompt_mask.shape), 0).astype(
            np.int32
        ),
        prompt_mask=prompt_mask,
        completion_tokens=np.where(
            completion_mask, rng.integers(1, vocab, completion_mask.shape), 0
        ).astype(np.int32),
    )


class PolicyUpdate:
    """A jitted GRPO policy update and the train state it advances.

    ``update(batch)`` runs one step on a device batch (``parallel.shard_batch``), the state
    donated and replaced by the new one, and returns ``(state, metrics)`` without blocking.

    Attributes:
      step: the jitted ``(state, batch) -> (state, metrics)``.
      state: the current ``TrainState``.
      frozen: a LoRA run's frozen base parameters, or None.
      state_bytes: bytes of the parameters, the optimizer state and the frozen base.
    """

    def __init__(self, step: Any, state: TrainState, frozen: Any = None):
        self.step, self.state, self.frozen = step, state, frozen
        leaves = jax.tree.leaves((state.params, state.opt_state, frozen))
        self.state_bytes = int(sum(x.size * x.dtype.itemsize for x in leaves))

    def __call__(self, batch: RolloutBatch) -> tuple[TrainState, dict]:
        self.state, metrics = self.step(self.state, batch)
        return self.state, metrics

    def temp_bytes(self, batch: RolloutBatch) -> int:
        """XLA's temporary bytes of the compiled step on ``batch`` (compiles it once more)."""
        compiled = self.step.lower(self.state, batch).compile()
        return int(compiled.memory_analysis().temp_size_in_bytes)


def grpo_update(
    config: models.ModelConfig,
    params: Any,
    mesh: jax.sharding.Mesh,
    *,
    learning_rate: float,
    key: jax.Array,
    compute_entropy: bool = True,
    lora_rank: int | None = None,
) -> PolicyUpdate:
    """``make_policy_step`` with the ``grpo`` objective and AdamW, jitted on a fresh state.

    Args:
      config: the policy's ``ModelConfig`` (its ``compute_dtype`` is the step's).
      params: the starting weights (f32 masters), on ``mesh``.
      mesh: the mesh of the state and the batch.
      learning_rate: AdamW's (``train.optim.make_optimizer``).
      key: the train state's key.
      compute_entropy: also compute the per-token entropy (a metric).
      lora_rank: train rank-r adapters (alpha ``2r``, every projection) on the frozen
        ``params`` instead of every weight; None trains every weight.

    Returns:
      A ``PolicyUpdate``.
    """
    optimizer = make_optimizer(learning_rate)
    frozen = frozen_shardings = None
    if lora_rank is None:
        state, shardings = create_train_state(config, optimizer, key=key, mesh=mesh, params=params)
    else:
        config = dataclasses.replace(config, lora=models.LoraSpec(lora_rank, 2.0 * lora_rank))
        state, shardings, frozen, frozen_shardings = adapters.create_lora_state(
            config, optimizer, key=key, mesh=mesh, params=params
        )
    step = jit_step(
        make_policy_step(
            config,
            objectives.make("grpo"),
            optimizer,
            compute_entropy=compute_entropy,
            param_shardings=shardings.params,
        ),
        shardings,
        frozen=frozen,
        frozen_shardings=frozen_shardings,
    )
    return PolicyUpdate(step, state, frozen)
