"""``plan`` lowers the packed programs ``train`` runs with ``trainer.packing``
(``jaxrl_llm.plan._packing``), by hand.

The tiny model of ``test_programs`` on 4 CPU devices (``mesh.fsdp=4``: 4 batch shards) with
``B = 8 x 4 = 32`` rows of ``P = 8`` prompt (full: ``p = 8``) and ``T = 24`` completion
positions, ``W = 32``. At ``f = 0.25`` a sequence holds ``8 + 6 = 14`` tokens; a micro-batch of
``n`` rows a shard packs to ``bucket_rows(ceil(14 n / 32), n)`` rows: ``n = 8`` (one
micro-batch) -> ``ceil(3.5) = 4``; ``n = 4`` (two) -> ``ceil(1.75) = 2``. One test compiles
the packed programs (on deviceless TPU where libtpu is installed).
"""

import json

import jax
import numpy as np
import pytest

from jaxrl_llm import packing
from jaxrl_llm.plan import flops as flops_lib
from jaxrl_llm.plan import goodput
from jaxrl_llm.plan import programs as pr
from jaxrl_llm.plan._job import PlanError
from jaxrl_llm.plan._packing import packed_rows_per_shard, plan_forward
from jaxrl_llm.plan.topology import get_devices, libtpu_available, resolve_topology
from jaxrl_llm.train import packing as train_packing
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.rl.config import TrainConfig
from jaxrl_llm.train.step import TokenBudget
from tests.plan.test_programs import TINY

V5E_4 = resolve_topology("v5litepod-4")
ROWS, P, T, W, SHARDS = 32, 8, 24, 32, 4


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def _cfg(tiny_path, *overrides):
    return load_config(
        TrainConfig,
        None,
        [
            f"model.architecture={tiny_path}",
            "rollout.prompts_per_step=8",
            "rollout.group_size=4",
            "data.max_prompt_tokens=8",
            "rollout.max_new_tokens=24",
            "mesh.fsdp=4",
            "trainer.micro_batch_tokens=null",
            *overrides,
        ],
    )


def _job(tiny_path, *overrides, devices=None):
    devices = jax.devices()[:4] if devices is None else devices
    return pr.build_job(_cfg(tiny_path, *overrides), V5E_4, devices=devices)


def _plan_leaves(plan):
    return [(tuple(x.shape), str(x.dtype)) for x in plan]


def test_rows_per_shard_by_hand():
    assert packed_rows_per_shard(8, W, 8, 6.0) == 4  # ceil(112 / 32) = 4
    assert packed_rows_per_shard(4, W, 8, 6.0) == 2  # ceil(56 / 32) = 2
    assert packed_rows_per_shard(8, W, 8, 24.0) == 8  # full rows: no packing
    assert packed_rows_per_shard(32, W, 8, 6.0) == 14  # ceil(14) = 14, a bucket
    assert packed_rows_per_shard(32, W, 8, 6.5) == 16  # ceil(14.5) = 15 -> bucket 16


def test_rows_equal_what_train_packs_when_first_fit_reaches_the_ceiling():
    """Every row 8 prompt + 6 completion tokens: first-fit decreasing puts two sequences in
    each packed row, the ceiling, so train's plan (``train.packing``) has plan's shape, for a
    fixed micro-batch count and for a token budget over packed rows."""
    prompt_mask = np.ones((ROWS, P), bool)
    completion_mask = np.zeros((ROWS, T), bool)
    completion_mask[:, :6] = True
    for k in (1, 2, 4):
        real = train_packing.plan_micro_batches(
            prompt_mask, completion_mask, micro_batches=k, shards=SHARDS
        )
        assert real.source.shape == (k, SHARDS, *plan_forward(k, ROWS, W, SHARDS, 8, 6.0)[1:], W)
    for tokens in (64, 128, 1000):
        real = train_packing.plan_by_budget(
            prompt_mask, completion_mask, tokens=tokens, minimum=1, shards=SHARDS
        )
        k, r = plan_forward(TokenBudget(tokens), ROWS, W, SHARDS, 8, 6.0)
        assert real.source.shape == (k, SHARDS, r, W), tokens
    assert plan_forward(TokenBudget(64), ROWS, W, SHARDS, 8, 6.0) == (2, 2)


