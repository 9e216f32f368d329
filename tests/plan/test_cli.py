"""``jaxrl-llm plan``: exit codes, the printed report and the JSON report.

The fitting plan (Qwen2.5-0.5B, GRPO, on a v5litepod-4) compiles its four programs once for
the module (about 1.5 minutes on 2 CPU cores); the other cases fail before compiling. The
resident parameter bytes are checked against the model's parameter count by hand; the
deviceless compiles need libtpu (skipped without it).
"""

import contextlib
import io
import json
import os
import pathlib
import subprocess
import sys

import pytest

from jaxrl_llm import cli
from jaxrl_llm.plan.topology import GiB, libtpu_available

needs_libtpu = pytest.mark.skipif(
    not libtpu_available(),
    reason="libtpu not importable (pip install 'jax[tpu]'): no deviceless TPU compiles",
)

SMALL_ROLLOUT = [
    "rollout.prompts_per_step=8",
    "rollout.group_size=4",
    "data.max_prompt_tokens=128",
    "rollout.max_new_tokens=256",
]
PROGRAMS = {"update", "logprobs", "ref_logprobs", "reshard", "prefill", "decode_step"}
# Qwen2.5-0.5B: 494,032,768 parameters; fsdp=4 splits every leaf but the q/k/v biases
# (24 layers x (896 + 128 + 128) = 27,648 values, split only by a tensor axis), which every
# chip holds whole: f32 bytes a chip = 4 x (P - 27648) / 4 + 4 x 27648.
QWEN_05B_PARAMS = 494_032_768
QWEN_05B_PARAM_BYTES_PER_CHIP = (QWEN_05B_PARAMS - 27_648) + 4 * 27_648


