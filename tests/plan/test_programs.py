"""The RL step's programs for ``jaxrl-llm plan``: shapes, per-chip memory accounting, refusals.

Expected numbers are worked out by hand from the model's sizes (``param_count``'s formula),
AdamW's two moments and the mesh's shards. The programs are built over 4 of the 8 fake CPU
devices (``tests/conftest.py``), so no libtpu is needed; one test compiles the tiny model's
programs on CPU and checks the accounting against XLA's own ``memory_analysis``.
"""

import dataclasses
import io
import json
import re

import jax
import pytest

from jaxrl_llm.plan import estimate as est
from jaxrl_llm.plan import hlo
from jaxrl_llm.plan import programs as pr
from jaxrl_llm.plan.topology import GiB, get_devices, libtpu_available, resolve_topology
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.rl.config import TrainConfig

V5E_4 = resolve_topology("v5litepod-4")

# A Llama-shaped model every dimension of which divides 4 (so fsdp=4 splits each leaf evenly).
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
# V D + L (2 D + D N H + 2 D K H + N H D + 3 D F) + D + D V
#   = 16384 + 2 (128 + 4096 + 2048 + 4096 + 24576) + 64 + 16384
TINY_PARAMS = 16384 + 2 * (128 + 4096 + 2 * 2048 + 4096 + 24576) + 64 + 16384
# Scalars besides the moments: AdamW's count, the learning-rate schedule's count, the state's
# step (int32 each) and its PRNG key (two uint32).
SCALARS = 4 + 4 + 4 + 8


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
            "rollout.prompts_per_step=4",
            "rollout.group_size=2",
            "data.max_prompt_tokens=12",
            "rollout.max_new_tokens=8",
            "mesh.fsdp=4",
            *overrides,
        ],
    )


def _job(tiny_path, *overrides):
    return pr.build_job(_cfg(tiny_path, *overrides), V5E_4, devices=jax.devices()[:4])


def test_tiny_param_count_by_hand(tiny_path):
    from jaxrl_llm import models

    assert models.param_count(models.architecture_config(tiny_path)) == TINY_PARAMS == 106816


