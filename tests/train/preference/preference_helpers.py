"""Shared settings of the preference-job tests: the tiny run and the small model.

Modules that use the same settings compile the same programs, which the session's persistent
compilation cache then shares between them. Job-independent helpers live in
``tests.train.helpers``.
"""

# One device, no SFT, 16 training pairs (an epoch is 2 steps), 16 held out, batches of 8.
TINY = (
    "sft_warmup.steps=0",
    "data.num_train=16",
    "data.eval_size=16",
    "trainer.batch_size=8",
    "trainer.learning_rate=5e-3",
    "logging.progress=false",
    "logging.plots=false",
    "logging.tensorboard=false",
    "mesh.fsdp=1",
)

# A one-layer model of width 32 (``model.tiny.*`` overrides of the built-in task's model).
SMALL_MODEL = (
    "model.tiny.hidden_size=32",
    "model.tiny.intermediate_size=64",
    "model.tiny.num_hidden_layers=1",
    "model.tiny.num_attention_heads=2",
    "model.tiny.num_key_value_heads=1",
    "model.tiny.head_dim=16",
)
