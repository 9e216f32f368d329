"""Offline preference training end to end on the built-in synthetic pairs.

One uninterrupted DPO run (precomputed reference, checkpoints every 4 steps) is the reference.
The same run with the reference scored on the fly must match it; a run stopped at step 4 and
resumed to 8 must reproduce it exactly (metric rows and final state). KTO runs and resumes
with an on-the-fly reference (its mismatched-pair KL included). All runs share shapes, so the
compiled programs are shared through a persistent compilation cache.
"""

from __future__ import annotations

import json
import math

import chex
import jax
import numpy as np
import pytest

from jaxrl_llm import data
from jaxrl_llm.train.checkpoint import Checkpointer
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.preference.config import PreferenceConfig
from jaxrl_llm.train.preference.run import run
from jaxrl_llm.train.preference.trainer import SFT_WARMUP_STEPS_BUILTIN, PreferenceTrainer
from tests.train import helpers
from tests.train.preference.preference_helpers import TINY

STEPS = 8
METRIC_KEYS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "nll",
    "grad_norm",
)


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


def config(name: str, run_dir, *overrides: str) -> PreferenceConfig:
    return load_config(
        PreferenceConfig, helpers.CONFIGS / name, [*TINY, f"run_dir={run_dir}", *overrides]
    )


def final_state(run_dir):
    """The state, sampler position and extras of a run's last checkpoint, on the host."""
    trainer = PreferenceTrainer(
        load_config(PreferenceConfig, run_dir / "config.yaml", ["resume=true"])
    )
    trainer.setup()
    trainer.restore(trainer.latest)
    out = jax.device_get(trainer.state), trainer.sampler.state(), trainer.extra
    trainer.checkpointer.close()
    trainer.metrics_writer.close()
    return out


def without_timing(rows):
    return helpers.without_timing(rows)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dpo") / "run"
    cfg = config(
        "dpo.yaml", run_dir, f"trainer.max_steps={STEPS}", "checkpoint.every_steps=4",
        "trainer.eval_every=4",
    )  # fmt: skip
    return run_dir, run(cfg)


