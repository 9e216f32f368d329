"""The GRPO-step benchmark's long-tailed workload: the per-token stop probability that gives
the asked mean length, and the checkpoint that stops with it at every position (both
implementations then draw lengths from one distribution)."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench_grpo_step.py"


@pytest.fixture(scope="module")
def bench_module():
    spec = importlib.util.spec_from_file_location("_test_bench_grpo_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mean_length(stop: float, limit: int) -> float:
    """E[min(G, T)] for G ~ Geometric(stop) on 1, 2, ...: the sum over the distribution."""
    t = np.arange(1, limit, dtype=np.float64)
    running = np.sum(t * stop * (1 - stop) ** (t - 1))  # ended at token t < T
    return float(running + limit * (1 - stop) ** (limit - 1))  # reached T


@pytest.mark.parametrize(("fraction", "limit"), [(0.3, 512), (0.5, 64), (0.1, 8192)])
def test_stop_probability_gives_the_asked_mean_length(bench_module, fraction, limit):
    stop = bench_module.stop_probability(fraction, limit)
    assert 0 < stop < 1
    assert _mean_length(stop, limit) == pytest.approx(fraction * limit, rel=1e-9)


def test_stop_probability_refuses_means_no_length_can_have(bench_module):
    for fraction in (0.0, 1 / 512, 1.0):
        with pytest.raises(ValueError, match="--mean-fraction"):
            bench_module.stop_probability(fraction, 512)


def test_the_long_tailed_checkpoint_stops_with_that_probability_everywhere(bench_module, tmp_path):
    import torch
    import transformers

    from jaxrl_llm.data.char_tokenizer import ARITHMETIC_ALPHABET

    stop = bench_module.stop_probability(0.3, 512)
    bench_module.build_checkpoint(str(tmp_path), stop, max_positions=1152)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = torch.randint(
        0, model.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        probs = model(input_ids=ids).logits.double().softmax(-1)
    chars = tokenizer.convert_tokens_to_ids(list(ARITHMETIC_ALPHABET))
    others = sorted(set(range(model.config.vocab_size)) - {*chars, tokenizer.eos_token_id})
    np.testing.assert_allclose(probs[..., tokenizer.eos_token_id], stop, rtol=1e-5)
    np.testing.assert_allclose(probs[..., chars], (1 - stop) / len(chars), rtol=1e-5)
    assert probs[..., others].max() < 1e-12  # special tokens are never drawn
