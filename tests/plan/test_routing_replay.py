"""``jaxrl-llm plan`` with routing replay (``model.routing_replay``), by hand: the programs
take the sampler's recorded routing as ``RLTrainer.train_step`` passes it, and its bytes are
counted.

The job is test_moe's tiny Qwen3-MoE (``L = 2`` layers, ``k = 2`` of ``E = 8`` experts a token)
with 4 prompts x 2 = 8 rows of 16 + 8 = 24 positions on fsdp 2 x expert 2 (4 batch shards, 2
rows a chip). The recorded routing is ``[B, P + T, L, k] = [8, 24, 2, 2]``: int32 on the
trainer's mesh, ``2 x 24 x 2 x 2 x 4 = 768`` bytes a chip; int8 (``routing_dtype`` of 8
experts) in the sampler's state.
"""

import json

import jax
import numpy as np
import pytest

from jaxrl_llm.plan import programs as pr
from jaxrl_llm.plan.cli import format_report
from jaxrl_llm.plan.topology import get_devices
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.rl.config import TrainConfig
from tests.plan.test_cli import plan
from tests.plan.test_moe import JOB, TINY_MOE, V5P_8, _job, needs_libtpu

ROWS, SEQ, L, K = 8, 24, 2, 2
ROUTING_PER_CHIP = ROWS // 4 * SEQ * L * K * 4  # 768: int32, rows over 4 batch shards
MESH = ("mesh.fsdp=2", "mesh.expert=2")


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe_replay") / "config.json"
    path.write_text(json.dumps(TINY_MOE))
    return str(path)


def _routing(arg):
    return None if arg is None else (tuple(arg.shape), np.dtype(arg.dtype))


def _update_batch(job):
    return job.programs["update"].lowered.args_info[0][1]


def _forward_routing(job, name):
    """The ``routing`` argument a lowered log-prob forward took (``(params, seqs, packing,
    routing)``)."""
    return _routing(job.programs[name].lowered.args_info[0][3])


@pytest.mark.parametrize(
    "mode, forwards_replay", [("rollout", True), ("measure", False), ("off", False)]
)
def test_programs_take_the_routing_as_the_trainer_passes_it(moe_path, mode, forwards_replay):
    """``batch_routing``'s ``[B, P + T, L, k]`` int32 is in the update's batch whenever the
    sampler records (``measure``, ``rollout``); only ``rollout`` passes it to the behaviour
    forward (``routing=``); the sampler's prefill records into its state, which the decode loop
    carries (int8 for 8 experts)."""
    job = _job(moe_path, *MESH, "trainer.epochs=2", f"model.routing_replay={mode}")
    records = mode != "off"
    want = ((ROWS, SEQ, L, K), np.dtype(np.int32)) if records else None
    assert _routing(_update_batch(job).routing) == want
    assert _forward_routing(job, "logprobs") == (want if forwards_replay else None)
    decode_state = job.programs["decode_step"].lowered.args_info[0][1]
    sampler = ((ROWS, SEQ, L, K), np.dtype(np.int8)) if records else None
    assert _routing(decode_state.routing) == sampler
    prefill_out = job.programs["prefill"].lowered.out_info
    assert _routing(prefill_out.routing) == sampler


def test_routing_bytes_are_counted_where_they_are_alive(moe_path):
    """768 bytes a chip of int32 routing: an argument of the replaying forwards, beside the
    forwards that do not replay it (``measure``), in the whole batch resident during the update
    and again in its minibatch argument; the sampler's int8 buffer is split over its serving
    layout's 2 data shards."""
    off = _job(moe_path, *MESH, "trainer.epochs=2")
    on = _job(moe_path, *MESH, "trainer.epochs=2", "model.routing_replay=rollout")
    measure = _job(moe_path, *MESH, "trainer.epochs=2", "model.routing_replay=measure")
    # The whole batch stays resident during the update: its routing is 768 more bytes.
    for job in (on, measure):
        update = job.programs["update"]
        assert update.resident["inputs"] == off.programs["update"].resident["inputs"] + 768
        assert update.routing_bytes == 2 * ROUTING_PER_CHIP  # the batch's and the minibatch's
        assert job.programs["logprobs"].routing_bytes == ROUTING_PER_CHIP
        # The sampler's serving layout (data 2 x tensor 2): 4 rows a chip of int8.
        assert dict(job.serving.mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 2}
        assert job.programs["decode_step"].routing_bytes == 4 * SEQ * L * K == 384
        assert job.programs["prefill"].routing_bytes == 384
    # Replayed: an argument (counted from the compiled arguments), not resident.
    assert "inputs" not in on.programs["logprobs"].resident
    # Measured only: alive beside the forwards that do not take it.
    assert measure.programs["logprobs"].resident["inputs"] == ROUTING_PER_CHIP
    assert (
        measure.programs["ref_logprobs"].resident["inputs"]
        == on.programs["ref_logprobs"].resident["inputs"] + ROUTING_PER_CHIP
    )
    assert all(p.routing_bytes == 0 for p in off.programs.values())