@pytest.mark.parametrize(
    "overrides, params, optimizer, reference, compute_copy",
    [
        # f32 masters and moments on fsdp=4: P x 4 / 4 each, two moments; a bf16 copy P x 2 / 4.
        ((), TINY_PARAMS, 2 * TINY_PARAMS + SCALARS, TINY_PARAMS, TINY_PARAMS // 2),
        # bf16 masters and moments: half; the weights are already in the compute dtype.
        (
            ("model.param_dtype=bfloat16", "trainer.optimizer_state_dtype=bfloat16"),
            TINY_PARAMS // 2,
            TINY_PARAMS + SCALARS,
            TINY_PARAMS // 2,
            0,
        ),
        # An EMA reference is kept in f32 whatever the masters' dtype.
        (
            ("model.param_dtype=bfloat16", "reference.mode=ema"),
            TINY_PARAMS // 2,
            2 * TINY_PARAMS + SCALARS,
            TINY_PARAMS,
            0,
        ),
        # An objective without a KL term keeps no reference.
        (("objective.name=dr_grpo",), TINY_PARAMS, 2 * TINY_PARAMS + SCALARS, 0, TINY_PARAMS // 2),
    ],
)
def test_resident_state_bytes_per_chip_by_hand(
    tiny_path, overrides, params, optimizer, reference, compute_copy
):
    state = _job(tiny_path, *overrides).state
    assert (state.params, state.optimizer, state.reference, state.params_compute) == (
        params,
        optimizer,
        reference,
        compute_copy,
    )


def test_shard_bytes_counts_one_shard_and_replicated_leaves_whole():
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    tree = {
        "a": jax.ShapeDtypeStruct((8, 3), "float32", sharding=sharded),  # 2 x 3 x 4
        "b": jax.ShapeDtypeStruct((5,), "bfloat16", sharding=replicated),  # 5 x 2
        "c": jax.ShapeDtypeStruct((2, 2), "int8"),  # no sharding: whole, 4
    }
    assert pr.shard_bytes(tree) == 24 + 10 + 4


def test_job_shape(tiny_path):
    job = _job(tiny_path, "trainer.minibatches=2", "trainer.epochs=3", "data.max_prompt_tokens=100")
    shape = job.shape
    assert (shape.rows, shape.minibatch_rows, shape.updates_per_step) == (8, 4, 6)
    assert (shape.prompt_len, shape.completion_len, shape.seq_len) == (128, 8, 136)
    assert shape.needs_reference and shape.reference_mode == "frozen"
    assert job.programs["update"].calls_per_step == 6
    assert job.programs["decode_step"].calls_per_step == 8


def test_rollout_batch_bytes_by_hand(tiny_path):
    job = _job(tiny_path)
    # 8 rows over 4 shards = 2 a chip; P = bucket(12) = 16, T = 8: prompt tokens 2x16x4, mask
    # 2x16, completion tokens 2x8x4, mask 2x8, ref log-probs 2x8x4, GRPO's per-sequence
    # advantages 2x4, rewards 2x4, the sampler's log-probs 2x8x4. One epoch, one minibatch:
    # on-policy, so no old log-probs (the update takes its own) and no behaviour forward.
    expected = 128 + 32 + 64 + 16 + 64 + 8 + 8 + 64
    assert job.programs["update"].resident["inputs"] == expected
    assert job.programs["logprobs"].calls_per_step == 0
    # Two minibatches: the behaviour log-probs (2x8x4 more) are computed once and carried.
    several = _job(tiny_path, "trainer.minibatches=2")
    assert several.programs["update"].resident["inputs"] == expected + 64
    assert several.programs["logprobs"].calls_per_step == 1
    # A decoupled rollout correction: old log-probs recomputed (never on-policy) and the
    # batch's IS weights (2x8x4 each).
    corrected = _job(tiny_path, "objective.overrides={rollout_correction: {is_level: token}}")
    assert corrected.programs["update"].resident["inputs"] == expected + 64 + 64
    assert corrected.programs["logprobs"].calls_per_step == 1
    # The decode step's KV cache: L x 2 (k, v) x rows x K x (P + T) x H x 2 bytes (bf16) on the
    # sampler's serving layout (data 2 x tensor 2: rows over 2 shards, kv-heads over 2):
    # 2 x 2 x 4 x 1 x 24 x 16 x 2, plus the [rows, P + T] bool mask 4 x 24.
    assert dict(job.serving.mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 2}
    assert job.programs["decode_step"].argument_parts["kv_cache"] == 2 * 2 * 4 * 24 * 16 * 2 + 96
    # On the trainer's layout (fsdp 4): rows over 4 chips, kv-heads whole.
    trainer = _job(tiny_path, "rollout.tensor_parallel=trainer")
    assert trainer.serving.is_trainer_layout
    cache = trainer.programs["decode_step"].argument_parts["kv_cache"]
    assert cache == 2 * 2 * 2 * 2 * 24 * 16 * 2 + 48


def _memory(**sizes):
    fields = dict.fromkeys(est._MEMORY_FIELDS, 0)
    fields.update(sizes)
    total = (
        fields["argument_bytes"]
        + fields["output_bytes"]
        - fields["alias_bytes"]
        + fields["temp_bytes"]
        + fields["generated_code_bytes"]
    )
    return est.MemoryBreakdown(
        **fields,
        total_bytes=total,
        capacity_bytes=None,
        usable_bytes=None,
        fits=None,
        headroom_bytes=None,
    )


def _program(**kwargs):
    defaults = dict(
        name="prefill",
        lowered=None,
        calls_per_step=1,
        flops=1.0,
        model_flops=1.0,
        tokens=1.0,
        argument_parts={"parameters": 1000},
        resident={"optimizer_state": 2000, "reference": 500},
        inner_parts={"kv_cache": 300},
    )
    defaults.update(kwargs)
    return pr.Program(**defaults)


def test_memory_parts_by_hand():
    # Arguments 1040 = 1000 parameters + 40 prompts; outputs 310 (300 cache + 10 logits);
    # temporaries 200; code 5: program total 1555.
    memory = _memory(argument_bytes=1040, output_bytes=310, temp_bytes=200, generated_code_bytes=5)
    parts = pr.memory_parts(_program(), memory)
    assert parts == {
        "parameters": 1000,
        "optimizer_state": 2000,
        "reference": 500,
        "frozen_base": 0,
        "aux_model": 0,
        "reward_model": 0,
        "teacher": 0,
        "sampler_weights": 0,
        "kv_cache": 300,
        "inputs": 40,
        "temporaries": 215,  # 10 + 200 + 5
    }
    assert sum(parts.values()) == memory.total_bytes + 2500


def test_memory_parts_of_a_donated_state():
    # The update donates the state: outputs alias the arguments, only the temporaries add.
    program = _program(
        name="update",
        argument_parts={"parameters": 1000, "optimizer_state": 2000},
        resident={"reference": 1000, "inputs": 50},
        inner_parts={},
    )
    memory = _memory(argument_bytes=3020, output_bytes=3004, alias_bytes=3000, temp_bytes=700)
    parts = pr.memory_parts(program, memory)
    assert parts["inputs"] == 20 + 50 and parts["temporaries"] == 704
    assert sum(parts.values()) == 3020 + 4 + 700 + 1050


def test_memory_parts_without_a_compile_uses_the_compilers_figure():
    parts = pr.memory_parts(_program(inner_parts={}), None, required_bytes=5000)
    assert parts["temporaries"] == 4000 and sum(parts.values()) == 5000 + 2500
    parts = pr.memory_parts(_program(inner_parts={}), None)  # no figure: the arguments only
    assert parts["temporaries"] == 0 and sum(parts.values()) == 1000 + 2500


COPIES = """HloModule copies, num_partitions=4

%fused_start (p0: bf16[4,8]) -> bf16[16,8] {
  %p0 = bf16[4,8]{1,0} parameter(0)
  ROOT %ag.1 = bf16[16,8]{1,0} all-gather(%p0), channel_id=7, GROUPS
}

%fused_done (q0: bf16[4,8]) -> bf16[16,8] {
  %q0 = bf16[4,8]{1,0} parameter(0)
  ROOT %ag.2 = bf16[16,8]{1,0} all-gather(%q0), channel_id=7, GROUPS
}

%body (b: (s32[], bf16[4,8])) -> (s32[], bf16[4,8]) {
  %b = (s32[], bf16[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %w = bf16[4,8]{1,0} get-tuple-element(%b), index=1
  %f1 = bf16[16,8]{1,0} fusion(%w), kind=kLoop, calls=%fused_start
  %f2 = bf16[16,8]{1,0} fusion(%w), kind=kLoop, calls=%fused_done
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[4,8]{1,0}) tuple(%next, %w)
}

%cond (c: (s32[], bf16[4,8])) -> pred[] {
  %c = (s32[], bf16[4,8]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}

ENTRY %main (x: bf16[4,8]) -> (bf16[16,8], bf16[16,8]) {
  %x = bf16[4,8]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[4,8]{1,0}) tuple(%zero, %x)
  %loop = (s32[], bf16[4,8]{1,0}) while(%init), condition=%cond, body=%body
  %ag.3 = bf16[16,8]{1,0} all-gather(%x), channel_id=9, GROUPS
  %ag.4 = bf16[16,8]{1,0} all-gather(%x), channel_id=9, GROUPS
  ROOT %r = (bf16[16,8]{1,0}, bf16[16,8]{1,0}) tuple(%ag.3, %ag.4)
}
""".replace("GROUPS", "replica_groups=[1,4]<=[4], dimensions={0}")


def test_unique_collectives_counts_an_async_fusion_copy_once():
    """One all-gather (channel 7) copied into the start and done fusions of a 3-trip loop, as
    XLA:TPU's async collective fusion writes it, is one all-gather a trip; the two top-level
    ops of channel 9 (outside any fusion) are both kept."""
    module = hlo.parse_hlo_module(COPIES)
    parsed = hlo.collective_ops(module)
    assert len(parsed) == 4  # what the parser lists: every copy
    unique = pr.unique_collectives(module, parsed)
    assert sorted((op.name, op.multiplier) for op in unique) == [
        ("ag.1", 3),
        ("ag.3", 1),
        ("ag.4", 1),
    ]
    # 16 x 8 bf16 = 256 bytes each: 3 trips + 2 top-level.
    assert sum(op.total_bytes for op in unique) == 5 * 256


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("objective.name=ppo", "critic.init=reward_model", "critic.path=/x"), "critic.path"),
        (("reward_model.path=/x",), "reward_model.path"),
        (("rollout.prompts_per_step=2",), "rollout.prompts_per_step"),
        (("trainer.micro_batches=4",), "micro-batch"),
        (("model.path=/nowhere",), "not both"),
        (("mesh.fsdp=8",), "mesh"),
        (("model.remat=full",), "model.remat"),
    ],
)
def test_refusals_name_the_key(tiny_path, overrides, message):
    with pytest.raises(pr.PlanError, match=message):
        _job(tiny_path, *overrides)


