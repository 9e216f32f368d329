"""``jaxrl-llm plan`` for a mixture-of-experts job, by hand: total and active parameters, the
expert all-to-all's bytes and ICI time per program, the experts' share of a chip's memory, the
whole-expert gather check and the ``mesh.expert`` advice.

The job is a tiny Qwen3-MoE (``E = 8`` experts of width ``F = 48``, ``k = 2`` a token, ``D =
64``, two layers) on 4 of the 8 fake CPU devices (``fsdp 2 x expert 2``); its update and
log-prob forward are compiled once for the module on CPU. XLA:CPU exchanges a ``bf16``
all-to-all in f32, so the job computes in f32 (``c = 4``) and the counted bytes are the
formula's. One test compiles the update deviceless for a v5p-8 (libtpu), where the layers stay
a scanned ``while`` loop and the exchanges are weighted by its trip count.
"""

import json
import math

import jax
import pytest

from jaxrl_llm import models
from jaxrl_llm.plan import _moe, flops, hlo
from jaxrl_llm.plan import estimate as est
from jaxrl_llm.plan import programs as pr
from jaxrl_llm.plan.cli import format_report
from jaxrl_llm.plan.topology import get_devices, libtpu_available, resolve_topology, try_compile
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.rl.config import TrainConfig

needs_libtpu = pytest.mark.skipif(
    not libtpu_available(),
    reason="libtpu not importable (pip install 'jax[tpu]'): no deviceless TPU compiles",
)
V5P_8 = resolve_topology("v5p-8")  # 4 chips
W = V5P_8.ici_bandwidth_bytes_per_s_per_link  # one direction of one link: 100 GB/s

TINY_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 48,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
L, E, K_TOP, D, F = 2, 8, 2, 64, 48
# A layer: norms 2D 128, q/k/v/o 4096 + 4096 + 4096, q/k norms 2H 32, router D E 512, experts
# 3 E D F 73728: 86688. Total: embedding V D 16384, two layers, final norm 64, unembedding 16384.
EXPERTS_PER_LAYER = 3 * E * D * F  # 73728
TOTAL = 16384 + L * (128 + 3 * 4096 + 32 + 512 + EXPERTS_PER_LAYER) + 64 + 16384  # 206208
ACTIVE = TOTAL - L * (E - K_TOP) * 3 * D * F  # 95616: a token's 2 experts of 8
# The job: 4 prompts x 2 = 8 rows of 16 (bucket of 12) + 8 = 24 positions; 2 micro-batches,
# layer remat, f32 compute, on fsdp 2 x expert 2: 4 batch shards.
ROWS, SEQ, MICRO, SHARDS, P = 8, 24, 2, 4, 2
JOB = (
    "rollout.prompts_per_step=4",
    "rollout.group_size=2",
    "data.max_prompt_tokens=12",
    "rollout.max_new_tokens=8",
    "model.remat=layer",
    "trainer.micro_batches=2",
    "model.compute_dtype=float32",
)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "config.json"
    path.write_text(json.dumps(TINY_MOE))
    return str(path)


def _cfg(moe_path, *overrides):
    return load_config(TrainConfig, None, [f"model.architecture={moe_path}", *JOB, *overrides])


def _job(moe_path, *overrides, spec=V5P_8, devices=None):
    devices = jax.devices()[:4] if devices is None else devices
    return pr.build_job(_cfg(moe_path, *overrides), spec, devices=devices)


@pytest.fixture(scope="module")
def expert_job(moe_path):
    """The job on fsdp 2 x expert 2 with its update and log-prob forward compiled on CPU."""
    job = _job(moe_path, "mesh.fsdp=2", "mesh.expert=2")
    reports = {}
    for name in ("update", "logprobs"):
        outcome = try_compile(job.programs[name].lowered)
        reports[name] = pr._program_report(job, job.programs[name], outcome)
    return job, reports


# -- parameters and FLOPs ------------------------------------------------------------------


