"""The RL wing: rollout, rewards, advantages and policy updates (GRPO family, PPO, PRIME).

Modules: ``config`` (``TrainConfig``, ``check_config``), ``context`` (task data, sampling),
``rollout`` (sample → score → select groups), ``policy`` (the policy step), ``trainer``
(``RLTrainer``), ``ppo`` (critic), ``prime`` (implicit PRM), ``run`` (``run(cfg)``).
"""
