"""``jaxrl-llm plan`` for LoRA jobs (``model.lora``): what ``train`` runs, by hand.

A LoRA run trains the adapters only (f32 masters, AdamW's two moments over them), keeps the
frozen base in the compute dtype (also the reference: counted once), passes it to the update
as frozen parameters (no gradient), and, on a serving layout, keeps the base's sampler copy all
run while each step reshards the adapters. The byte counts below are worked out from the
logical-axis rules (an adapter factor is split over fsdp on the weight's ``embed`` axis only;
the rank axis is whole); the FLOPs formula is checked by hand and against XLA's own count.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

from jaxrl_llm.models import LoraSpec, forward, lora, param_shapes, unembed
from jaxrl_llm.parallel import vocab as vocab_parallel
from jaxrl_llm.plan import estimate as est
from jaxrl_llm.plan import flops, hlo
from jaxrl_llm.plan import programs as pr
from jaxrl_llm.plan.cli import format_report
from jaxrl_llm.plan.topology import libtpu_available, resolve_topology
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.rl.config import TrainConfig
from tests.plan.test_flops import ONE_LAYER  # XLA counts a while body once: one layer
from tests.plan.test_flops import TINY as FLOPS_TINY
from tests.plan.test_programs import TINY, TINY_PARAMS  # every dimension divides 4

V5E_4 = resolve_topology("v5litepod-4")
needs_libtpu = pytest.mark.skipif(
    not libtpu_available(),
    reason="libtpu not importable (pip install 'jax[tpu]'): no deviceless TPU compiles",
)

# Rank-4 adapters a layer, elements a chip on fsdp 4 (PARAM_RULES: embed -> fsdp; heads and
# mlp -> tensor, of size 1 here; the rank axis whole):
#   A of q, k, v, gate, up [D=64, r] and B of o, down [r, D=64]: split by 4, 7 x 64 = 448;
#   B of q [r, 4, 16] 256, of k and v [r, 2, 16] 128 each, A of o [4, 16, r] 256, B of gate
#   and up [r, 128] 512 each, A of down [128, r] 512: whole, 2304.
ADAPTER_ELEMENTS_PER_CHIP = 2 * (448 + 2304)
# All adapters, whole: per layer r (in + out) summed over the seven projections:
#   4 ((64 + 64) + 2 (64 + 32) + (64 + 64) + 3 (64 + 128)) = 4096; two layers.
ADAPTER_PARAMS = 2 * 4096
# AdamW's count, the schedule's count, the state's step (int32 each) and PRNG key (2 x uint32).
SCALARS = 4 + 4 + 4 + 8
# The base's serving copy on data 2 x tensor 2, bf16: split by tensor but for the norms (two a
# layer and the final one, 64 each), which every chip holds whole.
NORMS = 2 * 2 * 64 + 64
SERVING_BASE = 2 * ((TINY_PARAMS - NORMS) // 2 + NORMS)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def _cfg(model_path, *overrides, rank=4):
    """The tiny job of test_programs (4 x 2 rows, 16 + 8 tokens, fsdp 4), LoRA of ``rank``
    (None: full training)."""
    return load_config(
        TrainConfig,
        None,
        [
            f"model.architecture={model_path}",
            "rollout.prompts_per_step=4",
            "rollout.group_size=2",
            "data.max_prompt_tokens=12",
            "rollout.max_new_tokens=8",
            "mesh.fsdp=4",
            *([f"model.lora.rank={rank}"] if rank else []),
            *overrides,
        ],
    )


def _job(model_path, *overrides, rank=4):
    return pr.build_job(_cfg(model_path, *overrides, rank=rank), V5E_4, devices=jax.devices()[:4])


@pytest.fixture(scope="module")
def compiled(tiny_path):
    """The tiny LoRA job's programs compiled on 4 CPU devices: ``(job, outcomes)``."""
    job = _job(tiny_path)
    return job, pr.compile_job(job)