def test_total_and_active_parameters_by_hand(moe_path):
    config = models.architecture_config(moe_path)
    assert models.param_count(config) == TOTAL == 206208
    assert flops.active_param_count(config) == ACTIVE == 95616
    assert flops.routed_expert_params(config) == L * EXPERTS_PER_LAYER
    # A dense model: every parameter is active.
    dense = models.architecture_config("qwen2.5-0.5b")
    assert flops.active_param_count(dense) == models.param_count(dense)
    assert flops.routed_expert_params(dense) == 0


def test_model_flops_count_the_active_weights(moe_path):
    """MFU's 6N: N is a token's weights (attention, router, its k experts, unembedding), not
    the E experts; the update's model FLOPs (MFU, expected MFU, goodput) are train_flops'."""
    config = models.architecture_config(moe_path)
    attention = D * (4 * 16 + 2 * 2 * 16) + 4 * 16 * D  # 8192
    n = L * (attention + D * E + K_TOP * 3 * D * F) + D * 256  # 52224
    assert flops.matmul_params(config) == n
    assert flops.model_flops_per_token(config) == 6 * n
    assert flops.forward_flops_breakdown(config, 1, 1)["mlp"] == L * 2 * (D * E + 2 * 3 * D * F)


def test_experts_a_batch_reads_by_hand(moe_path):
    config = models.architecture_config(moe_path)
    # One token reaches its k experts; two reach 8 (1 - (6/8)^2) = 3.5 on average.
    assert flops.experts_touched(config, 1) == pytest.approx(K_TOP)
    assert flops.experts_touched(config, 2) == pytest.approx(3.5)
    assert flops.decode_weight_params(config, 1) == flops.matmul_params(config)
    extra = (3.5 - K_TOP) * 3 * D * F
    assert flops.decode_weight_params(config, 2) == pytest.approx(
        flops.matmul_params(config) + L * extra
    )
    dense = models.architecture_config("qwen2.5-0.5b")
    assert flops.decode_weight_params(dense, 64) == flops.matmul_params(dense)


def test_decode_hbm_bytes_read_the_experts_the_rows_reach(moe_path):
    """A decode step of 8 rows. On a serving layout (data 4: 2 rows a chip) each chip reads
    the dense weights and the 3.5 experts its 2 tokens reach a layer, not only k = 2. On fsdp
    2 x expert 2 each chip gathers its 4 experts a layer (shard read, written, as the dense
    weights) and reads those its expert group's 2 x 2 tokens reach: 8 (1 - (6/8)^4) / 2."""
    from jaxrl_llm.train.config import MeshSection  # noqa: PLC0415

    config = pr.plan_model_config(_cfg(moe_path).model)  # f32 compute: c = 4
    expert_w = 3 * D * F
    dense = flops.matmul_params(config) - L * K_TOP * expert_w
    cache = est.decode_hbm_bytes(config, 8, 24, param_bytes=0, cache_bytes=4)
    per_chip = (8 * D * 4 + cache + 2 * 8 * 256 * 4) / 4  # lookup, cache, logits over 4
    data = pr.plan_mesh(MeshSection(data=4, fsdp=1, tensor=1), jax.devices()[:4])
    weights = (dense + L * 3.5 * expert_w) * 4
    assert pr.decode_hbm_bytes_per_chip(config, data, 8, 24) == pytest.approx(weights + per_chip)
    ep = pr.plan_mesh(MeshSection(data=1, fsdp=2, tensor=1, expert=2), jax.devices()[:4])
    touched = 8 * (1 - 0.75**4)
    read = (dense + L * touched * expert_w / 2) * 4
    gathered = (dense + L * E * expert_w / 2) * 4 * 1.5
    table = 256 * D * 4 * 1.5  # the untied embedding, gathered too
    assert pr.decode_hbm_bytes_per_chip(config, ep, 8, 24) == pytest.approx(
        read + gathered + table + per_chip
    )


# -- the HLO: lines that continue, the exchange counted per layer ---------------------------

