"""The MoE layer benchmark (``benchmarks/bench_moe_layer.py``) at a tiny size: it checks JAX
against transformers' block before timing, and prints the table and the parity figures. No
timing is asserted."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_moe_layer.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("_test_bench_moe_layer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_prints_the_table_and_the_parity_check(bench, capsys):
    assert bench.main(["--quick", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "| implementation | fwd+bwd ms | this / torch eager | this / torch grouped_mm |" in out
    for name in ("jax (jaxrl_llm)", "torch eager", "torch grouped_mm"):
        assert f"| {name} |" in out
    assert "ratio jax / torch eager:" in out
    for impl in bench.TORCH_IMPLEMENTATIONS:
        line = next(x for x in out.splitlines() if x.startswith(f"- torch {impl}:"))
        errors = [float(part.split()[-1]) for part in line.split(":", 1)[1].split(",")]
        assert len(errors) == len(bench.GRAD_NAMES)
        assert all(e < bench.TOLERANCE for e in errors)
    assert "versions:" in out and "load average" in out


def test_parity_catches_a_wrong_weight_layout(bench):
    """Up and gate swapped on the JAX side: the check reports it (it is not vacuous)."""
    rng = np.random.default_rng(0)
    h = rng.normal(size=(2, 16, 32)).astype(np.float32)
    cot = rng.normal(size=h.shape).astype(np.float32)
    block = bench.build_torch(32, 16, 8, 2, "eager", seed=0)
    weights = bench.jax_weights(block)
    want = bench.torch_step(block, h, cot)()
    assert max(bench.parity(bench.jax_step(2, h, cot, weights)(), want).values()) < 1e-4
    weights["w_gate"], weights["w_up"] = weights["w_up"], weights["w_gate"]
    errors = bench.parity(bench.jax_step(2, h, cot, weights)(), want)
    assert errors["out"] > 1e-2 and errors["d_gate"] > 1e-2


def test_rejects_bad_sizes(bench):
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--rounds", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--experts", "4", "--top-k", "8"])
