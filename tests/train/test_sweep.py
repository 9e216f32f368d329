"""``jaxrl-llm sweep``: the variant table, its flags, the report from hand-written runs
(hand-checked means, t-intervals, steps to threshold, spike counts), reuse of finished runs,
bad input, and one tiny real sweep."""

from __future__ import annotations

import json
import math
import pathlib
import re
import subprocess

import pytest

from jaxrl_llm import cli, objectives
from jaxrl_llm.train import sweep, sweep_report
from tests.train import helpers

CONFIG = str(helpers.CONFIGS / "carry_slips.yaml")


# -- variants and flags ------------------------------------------------------------------------


def test_a_variant_is_a_preset_and_its_stabilisers_overrides():
    assert sweep.parse_variant("grpo") == sweep.Variant("grpo", "grpo", ())
    variant = sweep.parse_variant("dapo+m2po+top_entropy")
    assert variant.preset == "dapo"
    assert dict(variant.overrides) == {"m2_threshold": 0.04, "top_entropy_quantile": 0.2}
    assert variant.argv() == [
        "objective.name=dapo",
        "objective.overrides.m2_threshold=0.04",
        "objective.overrides.top_entropy_quantile=0.2",
    ]
    assert sweep.parse_variant("grpo+kl_bias_correction").argv()[-1] == (
        "objective.overrides.kl_bias_correction=true"
    )