@needs_libtpu
def test_deviceless_tpu_lowering_takes_the_routing(moe_path):
    """On a v5p-8's compile-only TPU devices (libtpu): the update's batch and the behaviour
    and reference forwards carry the routing as on the CPU devices."""
    job = _job(
        moe_path,
        "mesh.fsdp=4",
        "trainer.epochs=2",
        "model.routing_replay=rollout",
        devices=get_devices(V5P_8),
    )
    want = ((ROWS, SEQ, L, K), np.dtype(np.int32))
    assert _routing(_update_batch(job).routing) == want
    assert _forward_routing(job, "logprobs") == want
    leaf = _update_batch(job).routing
    assert leaf is not None and job.mesh.devices.flat[0].platform == "tpu"


@needs_libtpu
def test_plan_of_a_replaying_moe_job(moe_path, tmp_path):
    """``jaxrl-llm plan`` of the tiny MoE with ``model.routing_replay=rollout`` on a v5p-8
    compiles every program (it failed: the abstract batch had no routing) and reports the
    routing's arrays."""
    report_path = tmp_path / "plan.json"
    code, out, err = plan(
        "configs/grpo.yaml",
        "--topology",
        "v5p-8",
        f"model.architecture={moe_path}",
        *JOB,
        "mesh.fsdp=4",
        "trainer.epochs=2",
        "model.routing_replay=rollout",
        "--json",
        str(report_path),
    )
    assert code == 0, out + err
    report = json.loads(report_path.read_text())
    routing = report["routing_replay"]
    assert routing["mode"] == "rollout" and routing["shape"] == [ROWS, SEQ, L, K]
    assert routing["bytes"] == ROWS * SEQ * L * K * 4
    assert routing["bytes_per_chip"] == ROUTING_PER_CHIP
    assert routing["sampler_dtype"] == "int8"
    assert routing["replayed_by"] == ["logprobs", "ref_logprobs", "update"]
    assert all(p["compiled"] for p in report["programs"].values() if not p["shares_compile_of"])
    assert "routing replay (rollout)" in format_report(report)


def test_dense_model_with_replay_is_refused():
    """Exit 2's one line, as ``train`` refuses it (``programs.check_replay_model``)."""
    cfg = load_config(
        TrainConfig,
        None,
        ["model.architecture=qwen2.5-0.5b", "model.routing_replay=rollout", *JOB],
    )
    with pytest.raises(pr.PlanError, match="model.routing_replay=rollout applies to mixture"):
        pr.build_job(cfg, V5P_8, devices=jax.devices()[:4])


def test_a_ppo_job_with_one_optimizer_replays_in_its_joint_step(moe_path):
    """PPO's joint step (``critic.optimizer=joint``: the update that trains policy and critic)
    takes the recorded routing as ``train`` passes it; the critic has no update of its own."""
    job = _job(
        moe_path,
        *MESH,
        "objective.name=ppo",
        "critic.optimizer=joint",
        "model.routing_replay=rollout",
    )
    assert _routing(_update_batch(job).routing) == ((ROWS, SEQ, L, K), np.dtype(np.int32))
    assert _forward_routing(job, "logprobs") == ((ROWS, SEQ, L, K), np.dtype(np.int32))
    assert "critic_update" not in job.programs and "values" in job.programs