def test_dpo_run_writes_the_run_directory(straight):
    run_dir, summary = straight
    for name in ("config.yaml", "metrics.jsonl", "summary.json"):
        assert (run_dir / name).is_file()
    assert json.loads((run_dir / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert summary["job"] == "preference" and summary["loss"] == "dpo"
    assert summary["steps"] == STEPS and summary["truncated_records"] == 0
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        for key in METRIC_KEYS:
            assert math.isfinite(row[key]), (key, row)
    assert all(f"eval/{k}" in rows[3] and f"eval/{k}" in rows[7] for k in METRIC_KEYS[:-1])
    assert "eval/loss" not in rows[0]
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [4, 8]
        # The precomputed reference log-probs are saved once, with the first checkpoint.
        assert ckpt.reference_steps() == [4]
    # The trained policy is exported as a Hugging Face checkpoint in run_dir/hf, as by every
    # job (no run_dir/policy any more).
    assert summary["hf"] == str(run_dir / "hf")
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (run_dir / "hf" / name).is_file(), name
    assert not (run_dir / "policy").exists()


def test_dpo_starts_at_log_2_and_learns_the_preference(straight):
    run_dir, summary = straight
    rows = read_metrics(run_dir)
    # Before any update the policy is the reference: every implicit reward is exactly 0.
    for metrics in (summary["eval_before"], rows[0]):
        assert metrics["loss"] == pytest.approx(math.log(2.0), abs=1e-6)
        assert metrics["rewards/chosen"] == metrics["rewards/rejected"] == 0.0
        assert metrics["rewards/accuracies"] == 0.0
    # Four epochs over the 16 training pairs: the policy comes to prefer the correct answers
    # (each row's metrics are measured on its batch before the update).
    margins = [r["rewards/margins"] for r in rows]
    assert np.mean(margins[-2:]) > np.mean(margins[1:3]) > 0.0
    assert np.mean([r["rewards/accuracies"] for r in rows[-2:]]) >= 0.9
    assert rows[-1]["loss"] < math.log(2.0) - 0.1
    assert all(math.isfinite(v) for v in summary["eval_after"].values())


def test_on_the_fly_reference_matches_the_precomputed_one(straight, tmp_path):
    run_dir, summary = straight
    cfg = config(
        "dpo.yaml", tmp_path / "fly", f"trainer.max_steps={STEPS}", "checkpoint.every_steps=4",
        "trainer.eval_every=4", "loss.reference=on_the_fly",
    )  # fmt: skip
    fly = run(cfg)
    expected, got = without_timing(read_metrics(run_dir)), without_timing(read_metrics(cfg.run_dir))
    assert [r.keys() for r in got] == [r.keys() for r in expected]
    for want, row in zip(expected, got):
        for key in want:
            np.testing.assert_allclose(row[key], want[key], rtol=1e-4, atol=1e-5, err_msg=key)
    for key in summary["eval_after"]:
        np.testing.assert_allclose(fly["eval_after"][key], summary["eval_after"][key], atol=1e-5)
    with Checkpointer(tmp_path / "fly" / "checkpoints") as ckpt:
        # The on-the-fly reference is the initial policy's parameters, saved once.
        assert ckpt.reference_steps() == [4]


def test_resume_reproduces_the_uninterrupted_run(straight, tmp_path):
    run_dir, summary = straight
    resumed_dir = tmp_path / "resumed"
    common = ("checkpoint.every_steps=4", "trainer.eval_every=4")
    # The first half stops at step 4 (its learning-rate schedule is that of the full run).
    first = config("dpo.yaml", resumed_dir, "trainer.max_steps=4", *common)
    run(first)
    second = config("dpo.yaml", resumed_dir, f"trainer.max_steps={STEPS}", "resume=true", *common)
    resumed = run(second)

    assert without_timing(read_metrics(resumed_dir)) == without_timing(read_metrics(run_dir))
    assert resumed["eval_before"] == summary["eval_before"]
    assert resumed["eval_after"] == summary["eval_after"]
    want_state, want_sampler, want_extra = final_state(run_dir)
    got_state, got_sampler, got_extra = final_state(resumed_dir)
    chex.assert_trees_all_equal(got_state, want_state)
    assert got_sampler == want_sampler
    assert got_extra == want_extra


def test_sft_warm_up_null_resolves_to_the_builtin_length(tmp_path):
    """``sft_warmup.steps`` left null: 600 supervised steps for the built-in tiny model."""
    tiny = [o for o in TINY if not o.startswith("sft_warmup.")]
    cfg = load_config(PreferenceConfig, None, [*tiny, f"run_dir={tmp_path}"])
    assert cfg.sft_warmup.steps is None
    trainer = PreferenceTrainer(cfg)
    trainer.checkpointer.close()
    trainer.metrics_writer.close()
    assert trainer.sft_steps == SFT_WARMUP_STEPS_BUILTIN == 600


def test_an_existing_run_is_not_overwritten(straight):
    run_dir, _ = straight
    config_text = (run_dir / "config.yaml").read_text()
    cfg = config("dpo.yaml", run_dir, "trainer.max_steps=4")
    with pytest.raises(ValueError, match=r"already holds checkpoints .*resume=true"):
        PreferenceTrainer(cfg)
    assert (run_dir / "config.yaml").read_text() == config_text


@pytest.mark.slow
def test_kto_resumes_with_an_on_the_fly_reference_as_it_ran_with_a_precomputed_one(tmp_path):
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    common = ("checkpoint.every_steps=2", "trainer.eval_every=2")
    summary = run(config("kto.yaml", straight_dir, "trainer.max_steps=4", *common))
    fly = (*common, "loss.reference=on_the_fly")
    run(config("kto.yaml", resumed_dir, "trainer.max_steps=2", *fly))
    resumed = run(config("kto.yaml", resumed_dir, "trainer.max_steps=4", "resume=true", *fly))

    # The same examples as unpaired JSONL records (KTO's own data format) train identically.
    cfg = load_config(PreferenceConfig, straight_dir / "config.yaml")
    train, evaluation = (data.pairs_to_unpaired(p) for p in _builtin_pairs(cfg))
    unpaired = lambda e: {"prompt": e.prompt, "completion": e.completion, "label": e.label}  # noqa: E731
    paths = [
        _write_jsonl(tmp_path / f"{name}.jsonl", [unpaired(e) for e in part])
        for name, part in (("train", train), ("eval", evaluation))
    ]
    jsonl_dir = tmp_path / "jsonl"
    run(
        config(
            "kto.yaml", jsonl_dir, "trainer.max_steps=4", *common, "data.task=jsonl",
            "data.unpaired=true", f"data.train_path={paths[0]}", f"data.eval_path={paths[1]}",
            "data.eval_size=32",
        )
    )  # fmt: skip

    rows = without_timing(read_metrics(straight_dir))
    assert without_timing(read_metrics(jsonl_dir)) == rows
    for want, row in zip(rows, without_timing(read_metrics(resumed_dir)), strict=True):
        assert row.keys() == want.keys()
        for key in want:
            np.testing.assert_allclose(row[key], want[key], rtol=1e-4, atol=1e-5, err_msg=key)
    for key, value in summary["eval_after"].items():
        np.testing.assert_allclose(resumed["eval_after"][key], value, rtol=1e-4, atol=1e-5)
    keys = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "kl", "nll")
    for row in rows:
        for key in keys:
            assert math.isfinite(row[key]), (key, row)
    # At the start policy = reference: rewards and the KL reference point are 0, so every
    # example's loss is 1 − σ(0) = 0.5.
    assert rows[0]["loss"] == pytest.approx(0.5, abs=1e-6)
    assert rows[0]["kl"] == 0.0
    assert summary["eval_before"]["rewards/margins"] == 0.0
    assert rows[-1]["rewards/margins"] > 0.0


@pytest.mark.slow
def test_a_sharded_run_matches_the_single_device_run(straight, tmp_path):
    run_dir, summary = straight
    cfg = config(
        "dpo.yaml", tmp_path, "trainer.max_steps=4", "checkpoint.every_steps=4",
        "trainer.eval_every=4", "mesh.data=2", "mesh.fsdp=4",
    )  # fmt: skip
    run(cfg)
    expected = without_timing(read_metrics(run_dir))[:4]
    for want, row in zip(expected, without_timing(read_metrics(tmp_path)), strict=True):
        for key in want:
            np.testing.assert_allclose(row[key], want[key], rtol=1e-4, atol=1e-5, err_msg=key)


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _builtin_pairs(cfg):
    pairs = data.arithmetic_preference_pairs(cfg.data.num_train + cfg.data.eval_size, seed=cfg.seed)
    return pairs[cfg.data.eval_size :], pairs[: cfg.data.eval_size]


def test_a_jsonl_copy_of_the_builtin_pairs_trains_identically(straight, tmp_path):
    run_dir, _ = straight
    cfg = load_config(PreferenceConfig, run_dir / "config.yaml")
    train, evaluation = _builtin_pairs(cfg)
    fields = lambda p: {"question": p.prompt, "chosen": p.chosen, "rejected": p.rejected}  # noqa: E731
    paths = {
        name: _write_jsonl(tmp_path / f"{name}.jsonl", [fields(p) for p in pairs])
        for name, pairs in (("train", train), ("eval", evaluation))
    }
    jsonl = config(
        "dpo.yaml", tmp_path / "run", "trainer.max_steps=2", "trainer.eval_every=4",
        "data.task=jsonl", f"data.train_path={paths['train']}",
        f"data.eval_path={paths['eval']}", "data.prompt_field=question",
    )  # fmt: skip
    summary = run(jsonl)
    assert (
        without_timing(read_metrics(tmp_path / "run")) == without_timing(read_metrics(run_dir))[:2]
    )
    assert summary["eval_before"] == straight[1]["eval_before"]


def test_over_long_records_fail_or_are_counted_when_truncation_is_on(tmp_path):
    records = [
        {"prompt": "1+1=", "chosen": "2", "rejected": "3"},
        {"prompt": "2+2=", "chosen": "4", "rejected": "1234567"},
        {"prompt": "3+3=", "chosen": "6", "rejected": "7"},
    ]
    path = _write_jsonl(tmp_path / "pairs.jsonl", records)
    common = [
        "data.task=jsonl", f"data.train_path={path}", f"data.eval_path={path}",
        "data.max_completion_tokens=4", "trainer.batch_size=3",
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"rejected completion of row 1 has 8 tokens with EOS"):
        PreferenceTrainer(config("dpo.yaml", tmp_path / "a", *common))
    assert not (tmp_path / "a" / "config.yaml").exists()
    trainer = PreferenceTrainer(config("dpo.yaml", tmp_path / "b", *common, "data.truncate=true"))
    # The long pair is cut once in the training split and once in the held-out one.
    assert trainer.truncated == 2
    assert trainer.train_split.arrays.rejected_mask[1].sum() == 4
    trainer.checkpointer.close()
    trainer.metrics_writer.close()
