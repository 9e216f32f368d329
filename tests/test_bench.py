"""The loss benchmark harness: PyTorch baseline parity, timings, table, CLI."""

import importlib.util
import math
from pathlib import Path

import chex
import jax
import numpy as np
import pytest

from jaxrl_llm import bench, objectives
from jaxrl_llm.bench import timing
from jaxrl_llm.losses import aggregation

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TINY = ["losses", "--presets", "grpo", "--shapes", "4x16", "--repeats", "2", "--quiet"]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_test_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def torch_losses():
    pytest.importorskip("torch")
    return _load("torch_losses")


def _jax_loss_and_grad(objective, logprobs, batch):
    fn = jax.jit(jax.value_and_grad(lambda lp, b: objectives.policy_loss(objective, lp, b).loss))
    loss, grad = fn(logprobs, batch)
    return float(loss), np.asarray(grad)


def _parity_batch(objective, case):
    if case == "default":
        return bench.objective_batch(objective, B=8, T=32, seed=1)
    # Wide ratios reach every clip / cap / clamp branch; an empty row and a full row test the
    # per-sequence guards.
    logprobs, batch = bench.objective_batch(objective, B=8, T=32, seed=2, noise=1.0)
    mask = batch.completion_mask.copy()
    mask[0] = 0.0
    mask[1] = 1.0
    old = batch.old_logprobs.copy()
    old[2, 0] = logprobs[2, 0] - 25.0  # beyond the ±20 log-ratio clamp
    return logprobs, batch._replace(completion_mask=mask, old_logprobs=old)


