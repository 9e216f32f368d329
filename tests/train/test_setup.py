"""What every job resolves before its first step (``train.setup``): the SFT warm-up length, the
mesh, batch sizes against it."""

from __future__ import annotations

import pytest

from jaxrl_llm import parallel
from jaxrl_llm.train import setup
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.preference import trainer as preference_trainer
from jaxrl_llm.train.preference.config import PreferenceConfig
from jaxrl_llm.train.rl import trainer as rl_trainer
from jaxrl_llm.train.rl.config import TrainConfig


@pytest.mark.parametrize(
    ("config_class", "builtin"),
    [
        (TrainConfig, rl_trainer.SFT_WARMUP_STEPS_BUILTIN),
        (PreferenceConfig, preference_trainer.SFT_WARMUP_STEPS_BUILTIN),
    ],
    ids=["rl", "preference"],
)
def test_sft_warmup_steps_null_means_on_for_the_builtin_model_only(config_class, builtin):
    default = load_config(config_class, None)
    assert default.sft_warmup.steps is None
    assert setup.sft_warmup_steps(default, builtin) == builtin
    # A loaded checkpoint is never trained on the gold answers unasked...
    loaded = load_config(config_class, None, ["model.path=/some/checkpoint"])
    assert setup.sft_warmup_steps(loaded, builtin) == 0
    # ... and an explicit setting wins either way.
    for overrides in (["sft_warmup.steps=5"], ["sft_warmup.steps=5", "model.path=/x"]):
        assert setup.sft_warmup_steps(load_config(config_class, None, overrides), builtin) == 5
    assert setup.sft_warmup_steps(load_config(config_class, None, ["sft_warmup.steps=0"]), 7) == 0
    negative = load_config(config_class, None, ["sft_warmup.steps=-1"])
    with pytest.raises(ValueError, match="sft_warmup.steps must be >= 0, got -1"):
        setup.sft_warmup_steps(negative, builtin)


def test_the_builtin_warm_up_lengths():
    """The lengths the README's numbers were measured with."""
    assert rl_trainer.SFT_WARMUP_STEPS_BUILTIN == 2000
    assert preference_trainer.SFT_WARMUP_STEPS_BUILTIN == 600


def test_batch_sizes_must_divide_the_batch_shards():
    mesh = setup.make_run_mesh(load_config(TrainConfig, None, ["mesh.data=2", "mesh.fsdp=2"]).mesh)
    assert parallel.batch_shards(mesh) == 4
    setup.check_batch_sizes({"a": 8, "b": 4}, mesh)
    with pytest.raises(ValueError, match=r"b=6 does not divide into the 4 batch shards"):
        setup.check_batch_sizes({"a": 8, "b": 6, "c": 3}, mesh)
    too_big = load_config(TrainConfig, None, ["mesh.data=4", "mesh.fsdp=4"]).mesh
    with pytest.raises(ValueError, match=r"needs 16 devices; 8 available"):
        setup.make_run_mesh(too_big)


@pytest.mark.parametrize(
    ("name", "backend", "expected"),
    [
        ("auto", "cpu", "float32"),
        ("auto", "tpu", "bfloat16"),
        ("auto", "gpu", "bfloat16"),
        ("float32", "tpu", "float32"),
        ("bfloat16", "cpu", "bfloat16"),
    ],
)
def test_compute_dtype_auto_is_bf16_on_accelerators_only(name, backend, expected):
    cfg = load_config(TrainConfig, None, [f"model.compute_dtype={name}"])
    assert setup.compute_dtype(cfg.model, backend) == expected


def test_rl_job_keeps_f32_masters_and_moments_and_computes_in_the_compute_dtype(tmp_path):
    """The built-in model honours both keys (``model.dtype`` used to be ignored for it): bf16
    masters when asked, f32 AdamW moments, and every forward in the compute dtype."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from tests.train.rl import rl_helpers  # noqa: PLC0415

    cfg = rl_helpers.tiny_config(
        None,
        tmp_path,
        "model.param_dtype=bfloat16",
        "model.compute_dtype=bfloat16",
        "sft_warmup.steps=0",
    )
    trainer = rl_trainer.RLTrainer(cfg)
    trainer.setup()
    assert trainer.run.model_config.compute_dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(trainer.state.params)} == {jnp.dtype("bfloat16")}
    floating = [
        x for x in jax.tree.leaves(trainer.state.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    assert floating and {x.dtype for x in floating if x.ndim} == {jnp.dtype("float32")}


def test_lora_section_becomes_the_models_spec_rslora_included():
    from jaxrl_llm.models import LoraSpec
    from jaxrl_llm.train.config import LoraSection, ModelSection

    section = ModelSection(lora=LoraSection(rank=8, alpha=16.0, rslora=True, targets=("v", "q")))
    spec = setup.lora_spec(section)
    assert spec == LoraSpec(8, 16.0, ("q", "v"), rslora=True)
    assert spec.scale == 16.0 / 8**0.5
    assert setup.lora_spec(ModelSection()) is None
    with pytest.raises(ValueError, match="model.lora rslora"):
        setup.lora_spec(ModelSection(lora=LoraSection(rslora="yes")))


def test_the_rl_warm_up_probe_is_off_by_default_and_checked():
    """``sft_warmup.stop_at_accuracy``: null (off) by default, a fraction in (0, 1] as given;
    anything else, and the key on a preference job, is an error naming it."""
    default = load_config(TrainConfig, None)
    assert default.sft_warmup.stop_at_accuracy is None
    assert default.sft_warmup.check_every == 50
    for value, want in (("0.8", 0.8), ("1", 1.0), ("null", None)):
        section = load_config(TrainConfig, None, [f"sft_warmup.stop_at_accuracy={value}"])
        assert section.sft_warmup.stop_at_accuracy == want
    for value in ("0", "1.5", "-0.1"):
        with pytest.raises(ValueError, match="sft_warmup.stop_at_accuracy must be null or a"):
            load_config(TrainConfig, None, [f"sft_warmup.stop_at_accuracy={value}"])
    for value in ("half", "true"):
        with pytest.raises(ValueError, match="'sft_warmup.stop_at_accuracy' expects"):
            load_config(TrainConfig, None, [f"sft_warmup.stop_at_accuracy={value}"])
    with pytest.raises(ValueError, match="sft_warmup.check_every must be >= 1, got 0"):
        load_config(TrainConfig, None, ["sft_warmup.check_every=0"])
    with pytest.raises(ValueError, match="stop_at_accuracy"):
        load_config(PreferenceConfig, None, ["sft_warmup.stop_at_accuracy=0.5"])