def test_the_packed_programs_take_the_plan_train_passes(tiny_path):
    job = _job(tiny_path, "trainer.packing=on", "rollout.expected_length_fraction=0.25")
    # The log-prob forward: (params, seqs, plan), the plan [K=1, shards, 4, W] int32.
    plan = job.programs["logprobs"].lowered.args_info[0][2]
    assert _plan_leaves(plan) == [((1, SHARDS, 4, W), "int32")] * 3
    # Placed as train places it (``place_plan``: the shard axis over the batch axes).
    concrete = packing.PackingPlan(*(np.zeros((1, SHARDS, 4, W), np.int32),) * 3)
    placed = train_packing.place_plan(concrete, job.mesh)
    for planned, real in zip(job.packing.forwards.abstract(job.mesh), placed, strict=True):
        assert planned.sharding == real.sharding and real.sharding.spec[1] == ("data", "fsdp")
    # The update: its minibatch's RolloutBatch carries the plan.
    minibatch = job.programs["update"].lowered.args_info[0][1]
    assert _plan_leaves(minibatch.packing) == [((1, SHARDS, 4, W), "int32")] * 3
    report = job.packing.report()
    assert report["mode"] == "on" and report["packed"]
    assert report["rows_per_shard"] == {"update": 4, "forwards": 4}
    assert report["update"]["packed_rows"] == 16 and report["update"]["padded_rows"] == 32


def test_the_update_plan_has_the_micro_batches(tiny_path):
    """Two micro-batches: the update's plan [2, shards, 2, W]; the forwards' stays whole."""
    job = _job(
        tiny_path,
        "trainer.packing=on",
        "rollout.expected_length_fraction=0.25",
        "trainer.micro_batches=2",
        "objective.name=ppo",
        "critic.optimizer=separate",
    )
    minibatch = job.programs["update"].lowered.args_info[0][1]
    assert _plan_leaves(minibatch.packing) == [((2, SHARDS, 2, W), "int32")] * 3
    critic = job.programs["critic_update"].lowered.args_info[0][1]
    assert _plan_leaves(critic.packing) == [((2, SHARDS, 2, W), "int32")] * 3
    assert job.programs["values"].packing is None  # the critic's forward runs padded
    assert job.programs["update"].packing.packed_rows == 16


def test_prime_packs_the_prm_update_over_the_whole_batch(tiny_path):
    """PRIME's PRM update: the whole batch (8 rows a shard -> 4 packed) with its own plan; its
    log-probs share the policy's packed forward."""
    job = _job(
        tiny_path,
        "objective.name=prime",
        "trainer.packing=on",
        "rollout.expected_length_fraction=0.25",
        "trainer.minibatches=2",
    )
    batch = job.programs["prm_update"].lowered.args_info[0][1]
    assert _plan_leaves(batch.packing) == [((1, SHARDS, 4, W), "int32")] * 3
    update = job.programs["update"].lowered.args_info[0][1]  # 16 rows: 4 a shard -> 2
    assert _plan_leaves(update.packing) == [((1, SHARDS, 2, W), "int32")] * 3
    assert job.programs["prm_logprobs"].same_as == "logprobs"
    assert job.programs["prm_logprobs"].packing.packed_rows == 16
    assert job.packing.report()["rows_per_shard"] == {
        "update": 2,
        "forwards": 4,
        "prm_update": 4,
    }


