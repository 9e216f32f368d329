"""``jaxrl-llm plan`` for on-policy distillation (``objective.name=distill``): the teacher at
``teacher.path`` as ``train`` loads and runs it, by hand.

``train.rl.context.load_teacher`` keeps the teacher all run, frozen, in the compute dtype (bf16
on TPU), sharded by the parameter rules on the trainer's mesh: the ``teacher`` part of every
program. ``train.rl.programs.teacher_program`` scores the rollout batch once a step with the
policy's log-prob forward on the teacher: ``teacher_logprobs``, its FLOPs the teacher's forward
over ``B x (P + T)`` positions with the unembedding at the ``T`` completion positions.

The job is test_programs' tiny one (4 x 2 rows, 16 + 8 tokens, fsdp 4 over 4 of the 8 fake CPU
devices); the teacher's directory holds only a ``config.json``, as plan reads nothing else.
"""

import json

import jax
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.plan import estimate as est
from jaxrl_llm.plan import flops
from jaxrl_llm.plan import programs as pr
from jaxrl_llm.plan.cli import format_report
from jaxrl_llm.plan.topology import libtpu_available, resolve_topology
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.forward import make_logprob_fn
from jaxrl_llm.train.rl.config import TrainConfig
from jaxrl_llm.train.rl.programs import builder_name
from tests.plan.test_cli import plan
from tests.plan.test_programs import TINY

V5E_4 = resolve_topology("v5litepod-4")
needs_libtpu = pytest.mark.skipif(
    not libtpu_available(),
    reason="libtpu not importable (pip install 'jax[tpu]'): no deviceless TPU compiles",
)