@pytest.mark.parametrize("case", ["default", "wide"])
@pytest.mark.parametrize("name", bench.loss_presets())
def test_torch_formulation_equals_jaxrl_llm(torch_losses, name, case):
    import torch

    objective = objectives.make(name)
    logprobs, batch = _parity_batch(objective, case)
    loss, grad = _jax_loss_and_grad(objective, logprobs, batch)
    t_loss, t_grad = torch_losses.loss_and_grad(objective, logprobs, batch)
    ref_loss, ref_grad = torch_losses.loss_and_grad(objective, logprobs, batch, dtype=torch.float64)

    chex.assert_shape(grad, logprobs.shape)
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    assert np.any(grad != 0)
    scale = np.max(np.abs(ref_grad))
    # Ratios up to e^20 make some gradients ill-conditioned in f32 (SAPO's σ'(τ(r−1))·r loses
    # ~4 digits at r ≈ 30), so against float64 the wide case allows 1e-3; the two f32
    # formulations must still agree to 1e-5.
    rtol64 = 1e-5 if case == "default" else 1e-3
    for got_loss, got_grad in ((t_loss, t_grad), (loss, grad)):
        np.testing.assert_allclose(got_loss, ref_loss, rtol=rtol64, atol=1e-7)
        np.testing.assert_allclose(got_grad, ref_grad, rtol=rtol64, atol=1e-6 * scale)
    np.testing.assert_allclose(t_loss, loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(t_grad, grad, rtol=1e-5, atol=1e-6 * scale)
    padding = batch.completion_mask == 0
    assert np.all(grad[padding] == 0) and np.all(t_grad[padding] == 0)


def test_torch_formulation_covers_a_custom_combination(torch_losses):
    objective = objectives.make(
        "grpo", surrogate="cispo", clip_low=0.2, clip_high=0.3, kl_kind="abs", kl_coef=0.1,
        kl_straight_through=True, aggregation="seq-mean-token-sum-norm", norm_constant=20.0,
    )  # fmt: skip
    logprobs, batch = bench.objective_batch(objective, B=8, T=32, seed=3, noise=1.0)
    loss, grad = _jax_loss_and_grad(objective, logprobs, batch)
    t_loss, t_grad = torch_losses.loss_and_grad(objective, logprobs, batch)
    np.testing.assert_allclose(t_loss, loss, rtol=1e-5)
    np.testing.assert_allclose(t_grad, grad, rtol=1e-5, atol=1e-6 * np.max(np.abs(grad)))


def test_torch_gmpo_is_a_sequence_mean_whatever_the_mode(torch_losses):
    objective = objectives.make("gmpo", aggregation="token-mean")
    logprobs, batch = _parity_batch(objective, "wide")
    loss, grad = _jax_loss_and_grad(objective, logprobs, batch)
    t_loss, t_grad = torch_losses.loss_and_grad(objective, logprobs, batch)
    np.testing.assert_allclose(t_loss, loss, rtol=1e-5)
    np.testing.assert_allclose(t_grad, grad, rtol=1e-5, atol=1e-6 * np.max(np.abs(grad)))


def test_benchmark_batch_reaches_every_surrogate_branch():
    logprobs, batch = bench.random_batch(B=256, T=1024, seed=0)
    valid = batch.completion_mask > 0
    adv = batch.advantages[:, None]
    ratio = np.exp(logprobs.astype(np.float64) - batch.old_logprobs)
    branches = {
        "ppo upper clip": (adv > 0) & (ratio > 1.28),
        "ppo lower clip": (adv < 0) & (ratio < 0.8),
        "unclipped": (ratio > 0.8) & (ratio < 1.2),
        "dual clip": (adv < 0) & (ratio > 3.0),
        "cispo cap": ratio > 5.0,
        "sapo A <= 0": np.broadcast_to(adv <= 0, ratio.shape),
    }
    for name, hit in branches.items():
        assert np.sum(hit & valid) > 0, name
    lengths = batch.completion_mask.sum(axis=1)
    assert lengths.min() >= 1 and lengths.max() <= 1024 and len(np.unique(lengths)) > 100
    np.testing.assert_array_equal(
        batch.completion_mask, np.arange(1024)[None, :] < lengths[:, None]
    )


def test_random_batch_is_deterministic_and_shaped():
    lp1, b1 = bench.random_batch(B=4, T=16, seed=5, token_advantages=True, with_reference=False)
    lp2, b2 = bench.random_batch(B=4, T=16, seed=5, token_advantages=True, with_reference=False)
    chex.assert_trees_all_equal((lp1, b1), (lp2, b2))
    chex.assert_shape([lp1, b1.old_logprobs, b1.completion_mask, b1.advantages], (4, 16))
    assert b1.ref_logprobs is None
    assert np.all(b1.advantages[b1.completion_mask == 0] == 0)
    assert lp1.dtype == b1.old_logprobs.dtype == np.float32
    grpo = bench.objective_batch(objectives.make("grpo"), B=4, T=16)[1]
    assert grpo.advantages.shape == (4,) and grpo.ref_logprobs is not None
    ppo = bench.objective_batch(objectives.make("ppo"), B=4, T=16)[1]
    assert ppo.advantages.shape == (4, 16) and ppo.ref_logprobs is None
    with pytest.raises(ValueError, match="B must be a positive int"):
        bench.random_batch(B=0, T=16)


def test_time_loss_objective_is_sane():
    timing = bench.time_loss(objectives.make("grpo"), B=4, T=16, repeats=3)
    assert isinstance(timing, bench.LossTiming)
    assert timing.compile_s > 0
    assert 0 < timing.p10_s <= timing.median_s <= timing.p90_s
    # lp, old, mask, ref [4, 16] f32 + advantages [4] f32 read; gradient [4, 16] f32 written.
    assert timing.bytes == 5 * 4 * 16 * 4 + 4 * 4
    assert math.isclose(timing.gbps, timing.bytes / timing.median_s / 1e9)
    # ppo: per-token advantages, KL in the reward so no reference log-probs.
    assert bench.time_loss(objectives.make("ppo"), B=4, T=16, repeats=2).bytes == 5 * 4 * 16 * 4


def test_time_loss_takes_a_custom_loss_and_data():
    def reinforce_token_sum(logprobs, batch):
        per_token = -batch.advantages[:, None] * logprobs
        return aggregation.aggregate(per_token, batch.completion_mask, "token-sum")

    timing = bench.time_loss(reinforce_token_sum, B=4, T=16, repeats=2)
    assert timing.median_s > 0 and timing.compile_s > 0
    assert timing.bytes == 5 * 4 * 16 * 4 + 4 * 4  # a callable gets ref and [B] advantages
    data = bench.random_batch(B=2, T=8, with_reference=False)
    assert bench.time_loss(reinforce_token_sum, B=2, T=8, repeats=2, data=data).bytes == (
        4 * 2 * 8 * 4 + 2 * 4
    )


def test_time_loss_rejects_bad_input():
    with pytest.raises(ValueError, match="must return a scalar"):
        bench.time_loss(lambda lp, batch: lp, B=2, T=4, repeats=1)
    with pytest.raises(ValueError, match="Objective or a callable"):
        bench.time_loss("grpo", B=2, T=4)
    with pytest.raises(ValueError, match="T must be a positive int"):
        bench.time_loss(objectives.make("grpo"), B=2, T=0)
    with pytest.raises(ValueError, match="expected"):
        bench.time_loss(objectives.make("grpo"), B=2, T=4, data=bench.random_batch(B=2, T=8))
    with pytest.raises(ValueError, match="repeats"):
        bench.time_loss(objectives.make("grpo"), B=2, T=4, repeats=0)


def test_sample_times_adapts_repeats(monkeypatch):
    calls = []
    monkeypatch.setattr(timing, "_TIME_BUDGET_S", 1e-9)
    first, times = bench.sample_times(lambda: calls.append(1))
    assert len(times) == timing._MIN_REPEATS and len(calls) == timing._WARMUP + len(times)
    assert first >= 0 and np.all(times >= 0)
    _, times = bench.sample_times(lambda: None, repeats=3)
    assert len(times) == 3


def test_copy_bandwidth_is_positive():
    gbps = bench.copy_bandwidth(1 << 16, repeats=3)
    assert np.isfinite(gbps) and gbps > 0
    with pytest.raises(ValueError, match="num_bytes"):
        bench.copy_bandwidth(2)


def _timing(median_s, gbps):
    return bench.LossTiming(0.5, median_s, median_s * 0.9, median_s * 1.2, 1000, gbps)


def test_format_table_by_hand():
    rows = [
        bench.BenchRow("grpo", 64, 1024, _timing(0.002, 1.0), _timing(0.02, 0.1), 4.0),
        bench.BenchRow("dapo", 256, 4096, _timing(0.004, 2.0), None, 8.0),
    ]
    assert rows[0].speedup == pytest.approx(10.0) and rows[1].speedup is None
    md = bench.format_table(rows).splitlines()
    assert len(md) == 4 and md[1].startswith("|---|")
    cells = [c.strip() for c in md[2].strip("|").split("|")]
    assert cells == [
        "grpo", "64", "1024", "0.50", "2.000", "1.80–2.40", "1.00", "4.00", "25%", "20.00",
        "18.0–24.0", "10.0×",
    ]  # fmt: skip
    assert md[3].count("n/a") == 3 and "25%" in md[3]
    plain = bench.format_table(rows, markdown=False).splitlines()
    assert len(plain) == 3 and len({len(line) for line in plain}) == 1 and "|" not in plain[0]


def test_parse_options():
    assert bench.parse_shapes("64x1024, 256X4096") == [(64, 1024), (256, 4096)]
    every = list(objectives.available())
    assert bench.parse_presets("all") == [name for name in every if name != "distill_gkd"]
    with pytest.raises(ValueError, match=r"\['distill_gkd'\] add a distillation loss"):
        bench.parse_presets("grpo,distill_gkd")
    assert bench.parse_presets("grpo,dapo") == ["grpo", "dapo"]
    for bad in ("64", "64x", "0x8", "axb", ""):
        with pytest.raises(ValueError):
            bench.parse_shapes(bad)
    with pytest.raises(ValueError, match="unknown preset"):
        bench.parse_presets("grpo,nope")


def test_bench_main_prints_the_table(capsys):
    assert bench.bench_main(TINY) == 0
    out = capsys.readouterr().out
    assert f"jax {jax.__version__}" in out
    assert "device: cpu" in out and "machine:" in out
    row = [line for line in out.splitlines() if line.startswith("grpo")]
    assert len(row) == 1 and row[0].split()[1:3] == ["4", "16"]
    if importlib.util.find_spec("torch") is not None:
        assert row[0].endswith("×") and "torch 2" in out


def test_bench_main_without_torch(capsys, monkeypatch):
    assert bench.bench_main([*TINY, "--no-torch", "--markdown"]) == 0
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if line.startswith("| grpo")]
    assert len(row) == 1 and row[0].count("n/a") == 3
    # torch absent at runtime: the column says n/a, unless --torch insists.
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torch" else real_find_spec(name, *a),
    )
    assert bench.load_torch_impl() == (None, "torch is not installed")
    assert bench.bench_main(TINY) == 0
    assert "n/a" in capsys.readouterr().out
    with pytest.raises(SystemExit) as err:
        bench.bench_main([*TINY, "--torch"])
    assert err.value.code == 2


