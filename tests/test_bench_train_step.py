"""The train-step benchmark: its --quick path end to end, and its FLOP / MFU arithmetic."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench_train_step.py"


@pytest.fixture(scope="module")
def bench_module():
    spec = importlib.util.spec_from_file_location("_test_bench_train_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    # The script picks its own devices: no 8-device XLA_FLAGS inherited from conftest.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--repeats", "2", "--json", str(out)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.slow
def test_quick_json_has_every_implementation(bench_module, quick_run):
    _, payload = quick_run
    model, batch, length, _ = bench_module.QUICK_PLAN[0]
    results = {r["impl"]: r for r in payload["results"]}
    assert set(results) == {"jax", "jax_mesh", "torch"}
    assert {r["devices"] for r in results.values()} == {1, bench_module.MESH_DEVICES}
    assert results["jax_mesh"]["devices"] == bench_module.MESH_DEVICES
    tokens = batch * (bench_module.PROMPT_LEN + length)
    for r in results.values():
        assert (r["model"], r["B"], r["T"]) == (model, batch, length)
        assert 0 < r["p10_s"] <= r["median_s"] <= r["p90_s"] and r["first_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(tokens / r["median_s"])
    # Same weights, batch and loss: the first step's losses agree, so the timings compare like
    # with like (f32 on both sides; the mesh only changes the reduction order).
    assert results["jax"]["first_loss"] == pytest.approx(results["torch"]["first_loss"], abs=1e-5)
    assert results["jax_mesh"]["first_loss"] == pytest.approx(
        results["jax"]["first_loss"], abs=1e-5
    )
    assert payload["environment"]["device"].startswith("cpu")
    assert payload["peak_tflops"] is None
    assert "--quick" in payload["command"]


@pytest.mark.slow
def test_quick_prints_one_markdown_row(quick_run):
    stdout, _ = quick_run
    rows = [line for line in stdout.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in rows[0].strip("|").split("|")]
    assert header[:5] == ["model", "params", "B", "T", "tokens/step"]
    assert "speed-up 1 dev" in header and "speed-up mesh" in header
    assert "MFU 1 dev" not in header  # CPU: no MFU
    assert len(rows) == 3  # header, separator, one (model, B, T)
    cells = [cell.strip() for cell in rows[2].strip("|").split("|")]
    assert len(cells) == len(header)
    assert cells[0] == "tiny" and "n/a" not in cells
    assert "- machine:" in stdout and "- versions:" in stdout


def test_matmul_params_counts_every_weight_but_the_embedding(bench_module):
    transformers = pytest.importorskip("transformers")
    del transformers
    model = bench_module.hf_llama("tiny")
    total = sum(p.numel() for p in model.parameters())
    embedding = model.model.embed_tokens.weight.numel()
    assert bench_module.matmul_params(*bench_module.MODELS["tiny"]) == total - embedding


def test_mfu_arithmetic(bench_module):
    # 6 · 1e9 params · 1000 tokens = 6e12 FLOP in 1 s on a 6 TFLOP/s device: 100 %.
    assert bench_module.mfu(10**9, 1000, 1.0, 6.0, 1) == pytest.approx(1.0)
    # Twice the devices, twice the time: a quarter.
    assert bench_module.mfu(10**9, 1000, 2.0, 6.0, 2) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="seconds > 0"):
        bench_module.mfu(10**9, 1000, 0.0, 6.0, 1)
    assert bench_module.default_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert bench_module.default_peak_tflops("cpu") is None


def test_table_speed_up_and_mfu_columns(bench_module):
    def row(impl, devices, seconds, loss):
        return {
            "model": "tiny",
            "B": 8,
            "T": 64,
            "impl": impl,
            "devices": devices,
            "median_s": seconds,
            "tokens_per_s": 768 / seconds,
            "first_loss": loss,
        }

    results = [row("jax", 1, 0.5, 0.25), row("torch", 1, 2.0, 0.5), row("jax_mesh", 8, 1.0, 0.25)]
    table = bench_module.format_table(results, peak_tflops=1.0).splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    cells = dict(zip(header, (c.strip() for c in table[2].strip("|").split("|"))))
    assert cells["speed-up 1 dev"] == "4.00×" and cells["speed-up mesh"] == "2.00×"
    assert cells["loss diff"] == "2.5e-01"
    assert cells["jax ms"] == "500.0" and cells["torch tok/s"] == "384"
    n = bench_module.matmul_params(*bench_module.MODELS["tiny"])
    assert cells["MFU 1 dev"] == f"{6 * n * 768 / 0.5 / 1e12:.1%}"
    assert cells["MFU mesh"] == f"{6 * n * 768 / 1.0 / 8e12:.1%}"
