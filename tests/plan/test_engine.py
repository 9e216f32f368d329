"""``jaxrl-llm plan`` of a job on the continuous engine (``rollout.engine=continuous``): its
refill prefill and decode loop over ``rollout.slots`` slots, the KV cache contiguous or a paged
pool of ``rollout.kv_blocks`` blocks, counted by hand and compiled on the CPU devices.

The tiny job of ``test_programs`` (4 prompts x 2 samples = 8 rows, prompts bucketed to 16
tokens, 8 new tokens) on the sampler's serving layout (data 2 x tensor 2 over 4 fake CPU
devices: slots over 2 batch shards, kv-heads over 2).
"""

import pytest

from jaxrl_llm.plan import _analysis
from jaxrl_llm.plan import estimate as est
from jaxrl_llm.plan import programs as pr
from jaxrl_llm.plan._engine import engine_shape
from tests.plan.test_programs import _job, compiled_report, tiny_path  # noqa: F401  (fixture)

L, K, H, BF16 = 2, 2, 16, 2  # layers, kv-heads, head dim, bytes of the compute dtype
PAGED = (
    "rollout.engine=continuous",
    "rollout.slots=4",
    "rollout.kv_block_size=8",
    "rollout.kv_blocks=8",
)


def test_the_paged_engine_by_hand(tiny_path):  # noqa: F811
    job = _job(tiny_path, *PAGED)
    assert dict(job.serving.mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 2}
    engine = engine_shape(job.cfg, job.shape, job.serving.mesh)
    # 16 + 8 = 24 cache slots a row, 3 blocks of 8; 8 rows through 4 slots: 2 waves.
    assert (engine.slots, engine.width, engine.waves, engine.paged) == (4, 24, 2, (8, 8))
    decode, prefill = job.programs["decode_step"], job.programs["prefill"]
    # Every completion at its limit: 2 waves x 8 decode steps of 4 slots, one refill a wave.
    assert (decode.calls_per_step, decode.tokens, decode.per_step_loop) == (16, 4, True)
    assert prefill.calls_per_step == 2
    # The pool: k and v [L, K, N, P, H] with kv-heads over tensor 2 and blocks over data 2
    # (2 x 1 x 4 x 8 x 16 bf16 a chip each); the [S, W] bool mask and the [S, W / P] int32
    # table with slots over data 2 (2 x 24 and 2 x 3 x 4).
    pool = 2 * (L * (K // 2) * (8 // 2) * 8 * H * BF16)
    assert decode.argument_parts["kv_cache"] == pool + 2 * 24 + 2 * 3 * 4
    assert prefill.argument_parts["kv_cache"] == decode.argument_parts["kv_cache"]
    # The refill prefill: 4 slots of 2 samples share 2 prompts (a power of two, a multiple of
    # the 2 batch shards): 2 x 16 tokens.
    assert prefill.tokens == 2 * 16
    # A pool half the size halves the blocks a chip.
    half = _job(tiny_path, *PAGED[:-1], "rollout.kv_blocks=4")
    assert half.programs["decode_step"].argument_parts["kv_cache"] == pool // 2 + 48 + 24


def test_the_contiguous_engine_matches_the_static_cache(tiny_path):  # noqa: F811
    """Without a paged pool the engine's cache is the static sampler's layout: all 8 rows in
    slots (the default), one wave."""
    job = _job(tiny_path, "rollout.engine=continuous")
    static = _job(tiny_path)
    decode = job.programs["decode_step"]
    assert (decode.calls_per_step, decode.tokens) == (8, 8)
    assert decode.argument_parts["kv_cache"] == 2 * 2 * 4 * 24 * 16 * 2 + 96
    assert decode.argument_parts == static.programs["decode_step"].argument_parts
    assert decode.flops == static.programs["decode_step"].flops


def test_the_paged_engine_compiles_and_reports(tiny_path):  # noqa: F811
    """Compiled on the CPU devices: the accounting holds (every total is the program's peak
    plus what stays resident), the decode loop's HBM is read off one trip of its body, and the
    roofline is the engine's: 4 slots, each over its share of the pool (8 blocks of 8 = 64
    slots: 16 a row, fewer than the 24 of a longest row)."""
    job = _job(tiny_path, *PAGED)
    outcomes = pr.compile_job(job)
    for name in ("prefill", "decode_step"):
        program = job.programs[name]
        memory = est.memory_breakdown(outcomes[name].compiled)
        assert memory.argument_bytes >= sum(program.argument_parts.values()), name
        parts = pr.memory_parts(program, memory)
        assert sum(parts.values()) == memory.total_bytes + sum(program.resident.values())
    report = compiled_report(job, outcomes)
    decode = report["programs"]["decode_step"]
    assert decode["hlo_of_one_loop_trip"] is True
    floor = _analysis.decode_hbm_bytes_per_chip(job.model_config, job.serving.mesh, 4, 16)
    assert decode["hbm_roofline_bytes"] == floor
    assert report["est_decode_roofline_tokens_per_s"] == pytest.approx(4 / decode["hbm_roofline_s"])
    assert report["est_decode_tokens_per_s"] == pytest.approx(4 / decode["times"]["step_s"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("rollout.slots=3",), "rollout.slots=3 must be a multiple of the sampler mesh's"),
        (("rollout.kv_block_size=8", "rollout.kv_blocks=7"), "rollout.kv_blocks=7 must be a"),
        (("rollout.decode_layers=per_layer",), "decode_layers=per_layer with rollout.engine"),
    ],
)
def test_engine_refusals_name_the_key(tiny_path, overrides, message):  # noqa: F811
    with pytest.raises(pr.PlanError, match=message):
        _job(tiny_path, "rollout.engine=continuous", *overrides)