def test_a_model_is_required():
    cfg = load_config(TrainConfig, None, [])
    with pytest.raises(pr.PlanError, match="model.architecture"):
        pr.plan_model_config(cfg.model)
    cfg = load_config(TrainConfig, None, ["model.architecture=qwen9-1b"])
    with pytest.raises(pr.PlanError, match="unknown architecture"):
        pr.plan_model_config(cfg.model)


def test_compute_dtype_is_the_tpu_default():
    cfg = load_config(TrainConfig, None, ["model.architecture=qwen2.5-0.5b"])
    assert pr.plan_model_config(cfg.model).compute_dtype == "bfloat16"
    cfg = load_config(
        TrainConfig, None, ["model.architecture=qwen2.5-0.5b", "model.compute_dtype=float32"]
    )
    assert pr.plan_model_config(cfg.model).compute_dtype == "float32"


@pytest.mark.parametrize(
    "name, bigger",
    [("v5litepod-4", "v5litepod-8"), ("v5p-8", "v5p-16"), ("v6e-256", None), ("v4-128", "v4-256")],
)
def test_bigger_topology(name, bigger):
    assert pr.bigger_topology(resolve_topology(name)) == bigger


def compiled_report(job, outcomes):
    """The plan's report of a job whose programs compiled (``compile_job``)."""
    return pr.summarise(
        job,
        {n: pr._program_report(job, p, outcomes[n]) for n, p in job.programs.items()},
        skipped_compile=False,
    )


