"""The RL job: picks the trainer an objective needs and runs it.

``gae`` advantages need PPO's critic (``train.rl.ppo``), ``prime`` advantages PRIME's implicit
process reward model (``train.rl.prime``); every other objective runs on the plain policy
trainer (``train.rl.trainer``). The factory lives here, apart from the trainers, so no trainer
module imports another's subclass.
"""

from __future__ import annotations

from typing import Any

from jaxrl_llm.train.rl.config import TrainConfig, make_objective
from jaxrl_llm.train.rl.ppo import PPOTrainer
from jaxrl_llm.train.rl.prime import PRIMETrainer
from jaxrl_llm.train.rl.trainer import RLTrainer


def trainer_for(cfg: TrainConfig) -> RLTrainer:
    """The trainer ``cfg``'s objective needs (not yet set up: call ``.fit()``)."""
    advantage = make_objective(cfg.objective).advantage
    if advantage == "gae":
        return PPOTrainer(cfg)
    if advantage == "prime":
        return PRIMETrainer(cfg)
    return RLTrainer(cfg)


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Runs an RL job from a resolved config; returns the summary written to summary.json."""
    return trainer_for(cfg).fit()