# A scanned layer (3 trips) holding a Pallas kernel whose attribute spans three lines (as
# XLA:TPU prints splash attention), then the experts' all-to-all.
SPLIT_LINES = r"""HloModule m, num_partitions=4

%body (p: (s32[], bf16[8,16])) -> (s32[], bf16[8,16]) {
  %p = (s32[], bf16[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[8,16]{1,0} get-tuple-element(%p), index=1
  %k = bf16[8,16]{1,0} custom-call(%x), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\"block_q\": 128, \"block_kv\": 128}"
}}, metadata={op_name="jit(f)/while/body/pallas_call"}
  %a = bf16[8,16]{1,0} all-to-all(%k), channel_id=1, replica_groups={{0,1},{2,3}}, dimensions={0}, metadata={op_name="jit(f)/while/body/shard_map/all_to_all" stack_frame_id=3}
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[8,16]{1,0}) tuple(%n, %a)
}

%cond (p: (s32[], bf16[8,16])) -> pred[] {
  %p = (s32[], bf16[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %c = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

ENTRY %main (x: bf16[8,16]) -> (s32[], bf16[8,16]) {
  %x = bf16[8,16]{1,0} parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], bf16[8,16]{1,0}) tuple(%z, %x)
  ROOT %w = (s32[], bf16[8,16]{1,0}) while(%t), condition=%cond, body=%body
}
"""  # noqa: E501


def test_an_attribute_spanning_lines_keeps_the_rest_of_its_computation():
    module = hlo.parse_hlo_module(SPLIT_LINES)
    body = module.computations["body"]
    assert [i.name for i in body.instructions] == ["p", "i", "x", "k", "a", "one", "n", "t"]
    assert hlo.op_name(body.by_name["k"]) == "jit(f)/while/body/pallas_call"
    (op,) = hlo.collective_ops(module)
    assert (op.kind, op.bytes, op.group_size, op.multiplier) == ("all-to-all", 256, 2, 3)
    assert _moe.is_expert_exchange(op)
    summary = _moe.exchange_summary([op], W)
    assert summary["bytes"] == 3 * 256 and summary["exchanges"] == 3
    # ring of 2: max(1/2, 2/4) R / 2W a trip
    assert summary["ici_s"] == pytest.approx(3 * 0.5 * 256 / (2 * W))


def test_a_resharding_all_to_all_is_not_the_experts():
    text = SPLIT_LINES.replace("shard_map/all_to_all", "convert_element_type")
    (op,) = hlo.collective_ops(hlo.parse_hlo_module(text))
    assert op.kind == "all-to-all" and not _moe.is_expert_exchange(op)
    assert _moe.exchange_summary([op], W)["bytes"] == 0


def _exchange(tokens, layers_micro, rows_n, ids_n, c=4):
    """By hand: ``layers_micro`` trips of ``rows_n`` exchanges of ``P T k D c`` and ``ids_n``
    of ``P T k 4`` (bytes, ICI seconds on a ring of P = 2: half of R over 2W)."""
    rows, ids = P * tokens * K_TOP * D * c, P * tokens * K_TOP * 4
    nbytes = layers_micro * (rows_n * rows + ids_n * ids)
    return nbytes, 0.5 * nbytes / (2 * W)


# The update: each micro-batch's 4 rows x 24 positions over 4 shards, T = 24 tokens a chip;
# per layer and micro-batch 6 exchanges of rows (forward 2, remat 2, backward 2) and 2 of ids.
UPDATE_BYTES, UPDATE_ICI = _exchange(24, L * MICRO, 6, 2)
# A forward over the 8 rows at once: T = 48; per layer 2 exchanges of rows and 1 of ids.
FORWARD_BYTES, FORWARD_ICI = _exchange(48, L, 2, 1)


def test_expert_all_to_all_of_the_compiled_programs_by_hand(expert_job):
    _, reports = expert_job
    assert UPDATE_BYTES == 4 * (6 * 24576 + 2 * 384) == 592896
    assert FORWARD_BYTES == 2 * (2 * 49152 + 768) == 198144
    for name, nbytes, seconds, exchanges in (
        ("update", UPDATE_BYTES, UPDATE_ICI, L * MICRO * 8),
        ("logprobs", FORWARD_BYTES, FORWARD_ICI, L * 3),
    ):
        a2a = reports[name]["moe"]["expert_all_to_all"]
        assert a2a["bytes"] == nbytes, name
        assert a2a["exchanges"] == exchanges, name
        assert a2a["ici_s"] == pytest.approx(seconds), name
        assert reports[name]["collective_bytes"]["all-to-all"] == nbytes, name
        flagged = [c for c in reports[name]["collectives"] if c["expert_exchange"]]
        assert sum(c["bytes"] * c["multiplier"] for c in flagged) == nbytes
        assert reports[name]["moe"]["whole_expert_gathers"] == []  # E / 2 experts a chip


