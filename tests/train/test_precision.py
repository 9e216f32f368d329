"""A job's precision resolved once (``train.precision``) and every model of a job loaded through
one function (``setup.load_model``): weights in the master or the compute dtype, the config
computing in the job's compute dtype, a vocabulary other than the policy's refused."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.models import heads
from jaxrl_llm.train import precision, setup
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.rl.config import TrainConfig
from jaxrl_llm.train.rl.spec import resolve

CONFIG = models.ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=40,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    eos_token_ids=(2,),
    pad_token_id=0,
)


def _precision(*overrides: str, backend: str = "cpu") -> precision.Precision:
    cfg = load_config(TrainConfig, None, list(overrides))
    return precision.resolve_precision(
        cfg.model, cfg.trainer.optimizer_state_dtype, backend=backend
    )


def test_precision_names_every_dtype_for_the_backend():
    cpu, tpu = _precision(backend="cpu"), _precision(backend="tpu")
    assert (cpu.param_dtype, cpu.compute_dtype, cpu.cache_dtype) == ("float32",) * 3
    assert (tpu.param_dtype, tpu.compute_dtype, tpu.cache_dtype) == (
        "float32",
        "bfloat16",
        "bfloat16",
    )
    assert tpu.optimizer_state_dtype == "float32"
    assert (tpu.param, tpu.compute) == (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
    mixed = _precision(
        "model.param_dtype=bfloat16",
        "model.compute_dtype=float32",
        "trainer.optimizer_state_dtype=bfloat16",
        backend="tpu",
    )
    assert dataclasses.astuple(mixed) == ("bfloat16", "float32", "float32", "bfloat16")


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.param_dtype=float16", "model.param_dtype"),
        ("model.compute_dtype=float16", "model.compute_dtype"),
        ("trainer.optimizer_state_dtype=int8", "trainer.optimizer_state_dtype"),
    ],
)
def test_an_unknown_dtype_names_its_key(override, key):
    with pytest.raises(ValueError, match=key):
        _precision(override)


def test_the_config_and_the_models_accept_the_same_compute_dtypes():
    """One list: the config's names are the models' and ``auto`` (they used to disagree)."""
    assert precision.COMPUTE_DTYPES == ("auto", *models.COMPUTE_DTYPES)
    for name in models.COMPUTE_DTYPES:
        models.ModelConfig(**{**CONFIG.__dict__, "compute_dtype": name})
    with pytest.raises(ValueError, match="compute_dtype"):
        models.ModelConfig(**{**CONFIG.__dict__, "compute_dtype": "float16"})


def test_the_run_spec_carries_the_resolved_precision():
    cfg = load_config(TrainConfig, None, ["model.compute_dtype=auto"])
    assert resolve(cfg, backend="tpu").precision == precision.resolve_precision(
        cfg.model, backend="tpu"
    )
    assert resolve(cfg, backend="cpu").precision.compute_dtype == "float32"


def test_job_model_sets_the_compute_dtype_and_adapters():
    bf16 = _precision("model.compute_dtype=bfloat16")
    spec = models.LoraSpec(rank=2, alpha=4.0)
    got = precision.job_model(CONFIG, bf16, lora=spec)
    assert (got.compute_dtype, got.lora) == ("bfloat16", spec)
    assert precision.job_model(got, bf16).lora is None  # adapters only when given
    assert dataclasses.replace(got, compute_dtype=None, lora=None) == CONFIG


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A causal LM and a scalar-head model of ``CONFIG``'s shapes, and one of another
    vocabulary, saved in float32."""
    root = tmp_path_factory.mktemp("models")
    key = jax.random.key(0)
    models.save_pretrained(root / "lm", CONFIG, models.init_params(CONFIG, key))
    heads.save_scalar_model(root / "rm", CONFIG, heads.init_scalar_params(CONFIG, key))
    other = dataclasses.replace(CONFIG, vocab_size=48)
    heads.save_scalar_model(root / "other", other, heads.init_scalar_params(other, key))
    return root


def _dtypes(tree) -> set:
    return {x.dtype for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


def test_load_model_reads_trained_weights_in_the_master_dtype(checkpoints):
    job = _precision("model.param_dtype=float32", "model.compute_dtype=bfloat16")
    config, params = setup.load_model(str(checkpoints / "lm"), job)
    assert config.compute_dtype == "bfloat16" and config.lora is None
    assert _dtypes(params) == {jnp.dtype(jnp.float32)}
    want = models.init_params(CONFIG, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(params["embed"]), np.asarray(want["embed"]))


def test_load_model_reads_a_frozen_scalar_model_in_the_compute_dtype(checkpoints):
    job = _precision("model.param_dtype=float32", "model.compute_dtype=bfloat16")
    config, params = setup.load_model(
        str(checkpoints / "rm"), job, head="scalar", frozen=True, policy=CONFIG
    )
    assert config.compute_dtype == "bfloat16"
    assert _dtypes(params) == {jnp.dtype(jnp.bfloat16)}
    trained = setup.load_model(str(checkpoints / "rm"), job, head="scalar")[1]
    assert _dtypes(trained) == {jnp.dtype(jnp.float32)}


def test_load_model_without_weights_gives_the_same_config(checkpoints):
    job = _precision("model.compute_dtype=bfloat16")
    spec = models.LoraSpec(rank=2, alpha=4.0)
    for path, head in (("lm", "causal"), ("rm", "scalar")):
        loaded = setup.load_model(str(checkpoints / path), job, head=head, lora=spec)[0]
        config, params = setup.load_model(
            str(checkpoints / path), job, head=head, lora=spec, weights=False
        )
        assert params is None and config == loaded and config.lora == spec


def test_load_model_refuses_another_vocabulary_naming_the_key(checkpoints):
    job = _precision()
    with pytest.raises(ValueError, match=r"^critic\.path .*vocab_size 48, the policy 40"):
        setup.load_model(
            str(checkpoints / "other"), job, head="scalar", policy=CONFIG, key="critic.path"
        )
    with pytest.raises(ValueError, match="head must be"):
        setup.load_model(str(checkpoints / "lm"), job, head="value")