# A teacher smaller than the policy, on its vocabulary: D=32, F=64, one layer, N=4, K=2, H=16,
# its own unembedding (untied).
TEACHER = {**TINY, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
# V D + L (2 D + D N H + 2 D K H + N H D + 3 D F) + D + D V
#   = 8192 + (64 + 2048 + 2048 + 2048 + 6144) + 32 + 8192
TEACHER_PARAMS = 8192 + 12352 + 32 + 8192
# Rows 8 = 2 a chip; P = 16, T = 8: 24 positions a row.
ROWS, SEQ, T = 8, 24, 8
TEACHER_LAYER = 32 * (64 + 64) + 64 * 32 + 3 * 32 * 64  # D (N H + 2 K H) + N H D + 3 D F
PAIRS = ROWS * 24 * 25 // 2  # causal (query, key) pairs; 4 N H FLOPs a pair and layer
# 2 N a token, attention, and the unembedding (2 D V) at the T completion positions.
TEACHER_FORWARD = 2 * TEACHER_LAYER * ROWS * SEQ + 4 * 4 * 16 * PAIRS + ROWS * T * 2 * 32 * 256
# bf16 (the TPU compute dtype), every leaf split over fsdp 4.
TEACHER_BYTES = TEACHER_PARAMS * 2 // 4
OPD = ("objective.name=distill", "teacher.path={teacher}")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    (root / "config.json").write_text(json.dumps(TINY))
    for name, config in {
        "teacher": TEACHER,
        "other_vocab": {**TEACHER, "vocab_size": 512},
        # A Qwen2-shaped teacher (q/k/v biases, tied embeddings) of the policy's vocabulary.
        "qwen2": {
            **TEACHER,
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "tie_word_embeddings": True,
        },
    }.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    return {"policy": str(root / "config.json"), "teacher": str(root / "teacher"), "root": root}


def _overrides(paths, *overrides):
    return [
        f"model.architecture={paths['policy']}",
        "rollout.prompts_per_step=4",
        "rollout.group_size=2",
        "data.max_prompt_tokens=12",
        "rollout.max_new_tokens=8",
        "mesh.fsdp=4",
        *(o.format(teacher=paths["teacher"], root=paths["root"]) for o in overrides),
    ]


def _job(paths, *overrides):
    cfg = load_config(TrainConfig, None, _overrides(paths, *overrides))
    return pr.build_job(cfg, V5E_4, devices=jax.devices()[:4])


def test_hand_counts_match_the_formulas():
    teacher = models.ModelConfig.from_hf_dict(TEACHER)
    assert models.param_count(teacher) == TEACHER_PARAMS == 28768
    assert flops.forward_flops(teacher, ROWS, SEQ, logits_positions=T) == TEACHER_FORWARD


@pytest.mark.parametrize(
    "overrides, itemsize",
    [
        ((), 2),  # the compute dtype (bf16 on TPU), whatever the masters' (f32)
        (("model.param_dtype=bfloat16", "model.compute_dtype=float32"), 4),
    ],
)
def test_teacher_weights_are_resident_in_every_program_once(paths, overrides, itemsize):
    """``load_teacher`` keeps the teacher in the compute dtype, split over fsdp 4, all run:
    every program counts it once (its log-prob forward as an argument), beside the rest of
    the resident state."""
    job = _job(paths, *OPD, *overrides)
    state = job.state
    assert state.teacher == TEACHER_PARAMS * itemsize // 4
    # Dr. GRPO keeps no reference either: the same state but the teacher.
    assert state.resident == _job(paths, "objective.name=dr_grpo", *overrides).state.resident + (
        state.teacher
    )
    assert job.programs["teacher_logprobs"].argument_parts == {"teacher": state.teacher}
    for name, program in job.programs.items():
        alive = dict(program.resident)
        for part, nbytes in program.argument_parts.items():
            assert part not in program.resident, (name, part)
            alive[part] = alive.get(part, 0) + nbytes
        assert alive["teacher"] == state.teacher, name
        assert alive["parameters"] == state.params, name
        assert alive["optimizer_state"] == state.optimizer, name


def test_teacher_logprobs_is_the_trainers_forward_on_the_teacher(paths):
    """Once a step over all B rows of P + T positions with the teacher's own architecture (not
    the policy's), built by the trainer's ``teacher_program`` (``make_logprob_fn``); compiled,
    its arguments are the teacher and the rollout's sequences, and the sampler's and the
    behaviour forward's log-probs are alive beside it."""
    job = _job(paths, *OPD)
    program = job.programs["teacher_logprobs"]
    assert program.calls_per_step == 1
    assert program.function == builder_name(make_logprob_fn)
    assert program.flops == program.model_flops == TEACHER_FORWARD
    assert program.tokens == ROWS * T
    memory = est.memory_breakdown(program.lowered.compile())
    # Per chip: the teacher, and 2 rows of prompt tokens 2x16x4, mask 2x16, completion tokens
    # 2x8x4, mask 2x8.
    assert memory.argument_bytes == TEACHER_BYTES + 240
    parts = pr.memory_parts(program, memory)
    assert parts["teacher"] == TEACHER_BYTES
    # The sampler's and the behaviour forward's [2, 8] f32 log-probs (64 bytes a chip each),
    # and the seqs.
    assert program.resident["inputs"] == 2 * 64 and parts["inputs"] == 240 + 2 * 64
    assert sum(parts.values()) == memory.total_bytes + sum(program.resident.values())
    # A reference (a KL term) adds its log-probs.
    kl = _job(paths, *OPD, "objective.overrides={{kl_kind: k3, kl_coef: 0.01}}")
    assert "ref_logprobs" in kl.programs
    assert kl.programs["teacher_logprobs"].resident["inputs"] == 3 * 64


def test_without_a_teacher_nothing_changes(paths):
    job = _job(paths)
    assert "teacher_logprobs" not in job.programs and job.state.teacher == 0
    assert all("teacher" not in p.resident for p in job.programs.values())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ("objective.name=distill", "teacher.path={root}/other_vocab"),
            "teacher.path .* vocab_size",
        ),
        (("objective.name=distill", "teacher.path={root}/nowhere"), "teacher.path: no config.json"),
        (("objective.name=distill",), "needs a teacher"),
        (("teacher.path={teacher}",), "teacher.path is read by the distillation objectives"),
    ],
)
def test_teacher_refusals_name_the_key(paths, overrides, message):
    with pytest.raises(pr.PlanError, match=message):
        _job(paths, *overrides)


def test_sampler_chips_of_their_own_do_not_hold_the_teacher(paths):
    """``mesh.rollout_devices``: the teacher lives on the trainer's chips, the sampler's
    programs on its own chips hold only its weights, cache and temporaries."""
    cfg = load_config(
        TrainConfig,
        None,
        _overrides(paths, *OPD, "mesh.rollout_devices=4", "rollout.max_staleness=1"),
    )
    job = pr.build_job(cfg, resolve_topology("v5litepod-8"), devices=jax.devices()[:8])
    for name in ("prefill", "decode_step"):
        assert "teacher" not in job.programs[name].resident, name
    for name in ("update", "logprobs", "reshard"):
        assert job.programs[name].resident["teacher"] == job.state.teacher, name