def test_the_formula_matches_the_hand_count(moe_path):
    config = models.architecture_config(moe_path)
    common = dict(seq=SEQ, shards=SHARDS, expert=P, remat="layer", itemsize=4)
    update = _moe.expected_exchange(
        config, rows=ROWS, calls=MICRO, training=True, link_bandwidth=W, **common
    )
    forward = _moe.expected_exchange(
        config, rows=ROWS, calls=1, training=False, link_bandwidth=W, **common
    )
    assert update["bytes"] == UPDATE_BYTES and update["ici_s"] == pytest.approx(UPDATE_ICI)
    assert forward["bytes"] == FORWARD_BYTES and forward["ici_s"] == pytest.approx(FORWARD_ICI)
    no_remat = _moe.expected_exchange(
        config,
        rows=ROWS,
        calls=MICRO,
        training=True,
        link_bandwidth=W,
        **common | {"remat": "none"},
    )
    assert no_remat["bytes"] == _exchange(24, L * MICRO, 4, 1)[0]
    assert _moe.exchange_bytes(config, 24, 1, 4) == (0.0, 0.0)  # no expert axis: no exchange


@needs_libtpu
def test_a_scanned_layer_stack_weights_the_exchange_by_its_trips(moe_path):
    """Deviceless for a v5p-8: the layers are a ``while`` loop over the stacked weights (one
    copy of each exchange in its body) inside the micro-batch loop; bf16 rows (c = 2)."""
    job = _job(
        moe_path,
        "mesh.fsdp=2",
        "mesh.expert=2",
        "model.compute_dtype=bfloat16",
        devices=get_devices(V5P_8),
    )
    report = pr._program_report(
        job, job.programs["update"], try_compile(job.programs["update"].lowered)
    )
    flagged = [c for c in report["collectives"] if c["expert_exchange"]]
    assert len(flagged) == 8  # each exchange once in the layer body
    assert {c["multiplier"] for c in flagged} == {L * MICRO}
    nbytes, seconds = _exchange(24, L * MICRO, 6, 2, c=2)
    a2a = report["moe"]["expert_all_to_all"]
    assert (a2a["bytes"], a2a["exchanges"]) == (nbytes, L * MICRO * 8)
    assert a2a["ici_s"] == pytest.approx(seconds)
    assert report["moe"]["whole_expert_gathers"] == []


@needs_libtpu
def test_without_an_expert_axis_every_chip_runs_the_whole_batch_through_the_experts(moe_path):
    """fsdp 4, no expert axis, deviceless for a v5p-8: the forward's grouped matmuls take the
    whole batch's 8 x 24 tokens x 2 experts on each chip, 4x its own; the other chips' share
    (3x the experts' matmul FLOPs, L 2 k 3 D F a token) is added to its compute time."""
    job = _job(moe_path, "mesh.fsdp=4", devices=get_devices(V5P_8))
    name = "logprobs"
    report = pr._program_report(job, job.programs[name], try_compile(job.programs[name].lowered))
    rep = report["moe"]["replication"]
    assert (rep["expert_rows"], rep["routed_rows"], rep["factor"]) == (384, 96, 4)
    expert_flops = ROWS * SEQ * L * 2 * K_TOP * 3 * D * F
    assert rep["extra_flops"] == 3 * expert_flops
    peak = 4 * V5P_8.peak_bf16_flops_per_chip
    assert report["times"]["compute_s"] == pytest.approx(
        (job.programs[name].flops + 3 * expert_flops) / peak
    )
    assert report["moe"]["whole_expert_gathers"]  # and FSDP gathers every expert


# -- whole-expert gathers ------------------------------------------------------------------