# -- the resident state ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, adapter_bytes, base_bytes, serving_base",
    [
        # f32 adapters, bf16 base over fsdp 4; the serving copy (bf16, tensor 2) kept all run.
        ((), 4, 2 * TINY_PARAMS // 4, SERVING_BASE),
        # bf16 adapters: half; the base is in the compute dtype whatever param_dtype says.
        (("model.param_dtype=bfloat16",), 2, 2 * TINY_PARAMS // 4, SERVING_BASE),
        # Decoding on the trainer's layout: no serving copy of the base.
        (("rollout.tensor_parallel=trainer",), 4, 2 * TINY_PARAMS // 4, 0),
        # f32 compute: the base is kept in f32 (and served in f32).
        (("model.compute_dtype=float32",), 4, 4 * TINY_PARAMS // 4, 2 * SERVING_BASE),
    ],
)
def test_lora_state_bytes_by_hand(tiny_path, overrides, adapter_bytes, base_bytes, serving_base):
    state = _job(tiny_path, *overrides).state
    adapters = ADAPTER_ELEMENTS_PER_CHIP * adapter_bytes
    assert state.params == adapters
    # Two moments of the adapters' layout (f32: optimizer_state_dtype), plus the scalars.
    assert state.optimizer == 2 * ADAPTER_ELEMENTS_PER_CHIP * 4 + SCALARS
    assert state.base == base_bytes
    assert state.reference == 0  # the base is the reference: counted once
    assert state.serving_base == serving_base
    # The adapters cast to the compute dtype for the decode loop (none when already in it).
    compute = 4 if "model.compute_dtype=float32" in overrides else 2
    assert state.params_compute == (0 if adapter_bytes == compute else adapters // 2)
    assert state.resident == adapters + state.optimizer + base_bytes + serving_base


@pytest.mark.parametrize("overrides", [(), ("rollout.tensor_parallel=trainer",)])
def test_every_lora_program_counts_the_resident_state_once(tiny_path, overrides):
    """Adapters, their optimizer state and the frozen base are alive during every program, as
    its arguments or around it; no reference part (the base is it); the base's serving copy
    (a serving layout) in every program, the adapters' serving copy in the sampler's only."""
    job = _job(tiny_path, *overrides)
    state = job.state
    sampler = {"reshard", "prefill", "decode_step"}
    served_adapters = 0
    if "reshard" in job.programs:
        served_adapters = job.programs["reshard"].inner_parts["sampler_weights"]
        assert served_adapters == 11776  # test_lora_programs_by_hand
    for name, program in job.programs.items():
        alive = dict(program.resident)
        for part, nbytes in program.argument_parts.items():
            alive[part] = alive.get(part, 0) + nbytes
        for part, nbytes in program.inner_parts.items():
            alive[part] = alive.get(part, 0) + nbytes
        assert alive["parameters"] == state.params, name
        assert alive["optimizer_state"] == state.optimizer, name
        assert alive["frozen_base"] == state.base, name
        assert alive.get("reference", 0) == 0, name
        if job.serving.is_trainer_layout:
            # The decode loop's compute-dtype copy of the adapters only (the base is in it).
            copy = state.params_compute if name in ("prefill", "decode_step") else 0
            assert alive.get("sampler_weights", 0) == copy, name
        else:
            extra = served_adapters if name in sampler else 0
            assert alive["sampler_weights"] == state.serving_base + extra, name


def test_lora_programs_by_hand(tiny_path):
    job = _job(tiny_path)
    programs = job.programs
    assert set(programs) == {
        "update",
        "logprobs",
        "ref_logprobs",
        "reshard_base",
        "reshard",
        "prefill",
        "decode_step",
    }
    # The reference forward runs on the base alone, its own program (not the policy's).
    ref = programs["ref_logprobs"]
    assert ref.argument_parts == {"frozen_base": job.state.base} and ref.same_as is None
    # The base moves to the serving layout once a run; the adapters every step (bf16 on data
    # 2 x tensor 2: A of q, k, v, gate, up [64, 4] whole; B of q [4, 4, 16], k and v
    # [4, 2, 16], A of o [4, 16, 4], B of gate and up [4, 128], A of down [128, 4] split by
    # tensor 2; B of o and down [4, 64] whole): 2 layers x 2944 elements x 2 bytes.
    assert programs["reshard_base"].calls_per_step == 0
    assert programs["reshard"].calls_per_step == 1
    assert programs["reshard"].argument_parts == {"parameters": job.state.params}
    assert programs["reshard"].inner_parts == {"sampler_weights": 2 * 2 * 2944}
    assert programs["reshard_base"].inner_parts == {"sampler_weights": SERVING_BASE}
    # FLOPs: the update is plan.flops' LoRA step, the reference forward the base's.
    shape, config = job.shape, job.model_config
    assert config.lora == LoraSpec(rank=4, alpha=32.0)
    assert flops.adapter_params(config) == ADAPTER_PARAMS
    base = lora.base_config(config)
    assert ref.flops == flops.forward_flops(base, shape.rows, shape.seq_len, logits_positions=8)
    tokens = shape.rows * shape.seq_len
    assert programs["logprobs"].flops == ref.flops + 2 * ADAPTER_PARAMS * tokens
    assert programs["update"].model_flops == flops.train_flops(
        config, shape.minibatch_rows, shape.seq_len, logits_positions=8
    )


def test_lora_compile_matches_the_accounting(compiled):
    """Compiled on CPU devices: each program's arguments are the parts the accounting names
    plus its inputs. The update takes the adapters' state and the frozen base (not donated),
    the reference forward the base alone, the reshards the adapters or the base."""
    job, outcomes = compiled
    inputs = {
        "update": 320 - 8 + 64,  # test_programs: the minibatch less its unread rewards
        "logprobs": 240,
        "ref_logprobs": 240,
        "reshard_base": 0,
        "reshard": 0,
        "prefill": 164,
        "decode_step": 2400,
    }
    for name, program in job.programs.items():
        memory = est.memory_breakdown(outcomes[name].compiled)
        known = sum(program.argument_parts.values())
        assert memory.argument_bytes - known == inputs[name], name
        parts = pr.memory_parts(program, memory)
        assert sum(parts.values()) == memory.total_bytes + sum(program.resident.values())
    # Only the state is donated: the outputs aliased to arguments are the adapters' state.
    update = est.memory_breakdown(outcomes["update"].compiled)
    assert update.alias_bytes <= job.state.params + job.state.optimizer
    report = pr.summarise(
        job,
        {n: pr._program_report(job, p, outcomes[n]) for n, p in job.programs.items()},
        skipped_compile=False,
    )
    assert report["fits"] and report["model"]["lora"]["adapter_params"] == ADAPTER_PARAMS
    assert report["sampler_layout"]["reshard_moves"] == "adapters"
    assert report["step_breakdown_s"]["reshard_base"] == 0.0  # once a run, not a step
    text = format_report(report)
    assert "LoRA: rank 4" in text and "reshard of the LoRA adapters" in text
    json.dumps(report)


# The targeted weights (all seven) a layer: q, o [64, 4 x 16], k, v [64, 2 x 16], gate, up,
# down 64 x 128: 2 x 4096 + 2 x 2048 + 3 x 8192 = 36864; on data 2 x tensor 2 each is split by
# tensor (heads, MLP), bf16: 2 layers x 36864 / 2 x 2 bytes.
MERGED_BYTES = 2 * 36864 // 2 * 2


def test_the_merged_sampler_is_planned_as_train_runs_it(tiny_path):
    """``model.lora.sampler=merged``: a ``merge`` program once a step (its output the merged
    copy of the targeted weights, 2 r N_W FLOPs for the A B products), and the sampler's
    prefill and decode are the base model's (no adapter FLOPs), with that copy alive beside
    the base's serving copy. ``auto`` picks it from T > 2 N_W / N_A = 2 x 36864 / 4096 = 18
    decode steps on (the job decodes 8: adapters on the fly)."""
    on_the_fly = _job(tiny_path)
    job = _job(tiny_path, "model.lora.sampler=merged")
    assert "merge" not in on_the_fly.programs and "merge" in job.programs
    assert "merge" in _job(tiny_path, "rollout.max_new_tokens=19").programs
    assert "merge" not in _job(tiny_path, "rollout.max_new_tokens=18").programs
    merge = job.programs["merge"]
    served_adapters = 11776  # test_lora_programs_by_hand
    assert merge.calls_per_step == 1
    assert merge.inner_parts == {"sampler_weights": MERGED_BYTES}
    assert merge.argument_parts == {"sampler_weights": SERVING_BASE + served_adapters}
    assert merge.flops == 2 * 4 * 2 * 36864
    base = lora.base_config(job.model_config)
    shape = job.shape
    decode = job.programs["decode_step"]
    assert decode.flops == flops.decode_flops(base, shape.rows, shape.seq_len)
    assert on_the_fly.programs["decode_step"].flops > decode.flops
    weights = SERVING_BASE + served_adapters + MERGED_BYTES
    assert decode.argument_parts["sampler_weights"] == weights
    compiled = merge.lowered.compile()  # the merge program runs on the serving layout
    assert est.memory_breakdown(compiled).output_bytes >= MERGED_BYTES


def _gradient_reductions(program) -> list[hlo.CollectiveOp]:
    """The all-reduces and reduce-scatters outside the vocabulary-parallel tables (whose
    per-position sums and hidden-state reduce-scatters are activations, not gradients)."""
    module = hlo.parse_hlo_module(program.lowered.compile().as_text())
    return [
        op
        for op in hlo.collective_ops(module)
        if op.kind in ("all-reduce", "reduce-scatter") and not vocab_parallel.in_scope(op.op_name)
    ]


def test_lora_update_reduces_adapter_gradients_only(tiny_path, compiled):
    """On fsdp 4 (XLA:CPU reduces a gradient with an all-reduce, then slices it) the LoRA
    update reduces the adapters' f32 gradients and a few scalars, nothing base-sized; the full
    update, as a control, reduces every parameter's gradient but the vocabulary tables' (on an
    fsdp-only mesh they are vocabulary-parallel: each chip's table gradient is its own)."""
    job, _ = compiled
    lora_ops = _gradient_reductions(job.programs["update"])
    smallest_base_weight = 2 * 64 * 2 * 16 * 4  # wk's f32 gradient, [L, D, K, H]
    assert max(op.bytes for op in lora_ops) < smallest_base_weight
    assert sum(op.total_bytes for op in lora_ops) <= ADAPTER_PARAMS * 4 + 512
    full = _job(tiny_path, rank=None)
    full_ops = _gradient_reductions(full.programs["update"])
    tables = 2 * TINY["vocab_size"] * TINY["hidden_size"]  # untied embedding + unembedding
    assert sum(op.total_bytes for op in full_ops) >= (TINY_PARAMS - tables) * 4


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("objective.name=ppo", "critic.init=random"), "critic.init=random with model.lora"),
        (("reference.mode=ema",), "reference.mode='ema' with model.lora"),
        (("model.lora.rank=0",), "model.lora rank"),
        (("model.lora.targets=[q,x]",), "model.lora targets"),
    ],
)
def test_lora_refusals_are_named(tiny_path, overrides, message):
    with pytest.raises(pr.PlanError, match=message):
        _job(tiny_path, *overrides)


def test_the_cli_refuses_a_lora_critic_it_cannot_train_by_name(capsys):
    from jaxrl_llm import cli

    code = cli.main(
        [
            "plan",
            "configs/ppo.yaml",
            "--topology",
            "v5litepod-4",
            "model.architecture=qwen2.5-0.5b",
            "model.lora.rank=8",
            "critic.init=random",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: critic.init=random with model.lora")


def test_lora_suggestions_name_the_serving_copy_not_the_masters(tiny_path):
    job = _job(tiny_path)
    # Pretend a chip of 100 KiB: the tiny LoRA state (about 0.22 MiB a chip) cannot fit.
    spec = dataclasses.replace(V5E_4, usable_hbm_bytes_per_chip=100 * 1024)
    job = dataclasses.replace(job, spec=spec)
    programs = {
        n: {"total_bytes": 10**9, "compiled": False, "memory_bytes": {"kv_cache": 0}}
        for n in job.programs
    }
    text = "\n".join(pr.suggestions(job, programs, skipped_compile=True))
    assert "frozen base" in text  # the resident state's list names it
    assert "rollout.tensor_parallel=trainer" in text
    # Halving the adapters' masters or moments saves next to nothing: not suggested.
    assert "model.param_dtype=bfloat16" not in text
    assert "trainer.optimizer_state_dtype=bfloat16" not in text


def test_a_peft_adapter_directory_is_refused_with_what_to_set(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    cfg = load_config(TrainConfig, None, [f"model.path={tmp_path}"])
    with pytest.raises(pr.PlanError, match="model.lora.rank"):
        pr.plan_model_config(cfg.model)


# -- FLOPs ---------------------------------------------------------------------------------------

# plan/test_flops.py's TINY: V=10, D=8, F=16, L=2, N=2, K=1, H=4; rank-2 adapters on all seven.
SMALL = dataclasses.replace(FLOPS_TINY, lora=LoraSpec(rank=2, alpha=4.0))


def test_lora_flops_by_hand():
    # Adapters a layer, r (in + out): q 2 (8 + 8) = 32, k and v 2 (8 + 4) = 24, o 32, gate and
    # up 2 (8 + 16) = 48, down 2 (16 + 8) = 48: 256; two layers.
    assert flops.adapter_params(SMALL) == 512
    assert sum(x.size for x in jax.tree.leaves(lora.adapter_shapes(SMALL))) == 512
    # B=1, S=3: the base's forward (test_flops: projections 2304, attention 384, MLP 4608,
    # unembedding 480 = 7776) plus the adapters' 2 x 512 a token.
    base = {"projections": 2304, "attention": 384, "mlp": 4608, "unembed": 480}
    assert flops.forward_flops_breakdown(SMALL, 1, 3) == {**base, "adapters": 3 * 2 * 512}
    assert flops.forward_flops(SMALL, 1, 3) == 7776 + 3072
    # Training: forward 7776 + 3072; backward: activation gradients of the frozen matmuls
    # (2304 + 4608 + 480 = 7392) and of attention (2 x 384), no weight gradient of the base,
    # and the adapters' backward (2 x 3072).
    forward = 7776 + 3072
    backward = 7392 + 2 * 384 + 2 * 3072
    assert flops.train_flops(SMALL, 1, 3) == forward + backward == 25152
    # Remat: the layers' forward again (10848 - 480 unembedding) less the down projection
    # (2 D F = 256 a token and layer, 6 of them) and the down adapter's (x A) B (2 r D = 32,
    # 6 of them).
    assert flops.train_flops(SMALL, 1, 3, remat="layer") == 25152 + (10848 - 480) - 6 * 256 - 6 * 32
    # Adapters on q and v only: 2 layers x (32 + 24) = 112; no down adapter to drop.
    qv = dataclasses.replace(SMALL, lora=LoraSpec(rank=2, alpha=4.0, targets=("q", "v")))
    assert flops.adapter_params(qv) == 112
    assert flops.train_flops(qv, 1, 3) == (7776 + 672) + (7392 + 768 + 2 * 672)
    assert flops.train_flops(qv, 1, 3, remat="layer") == flops.train_flops(qv, 1, 3) + (
        7776 + 672 - 480 - 6 * 256
    )
    # The base model (lora.base_config) is full training again.
    assert flops.train_flops(lora.base_config(SMALL), 1, 3) == 3 * 7776


@pytest.mark.parametrize(
    "targets, remat",
    [
        (("q", "k", "v", "o", "gate", "up", "down"), "none"),
        (("q", "k", "v", "o", "gate", "up", "down"), "layer"),
        (("q", "v"), "layer"),
        (("down",), "layer"),
    ],
)
def test_lora_train_flops_match_xla_cost_analysis(targets, remat):
    """The gradient with respect to the adapters only, the base passed frozen, against
    ``train_flops``. On CPU the layers are unrolled, so XLA drops the first layer's input
    gradient, which TPU's scanned layers compute every trip; a trained scale on the embedding
    keeps it (its own cost: a scatter and elementwise work, no matmul)."""
    config = dataclasses.replace(ONE_LAYER, lora=LoraSpec(rank=8, alpha=16.0, targets=targets))
    batch, seq = 2, 64

    def loss(trained, base, tokens):
        adapters, scale = trained
        params = lora.combine({**base, "embed": base["embed"] * scale}, adapters)
        hidden, _ = forward(params, config, tokens, remat=remat)
        return jnp.square(unembed(params, config, hidden)).sum()

    base, adapters = lora.split(param_shapes(config))
    trained = (adapters, jax.ShapeDtypeStruct((), jnp.float32))
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    xla = jax.jit(jax.grad(loss)).lower(trained, base, tokens).compile().cost_analysis()["flops"]
    analytic = flops.train_flops(config, batch, seq, remat=remat, causal=False)
    # XLA adds the elementwise work: under 2% here, never less than the matmuls.
    assert 1.0 <= xla / analytic < 1.02, (xla, analytic)


# -- deviceless TPU ------------------------------------------------------------------------------


# A wider Llama (13.1 M parameters, 8.4 M of them the two vocabulary tables), so that the state
# outweighs the tiny batch's activations and a base weight's gradient the adapters'.
WIDE = {
    **TINY,
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
}


@pytest.fixture(scope="module")
def wide_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("wide") / "config.json"
    path.write_text(json.dumps(WIDE))
    return str(path)


@needs_libtpu
def test_lora_plan_on_tpu_needs_less_hbm_and_reduces_no_base_gradient(wide_path):
    """The same model and job planned for a v5litepod-4 (deviceless) with and without rank-4
    LoRA: the LoRA plan compiles and fits, every program of it below the full update alone;
    its update's gradient reductions (XLA:TPU's reduce-scatters and all-reduces) carry at
    most the adapters' f32 gradients (a few scalars besides), where the full update's carry
    the base's (megabytes)."""
    from jaxrl_llm.plan.topology import try_compile

    report = pr.plan_job(_cfg(wide_path), V5E_4)
    assert report["fits"] and all(p["compiled"] for p in report["programs"].values())
    # Adapters a layer, r (in + out): 4 (2 (512 + 512) + 2 (512 + 256) + 3 (512 + 1024)).
    adapter_bytes = 2 * 4 * (2 * 1024 + 2 * 768 + 3 * 1536) * 4
    assert report["model"]["lora"]["adapter_params"] * 4 == adapter_bytes
    lora_update = report["programs"]["update"]["collectives"]
    reduced = [c["bytes"] for c in lora_update if c["kind"] in ("reduce-scatter", "all-reduce")]
    assert sum(reduced) <= adapter_bytes + 1024

    full = pr.build_job(_cfg(wide_path, rank=None), V5E_4)
    program = full.programs["update"]
    full_update = pr._program_report(full, program, try_compile(program.lowered))
    full_reduced = full_update["collective_bytes"]
    assert full_reduced["reduce-scatter"] + full_reduced["all-reduce"] > 10 * adapter_bytes
    # The base in bf16 (13.1 MB over 4 chips) and its serving copy against f32 parameters,
    # two moments and the reference (16 bytes a parameter over 4 chips).
    assert report["hbm_per_chip_gib"] < full_update["total_gib"] / 2