def plan(*args):
    """``(exit code, stdout, stderr)`` of ``jaxrl-llm plan ARGS``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["plan", *args])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def small_plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    code, out, err = plan(
        "configs/grpo.yaml",
        "--topology",
        "v5litepod-4",
        "model.architecture=qwen2.5-0.5b",
        *SMALL_ROLLOUT,
        "--json",
        str(path),
    )
    return code, out, err, json.loads(path.read_text())


@needs_libtpu
def test_small_job_fits_and_reports(small_plan):
    code, out, err, report = small_plan
    assert code == 0, out + err
    assert report["fits"] is True
    assert report["topology"] == "v5litepod-4" and report["chips"] == 4
    assert report["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert report["hbm_capacity_gib"] == 16.0
    assert 0 < report["hbm_per_chip_gib"] < report["hbm_usable_gib"] < report["hbm_capacity_gib"]
    assert 0 < report["roofline_mfu_bound"] <= 1  # 1: compute-bound, no remat
    assert report["est_mfu"] == report["roofline_mfu_bound"]  # the old name, kept
    assert report["est_step_s"] > 0 and report["est_decode_tokens_per_s"] > 0
    assert set(report["programs"]) == PROGRAMS
    assert all(p["compiled"] and p["fits"] for p in report["programs"].values())
    assert report["hints"] == []  # its stacked decode loop is at its roofline
    assert report["programs"]["ref_logprobs"]["shares_compile_of"] == "logprobs"
    assert report["job"]["rows"] == 32 and report["job"]["seq_len"] == 128 + 256


@needs_libtpu
def test_small_job_memory_by_hand(small_plan):
    report = small_plan[3]
    resident = report["resident_bytes"]
    assert resident["params"] == QWEN_05B_PARAM_BYTES_PER_CHIP
    # Two f32 moments of the same layout, plus AdamW's and the schedule's counts, the step
    # and the PRNG key: 4 + 4 + 4 + 8 bytes.
    assert resident["optimizer"] == 2 * QWEN_05B_PARAM_BYTES_PER_CHIP + 20
    assert resident["reference"] == QWEN_05B_PARAM_BYTES_PER_CHIP  # GRPO's frozen reference
    assert resident["params_compute"] == QWEN_05B_PARAM_BYTES_PER_CHIP // 2  # bf16 copy
    for name, program in report["programs"].items():
        parts = program["memory_bytes"]
        assert parts["parameters"] == resident["params"], name
        assert parts["optimizer_state"] == resident["optimizer"], name
        assert parts["reference"] == resident["reference"], name
        assert sum(parts.values()) == program["total_bytes"], name
    # The sampler's serving layout: 14 heads allow tensor 1 or 2 on 4 chips; the largest in
    # the host (4 chips) is 2, so data 2 x tensor 2. Its bf16 weights split by tensor but
    # for the norms (24 layers x 2 x 896 + 896 values, whole on every chip).
    assert report["sampler_layout"]["mesh"] == {"data": 2, "fsdp": 1, "tensor": 2}
    norms = 24 * 2 * 896 + 896
    served = 2 * ((QWEN_05B_PARAMS - norms) // 2 + norms)
    for name in ("prefill", "decode_step"):
        assert report["programs"][name]["memory_bytes"]["sampler_weights"] == served, name
    # Decode: cache of 24 layers x 2 (k, v) x 32 rows x 2 kv-heads x 384 slots x 64 x bf16
    # (rows over 2 shards, kv-heads over 2), plus the [32, 384] bool mask (rows over 2).
    kv = 24 * 2 * 32 * 2 * 384 * 64 * 2 // 4 + 32 * 384 // 2
    assert report["programs"]["decode_step"]["memory_bytes"]["kv_cache"] == kv
    assert report["hbm_per_chip_gib"] == pytest.approx(
        max(p["total_bytes"] for p in report["programs"].values()) / GiB
    )


@needs_libtpu
def test_small_job_times_add_up(small_plan):
    report = small_plan[3]
    programs = report["programs"]
    step = sum(p["calls_per_step"] * p["times"]["step_s"] for p in programs.values())
    assert report["est_step_s"] == pytest.approx(step)
    assert programs["decode_step"]["calls_per_step"] == 256
    decode = programs["decode_step"]["times"]
    assert report["est_decode_tokens_per_s"] == pytest.approx(32 / decode["step_s"])
    update = programs["update"]["times"]
    assert report["roofline_mfu_bound"] == update["roofline_mfu_bound"]
    # One decode step is one trip of the compiled decode loop, read from its body.
    assert programs["decode_step"]["hlo_of_one_loop_trip"] is True
    # On the serving layout the loop reads its weights in place: no all-gather of them per
    # token (the trainer's FSDP layout gathered all 0.99 GB of bf16 weights per step). What
    # it gathers is the sampler's f32 logits over the vocabulary (16 rows a shard x 151936
    # x 4 bytes); the step is HBM-bound near its floor.
    gathered = programs["decode_step"]["collective_bytes"]["all-gather"]
    assert gathered <= 16 * 151_936 * 4
    assert decode["bound"] == "hbm"
    assert report["est_decode_fraction_of_roofline"] >= 0.7
    assert report["est_decode_roofline_tokens_per_s"] == pytest.approx(
        32 / programs["decode_step"]["hbm_roofline_s"]
    )
    # The reshard runs once a step, moving the weights over ICI (no host round trip).
    assert programs["reshard"]["calls_per_step"] == 1
    assert report["sampler_layout"]["reshard_s"] == programs["reshard"]["times"]["step_s"] > 0
    assert sum(programs["reshard"]["collective_bytes"].values()) > 0
    for p in programs.values():
        times = p["times"]
        assert times["step_s"] == max(times["compute_s"], times["hbm_s"], times["ici_s"])


@needs_libtpu
def test_small_job_prints_a_table(small_plan):
    out = small_plan[1]
    assert "HBM per chip" in out and "estimated RL step" in out and "fits:" in out
    for name in PROGRAMS:
        assert name in out


@needs_libtpu
def test_a_job_that_cannot_fit_exits_1_and_says_what_to_change(tmp_path):
    path = tmp_path / "plan.json"
    code, out, err = plan(
        "configs/grpo.yaml",
        "--topology",
        "v5litepod-4",
        "model.architecture=qwen2.5-7b",
        *SMALL_ROLLOUT,
        "--json",
        str(path),
    )
    assert code == 1, out + err
    assert "DOES NOT FIT" in out
    assert "bigger topology" in out and "v5litepod-16" in out
    assert "trainer.optimizer_state_dtype=bfloat16" in out
    report = json.loads(path.read_text())
    assert report["fits"] is False and report["suggestions"]
    # 7.6 B f32 parameters, two moments and a reference over 4 chips: about 28 GiB a chip.
    assert report["hbm_per_chip_gib"] > 2 * report["hbm_capacity_gib"] * 0.8


@pytest.mark.parametrize(
    "args, message",
    [
        (["--topology", "v9-4", "model.architecture=qwen2.5-0.5b"], "unknown TPU topology"),
        (["--topology", "v5litepod-4", "model.architecure=x"], "did you mean 'model.architecture'"),
        (["--topology", "v5litepod-4"], "set model.architecture"),
        (["--topology", "v5litepod-4", "model.architecture=qwen9-1b"], "unknown architecture"),
        (["--topology", "v5litepod-4", "job=preference"], "RL jobs"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(args, message):
    code, out, err = plan("configs/grpo.yaml", *args)
    assert code == 2, out + err
    assert message in err and err.startswith("error:")


@needs_libtpu
def test_bad_input_found_after_libtpu_starts_prints_one_error_line_and_nothing_else():
    """The installed command in a process of its own, as a user runs it: 4 prompts do not
    divide over v5litepod-16's 16 chips, found once libtpu has built the topology's devices,
    whose initialisation off a TPU VM printed lines of C++ errors to stderr before it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_PLATFORMS", "TPU_"))}
    result = subprocess.run(
        [
            str(pathlib.Path(sys.executable).with_name("jaxrl-llm")),
            "plan",
            "configs/grpo.yaml",
            "--topology",
            "v5litepod-16",
            "model.architecture=qwen2.5-0.5b",
            "rollout.prompts_per_step=4",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "error: rollout.prompts_per_step (the prefill's rows)=4 does not divide into the 16 "
        "batch shards of the mesh {'data': 1, 'fsdp': 16, 'tensor': 1}"
    ]


def test_missing_topology_flag_is_a_usage_error():
    code, _, err = plan("configs/grpo.yaml", "model.architecture=qwen2.5-0.5b")
    assert code == 2 and "--topology" in err


def test_without_libtpu_exits_2_saying_how_to_install_it(monkeypatch):
    from jaxrl_llm.plan import _analysis as programs  # where build_job looks it up

    def no_libtpu(spec):
        raise RuntimeError("deviceless TPU compilation needs libtpu: pip install 'jax[tpu]'")

    monkeypatch.setattr(programs, "get_devices", no_libtpu)
    code, _, err = plan(
        "configs/grpo.yaml", "--topology", "v5litepod-4", "model.architecture=qwen2.5-0.5b"
    )
    assert code == 2 and "pip install 'jax[tpu]'" in err