def test_fsdp_without_an_expert_axis_gathers_every_expert(moe_path):
    """fsdp 4, no expert axis: the forward all-gathers each layer's [E, D, F] experts."""
    job = _job(moe_path, "mesh.fsdp=4")
    report = pr._program_report(
        job, job.programs["logprobs"], try_compile(job.programs["logprobs"].lowered)
    )
    gathers = report["moe"]["whole_expert_gathers"]
    assert gathers, report["collectives"]
    for g in gathers:
        assert g["shape"][-3] == E and sorted(g["shape"][-2:]) == sorted([D, F])
        assert g["bytes"] == math.prod(g["shape"]) * 4  # f32 compute
    assert report["moe"]["expert_all_to_all"]["bytes"] == 0


WEIGHT_GATHER = """HloModule m, num_partitions=4

ENTRY %main (w: f32[1,8,32,48], z: f32[2,16,48,8]) -> (f32[1,8,64,48], f32[2,64,48,8]) {
  %w = f32[1,8,32,48]{3,2,1,0} parameter(0)
  %z = f32[2,16,48,8]{3,2,1,0} parameter(1)
  %g = f32[1,8,64,48]{3,2,1,0} all-gather(%w), channel_id=1, replica_groups={{0,1},{2,3}}, dimensions={2}
  %h = f32[2,64,48,8]{3,2,1,0} all-gather(%z), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={1}
  ROOT %t = (f32[1,8,64,48]{3,2,1,0}, f32[2,64,48,8]{3,2,1,0}) tuple(%g, %h)
}
"""  # noqa: E501


def test_a_gather_is_every_expert_only_if_shaped_like_the_weights(moe_path):
    """``[1, E, D, F]`` is every expert's weight; the router logits' ``[L, B, S, E]``, here
    with ``B = D`` and ``S = F``, end in E and are not."""
    config = models.architecture_config(moe_path)
    module = hlo.parse_hlo_module(WEIGHT_GATHER)
    ops = hlo.collective_ops(module)
    found = _moe.whole_expert_gathers(module, ops, config, {"fsdp": 2, "tensor": 1})
    assert found == [{"shape": [1, E, D, F], "bytes": E * D * F * 4, "multiplier": 1}]
    # Split by fsdp 2 the gathered D is still a chip's share of D: [1, 8, 32, 48] would match.
    assert _moe.whole_expert_gathers(module, ops, config, {"fsdp": 1, "tensor": 1}) == found


# -- memory and the report -----------------------------------------------------------------