def test_cpu_compile_matches_the_accounting(tiny_path):
    """Compiled on the CPU devices: each program's arguments are what the accounting says they
    are, and every total is the program's peak plus what stays resident around it."""
    job = _job(tiny_path)
    terminal = Terminal()
    outcomes = pr.compile_job(job, stream=terminal)
    assert outcomes["ref_logprobs"] is outcomes["logprobs"]  # same dtype, same program
    # On a terminal, a bar over the programs compiled (the shared one not counted), naming
    # the one compiling after those done, erased at the end.
    drawn = terminal.getvalue()
    compiled = [name for name, p in job.programs.items() if p.same_as is None]
    assert "ref_logprobs" not in compiled and len(compiled) == len(job.programs) - 1
    for done, name in enumerate(compiled):
        assert re.search(rf"\| {done}/{len(compiled)} \[[^]]*, {name}\]", drawn), (name, drawn)
    assert drawn.endswith("\r")  # cleared (leave=False)
    shape = job.shape
    # Per chip, the arguments besides the state, weights and cache the accounting names:
    inputs = {
        # The minibatch (the whole batch here, on-policy: no old log-probs) less its rewards
        # (2 rows x 4 bytes), which GRPO's loss does not read, so jit drops that argument;
        # with the sampler's log-probs 2x8x4 (the rollout/* metrics read them).
        "update": 320 - 8 + 64,
        # Sequences of 2 rows: prompt tokens 2x16x4, mask 2x16, completion 2x8x4, mask 2x8.
        "logprobs": 240,
        "ref_logprobs": 240,
        # On the sampler's layout (data 2 x tensor 2): two prompts a chip: tokens 2x16x4, mask
        # 2x16, the pad id 4.
        "prefill": 164,
        # Sampling state of 4 rows a chip (8 over the 2 batch shards): step 4, tokens 4x8x4,
        # log-probs 4x8x4, mask 4x8, done 4, positions 4x4, logits 4x256x4 split over tensor 2;
        # the key 8; temperature, top-p, min-p 3x4, 4 EOS slots 16, pad id 4.
        "decode_step": 4 + 128 + 128 + 32 + 4 + 16 + 2048 + 8 + 12 + 16 + 4,
        "reshard": 0,  # the parameters only
    }
    for name, program in job.programs.items():
        memory = est.memory_breakdown(outcomes[name].compiled)
        known = sum(program.argument_parts.values())
        assert memory.argument_bytes - known == inputs[name], name
        parts = pr.memory_parts(program, memory)
        assert sum(parts.values()) == memory.total_bytes + sum(program.resident.values())
    report = compiled_report(job, outcomes)
    assert report["fits"] and report["chips"] == 4
    assert report["programs"]["decode_step"]["hlo_of_one_loop_trip"] is True
    assert report["hbm_per_chip_gib"] == max(p["total_gib"] for p in report["programs"].values())
    expected_step = sum(
        p["calls_per_step"] * p["times"]["step_s"] for p in report["programs"].values()
    )
    assert report["est_step_s"] == pytest.approx(expected_step)
    decode = report["programs"]["decode_step"]["times"]
    assert report["est_decode_tokens_per_s"] == pytest.approx(shape.rows / decode["step_s"])
    json.dumps(report)