def test_flops_count_the_packed_rows(tiny_path):
    """Per row of W = 32 (L = 2, D = 64, N = 4, K = 2, H = 16, F = 128, V = 256, 24 scored
    positions): L (32 x (24576 + 49152) + 528 x 256) + 24 x 2 x 64 x 256 = 5,775,360; 16
    packed rows against 32 padded."""
    per_row = 2 * (32 * (24576 + 49152) + 528 * 256) + 24 * 2 * 64 * 256
    assert per_row == 5_775_360
    packed = _job(tiny_path, "trainer.packing=on", "rollout.expected_length_fraction=0.25")
    padded = _job(tiny_path, "trainer.packing=off", "rollout.expected_length_fraction=0.25")
    assert packed.programs["logprobs"].flops == 16 * per_row
    assert padded.programs["logprobs"].flops == 32 * per_row
    assert packed.programs["update"].flops == 3 * 16 * per_row  # no remat: 3 forwards
    assert packed.programs["update"].tokens == 16 * T
    assert padded.programs["update"].tokens == 32 * T
    config = packed.model_config
    assert packed.programs["logprobs"].flops == flops_lib.forward_flops(
        config, 16, W, logits_positions=T
    )


@pytest.mark.parametrize(
    ("fraction", "rows", "packs"),
    [
        # n = 8 rows a shard of 8 + 24 f tokens: ceil(8 (8 + 24 f) / 32), bucketed.
        (0.25, 4, True),  # 3.5 -> 4: 16 of 32 rows
        (0.6, 6, True),  # 5.6 -> 6: 24 of 32 = 75%, the rule's edge
        (0.7, 7, False),  # 6.2 -> 7: 28 of 32 > 75%
        (1.0, 8, False),
    ],
)
def test_auto_packs_by_the_trainers_rule(tiny_path, fraction, rows, packs):
    job = _job(tiny_path, "trainer.packing=auto", f"rollout.expected_length_fraction={fraction}")
    assert job.packing.update.rows_per_shard == rows
    assert job.packing.update.packed is packs
    minibatch = job.programs["update"].lowered.args_info[0][1]
    assert (minibatch.packing is not None) is packs
    assert (job.programs["logprobs"].lowered.args_info[0][2] is not None) is packs


def test_auto_without_a_length_model_lowers_padded_and_says_so(tiny_path):
    job = _job(tiny_path, "trainer.packing=auto")
    assert job.programs["logprobs"].lowered.args_info[0][2] is None
    assert job.programs["update"].lowered.args_info[0][1].packing is None
    report = job.packing.report()
    assert not report["packed"] and "without a length model" in report["reason"]


def test_on_without_a_length_model_is_refused(tiny_path):
    with pytest.raises(PlanError, match=r"rollout\.expected_length_fraction.*--lengths-from"):
        _job(tiny_path, "trainer.packing=on")


def test_real_share_of_a_packed_program():
    """B_p (p + f T) / (R W) = 32 x 14 / (16 x 32) = 0.875."""
    tokens = goodput.step_tokens(ROWS, P, T, P, 0.25)
    packed = {"packing": {"packed": True, "padded_rows": 32, "packed_rows": 16}}
    assert goodput.program_real_share(tokens, "update", packed) == pytest.approx(0.875)
    assert goodput.program_real_share(tokens, "update", {"packing": None}) == pytest.approx(14 / 32)


def test_the_packed_plan_compiles_and_reports(tiny_path):
    """The packed programs compile (deviceless TPU where libtpu is installed, else CPU) and
    the report says they are packed."""
    devices = get_devices(V5E_4) if libtpu_available() else None
    cfg = _cfg(tiny_path, "trainer.packing=on", "rollout.expected_length_fraction=0.25")
    report = pr.plan_job(cfg, V5E_4, devices=devices or jax.devices()[:4])
    assert report["packing"]["packed"] and report["packing"]["mode"] == "on"
    for name in ("update", "logprobs"):
        program = report["programs"][name]
        assert program["compiled"], (name, program["error"])
        assert program["packing"]["packed_rows"] == 16
    assert report["programs"]["prefill"]["packing"] is None
