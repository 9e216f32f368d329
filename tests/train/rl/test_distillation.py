"""On-policy distillation end to end (issue 47, item 1): ``objective.name=distill`` with a
teacher checkpoint on disk.

The teacher is a transformers Llama with random weights saved with the built-in character
tokenizer; the student is the built-in tiny model. Checked: the teacher log-probs the trainer
computes equal transformers' float64 forward of the teacher on the sampled tokens; the
advantages are ``lp_teacher - lp_old`` and ``distill/reverse_kl`` their negated mean; the
teacher's settings are checked (missing, unused, another tokenizer).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrl_llm import data
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.rl.config import check_config
from jaxrl_llm.train.rl.trainer import RLTrainer
from tests.models import hf_utils
from tests.train.rl import rl_helpers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with rl_helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


class RecordingTrainer(RLTrainer):
    """Keeps every step's sequences, behaviour and teacher log-probs and advantages."""

    def compile(self):
        super().compile()
        self.seen = []
        program = self.programs["teacher_logprobs"]
        inner = program.fn

        def recorded(params, seqs, *packing):
            out = inner(params, seqs, *packing)
            self.seen.append({"seqs": seqs, "teacher": out})
            return out

        self.programs["teacher_logprobs"] = type(program)(
            program.name, recorded, program.calls_per_step, program.builder, program.config
        )

    def score(self, step, samples, seqs, forwards, rewards):
        batch, metrics = super().score(step, samples, seqs, forwards, rewards)
        self.seen[-1].update(old=np.asarray(forwards.old), advantages=np.asarray(batch.advantages))
        return batch, metrics


def test_opd_trains_on_the_teachers_log_probs(tmp_path):
    torch_teacher = rl_helpers.distillation_teacher(tmp_path / "teacher")
    cfg = rl_helpers.tiny_config(
        rl_helpers.CONFIGS / "distill.yaml",
        tmp_path / "run",
        f"teacher.path={tmp_path / 'teacher'}",
        "trainer.max_steps=2",
        "model.compute_dtype=float32",
    )
    trainer = RecordingTrainer(cfg)
    trainer.fit()
    assert trainer.run.model_config.vocab_size == 21  # the built-in tokenizer: the teacher's too
    rows = read_metrics(tmp_path / "run")
    assert len(trainer.seen) == 2
    for row, seen in zip(rows, trainer.seen, strict=True):
        seqs = seen["seqs"]
        prompt, prompt_mask = np.asarray(seqs.prompt_tokens), np.asarray(seqs.prompt_mask)
        completion = np.asarray(seqs.completion_tokens)
        completion_mask = np.asarray(seqs.completion_mask)
        want = hf_utils.hf_completion_logprobs(
            torch_teacher, prompt, prompt_mask, completion, completion_mask
        )
        got = np.asarray(seen["teacher"])
        valid = completion_mask > 0
        np.testing.assert_allclose(got[valid], want[valid], atol=2e-4)
        gap = np.where(valid, want - seen["old"], 0.0)
        np.testing.assert_allclose(seen["advantages"], gap, atol=2e-4)
        assert row["distill/reverse_kl"] == pytest.approx(-gap[valid].mean(), abs=2e-4)
        assert row["advantage_std"] > 0 and row["grad_norm"] > 0


def test_the_teacher_settings_are_checked(tmp_path):
    other = tmp_path / "other"
    rl_helpers.distillation_teacher(other, data.ARITHMETIC_ALPHABET[::-1])  # other ids
    with pytest.raises(ValueError, match=r"teacher.path .* its tokenizer is not the policy's"):
        RLTrainer(
            rl_helpers.tiny_config(
                rl_helpers.CONFIGS / "distill.yaml", tmp_path / "run", f"teacher.path={other}"
            )
        )
    no_teacher = rl_helpers.tiny_config(
        rl_helpers.CONFIGS / "distill.yaml", tmp_path / "run", "teacher.path=null"
    )
    with pytest.raises(
        ValueError, match=r"objective 'distill' \(distill advantages\) needs a teacher"
    ):
        check_config(no_teacher)
    unused = rl_helpers.tiny_config(None, tmp_path / "run", f"teacher.path={other}")
    with pytest.raises(ValueError, match="teacher.path is read by the distillation objectives"):
        check_config(unused)
    placed = rl_helpers.tiny_config(None, tmp_path / "run", "teacher.devices=2")
    with pytest.raises(ValueError, match="teacher.devices places a teacher: set teacher.path"):
        check_config(placed)
    every = rl_helpers.tiny_config(
        rl_helpers.CONFIGS / "distill.yaml",
        tmp_path / "run",
        f"teacher.path={other}",
        f"teacher.devices={jax.device_count()}",
    )
    with pytest.raises(ValueError, match="teacher.devices=8 must leave the trainer a device"):
        RLTrainer(every)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("teacher")
    rl_helpers.distillation_teacher(path)
    return path