@needs_libtpu
def test_plan_of_the_opd_recipe_shows_the_teacher(paths, tmp_path):
    """``jaxrl-llm plan configs/distill.yaml`` (deviceless, v5litepod-4) with a small policy and a
    Qwen2-shaped teacher: a ``teacher_logprobs`` row called once a step, the teacher's weights
    in every program's HBM, the report's ``teacher`` entry."""
    report_path = tmp_path / "plan.json"
    code, out, err = plan(
        "configs/distill.yaml",
        "--topology",
        "v5litepod-4",
        *_overrides(paths, "teacher.path={root}/qwen2"),
        "--json",
        str(report_path),
    )
    assert code == 0, out + err
    report = json.loads(report_path.read_text())
    qwen2 = models.ModelConfig.from_hf_dict(
        json.loads((paths["root"] / "qwen2/config.json").read_text())
    )
    # Tied: no lm_head; q/k/v biases (N H + 2 K H = 128 a layer), all split over fsdp 4.
    params = TEACHER_PARAMS - 8192 + 128
    assert models.param_count(qwen2) == params
    teacher = report["teacher"]
    assert teacher["params"] == params and teacher["dtype"] == "bfloat16"
    assert teacher["architecture"] == "Qwen2ForCausalLM"
    assert report["resident_bytes"]["teacher"] == teacher["bytes_per_chip"]
    row = report["programs"]["teacher_logprobs"]
    assert row["calls_per_step"] == 1 and row["compiled"] and row["fits"]
    assert row["function"] == builder_name(make_logprob_fn)
    assert report["step_breakdown_s"]["teacher_logprobs"] > 0
    for name, program in report["programs"].items():
        assert program["memory_bytes"]["teacher"] == teacher["bytes_per_chip"] > 0, name
    text = format_report(report)
    assert out.strip() == text.strip()
    assert "\nteacher: " in text and "  teacher  " in text
    (line,) = [line for line in text.splitlines() if line.startswith("teacher_logprobs ")][1:]
    assert line.split()[1] == "1"  # the time table's calls column


# -- GKD (a JSD loss over the teacher's top-k) and a teacher on chips of its own ---------------

GKD = ("objective.name=distill_gkd", "teacher.path={teacher}")


def _shape(arg):
    return None if arg is None else (tuple(arg.shape), np.dtype(arg.dtype))


@pytest.mark.parametrize("k", [4, 8])
def test_gkd_update_takes_the_teachers_top_k(paths, k):
    """``distill_gkd``: ``teacher_program`` returns the teacher's top-k beside its log-probs
    (``[B, T, k]`` f32 and int32) and the update's batch carries them
    (``RolloutBatch.teacher_top_logprobs`` / ``teacher_top_ids``, a minibatch's rows)."""
    job = _job(paths, *GKD, f"teacher.top_k={k}")
    assert job.teacher.top_k == k
    out = job.programs["teacher_logprobs"].lowered.out_info
    assert _shape(out.top_logprobs) == ((ROWS, T, k), np.dtype(np.float32))
    assert _shape(out.top_ids) == ((ROWS, T, k), np.dtype(np.int32))
    batch = job.programs["update"].lowered.args_info[0][1]
    assert _shape(batch.teacher_top_logprobs) == ((ROWS, T, k), np.dtype(np.float32))
    assert _shape(batch.teacher_top_ids) == ((ROWS, T, k), np.dtype(np.int32))


def test_gkd_top_k_bytes_are_resident_during_the_update(paths):
    """The whole batch's top-k stays on device while its minibatches are drawn: per chip 2 rows
    x T 8 x k x (4 + 4) bytes, 512 more for k = 8 than for k = 4."""
    four, eight = (_job(paths, *GKD, f"teacher.top_k={k}") for k in (4, 8))
    extra = eight.programs["update"].resident["inputs"] - four.programs["update"].resident["inputs"]
    assert extra == 2 * T * (8 - 4) * 8 == 512
    # Without a JSD loss (distill's advantages) the batch has no top-k.
    opd = _job(paths, *OPD).programs["update"].lowered.args_info[0][1]
    assert opd.teacher_top_ids is None and opd.teacher_top_logprobs is None


