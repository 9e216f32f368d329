"""``jaxrl-llm eval`` on a run directory of the built-in task (a short SFT warm-up, one RL step).

Greedy (temperature 0) every sample of a prompt is the same, so pass@1 = pass@k = mean@k =
maj@k = the trainer's own held-out greedy accuracy (``summary.json``), computed by other code.
Sampled, pass@k is checked against ``1 - C(n - c, k) / C(n, k)`` from the reported per-prompt
counts with ``math.comb``.
"""

from __future__ import annotations

import json
import math

import pytest

from jaxrl_llm.cli import main
from jaxrl_llm.train.rl.trainer import RLTrainer
from tests.train.rl import rl_helpers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval_run")
    # 5000 training problems: 300 warm-up steps over the tiny set's 200 memorise them and
    # leave held-out accuracy at 0, where every sampled estimate is 0 too.
    cfg = rl_helpers.tiny_config(
        None,
        path,
        "sft_warmup.steps=300",
        "trainer.max_steps=1",
        "trainer.eval_k=4",
        "data.num_train=5000",
    )
    RLTrainer(cfg).fit()
    return path


def _eval(capsys, *argv):
    code = main(["eval", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_greedy_eval_equals_the_trainers_accuracy(run_dir, tmp_path, capsys):
    out_json = tmp_path / "eval.json"
    code, out, err = _eval(capsys, run_dir, "--k", 4, "--temperature", 0, "--json", out_json)
    assert code == 0, err
    report = json.loads(out_json.read_text())
    summary = report["summary"]
    accuracy = json.loads((run_dir / "summary.json").read_text())["eval_after_rl"]["accuracy"]
    assert summary["problems"] == 16 and summary["samples"] == 4
    for key in ("pass@1", "pass@4", "mean@1", "mean@4", "maj@4"):
        assert summary[key] == pytest.approx(accuracy), key
    assert all(p["correct"] in (0, 4) for p in report["per_prompt"])
    assert "pass@4" in out and "[" in out


def test_overrides_may_follow_the_options(run_dir, tmp_path, capsys):
    out_json = tmp_path / "eval.json"
    argv = (run_dir, "--k", 1, "--temperature", 0, "data.eval_size=8", "--json", out_json)
    code, _, err = _eval(capsys, *argv)
    assert code == 0, err
    assert json.loads(out_json.read_text())["summary"]["problems"] == 8


def test_sampled_pass_at_k_follows_the_per_prompt_counts(run_dir, tmp_path, capsys):
    out_json = tmp_path / "eval.json"
    code, _, err = _eval(capsys, run_dir, "--k", 4, "--samples", 6, "--json", out_json)
    assert code == 0, err
    report = json.loads(out_json.read_text())
    counts = [p["correct"] for p in report["per_prompt"]]
    assert 0 < sum(counts) < 6 * 16, counts  # a partly trained policy: a real estimate
    want = sum(1 - math.comb(6 - c, 4) / math.comb(6, 4) for c in counts) / 16
    summary = report["summary"]
    assert summary["pass@4"] == pytest.approx(want)
    assert summary["pass@1"] == pytest.approx(sum(counts) / (6 * 16))
    assert summary["pass@4_low"] <= summary["pass@4"] <= summary["pass@4_high"]


def test_trainer_eval_k_reports_what_eval_reports_for_its_policy(run_dir, tmp_path, capsys):
    """``trainer.eval_k=4``: the run's final evaluation holds pass@k / mean@k / maj@k with their
    bounds, the numbers ``jaxrl-llm eval`` gives for the exported policy at the run's seed and
    rollout temperature (the trainer's in-memory parameters vs the ``hf/`` export reloaded)."""
    after = json.loads((run_dir / "summary.json").read_text())["eval_after_rl"]
    out_json = tmp_path / "eval.json"
    code, _, err = _eval(capsys, run_dir, "--k", 4, "--seed", 0, "--json", out_json)
    assert code == 0, err
    summary = json.loads(out_json.read_text())["summary"]
    keys = [
        f"{name}@{k}{end}"
        for name in ("pass", "mean", "maj")
        for k in (1, 4)
        for end in ("", "_low", "_high")
    ]
    for key in keys:
        assert after[key] == pytest.approx(summary[key], abs=1e-6), key
    assert after["pass@1"] <= after["pass@4"] and after["mean@4"] == after["pass@1"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not any("eval/pass@4" in row for row in rows)  # eval_every=0: only before / after


@pytest.mark.parametrize(
    ("target", "extra", "match"),
    [
        ("missing", (), "no run directory or config file"),
        ("empty_dir", (), "without config.yaml"),
        ("run", ("--samples", "2"), "--samples 2 must be at least --k 8"),
    ],
)
def test_bad_input_exits_2_with_the_reason(run_dir, tmp_path, capsys, target, extra, match):
    (tmp_path / "empty_dir").mkdir()
    path = {"missing": tmp_path / "nope", "empty_dir": tmp_path / "empty_dir", "run": run_dir}
    code, _, err = _eval(capsys, path[target], *extra)
    assert code == 2 and match in err


def test_eval_of_a_lora_run_evaluates_the_base_with_its_adapters(tmp_path, capsys, monkeypatch):
    """A LoRA run's ``hf/`` holds its PEFT adapter (``adapter_config.json``, no config.json)
    over the base it saved (``base/``): ``jaxrl-llm eval RUN_DIR`` samples the base with the
    trained adapters applied (docs/lora.md), the figures the run's own final evaluation gave
    at its seed and rollout temperature (``trainer.eval_k``)."""
    from safetensors.numpy import load_file

    from jaxrl_llm.train.rl import evaluate

    run = tmp_path / "lora"
    code = main(
        [
            "train",
            "model.lora.rank=4",
            "trainer.max_steps=1",
            "sft_warmup.steps=2",
            "data.eval_size=8",
            "rollout.prompts_per_step=4",
            "rollout.group_size=2",
            "mesh.fsdp=1",
            "trainer.eval_k=2",
            # Two warm-up steps leave every answer wrong (no advantage): an entropy bonus
            # gives the one RL step a gradient, so the adapters move off their start.
            "objective.overrides={entropy_coef: 0.01}",
            f"run_dir={run}",
        ]
    )
    capsys.readouterr()
    assert code == 0
    assert (run / "hf" / "adapter_config.json").is_file()
    assert not (run / "hf" / "config.json").exists()
    evaluated = {}
    real = evaluate.sampled_report

    def recorded(context, params, *args, **kwargs):
        evaluated.update(config=context.model_config, params=params)
        return real(context, params, *args, **kwargs)

    monkeypatch.setattr(evaluate, "sampled_report", recorded)
    out_json = tmp_path / "eval.json"
    code, out, err = _eval(capsys, run, "--k", 2, "--seed", 0, "--json", out_json)
    assert code == 0, err
    assert "pass@2" in out and f"({run / 'hf'})" in out
    # The adapters, as saved (PEFT names, [r, in] A and [out, r] B a layer), in the model.
    assert evaluated["config"].lora is not None and evaluated["config"].lora.rank == 4
    saved = load_file(run / "hf" / "adapter_model.safetensors")
    b = next(v for k, v in saved.items() if k.endswith("layers.0.self_attn.q_proj.lora_B.weight"))
    assert abs(b).max() > 0  # trained: B starts at zero
    layers = evaluated["params"]["layers"]
    got = layers["wq_lora_b"][0].reshape(4, -1)
    assert got == pytest.approx(b.T.reshape(4, -1), abs=1e-6)
    summary = json.loads(out_json.read_text())["summary"]
    after = json.loads((run / "summary.json").read_text())["eval_after_rl"]
    assert summary["problems"] == 8 and summary["samples"] == 2
    for key in ("pass@1", "pass@2", "mean@2", "maj@2"):
        assert after[key] == pytest.approx(summary[key], abs=1e-6), key
