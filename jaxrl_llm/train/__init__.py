"""Training: one core and two wings.

The core (this package's modules) is what every job shares: ``config`` sections,
``config_io`` (YAML ↔ dataclasses), ``setup`` (mesh, policy, batch placement), ``state``
(sharded ``TrainState``), ``optim``, ``step`` (the one micro-batched, sharded optimizer step),
``forward`` (frozen log-prob passes), ``sft`` (the one supervised warm-up), ``checkpoint``,
``metrics``, ``plots``, ``export`` (Hugging Face checkpoints), ``core`` (the ``Trainer`` run
loop) and ``cli``. The wings: ``train.rl`` (RL: GRPO family, PPO, PRIME) and
``train.preference`` (offline DPO family, KTO, ORPO, SimPO, CPO, reward models).
"""