def test_every_default_variant_builds_a_valid_objective():
    assert len(sweep.BAKE_OFF) >= 12
    assert {f"grpo+{name}" for name in sweep.STABILISERS} <= set(sweep.BAKE_OFF)
    for name in sweep.BAKE_OFF:
        variant = sweep.parse_variant(name)
        built = objectives.make(variant.preset, **dict(variant.overrides))
        for key, value in variant.overrides:
            assert built.value_of(key) == value, (name, key)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("grpo+nope", "unknown stabiliser 'nope' in 'grpo+nope'"),
        ("nope", "unknown preset 'nope'"),
        ("grpo+kl_cov+clip_cov", "sets objective field 'surrogate' twice"),
    ],
)
def test_a_bad_variant_is_named(name, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        sweep.parse_variant(name)


def test_seeds_and_lists_parse_or_say_why():
    assert sweep.parse_seeds("0, 1,2") == (0, 1, 2)
    assert sweep.parse_list("grpo,dapo", "--presets") == ["grpo", "dapo"]
    with pytest.raises(ValueError, match=r"--seeds: '-1' is not a non-negative integer"):
        sweep.parse_seeds("0,-1")
    with pytest.raises(ValueError, match="--presets: expected a comma-separated list"):
        sweep.parse_list("grpo,,dapo", "--presets")
    with pytest.raises(ValueError, match="--seeds: 1 given twice"):
        sweep.parse_seeds("1,1")


def test_a_cell_trains_the_config_with_its_variant_seed_and_directory(tmp_path):
    variant = sweep.parse_variant("grpo+m2po")
    argv = sweep.cell_argv("c.yaml", variant, 2, tmp_path, ["trainer.max_steps=5"])
    where = tmp_path / "grpo+m2po" / "seed2"
    assert argv == [
        "c.yaml",
        "trainer.max_steps=5",
        "objective.name=grpo",
        "objective.overrides.m2_threshold=0.04",
        "seed=2",
        f"run_dir={where}",
        "resume=true",
        "logging.progress=false",
    ]
    assert sweep.run_dir(tmp_path, "grpo+m2po", 2) == where


# -- the report from hand-written runs ---------------------------------------------------------


def _write_run(run_dir: pathlib.Path, before, after, rows, steps) -> pathlib.Path:
    run_dir.mkdir(parents=True)
    summary = {
        "job": "rl",
        "steps": steps,
        "eval_before_rl": {"accuracy": before},
        "eval_after_rl": {"accuracy": after},
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def _rows(evals, grads, entropy, clips, times):
    rows = []
    for i, (g, h, c, t) in enumerate(zip(grads, entropy, clips, times, strict=True)):
        row = {"step": i + 1, "grad_norm": g, "entropy": h, "time/step": t}
        if c is not None:
            row["clip_frac"] = c
        if i + 1 in evals:
            row["eval/accuracy"] = evals[i + 1]
        rows.append(row)
    return rows


@pytest.fixture
def hand_runs(tmp_path):
    """Three seeds of one variant, six steps each, evaluated at steps 2 and 4 (and after)."""
    seed0 = _rows(
        {2: 0.5, 4: 0.62},
        grads=[1.0, 1.0, 1.0, 6.0, 1.0, 1.0],  # median 1: one step above 5x
        entropy=[2.0, 1.5, 1.0, 1.0, 1.0, 0.5],
        clips=[0.1, 0.2, 0.3, 0.0, 0.0, 0.0],
        times=[10.0, 1.0, 2.0, 3.0, 4.0, 5.0],
    )
    for row, cov in zip(seed0, [0.0, 0.0, 0.0, 0.0, 0.0, 0.06], strict=True):
        row["cov_frac"] = cov  # KL-Cov's selected share: mean 0.01
    # A resumed run repeats step 4: its last row wins (0.65 would reach the threshold).
    seed1 = _rows(
        {2: 0.55, 4: 0.65},
        grads=[1.0, 2.0, 3.0, 4.0, 5.0, 100.0],  # median 3.5: 100 > 17.5 is one spike
        entropy=[1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        clips=[0.0, 0.0, 0.0, 0.0, 0.0, 0.6],
        times=[1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    )
    seed1.insert(4, {**seed1[3], "eval/accuracy": 0.6})
    seed2 = _rows(
        {2: 0.3},
        grads=[1.0] * 6,
        entropy=[1.0] * 6,
        clips=[None] * 6,  # a surrogate that reports no clip fraction
        times=[2.0] * 6,
    )
    return {
        0: _write_run(tmp_path / "v" / "seed0", 0.40, 0.70, seed0, 6),
        1: _write_run(tmp_path / "v" / "seed1", 0.50, 0.60, seed1, 6),
        2: _write_run(tmp_path / "v" / "seed2", 0.10, 0.30, seed2, 6),
    }


def test_run_stats_are_the_hand_checked_values(hand_runs):
    report = sweep_report.build_report({"v": hand_runs}, threshold=20.0)
    seeds = report["variants"]["v"]["seeds"]
    s0, s1, s2 = seeds[0], seeds[1], seeds[2]
    assert s0["gain"] == pytest.approx(30.0)
    assert s0["steps_to_threshold"] == 4  # 0.62 >= 0.40 + 0.20 first at step 4
    assert s0["step_time"] == pytest.approx(3.5)  # median of 10,1,2,3,4,5
    assert s0["entropy_ratio"] == pytest.approx(0.25)
    assert s0["grad_spikes"] == 1
    assert s0["clip_frac"] == pytest.approx(0.1)
    assert s0["curve"] == [[0, 40.0], [2, 50.0], [4, 62.0], [6, 70.0]]
    assert s1["gain"] == pytest.approx(10.0)
    assert s1["steps_to_threshold"] is None  # 0.60 < 0.70, the repeated row's 0.65 overridden
    assert s1["grad_spikes"] == 1
    assert s1["clip_frac"] == pytest.approx(0.1)
    assert s2["gain"] == pytest.approx(20.0)
    assert s2["steps_to_threshold"] == 2  # 0.30 >= 0.10 + 0.20 exactly
    assert s2["clip_frac"] is None
    assert s0["fractions"] == {"cov_frac": pytest.approx(0.01)}
    assert s1["fractions"] == {}


def test_variant_row_is_the_mean_with_a_student_t_interval(hand_runs):
    row = sweep_report.build_report({"v": hand_runs}, threshold=20.0)["variants"]["v"]
    # gains 30, 10, 20: mean 20, s = 10, t(0.975, 2) = 4.302653 (tables), half = t*s/sqrt(3)
    half = 4.302653 * 10.0 / math.sqrt(3.0)
    assert row["gain"] == pytest.approx(20.0)
    assert row["gain_low"] == pytest.approx(20.0 - half, rel=1e-6)
    assert row["gain_high"] == pytest.approx(20.0 + half, rel=1e-6)
    assert row["steps_to_threshold"] == 3  # median of steps 4 and 2 (seed 1 never reached)
    assert row["reached"] == 2
    assert row["step_time"] == pytest.approx(2.0)  # median of 3.5, 1, 2
    assert row["entropy_ratio"] == pytest.approx(0.75)  # mean of 0.25, 1, 1
    assert row["grad_spikes"] == pytest.approx(2 / 3)
    assert row["clip_frac"] == pytest.approx(0.1)  # mean over the seeds that report it
    assert row["before"] == pytest.approx(100 / 3)
    assert (row["runs"], row["failed"]) == (3, 0)


def test_t_quantiles_are_the_tables():
    assert sweep_report.t_quantile(0.975, 1) == pytest.approx(12.7062, rel=1e-5)
    assert sweep_report.t_quantile(0.975, 4) == pytest.approx(2.7764, rel=1e-4)
    assert sweep_report.mean_interval([5.0]) == (5.0, None, None)
    with pytest.raises(ValueError, match="at least one value"):
        sweep_report.mean_interval([])


def test_a_failed_run_is_counted_not_averaged(hand_runs, tmp_path):
    cells = {"v": {**hand_runs, 3: tmp_path / "v" / "seed3"}, "dead": {0: tmp_path / "no"}}
    report = sweep_report.build_report(cells, threshold=20.0)
    assert report["variants"]["v"]["failed"] == 1
    assert report["variants"]["v"]["gain"] == pytest.approx(20.0)
    assert report["variants"]["dead"] == {"runs": 1, "failed": 1, "seeds": {0: None}}
    table = sweep_report.markdown_table(report)
    assert "| `v` | 3/4 | 33.3 | 53.3 | +20.0 [-4.8, +44.8] | 3 (2/3) | 2.000 |" in table
    assert "| 0.100 | cov 0.010 |" in table  # the mean over the seeds reporting them
    assert "| `dead` | 0/1 (all failed) |" in table


def test_the_mean_curve_keeps_the_shared_steps():
    curves = [[[0, 10.0], [2, 30.0], [4, 50.0]], [[0, 20.0], [4, 40.0]]]
    assert sweep_report.mean_curve(curves) == ([0, 4], [15.0, 45.0], [10.0, 40.0], [20.0, 50.0])


def test_the_report_writes_table_json_and_plot(hand_runs, tmp_path):
    out = tmp_path / "out"
    sweep_report.write_report(out, {"v": hand_runs}, threshold=20.0)
    assert (out / "sweep.md").read_text().startswith("| variant |")
    assert json.loads((out / "sweep.json").read_text())["interval"] == "student-t"
    assert (out / "sweep_accuracy.png").read_bytes()[:4] == b"\x89PNG"


# -- running cells: reuse, failure, bad input --------------------------------------------------


def _finish(where: pathlib.Path) -> None:
    _write_run(where, 0.1, 0.2, [], 2)


def test_a_finished_run_is_reused_and_an_unfinished_one_trained(tmp_path, monkeypatch):
    variants = [sweep.parse_variant("grpo")]
    calls = []

    def fake_call(argv, **_):
        calls.append(argv)
        where = pathlib.Path(next(a for a in argv if a.startswith("run_dir=")).split("=", 1)[1])
        _finish(where)
        return 0

    monkeypatch.setattr(subprocess, "call", fake_call)
    first = sweep.sweep("c.yaml", variants, [0, 1], tmp_path, ["x=1"])
    assert [o.status for o in first] == ["trained", "trained"]
    assert len(calls) == 2 and calls[0][1:4] == ["-m", "jaxrl_llm.cli", "train"]
    again = sweep.sweep("c.yaml", variants, [0, 1], tmp_path, ["x=1"])
    assert [o.status for o in again] == ["reused", "reused"]
    assert len(calls) == 2  # nothing retrained
    # The same runs under other overrides are refused before anything trains.
    with pytest.raises(ValueError, match="finished with another command"):
        sweep.sweep("c.yaml", variants, [2, 0], tmp_path, ["x=2"])
    assert len(calls) == 2


def test_a_failed_run_names_its_error_and_log(tmp_path, monkeypatch):
    def fake_call(argv, stdout, **_):
        stdout.write("some log\nerror: step 3 diverged\n")
        return 2

    monkeypatch.setattr(subprocess, "call", fake_call)
    (outcome,) = sweep.sweep(None, [sweep.parse_variant("grpo")], [0], tmp_path)
    assert outcome.status == "failed"
    log = tmp_path / "grpo" / "seed0.log"
    assert outcome.detail == f"exit 2: error: step 3 diverged (log: {log})"


def test_a_shared_warmup_trains_once_a_seed_and_starts_its_variants(tmp_path, monkeypatch):
    variants = [sweep.parse_variant("grpo"), sweep.parse_variant("dapo")]
    calls = []

    def fake_call(argv, **_):
        calls.append(argv[3:])
        where = pathlib.Path(next(a for a in argv if a.startswith("run_dir=")).split("=", 1)[1])
        if "seed=1" in argv and "trainer.max_steps=0" in argv:
            return 1  # seed 1's warm-up fails
        _finish(where)
        return 0

    monkeypatch.setattr(subprocess, "call", fake_call)
    outcomes = sweep.sweep("c.yaml", variants, [0, 1], tmp_path, ["x=1"], share_warmup=True)
    warm0, warm1 = tmp_path / "_warmup" / "seed0", tmp_path / "_warmup" / "seed1"
    # The two warm-ups first (the config's objective, no RL step), then seed 0's two variants
    # from its warm-up; seed 1's variants are failed without training.
    assert calls == [
        ["train", "c.yaml", "x=1", "seed=0", f"run_dir={warm0}", "resume=true",
         "logging.progress=false", "trainer.max_steps=0"],
        ["train", "c.yaml", "x=1", "seed=1", f"run_dir={warm1}", "resume=true",
         "logging.progress=false", "trainer.max_steps=0"],
        ["train", "c.yaml", "x=1", f"model.path={warm0 / 'hf'}", "sft_warmup.steps=0",
         "objective.name=grpo", "seed=0", f"run_dir={tmp_path / 'grpo' / 'seed0'}",
         "resume=true", "logging.progress=false"],
        ["train", "c.yaml", "x=1", f"model.path={warm0 / 'hf'}", "sft_warmup.steps=0",
         "objective.name=dapo", "seed=0", f"run_dir={tmp_path / 'dapo' / 'seed0'}",
         "resume=true", "logging.progress=false"],
    ]  # fmt: skip
    assert [(o.variant, o.seed, o.status) for o in outcomes] == [
        ("_warmup", 0, "trained"),
        ("_warmup", 1, "failed"),
        ("grpo", 0, "trained"),
        ("grpo", 1, "failed"),
        ("dapo", 0, "trained"),
        ("dapo", 1, "failed"),
    ]
    assert outcomes[3].detail.startswith("warm-up failed: exit 1")
    # Again: the finished warm-up and cells are reused; seed 1's warm-up is retried.
    calls.clear()
    again = sweep.sweep("c.yaml", variants, [0], tmp_path, ["x=1"], share_warmup=True)
    assert calls == [] and {o.status for o in again} == {"reused"}
    # A finished warm-up under other overrides is refused before anything trains.
    with pytest.raises(ValueError, match="shared warm-up.*another command"):
        sweep.sweep("c.yaml", [], [0], tmp_path, ["x=2"], share_warmup=True)


def test_a_lora_config_cannot_share_its_warmup():
    with pytest.raises(ValueError, match="--warmup each"):
        sweep.warms_up(CONFIG, ["model.lora.rank=4"])
    assert sweep.warms_up(CONFIG, [])
    assert not sweep.warms_up(CONFIG, ["sft_warmup.steps=0"])


@pytest.mark.parametrize("where", ["sweep", "run"])
def test_ctrl_c_stops_the_sweep_and_says_how_to_resume(where, tmp_path, monkeypatch, capsys):
    calls = []

    def interrupted(argv, **_):
        calls.append(argv)
        if where == "sweep":  # the signal reached the sweep's own process in the call
            raise KeyboardInterrupt
        return 130  # the run stopped on it with a checkpoint

    monkeypatch.setattr(subprocess, "call", interrupted)
    argv = ["sweep", CONFIG, "--presets", "grpo,dapo", "--seeds", "0,1", "--out", str(tmp_path)]
    assert cli.main(argv) == 130
    assert len(calls) == 1  # no run starts after it
    assert "the same command resumes the sweep" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--presets", "grpo+nope"], "unknown stabiliser 'nope'"),
        (["--seeds", "a"], "--seeds: 'a' is not a non-negative integer"),
        (["--jobs", "0"], "--jobs must be >= 1"),
        (["seed=3"], "override 'seed=3': the sweep sets seed for each run"),
        (["--presets", "gspo+kl_cov"], "variant 'gspo+kl_cov': objective: surrogate 'kl_cov'"),
        (["trainer.nope=1"], "nope"),
        (["missing.yaml"], "config file not found"),
    ],
)
def test_bad_input_is_one_error_line(args, message, tmp_path, capsys):
    config = [] if args[0].endswith(".yaml") else [CONFIG]
    code = cli.main(["sweep", *config, *args, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and message in errors[0], err
    assert not (tmp_path / "out").exists()


# -- one tiny real sweep -----------------------------------------------------------------------

TINY_SWEEP = (
    "sft_warmup.steps=2",
    "trainer.max_steps=2",
    "trainer.eval_every=1",
    "data.eval_size=8",
    "data.num_train=64",
    "rollout.prompts_per_step=4",
    "rollout.group_size=2",
    "checkpoint.every_steps=2",
    "model.tiny.num_hidden_layers=1",
    "logging.tensorboard=false",
    "mesh.fsdp=1",
)


@pytest.mark.slow
def test_a_tiny_sweep_trains_and_reports(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XLA_FLAGS", helpers.single_device_env()["XLA_FLAGS"])
    for key, value in helpers.cache_env(tmp_path / "jax_cache").items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "out"
    argv = ["sweep", CONFIG, "--presets", "grpo,dapo+m2po", "--seeds", "0", "--out", str(out)]
    assert cli.main([*argv, *TINY_SWEEP]) == 0, capsys.readouterr().err
    report = json.loads((out / "sweep.json").read_text())
    assert list(report["variants"]) == ["grpo", "dapo+m2po"]
    for row in report["variants"].values():
        assert row["failed"] == 0
        assert [step for step, _ in row["seeds"]["0"]["curve"]] == [0, 1, 2]
    table = capsys.readouterr().out
    assert table == (out / "sweep.md").read_text() and table.count("\n") == 4
    assert (out / "sweep_accuracy.png").stat().st_size > 0
    # One shared warm-up; both variants start RL from its export, evaluated as it was.
    warmup = json.loads((out / "_warmup" / "seed0" / "summary.json").read_text())
    assert warmup["steps"] == 0 and warmup["sft_warmup_steps"] == 2
    for variant in ("grpo", "dapo+m2po"):
        summary = json.loads((out / variant / "seed0" / "summary.json").read_text())
        assert summary["eval_before_rl"] == warmup["eval_before_rl"]
        assert summary["steps"] == 2 and not summary.get("sft_warmup_steps")
