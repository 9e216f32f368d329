"""On-policy distillation end to end (issue 47, item 1): ``objective.name=distill`` with a
teacher checkpoint on disk.

The teacher is a transformers Llama with random weights saved with the built-in character
tokenizer; the student is the built-in tiny model. Checked: the teacher log-probs the trainer
computes equal transformers' float64 forward of the teacher on the sampled tokens; the
advantages are ``lp_teacher - lp_old`` and ``distill/reverse_kl`` their negated mean; the
teacher's settings are checked (missing, unused, another tokenizer).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl_llm import data, objectives
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.rl.config import check_config, teacher_top_k
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
        # The engine and the trained parameters are independent; one run has both (the GKD
        # variant below runs the same sampler, so its programs are compiled once).
        ("rollout.engine=continuous", "rollout.slots=8", "model.lora={rank: 4, alpha: 8.0}"),
        ("rollout.max_staleness=1",),
    ],
    ids=["continuous_engine_lora_student", "one_step_off"],
)
def test_distillation_with_each_sampler_pipeline_and_student(teacher_dir, tmp_path, extra):
    """Every step's advantages are the teacher's log-probs of that step's own samples minus the
    behaviour log-probs, however the samples were drawn (continuous engine, a one-step-off
    pipeline) and whatever trains (a LoRA student's adapters, with the continuous engine)."""
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


# --- GKD: the generalised JSD to the teacher's top-k as a loss (teacher.loss=jsd) ----------

SHAPED = rl_helpers.SHAPED_REWARDS  # GRPO's advantages then differ within groups


class GKDRecorder(RLTrainer):
    """Keeps every step's sequences, the teacher program's outputs (its top-k) and the policy's
    parameters as the step's update receives them."""

    def compile(self):
        super().compile()
        self.seen = []
        program = self.programs["teacher_logprobs"]
        inner = program.fn

        def recorded(params, seqs, *packing):
            out = inner(params, seqs, *packing)
            self.seen.append({"seqs": jax.device_get(seqs), "teacher": jax.device_get(out)})
            return out

        self.programs["teacher_logprobs"] = dataclasses.replace(program, fn=recorded)

    def update(self, step, minibatch):
        self.seen[-1]["params"] = jax.device_get(self.policy_params)
        return super().update(step, minibatch)


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _completion_logits(seqs, forward) -> np.ndarray:
    """float64 ``[B, T, V]`` logits predicting each completion token, from ``forward(tokens,
    mask) -> [B, P + T, V]``."""
    tokens = np.concatenate([seqs.prompt_tokens, seqs.completion_tokens], axis=1)
    mask = np.concatenate([seqs.prompt_mask, seqs.completion_mask], axis=1).astype(np.int32)
    prompt, length = seqs.prompt_tokens.shape[1], seqs.completion_tokens.shape[1]
    return np.asarray(forward(tokens, mask), np.float64)[:, prompt - 1 : prompt - 1 + length]


def _unpadded_completion_logits(torch_model, seqs) -> np.ndarray:
    """float64 transformers logits ``[B, T, V]`` predicting each real completion token, each
    row run alone and unpadded (as ``hf_utils.hf_completion_logprobs``: left padding would
    feed NaN through HF's fully masked rows); 0 at completion padding."""
    out = None
    for row in range(len(seqs.prompt_tokens)):
        prompt = seqs.prompt_tokens[row][seqs.prompt_mask[row] > 0]
        completion = seqs.completion_tokens[row][seqs.completion_mask[row] > 0]
        seq = np.concatenate([prompt, completion])[None]
        full = hf_utils.hf_logits(torch_model, seq, np.ones_like(seq), double=True)[0]
        if out is None:
            out = np.zeros((*seqs.completion_tokens.shape, full.shape[-1]))
        out[row, : len(completion)] = full[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
    return out


def hand_jsd(trainer: GKDRecorder, seen: dict) -> float:
    """``distill/jsd`` by hand: the student's logits (``models.logits`` of the parameters the
    update received, float64 from there on), its log-softmax at the recorded teacher top-k ids,
    both renormalised over the k tokens, GKD's JSD_β (TRL's ends), mean over the valid tokens."""
    from jaxrl_llm import models  # noqa: PLC0415

    config, objective = trainer.run.model_config, trainer.spec.objective
    seqs, teacher = seen["seqs"], seen["teacher"]

    def student_logits(tokens, mask):
        return models.logits(seen["params"], config, tokens, attention_mask=mask)

    z = _completion_logits(seqs, student_logits) / trainer.cfg.rollout.temperature
    student = _log_softmax(np.take_along_axis(_log_softmax(z), teacher.top_ids, axis=-1))
    p = np.exp(_log_softmax(np.asarray(teacher.top_logprobs, np.float64)))
    q = np.exp(student)
    beta = objective.distill.jsd_beta

    def kl(a, b):
        return np.where(a > 0, a * (np.log(a) - np.log(b)), 0.0).sum(-1)

    if beta in (0.0, 1.0):
        jsd = kl(p, q) if beta == 0.0 else kl(q, p)
    else:
        m = beta * p + (1 - beta) * q
        jsd = beta * kl(p, m) + (1 - beta) * kl(q, m)
    valid = np.asarray(seqs.completion_mask) > 0
    return float(jsd[valid].mean())


def _gkd_run(teacher_dir, run_dir, *extra):
    cfg = rl_helpers.tiny_config(
        rl_helpers.CONFIGS / "distill_gkd.yaml",
        run_dir,
        f"teacher.path={teacher_dir}",
        "trainer.max_steps=2",
        "model.compute_dtype=float32",
        "teacher.top_k=5",
        "teacher.jsd_beta=0.3",
        *extra,
    )
    trainer = GKDRecorder(cfg)
    trainer.fit()
    rows = read_metrics(run_dir)
    assert len(rows) == len(trainer.seen) == 2
    alone = trainer.spec.objective.advantage.name == "none"
    for row, seen in zip(rows, trainer.seen, strict=True):
        assert row["distill/jsd"] == pytest.approx(hand_jsd(trainer, seen), rel=1e-5, abs=1e-6)
        assert row["distill/jsd"] > 0 and row["grad_norm"] > 0
        if alone:  # no advantage: the JSD is the whole loss
            assert row["loss"] == pytest.approx(row["distill/jsd_loss"], rel=1e-6)
            assert row["advantage_max"] == row["advantage_min"] == 0.0
    return trainer, rows


def test_gkd_reports_the_jsd_of_the_teachers_top_k_and_packed_equals_padded(teacher_dir, tmp_path):
    """``distill_gkd`` with ``teacher.top_k=5``, ``jsd_beta=0.3``, sampling temperature 0.8:
    the teacher's recorded top-k is transformers' float64 teacher's at that temperature (ids
    and log-probs), each step's ``distill/jsd`` is the hand computation from it and the
    student's logits, and packed rows in two micro-batches train as padded ones (f32: teacher
    top-k, ``distill/jsd``, loss and gradient norm)."""
    torch_teacher = rl_helpers.distillation_teacher(tmp_path / "teacher")
    warm = "rollout.temperature=0.8"  # the teacher's and student's distributions both at it
    padded, padded_rows = _gkd_run(tmp_path / "teacher", tmp_path / "padded", warm)
    for seen in padded.seen:
        seqs, top = seen["seqs"], seen["teacher"]
        assert top.top_ids.shape == (*seqs.completion_tokens.shape, 5)
        assert top.top_ids.dtype == np.int32 and top.top_logprobs.dtype == np.float32

        logp = _log_softmax(_unpadded_completion_logits(torch_teacher, seqs) / 0.8)
        want_ids = np.argsort(-logp, axis=-1, kind="stable")[..., :5]
        valid = np.asarray(seqs.completion_mask) > 0
        np.testing.assert_array_equal(top.top_ids[valid], want_ids[valid])
        np.testing.assert_allclose(
            top.top_logprobs[valid], np.take_along_axis(logp, want_ids, -1)[valid], atol=2e-4
        )
    packed, packed_rows = _gkd_run(
        tmp_path / "teacher",
        tmp_path / "packed",
        warm,
        "trainer.packing=on",
        "trainer.micro_batches=2",
        "trainer.micro_batch_tokens=null",
    )
    for want, got in zip(padded.seen, packed.seen, strict=True):
        np.testing.assert_array_equal(got["teacher"].top_ids, want["teacher"].top_ids)
        np.testing.assert_allclose(
            got["teacher"].top_logprobs, want["teacher"].top_logprobs, rtol=1e-5, atol=1e-5
        )
    for want, got in zip(padded_rows, packed_rows, strict=True):
        for key in ("distill/jsd", "loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize(
    "extra",
    [
        ("rollout.engine=continuous", "rollout.slots=8", "model.lora={rank: 4, alpha: 8.0}"),
        # The sampling pipeline, the teacher's k and its placement are independent: one run.
        (
            "rollout.max_staleness=1",
            "teacher.top_k=null",
            "mesh.fsdp=4",
            "teacher.devices=2",
            "trainer.packing=on",
        ),
        ("objective.overrides={advantage: grpo}", "teacher.coef=0.5", SHAPED),
    ],
    ids=["continuous_engine_lora_student", "one_step_off_full_vocab_teacher_devices", "grpo"],
)
def test_gkd_with_each_pipeline_student_and_placement(teacher_dir, tmp_path, extra):
    """Each step's ``distill/jsd`` is the hand computation from the recorded teacher top-k and
    the parameters the update received, however the samples were drawn (continuous engine, a
    one-step-off pipeline), whatever trains (a LoRA student's adapters), wherever the teacher
    runs (devices of its own, packed for their shards; with the one-step-off pipeline), over
    the whole vocabulary (``teacher.top_k=null``: k = V = 21) and mixed with GRPO's reward
    advantage."""
    trainer, rows = _gkd_run(teacher_dir, tmp_path / "run", *extra)
    if "teacher.top_k=null" in extra:
        assert trainer.seen[0]["teacher"].top_ids.shape[-1] == 21
    if "teacher.devices=2" in extra:
        devices = jax.devices()
        assert {d for leaf in jax.tree.leaves(trainer.teacher[1]) for d in leaf.devices()} == set(
            devices[6:]
        )
    if "teacher.coef=0.5" in extra:  # GRPO's loss plus half the JSD
        for row in rows:
            assert row["loss"] == pytest.approx(
                row["pg_loss"] + 0.5 * row["distill/jsd_loss"], rel=1e-5, abs=1e-7
            )
            assert row["advantage_max"] > 0


def test_the_jsd_settings_are_checked_and_reach_the_objective(teacher_dir, tmp_path):
    def config(path, *overrides):
        return rl_helpers.tiny_config(path, tmp_path / "run", *overrides)

    gkd = rl_helpers.CONFIGS / "distill_gkd.yaml"
    teacher = f"teacher.path={teacher_dir}"
    objective = check_config(
        config(
            None,
            teacher,
            "teacher.loss=jsd",
            "teacher.top_k=4",
            "teacher.jsd_beta=1.0",
            "teacher.coef=0.25",
        )
    )
    assert (objective.name, objective.advantage.name, objective.distill.loss) == (
        "grpo",
        "grpo",
        "jsd",
    )
    assert (objective.distill.top_k, objective.distill.jsd_beta, objective.distill.coef) == (
        4,
        1.0,
        0.25,
    )
    # Without a JSD loss, teacher.coef weighs the sampled-token advantage (distill_coef).
    opd = check_config(config(rl_helpers.CONFIGS / "distill.yaml", teacher, "teacher.coef=0.5"))
    assert (opd.advantage.distill_coef, opd.distill.loss, opd.distill.coef) == (0.5, None, 1.0)
    for overrides, message in [
        (("teacher.path=null",), r"objective 'distill_gkd' \(its jsd distillation loss\) needs"),
        ((teacher, "teacher.loss=kl"), r"teacher.loss must be one of \('none', 'jsd'\)"),
        ((teacher, "teacher.jsd_beta=1.5"), r"teacher.jsd_beta must be in \[0, 1\]"),
        ((teacher, "teacher.top_k=0"), "teacher.top_k must be an integer >= 1"),
        ((teacher, "teacher.coef=-1"), "teacher.coef must be a number >= 0"),
        (
            (teacher, "teacher.jsd_beta=0.2", "objective.overrides={jsd_beta: 0.1}"),
            r"objective.overrides sets \['jsd_beta'\], which the teacher section sets too",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            check_config(config(gkd, *overrides))
    for overrides, message in [
        (("teacher.top_k=4",), "teacher.jsd_beta and teacher.top_k shape the JSD"),
        (("teacher.coef=0.5",), "teacher.coef weighs a teacher's term: set teacher.path"),
        ((teacher, "teacher.loss=none"), "teacher.path is read by the distillation objectives"),
        (
            (teacher, "teacher.loss=jsd", "objective.name=ppo"),
            r"teacher.loss=jsd is computed by the policy trainer's update; objective 'ppo'",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            check_config(config(None, *overrides))
    too_many = config(gkd, teacher, "teacher.top_k=22")
    with pytest.raises(ValueError, match=r"teacher.top_k=22 is larger than the vocabulary \(21"):
        RLTrainer(too_many)  # refused before any warm-up or compile
    with pytest.raises(ValueError, match=r"\[64, 512, 151936\] log-probs and ids, 37.1 GiB"):
        teacher_top_k(objectives.make("distill_gkd"), 151936, 64, 512)
    assert teacher_top_k(objectives.make("distill_gkd"), 21, 64, 512) == 21