def test_the_experts_share_of_a_chip_by_hand(expert_job):
    """f32 masters, moments and reference; [L, E, D, F] split over expert 2 x fsdp 2: a
    quarter of the 2 x 73728 expert elements a chip each; the serving copy (data 2 x tensor 2,
    f32 compute here) splits F by 2 only."""
    job, _ = expert_job
    memory = _moe.expert_memory(job)
    per_chip = L * EXPERTS_PER_LAYER // 4  # 36864 elements
    assert memory["memory_bytes"] == {
        "parameters": 4 * per_chip,
        "optimizer_state": 2 * 4 * per_chip,
        "reference": 4 * per_chip,
        "frozen_base": 0,
        "sampler_weights": 4 * L * EXPERTS_PER_LAYER // dict(job.serving.mesh.shape)["tensor"],
    }
    assert memory["resident_bytes"] == 16 * per_chip
    assert memory["gradient_bytes"] == 4 * per_chip
    assert memory["gathered_layer_bytes"] == 3 * (E // 2) * D * F * 4  # one layer, D whole


def test_the_report_gives_the_moe_figures(expert_job):
    job, reports = expert_job
    programs = {
        name: reports.get(name) or pr._program_report(job, p, None)
        for name, p in job.programs.items()
    }
    report = pr.summarise(job, programs, skipped_compile=False)
    assert report["model"]["params"] == TOTAL and report["model"]["active_params"] == ACTIVE
    moe = report["moe"]
    assert (moe["experts"], moe["experts_per_token"], moe["expert_axis"]) == (E, K_TOP, P)
    assert moe["experts_per_chip"] == E // P
    assert moe["expert_weight_shards"] == {"expert": 2, "fsdp": 2, "tensor": 1}
    assert (moe["params"], moe["active_params"]) == (TOTAL, ACTIVE)
    update = moe["all_to_all"]["update"]
    assert update["bytes"] == update["expected_bytes"] == UPDATE_BYTES
    assert moe["all_to_all"]["logprobs"]["expected_bytes"] == FORWARD_BYTES
    calls = {n: p["calls_per_step"] for n, p in programs.items()}
    assert moe["all_to_all_s_per_step"] == pytest.approx(
        calls["update"] * UPDATE_ICI + calls["logprobs"] * FORWARD_ICI
    )
    assert moe["gathers_every_expert"] is False and moe["all_to_all_padding"] == P
    text = format_report(report)
    assert "MoE: 8 experts, 2 a token" in text
    assert "expert all-to-all a call (ICI): update" in text
    assert "no program gathers every expert on a chip" in text
    json.dumps(report)


def test_a_dense_model_has_no_moe_entry(moe_path):
    from tests.plan.test_programs import TINY  # noqa: PLC0415

    assert not _moe.is_moe(models.ModelConfig.from_hf_dict(TINY))


# -- advice --------------------------------------------------------------------------------


def _hand_traffic(expert, *, chips=4, tokens=24.0, c=4):
    """The update's modelled MoE ICI seconds on ``chips`` (fsdp fills): the exchange's 6 + 2 of
    ``_exchange`` and, per layer and micro-batch, 6 all-gathers of one weight's E / P experts
    over fsdp and 3 reduce-scatters of their shard."""
    fsdp = chips // expert
    a2a = 0.0
    if expert > 1:
        rows, ids = expert * tokens * K_TOP * D * c, expert * tokens * K_TOP * 4
        ring = max((expert - 1) / expert, expert / 4)
        a2a = L * MICRO * ring * (6 * rows + 2 * ids) / (2 * W)
    weight = (E // expert) * D * F * c
    gathers = 6 * (fsdp - 1) / fsdp * weight / (2 * W) if fsdp > 1 else 0.0
    scatters = 3 * (fsdp - 1) * (weight / fsdp) / (2 * W) if fsdp > 1 else 0.0
    return a2a + L * MICRO * (gathers + scatters)


@pytest.mark.parametrize("expert", [1, 2, 4])
def test_update_expert_traffic_by_hand(moe_path, expert):
    config = models.architecture_config(moe_path)
    got = _moe.update_expert_traffic(
        config,
        rows=ROWS,
        seq=SEQ,
        micro_batches=MICRO,
        mesh_sizes={"data": 1, "fsdp": 4 // expert, "expert": expert, "tensor": 1},
        remat="layer",
        itemsize=4,
        link_bandwidth=W,
    )
    assert got["total_s"] == pytest.approx(_hand_traffic(expert))


def _ici_bound(report, ici_s):
    """``report`` bound by ``ici_s`` seconds of collectives (next to no compute or HBM)."""
    times = {**report["times"], "compute_s": 1e-12, "hbm_s": 0.0, "ici_s": ici_s, "bound": "ici"}
    return {**report, "times": times}


def test_an_ici_bound_update_names_the_expert_axis_that_cuts_its_traffic(moe_path, expert_job):
    """fsdp 4 without an expert axis: every layer gathers all 8 experts; this tiny job routes
    few tokens, so an expert axis cuts the modelled traffic."""
    _, reports = expert_job
    job = _job(moe_path, "mesh.fsdp=4")
    traffic = {q: _hand_traffic(q) for q in (1, 2, 4)}
    best = min(traffic, key=traffic.get)
    assert best != 1
    rest = 1e-6  # the update's other collectives
    programs = {"update": _ici_bound(reports["update"], rest + traffic[1])}
    (hint,) = _moe.moe_hints(job, programs)
    assert hint.startswith(f"mesh.expert={best} (mesh.fsdp=-1; now 1): the update is ICI-bound")
    assert f"about {rest + traffic[best]:.3g} s an update with mesh.expert={best}, ICI" in hint
    # Not ICI-bound: no hint.
    assert _moe.moe_hints(job, {"update": reports["update"]}) == []


def test_an_ici_bound_update_at_its_best_expert_axis_says_so(moe_path, expert_job):
    _, reports = expert_job
    traffic = {q: _hand_traffic(q) for q in (1, 2, 4)}
    best = min(traffic, key=traffic.get)
    job = _job(moe_path, "mesh.fsdp=-1", f"mesh.expert={best}")
    (hint,) = _moe.moe_hints(job, {"update": _ici_bound(reports["update"], 1.0)})
    assert "no mesh.expert does much better" in hint


def test_an_update_over_names_the_expert_axis_with_the_least_transients(moe_path, expert_job):
    """fsdp 4 without an expert axis: each layer gathers all 8 experts (3 x 8 x 64 x 48 x 4
    bytes) and every chip sorts the whole micro-batch's 4 x 24 tokens (3 buffers of their 2
    rows each); with mesh.expert=4 (fsdp 1) none are gathered and the exchange's three
    buffers hold 4 x 24 x 2 rows: the least."""
    _, reports = expert_job
    job = _job(moe_path, "mesh.fsdp=4")
    over = {**reports["update"], "fits": False, "total_gib": 99.0}
    (line,) = _moe.moe_suggestions(job, {"update": over})
    rows = 4 * 24 * K_TOP * D * 4  # 4 x T_l k rows of D, f32
    gathered, buffers = 3 * E * D * F * 4 + 3 * rows, 3 * rows
    assert line.startswith("mesh.expert=4 (mesh.fsdp=-1; now 1): update is over")
    assert line.endswith("through the experts (4x its own)")
    assert f"from {gathered / 2**30:.3g} GiB to {buffers / 2**30:.3g} GiB" in line
    fitting = {name: reports["logprobs"] for name in job.programs}
    assert any(
        s.startswith("mesh.expert=4") for s in pr.suggestions(job, {**fitting, "update": over})
    )


@needs_libtpu
def test_only_expert_axes_the_torus_lays_out_are_named(moe_path):
    """v5p-128 is a 4x4x4 torus: a mesh axis must be a product of whole torus axes (4, 16,
    64), so of E = 8's divisors only mesh.expert=4 is on offer (and today's 1); a mesh the
    torus cannot lay out is refused with one line."""
    from jaxrl_llm.train.config import MeshSection  # noqa: PLC0415

    config = models.architecture_config(moe_path)
    devices = get_devices(resolve_topology("v5p-128"))
    sizes = {"data": 1, "fsdp": 64, "tensor": 1}
    assert _moe.expert_axis_sizes(config, sizes) == [1, 2, 4, 8]
    assert _moe.expert_axis_sizes(config, sizes, devices) == [1, 4]
    with pytest.raises(pr.PlanError, match="does not map onto the slice's torus"):
        pr.plan_mesh(MeshSection(tensor=2), devices)


def test_a_forward_over_gets_a_token_budget(expert_job):
    """The log-prob forward routes the whole batch at once, 8 x 24 / 4 = 48 tokens a chip; a
    token budget of one row (24 positions) halves its exchange buffers: (3 (E / 2) D F + 3 x
    2 T k D) x 4 bytes with T = 48, then 24."""
    job, reports = expert_job
    over = {**reports["logprobs"], "fits": False, "total_gib": 99.0}
    lines = _moe.moe_suggestions(job, {"logprobs": over, "ref_logprobs": over})
    gathered = 3 * (E // 2) * D * F * 4

    def transients(tokens):
        return gathered + 3 * 2 * tokens * K_TOP * D * 4

    want = (
        f"trainer.micro_batch_tokens={SEQ}: logprobs is over (99.00 of 95.74 GiB); the log-prob "
        f"forwards then run one row a chip at a time, and their modelled per-layer MoE "
        f"transients go from {transients(48) / 2**30:.3g} GiB to {transients(24) / 2**30:.3g} GiB"
    )
    assert [line for line in lines if line.startswith("trainer.")] == [lines[0]]  # once
    assert lines[0].startswith(want)