class Terminal(io.StringIO):
    """A stream that says it is a terminal (where ``plan`` draws its compile bar)."""

    def isatty(self) -> bool:
        return True


def test_compile_bar_is_hidden_off_a_terminal(tiny_path):
    job = _job(tiny_path)
    job = dataclasses.replace(job, programs={"reshard": job.programs["reshard"]})
    stream = io.StringIO()  # a pipe or a file: no bar (tqdm's disable=None)
    assert pr.compile_job(job, stream=stream)["reshard"].compiled is not None
    assert stream.getvalue() == ""


def test_suggestions_for_a_state_that_cannot_fit(tiny_path):
    job = _job(tiny_path)
    # Pretend a chip of 100 KiB: the tiny state (about 0.5 MiB a chip) cannot fit.
    spec = dataclasses.replace(V5E_4, usable_hbm_bytes_per_chip=100 * 1024)
    job = dataclasses.replace(job, spec=spec)
    programs = {
        n: {"total_bytes": 10**9, "compiled": False, "memory_bytes": {"kv_cache": 0}}
        for n in job.programs
    }
    text = "\n".join(pr.suggestions(job, programs, skipped_compile=True))
    assert "bigger topology" in text
    assert "trainer.optimizer_state_dtype=bfloat16" in text
    assert "model.param_dtype=bfloat16" in text


def test_suggestions_for_an_update_that_overflows(tiny_path):
    job = _job(tiny_path, "rollout.prompts_per_step=8")  # 16 rows: 4 a chip, room to split
    usable = job.spec.usable_hbm_bytes_per_chip
    programs = {
        n: {"total_bytes": 2 * usable if n == "update" else 1, "compiled": True}
        for n in job.programs
    }
    text = "\n".join(pr.suggestions(job, programs))
    # bf16 moments save half the optimizer state, quoted against the overflow (one chip's
    # usable HBM here).
    half = f"{job.state.optimizer / 2 / GiB:.2f} GiB a chip of the {usable / GiB:.2f} GiB over"
    assert "trainer.optimizer_state_dtype=bfloat16" in text and half in text
    assert "model.remat=layer" in text
    assert "trainer.micro_batches=2" in text
    assert "mesh.tensor=2" in text
    assert "v5litepod-8" in text


