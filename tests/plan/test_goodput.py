"""``plan``'s real-token and expected figures (``jaxrl_llm.plan.goodput``), by hand.

The length model (``rollout.expected_length_fraction`` or an earlier run's metrics), padded /
real / packed positions, the expected time at a chip generation's measured matmul efficiency,
goodput and MFU over real tokens; then one tiny plan whose report carries them all.
"""

import json
import math

import pytest

from jaxrl_llm.plan import goodput
from jaxrl_llm.plan.topology import libtpu_available
from tests.plan.test_cli import plan
from tests.plan.test_programs import TINY

needs_libtpu = pytest.mark.skipif(
    not libtpu_available(),
    reason="libtpu not importable (pip install 'jax[tpu]'): no deviceless TPU compiles",
)

# B = 8 rows of P = 16 padded prompt positions (p = 12 real) and T = 8 completion positions.
ROWS, P, T, PROMPT = 8, 16, 8, 12


def test_positions_by_hand():
    """f = 0.25: 2 completion tokens a row. Padded 8 x 24 = 192; real 8 x (12 + 2) = 112;
    packed ceil(112 / 24) = 5 rows of 24 = 120."""
    tokens = goodput.step_tokens(ROWS, P, T, PROMPT, 0.25)
    assert tokens.padded_positions == 192
    assert tokens.completion_tokens == 16
    assert tokens.real_tokens == 112
    assert tokens.packed_positions == 120
    assert tokens.length_source == "rollout.expected_length_fraction"
    assert tokens.real_share("update") == pytest.approx(14 / 24)
    assert tokens.real_share("rm_scores") == pytest.approx(14 / 24)
    assert tokens.real_share("decode_step") == 0.25
    assert tokens.real_share("prefill") == pytest.approx(12 / 16)
    assert tokens.real_share("reshard") == 1.0


def test_whole_rows_pack_exactly_and_unknown_lengths_count_full_rows():
    # f = 0.5 with full prompts: 8 x (16 + 4) = 160 real = 6.67 rows -> 7 rows = 168.
    assert goodput.step_tokens(ROWS, P, T, P, 0.5).packed_positions == 168
    # f = 1 with full prompts: every row is real; packing needs all 8 rows, no more.
    full = goodput.step_tokens(ROWS, P, T, P, None)
    assert full.fraction == 1.0 and "unknown" in full.length_source
    assert full.real_tokens == full.padded_positions == full.packed_positions == 192


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.01, math.nan])
def test_a_bad_fraction_is_refused(fraction):
    with pytest.raises(ValueError, match="expected_length_fraction must be in"):
        goodput.step_tokens(ROWS, P, T, PROMPT, fraction)


def test_the_efficiency_table_has_a_source_for_every_chip():
    for generation in ("v4", "v5e", "v5p", "v6e"):
        eff = goodput.matmul_efficiency(generation)
        assert 0 < eff.value <= 1 and "MaxText" in eff.source and "MFU" in eff.source
    assert goodput.matmul_efficiency("v5p").value == 0.6016


def test_an_unknown_chip_gets_no_number_and_a_reason():
    eff = goodput.matmul_efficiency("v7x")
    assert eff.value is None
    assert "unknown" in eff.source and "'v7x'" in eff.source
    assert goodput.expected_seconds({"compute_s": 1.0, "hbm_s": 0.5, "ici_s": 0.0}, None) is None


@pytest.mark.parametrize(
    ("compute", "hbm", "ici", "expected"),
    [
        (1.0, 0.2, 0.1, 2.0),  # compute-bound: compute / e
        (0.1, 1.0, 0.3, 1.0),  # HBM-bound: its roofline time stays
        (0.6, 1.0, 0.0, 1.2),  # HBM-bound at the roofline, derated compute takes over
        (0.1, 0.2, 0.9, 0.9),  # ICI-bound
        (0.5, None, None, 1.0),  # not compiled: compute only
    ],
)
def test_expected_time_derates_compute_only(compute, hbm, ici, expected):
    times = {"compute_s": compute, "hbm_s": hbm, "ici_s": ici}
    assert goodput.expected_seconds(times, 0.5) == pytest.approx(expected)


def test_goodput_and_mfu_over_real_tokens_by_hand():
    """Two programs on a 1e15 FLOP/s slice: the update (1 call, 6e12 model FLOPs) and a
    decode step (8 calls, 1e10 each). f = 0.25, p = 12: the update's real share is 14/24, the
    decode step's 1/4. Real model FLOPs 6e12 x 14/24 + 8e10 / 4 = 3.52e12; all of them
    6.08e12. Over a 10 s roofline step and a 20 s expected one."""
    tokens = goodput.step_tokens(ROWS, P, T, PROMPT, 0.25)
    programs = {
        "update": {"calls_per_step": 1, "model_flops": 6e12},
        "decode_step": {"calls_per_step": 8, "model_flops": 1e10},
    }
    eff = goodput.matmul_efficiency("v5e")
    out = goodput.goodput_report(programs, tokens, eff, 1e15, 10.0, 20.0)
    real = 6e12 * 14 / 24 + 8e10 / 4
    assert out["tokens"]["real_token_model_flops"] == pytest.approx(real) == pytest.approx(3.52e12)
    assert out["goodput_tokens_per_s"] == pytest.approx(112 / 20)
    assert out["goodput_tokens_per_s_roofline_bound"] == pytest.approx(112 / 10)
    assert out["mfu_real_tokens"] == pytest.approx(real / (1e15 * 20))
    assert out["mfu_real_tokens_roofline_bound"] == pytest.approx(real / (1e15 * 10))
    assert out["expected_step_mfu"] == pytest.approx(6.08e12 / (1e15 * 20))
    assert out["matmul_efficiency"] == {"generation": "v5e", "value": 0.577, "source": eff.source}
    assert out["tokens"]["packed_positions"] == 120
    # No expected step (an unknown chip): the expected figures are None, never a guess.
    unknown = goodput.goodput_report(programs, tokens, eff, 1e15, 10.0, None)
    assert unknown["goodput_tokens_per_s"] is None and unknown["mfu_real_tokens"] is None
    assert unknown["goodput_tokens_per_s_roofline_bound"] == pytest.approx(11.2)


