"""``spec.resolve``: an RL job's config resolved once, and the consumers that share it."""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest

from jaxrl_llm.plan import programs
from jaxrl_llm.plan.topology import resolve_topology
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.rl import spec
from jaxrl_llm.train.rl.config import TrainConfig
from jaxrl_llm.train.rl.run import trainer_class
from jaxrl_llm.train.rl.trainer import RLTrainer

TINY = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)


def _cfg(*overrides: str) -> TrainConfig:
    return load_config(TrainConfig, None, list(overrides))


def test_the_resolved_shape_by_hand():
    run = spec.resolve(
        _cfg(
            "rollout.prompts_per_step=6",
            "rollout.group_size=4",
            "trainer.minibatches=3",
            "trainer.epochs=2",
            "data.max_prompt_tokens=20",
            "rollout.max_new_tokens=9",
        )
    )
    shape = run.shape
    assert (shape.prompts, shape.group_size, shape.rows, shape.minibatch_rows) == (6, 4, 24, 8)
    # Prompts pad to the power-of-two bucket >= 16 that holds them.
    assert (shape.prompt_len, shape.completion_len, shape.seq_len) == (32, 9, 41)
    assert shape.updates_per_step == 6
    assert run.kind == "policy" and run.objective.name == "grpo"


def test_precision_names_every_dtype_for_the_backend():
    cpu = spec.resolve(_cfg(), backend="cpu").precision
    assert cpu == spec.Precision("float32", "float32", "float32", "float32")
    tpu = spec.resolve(_cfg("trainer.optimizer_state_dtype=bfloat16"), backend="tpu").precision
    assert tpu == spec.Precision("float32", "bfloat16", "bfloat16", "bfloat16")
    fixed = spec.resolve(_cfg("model.compute_dtype=bfloat16"), backend="cpu").precision
    assert fixed.compute_dtype == fixed.cache_dtype == "bfloat16"


def test_the_sampler_settings_turn_top_k_off_when_greedy():
    sampler = spec.resolve(_cfg("rollout.top_k=5", "rollout.temperature=0.7")).sampler
    assert sampler.sampling() == dict(temperature=0.7, top_k=5, top_p=1.0, min_p=0.0)
    assert sampler.sampling(0.0)["top_k"] == 0
    greedy = spec.resolve(_cfg("rollout.top_k=5", "rollout.temperature=0.0")).sampler
    assert greedy.sampling()["top_k"] == 0
    assert greedy.sampling(1.0)["top_k"] == 5  # an evaluation that samples


@pytest.mark.parametrize(
    "name, kind", [("grpo", "policy"), ("dapo", "policy"), ("ppo", "ppo"), ("prime", "prime")]
)
def test_the_trainer_kind_supplies_the_estimators_inputs(name, kind):
    run = spec.resolve(_cfg(f"objective.name={name}"))
    assert run.kind == kind
    assert trainer_class(run.objective).SUPPLIES == spec.TRAINER_SUPPLIES[kind]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("model.remat=sometimes",), "model.remat must be one of"),
        (("trainer.optimizer_state_dtype=float16",), "trainer.optimizer_state_dtype"),
        (("model.param_dtype=int8",), "model.param_dtype must be one of"),
        (("model.compute_dtype=float64",), "model.compute_dtype must be one of"),
        (("rollout.partial=true",), "rollout.partial"),
        (("trainer.minibatches=3",), "trainer.minibatches=3 does not divide"),
    ],
)
def test_train_and_plan_refuse_the_same_configs(overrides, message, tmp_path):
    cfg = _cfg(f"run_dir={tmp_path / 'run'}", *overrides)
    with pytest.raises(ValueError, match=message):
        spec.resolve(cfg)
    with pytest.raises(ValueError, match=message):
        RLTrainer(cfg)
    assert not (tmp_path / "run").exists()  # refused before anything was written
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    planned = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, architecture=str(config))
    )
    with pytest.raises(programs.PlanError, match=message):
        programs.build_job(planned, resolve_topology("v5litepod-4"), devices=jax.devices()[:4])
