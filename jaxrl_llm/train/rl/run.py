"""The RL job: picks the trainer an objective needs and runs it.

The choice follows what the objective's advantage estimator ``requires`` (its registration in
``jaxrl_llm.objectives``), not its name: an estimator that needs critic ``values`` (``gae``,
or a user's own) runs on PPO's trainer with a critic (``train.rl.ppo``), one that needs
``process_rewards`` (``prime``) on PRIME's with an implicit process reward model
(``train.rl.prime``); every other objective runs on the plain policy trainer
(``train.rl.trainer``). The factory lives here, apart from the trainers, so no trainer module
imports another's subclass.
"""

from __future__ import annotations

from typing import Any

from jaxrl_llm import objectives, parallel
from jaxrl_llm.train.rl import remote
from jaxrl_llm.train.rl.config import TrainConfig, make_objective
from jaxrl_llm.train.rl.ppo import PPOTrainer
from jaxrl_llm.train.rl.prime import PRIMETrainer
from jaxrl_llm.train.rl.spec import trainer_kind
from jaxrl_llm.train.rl.trainer import RLTrainer

TRAINERS = {"policy": RLTrainer, "ppo": PPOTrainer, "prime": PRIMETrainer}


def trainer_class(objective: objectives.Objective) -> type[RLTrainer]:
    """The trainer class that supplies every input ``objective``'s estimator requires
    (``spec.trainer_kind``)."""
    return TRAINERS[trainer_kind(objective)]


def trainer_for(cfg: TrainConfig) -> RLTrainer:
    """The trainer ``cfg``'s objective needs (not yet set up: call ``.fit()``)."""
    return trainer_class(make_objective(cfg.objective))(cfg)


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Runs an RL job from a resolved config; returns the summary written to summary.json (a
    sampler process of a job with the sampler on processes of its own: its rollout count)."""
    parallel.initialize_distributed()
    if remote.setup_roles(cfg):
        return remote.run_sampler(cfg)
    return trainer_for(cfg).fit()
