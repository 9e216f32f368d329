"""LoRA RL runs (``model.lora``): adapter-only state and checkpoints, the base as reference,
exact resume, PEFT export (transformers + peft load it with the policy's logits), ``--merge``,
evaluation of the adapter directory, and the errors for what is not supported.

The built-in tiny model is the base (after a short SFT warm-up, so it is not random); its run
writes it to ``run_dir/base`` as a Hugging Face checkpoint, which is what the exported PEFT
adapter names as its base and what a resumed run reloads.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import chex
import jax
import numpy as np
import pytest
import torch
import transformers

from jaxrl_llm import models
from jaxrl_llm.models import lora
from jaxrl_llm.train import cli
from jaxrl_llm.train.checkpoint import Checkpointer
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.rl.run import run
from jaxrl_llm.train.rl.trainer import RLTrainer
from jaxrl_llm.train.setup import build_policy
from tests.train.rl import rl_helpers

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with rl_helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


LORA = (
    rl_helpers.SHAPED_REWARDS,
    "model.lora={rank: 4, alpha: 8.0, targets: [q, v, o, up, down]}",
    "objective.overrides={kl_coef: 0.05}",  # a reference: the base
    "sft_warmup.steps=30",
    "trainer.learning_rate=3e-3",
    "trainer.max_steps=4",
    "trainer.warmup_steps=2",
    "checkpoint.every_steps=2",
    "trainer.eval_every=2",
)


def _config(run_dir, *extra):
    return rl_helpers.tiny_config(rl_helpers.CONFIGS / "grpo.yaml", run_dir, *LORA, *extra)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    cfg = _config(tmp_path_factory.mktemp("lora"))
    trainer = RLTrainer(cfg)
    summary = trainer.fit()
    return cfg, summary, trainer


def test_only_the_adapters_train_and_checkpoint(lora_run):
    cfg, _, trainer = lora_run
    names = set(trainer.state.params["layers"])
    assert names == {f"{w}_lora_{f}" for w in ("wq", "wv", "wo", "w_up", "w_down") for f in "ab"}
    # Optimizer moments mirror the adapters only: no base-sized leaf anywhere in the state.
    adapter_size = sum(x.size for x in jax.tree.leaves(trainer.state.params))
    state_size = sum(x.size for x in jax.tree.leaves(trainer.state.opt_state))
    assert adapter_size < state_size <= 2 * adapter_size + 16
    base_size = sum(x.size for x in jax.tree.leaves(trainer.base))
    assert base_size > 10 * adapter_size
    run_dir = pathlib.Path(cfg.run_dir)
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        raw, _ = ckpt.restore_raw(4)
    assert set(raw["params"]["layers"]) == names
    assert "embed" not in raw["params"]
    # The base never moved: it is still what the run wrote to base/ after the warm-up.
    _, saved = models.load_pretrained(run_dir / "base", dtype=np.float32)
    chex.assert_trees_all_equal(jax.device_get(trainer.base), saved)
    # The adapters did: B left zero.
    assert np.abs(np.asarray(trainer.state.params["layers"]["wq_lora_b"])).max() > 0


def test_the_reference_is_the_base(lora_run):
    cfg, _, trainer = lora_run
    assert trainer.reference is trainer.base
    rows = read_metrics(cfg.run_dir)
    # The first update's policy is the base exactly (B = 0): no KL; then the adapters move.
    assert rows[0]["kl"] == 0.0
    assert rows[-1]["kl"] > 0.0


def test_the_sampler_applies_the_current_adapters(lora_run):
    """The sampler's log-probs equal the update's own forward's (f32) at every step, also once
    the adapters have moved: the rollouts sample from base + adapters, not the base."""
    cfg, _, _ = lora_run
    rows = read_metrics(cfg.run_dir)
    assert all(row["rollout/logprob_diff_max"] < 1e-4 for row in rows), [
        row["rollout/logprob_diff_max"] for row in rows
    ]


def test_the_exported_adapter_loads_in_peft_with_the_policys_logits(lora_run, rng):
    cfg, summary, trainer = lora_run
    hf = pathlib.Path(summary["hf"])
    meta = json.loads((hf / lora.ADAPTER_CONFIG).read_text())
    assert meta["base_model_name_or_path"] == str(pathlib.Path(cfg.run_dir, "base").resolve())
    base = transformers.AutoModelForCausalLM.from_pretrained(meta["base_model_name_or_path"])
    model = peft.PeftModel.from_pretrained(base.to(torch.float32), str(hf)).eval()
    tokens = rng.integers(3, 20, size=(2, 7)).astype(np.int32)
    with torch.no_grad():
        want = model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    config = trainer.run.model_config
    got = np.asarray(models.logits(trainer.policy_params, config, tokens))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)

    # --merge writes the merged weights: plain transformers, same logits.
    out = pathlib.Path(cfg.run_dir) / "merged"
    assert cli.export_main([cfg.run_dir, "--merge", "--out", str(out)]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        logits = merged(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(logits, want, atol=1e-4, rtol=1e-4)
    # Without --merge, export from the checkpoint gives the same adapter as the run's hf/.
    again = pathlib.Path(cfg.run_dir) / "again"
    assert cli.export_main([cfg.run_dir, "--out", str(again)]) == 0
    _, a = lora.load_peft_adapter(again, lora.base_config(config))
    _, b = lora.load_peft_adapter(hf, lora.base_config(config))
    chex.assert_trees_all_equal(a, b)


def test_the_adapter_dir_is_a_model_path(lora_run):
    """``model.path`` = the run's ``hf/`` (what ``jaxrl-llm eval RUN_DIR`` loads) gives the
    base with the trained adapters."""
    cfg, summary, trainer = lora_run
    loaded = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, path=summary["hf"], lora=None)
    )
    _, config, params = build_policy(loaded, trainer.run.mesh)
    assert config.lora == trainer.run.model_config.lora
    chex.assert_trees_all_close(
        jax.device_get(params), jax.device_get(trainer.policy_params), atol=0, rtol=0
    )


@pytest.mark.slow
def test_resume_equals_the_uninterrupted_run(lora_run, tmp_path):
    cfg, summary, _ = lora_run
    first = _config(tmp_path, "trainer.max_steps=2")
    run(first)
    resumed = dataclasses.replace(cfg, run_dir=str(tmp_path), resume=True)
    resumed_summary = run(resumed)
    assert {k: v for k, v in resumed_summary.items() if k != "hf"} == {
        k: v for k, v in summary.items() if k != "hf"
    }
    assert rl_helpers.without_timing(read_metrics(tmp_path)) == rl_helpers.without_timing(
        read_metrics(cfg.run_dir)
    )
    _, a = lora.load_peft_adapter(tmp_path / "hf", lora.base_config(_model_config(tmp_path)))
    _, b = lora.load_peft_adapter(
        pathlib.Path(cfg.run_dir) / "hf", lora.base_config(_model_config(cfg.run_dir))
    )
    chex.assert_trees_all_equal(a, b)


def _model_config(run_dir) -> models.ModelConfig:
    return models.load_config(pathlib.Path(run_dir) / "base")


@pytest.mark.parametrize(
    "override, match",
    [
        (("objective.name=ppo", "critic.init=random"), "critic.init=random with model.lora"),
        (("reference.mode=ema",), "reference.mode"),
        (("model.lora.rank=0",), "model.lora rank"),
        (("model.lora.targets=[q, qkv]",), "model.lora targets"),
    ],
)
def test_unsupported_lora_settings_are_named(tmp_path, override, match):
    with pytest.raises(ValueError, match=match):
        RLTrainer(_config(tmp_path, *override))


def _run_counting_base_moves(cfg):
    """``(trainer, summary, the sampler's base at each sampler_params call)``."""
    trainer = RLTrainer(cfg)
    moved = []
    original = trainer.__class__.sampler_params

    def counting(self, timer=None):
        out = original(self, timer)
        moved.append(self.serving_base)
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RLTrainer, "sampler_params", counting)
        summary = trainer.fit()
    return trainer, summary, moved


