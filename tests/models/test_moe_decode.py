"""Mixture-of-experts models through the sampler's KV-cache decode: greedy decoding with the
static ``generate`` (stacked and per-layer layouts) and the continuous engine (paged cache, slot
refills) equals transformers ``generate(do_sample=False)`` on tiny random checkpoints."""

import numpy as np
import pytest

from tests.models.hf_utils import MOE_VARIANTS, load_variants, padded_batch
from tests.sampling.hf_reference import assert_engine_matches_hf, assert_greedy_matches_hf

MAX_NEW = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    loaded = load_variants(tmp_path_factory, MOE_VARIANTS, first_seed=40)
    return {
        name: (torch_model, config, params)
        for name, (torch_model, config, params, _) in loaded.items()
    }


@pytest.mark.parametrize(
    "name, decode_layers",
    [("qwen3_moe", "stacked"), ("qwen2_moe", "per_layer"), ("mixtral", "stacked")],
)
def test_greedy_matches_transformers_generate(checkpoints, name, decode_layers):
    torch_model, config, params = checkpoints[name]
    rng = np.random.default_rng(4)
    tokens, mask = padded_batch(rng, [11, 4, 7], 11, vocab=config.vocab_size, side="left")
    assert_greedy_matches_hf(
        torch_model, params, config, tokens, mask, MAX_NEW, decode_layers=decode_layers
    )


def test_continuous_engine_matches_transformers_generate(checkpoints):
    torch_model, config, params = checkpoints["qwen2_moe"]
    assert_engine_matches_hf(
        torch_model, params, config, [5, 2, 9, 4], [6, 8, 3, 8], seed=5, kv_block_size=4
    )