@pytest.mark.parametrize(
    "extra",
    [
        ("rollout.engine=continuous", "rollout.slots=8"),
        ("rollout.max_staleness=1",),
        ("model.lora={rank: 4, alpha: 8.0, targets: [q, v, o]}",),
    ],
    ids=["continuous_engine", "one_step_off", "lora_student"],
)
def test_distillation_with_each_sampler_pipeline_and_student(teacher_dir, tmp_path, extra):
    """Every step's advantages are the teacher's log-probs of that step's own samples minus the
    behaviour log-probs, however the samples were drawn (continuous engine, a one-step-off
    pipeline) and whatever trains (a LoRA student's adapters)."""
    cfg = rl_helpers.tiny_config(
        rl_helpers.CONFIGS / "distill.yaml",
        tmp_path / "run",
        f"teacher.path={teacher_dir}",
        "trainer.max_steps=2",
        "model.compute_dtype=float32",
        *extra,
    )
    trainer = RecordingTrainer(cfg)
    trainer.fit()
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == len(trainer.seen) == 2
    for row, seen in zip(rows, trainer.seen, strict=True):
        valid = np.asarray(seen["seqs"].completion_mask) > 0
        gap = np.where(valid, np.asarray(seen["teacher"]) - seen["old"], 0.0)
        np.testing.assert_allclose(seen["advantages"], gap, atol=1e-6)
        assert row["distill/reverse_kl"] == pytest.approx(-gap[valid].mean(), abs=1e-5)
        assert row["grad_norm"] > 0


def test_a_teacher_on_devices_of_its_own_gives_the_shared_runs_steps(teacher_dir, tmp_path):
    """``teacher.devices=2`` on 8 devices: the teacher's weights live on the last 2, the
    trainer's ``mesh.fsdp=4`` on the first 4, and two packed steps (the teacher's own packing
    plan for its 2 batch shards, not the trainer's 4) give the teacher log-probs, losses and
    gradient norms of the same trainer mesh with the teacher beside it (f32)."""

    def run(name: str, *extra: str):
        cfg = rl_helpers.tiny_config(
            rl_helpers.CONFIGS / "distill.yaml",
            tmp_path / name,
            f"teacher.path={teacher_dir}",
            "trainer.max_steps=2",
            "model.compute_dtype=float32",
            "trainer.packing=on",
            *extra,
        )
        trainer = RecordingTrainer(cfg)
        trainer.fit()
        return trainer, read_metrics(tmp_path / name)

    shared, shared_rows = run("shared", "mesh.fsdp=4")
    own, own_rows = run("own", "mesh.fsdp=4", "teacher.devices=2")
    devices = jax.devices()
    assert set(own.run.mesh.devices.flat) == set(shared.run.mesh.devices.flat) == set(devices[:4])
    placed = {d for leaf in jax.tree.leaves(own.teacher[1]) for d in leaf.devices()}
    assert placed == set(devices[6:])
    for want, got in zip(shared.seen, own.seen, strict=True):
        assert set(got["teacher"].devices()) == set(devices[6:])
        np.testing.assert_allclose(
            np.asarray(got["teacher"]), np.asarray(want["teacher"]), rtol=1e-5, atol=1e-6
        )
    for want, got in zip(shared_rows, own_rows, strict=True):
        for key in ("loss", "distill/reverse_kl", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