def test_gkd_top_k_larger_than_the_vocabulary_is_refused(paths):
    with pytest.raises(pr.PlanError, match="teacher.top_k=300 is larger than the vocabulary"):
        _job(paths, *GKD, "teacher.top_k=300")


def _own_chips_job(paths, *overrides):
    cfg = load_config(TrainConfig, None, _overrides(paths, *overrides))
    return pr.build_job(cfg, resolve_topology("v5litepod-8"), devices=jax.devices()[:8])


def test_teacher_devices_reserve_the_last_chips(paths):
    """``teacher.devices=4`` of 8 chips: the trainer's mesh takes the first 4
    (``make_run_mesh(reserve=4)``, with ``mesh.fsdp=-1``), the teacher is split over the last
    4 (``reserved_mesh``), and its forward runs there over the whole batch; no program on the
    trainer's chips holds the teacher, whose chips hold nothing but it and its forward."""
    devices = jax.devices()[:8]
    # fsdp -1 fills the chips the trainer has: 4, not 8.
    job = _own_chips_job(paths, *GKD, "teacher.top_k=8", "teacher.devices=4", "mesh.fsdp=-1")
    assert list(job.mesh.devices.flat) == devices[:4]
    teacher_devices = {d for s in jax.tree.leaves(job.teacher.shardings) for d in s.device_set}
    assert teacher_devices == set(devices[4:])
    assert job.teacher.own_mesh.shape == {"data": 1, "fsdp": 4, "tensor": 1}
    program = job.programs["teacher_logprobs"]
    assert program.chips == 4 and program.resident == {}
    assert program.argument_parts == {"teacher": TEACHER_BYTES}  # bf16, split over fsdp 4
    # Its sequences are on its own chips, compiled for them.
    seqs = program.lowered.args_info[0][1]
    assert seqs.prompt_tokens.shape == (ROWS, 16)
    shared = _job(paths, *GKD, "teacher.top_k=8")
    assert job.state.teacher == 0 and shared.state.teacher == TEACHER_BYTES
    assert job.state.resident == shared.state.resident - TEACHER_BYTES
    for name, p in job.programs.items():
        if name != "teacher_logprobs":
            assert "teacher" not in p.resident and "teacher" not in p.argument_parts, name
    # The update still takes the top-k (put back on the trainer's mesh).
    batch = job.programs["update"].lowered.args_info[0][1]
    assert batch.teacher_top_ids.shape == (ROWS, T, 8)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("teacher.devices=8",), "teacher.devices=8 must leave the trainer a device"),
        # 8 rows over 3 teacher chips, as ``RLTrainer`` checks them.
        (("teacher.devices=3",), "rollout batch on teacher.devices"),
        # The trainer's fsdp 4 does not fit the 2 chips left.
        (("teacher.devices=6",), "mesh .* needs 4 devices"),
    ],
)
def test_teacher_devices_refusals(paths, overrides, message):
    with pytest.raises(pr.PlanError, match=message):
        _own_chips_job(paths, *OPD, *overrides)


@needs_libtpu
def test_plan_of_gkd_with_a_teacher_on_its_own_chips(paths, tmp_path):
    """``jaxrl-llm plan configs/distill_gkd.yaml`` (deviceless, v5litepod-8) with
    ``teacher.devices=4``: the teacher's top-k forward compiles on its 4 chips and fits, its
    weights are in no other program's HBM, and the report says where it runs and its k."""
    report_path = tmp_path / "plan.json"
    code, out, err = plan(
        "configs/distill_gkd.yaml",
        "--topology",
        "v5litepod-8",
        *_overrides(paths, "teacher.devices=4", "teacher.path={teacher}"),
        "--json",
        str(report_path),
    )
    assert code == 0, out + err
    report = json.loads(report_path.read_text())
    teacher = report["teacher"]
    assert teacher["devices"] == 4 and teacher["top_k"] == 8
    assert teacher["bytes_per_chip"] == TEACHER_BYTES
    assert report["resident_bytes"]["teacher"] == 0
    row = report["programs"]["teacher_logprobs"]
    assert row["compiled"] and row["fits"]
    assert row["memory_bytes"]["teacher"] == TEACHER_BYTES
    for name, program in report["programs"].items():
        if name != "teacher_logprobs":
            assert program["memory_bytes"]["teacher"] == 0, name
    text = format_report(report)
    assert "on 4 chip(s) of its own (teacher.devices)" in text and "top-8" in text