def test_lengths_from_an_earlier_run(tmp_path):
    rows = [{"step": i, "completion_length_mean": float(i)} for i in range(1, 13)]
    rows.insert(3, {"step": 0, "eval/accuracy": 0.5})  # an eval row has no length
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fraction, source = goodput.lengths_from_run(str(tmp_path), max_new_tokens=15)
    # The last 10 steps: lengths 3..12, mean 7.5 of 15.
    assert fraction == pytest.approx(0.5)
    assert "7.5 tokens" in source and "metrics.jsonl" in source
    # Longer than the planned T: capped at 1.
    assert goodput.lengths_from_run(str(tmp_path), max_new_tokens=4)[0] == 1.0


def test_lengths_from_a_directory_without_them_is_refused(tmp_path):
    with pytest.raises(ValueError, match="metrics.jsonl does not exist"):
        goodput.lengths_from_run(str(tmp_path), 8)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.1}) + "\n")
    with pytest.raises(ValueError, match="no positive completion_length_mean"):
        goodput.lengths_from_run(str(tmp_path), 8)


# -- a whole plan ------------------------------------------------------------------------


# The tiny job is memory-bound at v5e's real efficiency (its expected times would equal the
# roofline's); at 2% the derated compute overtakes HBM and ICI in its programs.
LOW = (0.02, "test: a low efficiency, so that derated compute dominates")


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    """test_programs' tiny job (4 x 2 rows, 12 -> 16 prompt + 8 completion positions, fsdp 4
    on v5litepod-4) with f = 0.25 from an earlier run's metrics (2 tokens of 8), planned
    with v5e's matmul efficiency set to ``LOW``."""
    root = tmp_path_factory.mktemp("goodput")
    (root / "config.json").write_text(json.dumps(TINY))
    (root / "run").mkdir()
    (root / "run" / "metrics.jsonl").write_text(json.dumps({"completion_length_mean": 2.0}) + "\n")
    args = [
        "configs/grpo.yaml",
        "--topology",
        "v5litepod-4",
        f"model.architecture={root / 'config.json'}",
        "rollout.prompts_per_step=4",
        "rollout.group_size=2",
        "data.max_prompt_tokens=12",
        "rollout.max_new_tokens=8",
        "rollout.expected_length_fraction=0.9",  # --lengths-from wins
        "mesh.fsdp=4",
        "--lengths-from",
        str(root / "run"),
        "--json",
        str(root / "plan.json"),
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(goodput.MATMUL_EFFICIENCY, "v5e", LOW)
        code, out, err = plan(*args)
    assert code == 0, out + err
    return out, json.loads((root / "plan.json").read_text())


@needs_libtpu
def test_the_report_carries_every_figure_with_its_meaning(tiny_plan):
    out, report = tiny_plan
    for key in ("goodput_tokens_per_s", "mfu_real_tokens", "roofline_mfu_bound", "expected_mfu"):
        assert report[key] is not None and report[key] > 0, key
    assert report["matmul_efficiency"] == {"generation": "v5e", "value": LOW[0], "source": LOW[1]}
    tokens = report["tokens"]
    assert tokens["expected_length_fraction"] == 0.25 and "metrics.jsonl" in tokens["length_source"]
    assert (tokens["padded_positions"], tokens["real_tokens"], tokens["packed_positions"]) == (
        192,
        112,
        120,
    )
    assert "upper bound" in out and "expected" in out and "goodput" in out
    assert "MFU bound" in out and "exp. MFU" in out


@needs_libtpu
def test_the_report_figures_follow_from_the_programs(tiny_plan):
    report = tiny_plan[1]
    programs, e = report["programs"], report["matmul_efficiency"]["value"]
    for name, p in programs.items():
        t = p["times"]
        assert t["expected_s"] == pytest.approx(max(t["compute_s"] / e, t["hbm_s"], t["ici_s"]))
        assert t["expected_s"] >= t["step_s"], name
    # Derated compute takes over the update (memory- or ICI-bound at the roofline).
    update = programs["update"]["times"]
    assert update["bound"] != "compute"
    assert update["expected_s"] == pytest.approx(update["compute_s"] / e)
    assert update["expected_s"] > update["step_s"]
    expected = sum(p["calls_per_step"] * p["times"]["expected_s"] for p in programs.values())
    assert report["expected_step_s"] == pytest.approx(expected)
    assert report["goodput_tokens_per_s"] == pytest.approx(112 / expected)
    assert report["goodput_tokens_per_s_roofline_bound"] == pytest.approx(
        112 / report["est_step_s"]
    )
    update = programs["update"]
    assert report["expected_step_s"] > report["est_step_s"]
    peak = 4 * 197e12
    assert report["expected_mfu"] == pytest.approx(
        update["model_flops"] / (peak * update["times"]["expected_s"])
    )
    real = sum(
        p["calls_per_step"]
        * p["model_flops"]
        * {"prefill": 12 / 16, "decode_step": 0.25, "reshard": 1.0}.get(name, 14 / 24)
        for name, p in programs.items()
    )
    assert report["mfu_real_tokens"] == pytest.approx(real / (peak * expected))
    assert report["est_mfu"] == report["roofline_mfu_bound"] >= report["expected_mfu"]