@pytest.mark.slow
def test_lora_runs_on_a_2x2x2_mesh_and_on_sampler_devices_match_one_device(tmp_path):
    """Adapters follow their base weight's sharding; the sampler's layout (data 4 x tensor 2)
    gets the base once and the adapters every step; the first step equals one device's. With
    ``mesh.rollout_devices=4`` (and the asynchronous loop) the merged sampler sits on the
    first four devices: the base crosses once, each update's adapters are copied across and
    merged there, and the first step is again one device's."""
    common = ("trainer.max_steps=2", "model.tiny.vocab_multiple=2", "sft_warmup.steps=10")
    mesh = ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    trainer, summary, moved = _run_counting_base_moves(_config(tmp_path / "mesh", *common, *mesh))
    assert dict(trainer.serving.mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    assert len(moved) >= 3 and all(base is moved[0] for base in moved)  # resharded once
    wq_a = trainer.state.params["layers"]["wq_lora_a"].sharding.spec
    wq_b = trainer.state.params["layers"]["wq_lora_b"].sharding.spec
    assert wq_a[1] == "fsdp" and wq_b[2] == "tensor", (wq_a, wq_b)

    separate = (
        "mesh.rollout_devices=4",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "model.lora.sampler=merged",
        "rollout.max_staleness=1",
    )
    apart, apart_summary, moved = _run_counting_base_moves(
        _config(tmp_path / "apart", *common, *separate)
    )
    devices = jax.devices()
    assert {d for x in jax.tree.leaves(apart.state.params) for d in x.devices()} == set(devices[4:])
    served = apart.sampler_params()
    assert {d for x in jax.tree.leaves(served) for d in x.devices()} == set(devices[:4])
    assert len(moved) >= 3 and all(base is moved[0] for base in moved)  # crossed once
    config = apart.run.model_config
    merged = jax.jit(lambda p: lora.merge_weights(p, config))(apart.policy_params)
    assert np.abs(np.asarray(apart.state.params["layers"]["wq_lora_b"])).max() > 0
    for name in ("wq", "wv", "wo", "w_up", "w_down"):
        np.testing.assert_allclose(
            np.asarray(served["layers"][name]), np.asarray(merged["layers"][name]), atol=1e-6
        )

    single = RLTrainer(_config(tmp_path / "single", *common)).fit()
    for name, got in (("mesh", summary), ("apart", apart_summary)):
        assert got["eval_before_rl"] == single["eval_before_rl"], name
        first = read_metrics(tmp_path / name)[0]
        single_first = read_metrics(tmp_path / "single")[0]
        for key in ("reward_mean", "accuracy", "completion_length_mean"):
            assert first[key] == single_first[key], (name, key)
        for key in ("loss", "grad_norm", "kl"):
            assert first[key] == pytest.approx(single_first[key], rel=1e-4, abs=1e-6), (name, key)


def test_lora_dropout_is_in_the_update_only_and_reproducible(tmp_path):
    """``model.lora.dropout=0.3``: the update's forward drops adapter inputs (its log-probs
    differ from the sampler's, which never drops), with a key drawn from the train state, so
    the same config trains the same adapters twice."""
    runs = []
    for name in ("a", "b"):
        cfg = _config(tmp_path / name, "model.lora.dropout=0.3", "sft_warmup.steps=10")
        trainer = RLTrainer(cfg)
        trainer.fit()
        runs.append((read_metrics(tmp_path / name), jax.device_get(trainer.state.params)))
    (rows, params), (rows_b, params_b) = runs
    assert rows[0]["rollout/logprob_diff_max"] < 1e-5  # B = 0: dropped inputs change nothing
    assert rows[-1]["rollout/logprob_diff_max"] > 1e-3, [
        r["rollout/logprob_diff_max"] for r in rows
    ]
    assert rl_helpers.without_timing(rows) == rl_helpers.without_timing(rows_b)
    chex.assert_trees_all_equal(params, params_b)


# -- preference (DPO family) -------------------------------------------------------------------


def preference_config(config: str, run_dir, *extra):
    """A tiny LoRA preference or reward-model job from ``configs/<config>``."""
    from jaxrl_llm.train.config_io import load_config  # noqa: PLC0415
    from jaxrl_llm.train.preference.config import PreferenceConfig  # noqa: PLC0415

    return load_config(
        PreferenceConfig,
        rl_helpers.CONFIGS / config,
        [
            "sft_warmup.steps=20",
            "data.num_train=16",
            "data.eval_size=16",
            "trainer.batch_size=8",
            "trainer.learning_rate=5e-3",
            "trainer.max_steps=4",
            "logging.progress=false",
            "logging.plots=false",
            "logging.tensorboard=false",
            "mesh.fsdp=1",
            "model.lora={rank: 4, alpha: 8.0}",
            f"run_dir={run_dir}",
            *extra,
        ],
    )


def _dpo(run_dir, *extra):
    return preference_config("dpo.yaml", run_dir, *extra)


@pytest.mark.parametrize("reference", ["precompute", "on_the_fly"])
def test_dpo_with_lora_trains_adapters_against_the_base(tmp_path, reference):
    """The first step's policy is the base (B = 0) and so is the reference: DPO's loss is
    exactly log 2 with zero margins; the adapters then move and the base does not."""
    from jaxrl_llm.train.preference.trainer import PreferenceTrainer  # noqa: PLC0415

    trainer = PreferenceTrainer(_dpo(tmp_path, f"loss.reference={reference}"))
    summary = trainer.fit()
    rows = read_metrics(tmp_path)
    assert rows[0]["loss"] == pytest.approx(np.log(2.0), abs=1e-6)
    assert rows[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert rows[-1]["rewards/margins"] != pytest.approx(0.0, abs=1e-4)
    assert set(trainer.state.params) == {"layers"}
    if reference == "on_the_fly":
        assert trainer.reference is trainer.base
    _, saved = models.load_pretrained(tmp_path / "base", dtype=np.float32)
    chex.assert_trees_all_equal(jax.device_get(trainer.base), saved)
    spec, adapters = lora.load_peft_adapter(summary["hf"], models.load_config(tmp_path / "base"))
    assert spec == models.LoraSpec(rank=4, alpha=8.0)
    chex.assert_trees_all_close(adapters, jax.device_get(trainer.state.params), atol=0, rtol=0)


def test_bf16_compute_keeps_the_base_in_bf16_and_the_adapters_in_f32(tmp_path):
    """``model.compute_dtype=bfloat16`` (the TPU / GPU default): the frozen base is stored in
    bf16 (half the memory), the adapters' masters and moments in f32, and the updates move
    the f32 adapters (nothing rounds away)."""
    trainer = RLTrainer(_config(tmp_path, "model.compute_dtype=bfloat16", "sft_warmup.steps=0"))
    trainer.setup()
    before = jax.device_get(trainer.state.params)
    assert {x.dtype for x in jax.tree.leaves(trainer.base)} == {np.dtype("bfloat16")}
    assert {x.dtype for x in jax.tree.leaves(trainer.state.params)} == {np.dtype("float32")}
    moments = [x for x in jax.tree.leaves(trainer.state.opt_state) if x.ndim]
    assert moments and {x.dtype for x in moments} == {np.dtype("float32")}
    trainer.fit()
    after = jax.device_get(trainer.state.params)
    moved = [np.mean(a != b) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before))]
    # B leaves zero first; A's gradient is zero until B has (LoRA), so after 4 steps both move.
    assert min(moved) > 0.9, moved