def test_a_slow_stacked_decode_with_room_for_a_weight_copy_gets_a_per_layer_hint(tiny_path):
    job = _job(tiny_path)
    usable = job.spec.usable_hbm_bytes_per_chip

    def programs(step_s, total, weights=GiB):
        decode = {
            "compiled": True,
            "times": {"step_s": step_s},
            "hbm_roofline_s": 1.0,
            "total_bytes": total,
            "memory_bytes": {"kv_cache": GiB, "sampler_weights": weights},
        }
        return {"decode_step": decode}

    # At 25% of its roofline, with room for the copy (1 GiB): the hint and its figures.
    (hint,) = pr.decode_hints(job, programs(4.0, usable - 2 * GiB), usable)
    assert "rollout.decode_layers=per_layer" in hint and "runs at 25% of its HBM roofline" in hint
    at_most = f"up to 1.00 GiB a chip: decode_step at most {(usable - GiB) / GiB:.2f} of"
    assert at_most in hint
    # None at 60% of the roofline or more, without room for the copy, per layer already, on
    # the continuous engine (its per-layer layout is not planned), or uncompiled.
    assert pr.decode_hints(job, programs(1 / 0.6, usable - 2 * GiB), usable) == []
    assert pr.decode_hints(job, programs(4.0, usable - GiB // 2), usable) == []
    for change in ({"decode_layers": "per_layer"}, {"engine": "continuous"}):
        rollout = dataclasses.replace(job.cfg.rollout, **change)
        run = dataclasses.replace(job.run, config=dataclasses.replace(job.cfg, rollout=rollout))
        other = dataclasses.replace(job, run=run)
        assert pr.decode_hints(other, programs(4.0, usable - 2 * GiB), usable) == []
    uncompiled = programs(4.0, 0)
    uncompiled["decode_step"]["compiled"] = False
    assert pr.decode_hints(job, uncompiled, usable) == []


def test_decode_hbm_bytes_per_chip_by_hand(tiny_path):
    from jaxrl_llm.train.config import MeshSection

    config = pr.plan_model_config(_cfg(tiny_path).model)  # bf16 compute: 2 bytes
    # matmul_params = L (D (N H + 2 K H) + N H D + 3 D F) + D V
    #               = 2 (64 x 128 + 4096 + 24576) + 16384 = 90112; W = 2 x 90112 bytes.
    w = 2 * 90112
    table = 256 * 64 * 2  # untied embedding V D c
    # 8 rows, 24 slots: K and V read 2 L B K S H c, this step written 2 L B K H c.
    cache = 2 * 2 * 8 * 2 * 24 * 16 * 2 + 2 * 2 * 8 * 2 * 16 * 2
    logits = 2 * 8 * 256 * 4
    lookup = 8 * 64 * 2
    fsdp = pr.plan_mesh(MeshSection(data=1, fsdp=4, tensor=1), jax.devices()[:4])
    # Gathered every step: shard read (W / 4), gathered weights written and read back (2 W);
    # the table gathered (written, shard read); rows, cache and logits split over 4 chips.
    expected = w * 2.25 + table * 1.25 + (lookup + cache + logits) / 4
    assert pr.decode_hbm_bytes_per_chip(config, fsdp, 8, 24) == pytest.approx(expected)
    data = pr.plan_mesh(MeshSection(data=4, fsdp=1, tensor=1), jax.devices()[:4])
    # Replicated weights are read in place once; nothing is gathered.
    expected = w + (lookup + cache + logits) / 4
    assert pr.decode_hbm_bytes_per_chip(config, data, 8, 24) == pytest.approx(expected)


UNKNOWN_TRIPS = """HloModule loop, num_partitions=1

%body (b: (s32[], s32[])) -> (s32[], s32[]) {
  %b = (s32[], s32[]) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %n = s32[] get-tuple-element(%b), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], s32[]) tuple(%next, %n)
}

%cond (c: (s32[], s32[])) -> pred[] {
  %c = (s32[], s32[]) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %cn = s32[] get-tuple-element(%c), index=1
  ROOT %lt = pred[] compare(%ci, %cn), direction=LT
}

ENTRY %main (n: s32[]) -> (s32[], s32[]) {
  %n = s32[] parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], s32[]) tuple(%zero, %n)
  ROOT %loop = (s32[], s32[]) while(%init), condition=%cond, body=%body
}
"""


def test_loop_body_module_is_one_trip_of_the_data_dependent_loop():
    module = pr.loop_body_module(hlo.parse_hlo_module(UNKNOWN_TRIPS))
    assert module.entry == "body"
    with pytest.raises(ValueError, match="data-dependent while loop"):
        pr.loop_body_module(hlo.parse_hlo_module(COPIES))  # its loop runs a known 3 trips


@pytest.mark.parametrize(
    "overrides",
    [(), ("model.param_dtype=bfloat16",), ("objective.name=ppo",), ("objective.name=prime",)],
)
def test_every_program_counts_the_whole_resident_state(tiny_path, overrides):
    """Parameters, optimizer state and reference are alive during every program, as its
    arguments or around it; the decode loop's compute-dtype weights only during decoding."""
    job = _job(tiny_path, *overrides)
    state = job.state
    for name, program in job.programs.items():
        alive = {**program.resident}
        for part, nbytes in program.argument_parts.items():
            alive[part] = alive.get(part, 0) + nbytes
        assert alive["parameters"] == state.params, name
        assert alive["optimizer_state"] == state.optimizer, name
        assert alive["reference"] == state.reference, name
        assert alive.get("aux_model", 0) == state.aux, name
        # The sampler's serving copy: made by the reshard, read by the prefill and decode.
        served = program.argument_parts.get("sampler_weights", 0)
        made = program.inner_parts.get("sampler_weights", 0)
        if name in ("prefill", "decode_step"):
            assert served == job.programs["reshard"].inner_parts["sampler_weights"] > 0, name
        else:
            assert served == 0, name
        copy = job.programs["reshard"].inner_parts["sampler_weights"]
        assert made == (copy if name == "reshard" else 0), name


def _compiled_aux_report(job, names):
    """Compiles ``job`` on the CPU devices; checks the auxiliary model's programs ``names``
    count its whole state; returns the summary."""
    outcomes = pr.compile_job(job)
    for name in names:
        program = job.programs[name]
        memory = est.memory_breakdown(outcomes[name].compiled)
        parts = pr.memory_parts(program, memory)
        assert sum(parts.values()) == memory.total_bytes + sum(program.resident.values())
        assert parts["aux_model"] == job.state.aux, name
    return pr.summarise(
        job,
        {n: pr._program_report(job, p, outcomes[n]) for n, p in job.programs.items()},
        skipped_compile=False,
    )


def test_ppo_plans_the_critic_by_hand(tiny_path):
    """PPO (``PPOTrainer``, critic.optimizer=separate): the critic is the policy's backbone
    with a scalar head instead of the unembedding (``V D`` -> ``D``), f32 with its own AdamW
    moments, over the same fsdp=4; its rollout-time ``values`` forward and ``critic_update``
    run beside the policy's programs, compiled here on the CPU devices."""
    job = _job(tiny_path, "objective.name=ppo")
    state = job.state
    critic_params = TINY_PARAMS - 256 * 64 + 64  # no lm_head; a [D, 1] score head
    assert state.aux_params == critic_params  # f32 = 4 bytes, over 4 chips
    # Two f32 moments, plus the optimizer's counters, the state's step and PRNG key.
    assert 2 * critic_params < state.aux_optimizer <= 2 * critic_params + SCALARS
    assert {"values", "critic_update"} <= set(job.programs)
    shape = job.shape
    assert job.programs["critic_update"].calls_per_step == shape.updates_per_step
    assert job.programs["values"].calls_per_step == 1
    report = _compiled_aux_report(job, ("values", "critic_update"))
    assert report["fits"]
    assert report["step_breakdown_s"]["critic_update"] > 0
    # The critic update trains the backbone without the unembedding: fewer FLOPs than the
    # policy update on the same minibatch.
    assert 0 < job.programs["critic_update"].flops < job.programs["update"].flops


def test_prime_plans_the_implicit_prm_by_hand(tiny_path):
    """PRIME (``PRIMETrainer``): the implicit PRM is a trainable copy of the policy with its
    own AdamW, resident all step; it is updated once a step on the whole rollout batch and
    scores it with the policy's log-prob program (one compile for both)."""
    job = _job(tiny_path, "objective.name=prime")
    state = job.state
    assert state.aux_params == state.params == TINY_PARAMS  # f32 = 4 bytes, over 4 chips
    assert 2 * TINY_PARAMS < state.aux_optimizer <= 2 * TINY_PARAMS + SCALARS
    update, forward = job.programs["prm_update"], job.programs["prm_logprobs"]
    assert update.calls_per_step == forward.calls_per_step == 1
    assert forward.same_as == "logprobs" and forward.lowered is None
    # The PRM update trains on all B rows (the policy update on one minibatch of them).
    assert update.tokens == job.shape.rows * job.shape.completion_len
    report = _compiled_aux_report(job, ("prm_update", "prm_logprobs"))
    assert report["fits"] and report["step_breakdown_s"]["prm_update"] > 0


def test_decode_layers_are_planned_as_train_decodes(tiny_path, monkeypatch):
    """``rollout.decode_layers``: the plan lowers the decode loop stacked (``auto`` and
    ``stacked``: what ``generate`` runs on TPU) or per layer (``per_layer``), and says which."""
    from jaxrl_llm.plan import _serving

    seen = []
    real = _serving.decode_program

    class Recording:
        def lower(self, *args, **kwargs):
            seen.append(kwargs["unroll"])
            return real.lower(*args, **kwargs)

    monkeypatch.setattr(_serving, "decode_program", Recording())
    layers = {}
    for mode in ("auto", "stacked", "per_layer"):
        job = _job(tiny_path, f"rollout.decode_layers={mode}")
        report = pr.summarise(
            job,
            {n: pr._program_report(job, p, None) for n, p in job.programs.items()},
            skipped_compile=True,
        )
        layers[mode] = report["sampler_layout"]["decode_layers"]
    assert seen == [False, False, True]
    assert layers == {"auto": "stacked", "stacked": "stacked", "per_layer": "per_layer"}
    from jaxrl_llm.plan.cli import format_report

    assert "weights in the compute dtype per layer" in format_report(report)
    with pytest.raises(pr.PlanError, match="rollout.decode_layers must be one of"):
        _job(tiny_path, "rollout.decode_layers=unrolled")


@pytest.mark.skipif(not libtpu_available(), reason="needs libtpu (pip install 'jax[tpu]')")
def test_offloaded_layer_inputs_are_reported_as_host_memory(tiny_path):
    """``model.remat=offload`` on TPU (deviceless): the update keeps each layer's input of a
    micro-batch in pinned host memory, L x rows a chip x positions x D values, which the
    report counts apart from HBM and prints; the frozen forwards keep none."""
    from jaxrl_llm.plan.cli import format_report

    report = pr.plan_job(_cfg(tiny_path, "model.remat=offload"), V5E_4, devices=get_devices(V5E_4))
    programs = report["programs"]
    assert all(p["compiled"] for p in programs.values())
    seq = report["job"]["seq_len"]
    # 2 layers x (8 rows / 4 batch shards) x seq x 64 wide, f32.
    stack = 2 * 2 * seq * 64 * 4
    assert programs["update"]["host_bytes"] == stack
    assert programs["update"]["program_memory"]["host_temp_bytes"] == stack
    assert all(p["host_bytes"] == 0 for n, p in programs.items() if n != "update")
    assert report["host_per_chip_gib"] == stack / GiB
    line = next(x for x in format_report(report).splitlines() if x.startswith("host memory"))
    assert "update 0.00" in line and "logprobs" not in line