def test_bench_main_rejects_bad_options(capsys):
    for argv in (
        ["losses", "--presets", "nope"],
        ["losses", "--shapes", "4by16"],
        ["losses", "--repeats", "0"],
        ["nothing"],
    ):
        with pytest.raises(SystemExit) as err:
            bench.bench_main(argv)
        assert err.value.code == 2
    assert "unknown preset" in capsys.readouterr().err


def test_a_run_rewrites_the_loss_presets_section(tmp_path):
    """``--results`` writes the run's table as the file's one ``## Loss presets`` section: a
    second run replaces the first's figures (no dated sections appended), and the sections
    around it are kept."""
    results = tmp_path / "RESULTS.md"
    results.write_text(
        "# Benchmark results\n\n## Before\n\nkept\n\n"
        "## Loss presets\n\nold\n\n## After\n\nkept too\n"
    )
    script = _load("bench_losses")
    argv = ["--presets", "gpg", "--shapes", "2x8", "--repeats", "1", "--quiet", "--no-torch"]
    assert script.main([*argv, "--results", str(results)]) == 0
    text = results.read_text()
    assert text.count("## Loss presets") == 1 and "\nold\n" not in text
    assert "- command: python benchmarks/bench_losses.py --presets gpg" in text
    assert "| gpg | 2 | 8 |" in text
    assert text.index("## Before") < text.index("## Loss presets") < text.index("## After")
    assert "kept\n" in text and "kept too" in text
    assert bench.bench_main([*TINY, "--no-torch", "--results", str(results)]) == 0
    text = results.read_text()
    assert text.count("## Loss presets") == 1 and "| gpg | 2 | 8 |" not in text
    assert "- command: jaxrl-llm bench losses --presets grpo" in text
    assert "| grpo | 4 | 16 |" in text
    assert text.count("- versions: python") == 1 and "kept too" in text
    fresh = tmp_path / "new.md"
    assert bench.bench_main([*TINY, "--no-torch", "--results", str(fresh)]) == 0
    assert fresh.read_text().startswith("# Benchmark results\n\n## Loss presets\n")
