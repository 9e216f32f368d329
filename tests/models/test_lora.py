"""LoRA adapters: PEFT parity (both directions), merging, the frozen base, errors.

The reference is ``peft`` on the transformers model: our adapter files loaded by
``PeftModel.from_pretrained`` give the JAX LoRA model's logits, and an adapter that ``peft``
itself initialised and saved gives the same logits when read with ``load_peft_adapter``.
"""

from __future__ import annotations

import dataclasses
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxrl_llm import models
from jaxrl_llm.models import lora
from jaxrl_llm.models.config import LORA_TARGETS, LoraSpec
from tests.models import hf_utils

peft = pytest.importorskip("peft")

RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_ckpts")
    out = {}
    for name in hf_utils.VARIANTS:
        path = str(root / name)
        out[name] = (path, hf_utils.build_checkpoint(name, path))
    return out


def _lora_model(path: str, targets=LORA_TARGETS, *, seed: int = 0):
    """The checkpoint as a LoRA model whose adapters are random (B too: not a no-op)."""
    config, base = models.load_pretrained(path, dtype=jnp.float32)
    config = dataclasses.replace(config, lora=LoraSpec(RANK, ALPHA, tuple(targets)))
    adapters = lora.init_adapters(config, jax.random.key(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 1), 64))
    adapters = jax.tree.map(
        lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), adapters
    )
    return config, lora.combine(base, adapters)


def _batch(rng, vocab):
    return hf_utils.padded_batch(rng, [7, 4, 9], 9, vocab=vocab, side="left")


@pytest.mark.parametrize("name", list(hf_utils.VARIANTS))
def test_peft_loads_our_adapter_with_the_same_logits(checkpoints, name, tmp_path, rng):
    path, torch_model = checkpoints[name]
    # Mixtures of experts: adapters on the attention projections only.
    targets = ("q", "k", "v", "o") if name in hf_utils.MOE_VARIANTS else LORA_TARGETS
    config, params = _lora_model(path, targets)
    lora.save_peft_adapter(tmp_path / "adapter", config, params, base_model=path)
    meta = json.loads((tmp_path / "adapter" / lora.ADAPTER_CONFIG).read_text())
    assert meta["r"] == RANK and meta["lora_alpha"] == ALPHA
    assert meta["base_model_name_or_path"] == path
    peft_model = peft.PeftModel.from_pretrained(torch_model, str(tmp_path / "adapter")).eval()
    tokens, mask = _batch(rng, config.vocab_size)
    want = hf_utils.hf_logits(peft_model, tokens, mask)
    got = np.asarray(models.logits(params, config, tokens, attention_mask=mask))
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], want[valid], atol=1e-4, rtol=1e-4)
    # The adapters matter: the base alone is far from the adapted model.
    base = lora.without_adapters(params)
    plain = np.asarray(models.logits(base, lora.base_config(config), tokens, attention_mask=mask))
    assert np.abs(plain[valid] - want[valid]).max() > 1e-2
    peft_model.unload()


@pytest.mark.parametrize("target", ["gate", "up", "down"])
def test_adapters_on_expert_weights_are_refused(checkpoints, target):
    config = models.load_config(checkpoints["qwen3_moe"][0])
    with pytest.raises(ValueError, match=f"LoRA targets \\['{target}'\\] would adapt the expert"):
        dataclasses.replace(config, lora=LoraSpec(RANK, ALPHA, ("q", target)))


def test_an_adapter_saved_by_peft_reads_back_with_peft_logits(checkpoints, tmp_path, rng):
    path, _ = checkpoints["qwen2"]
    torch_model = hf_utils.build_model("qwen2")
    spec = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj", "down_proj"]
    )
    peft_model = peft.get_peft_model(torch_model, spec)
    with torch.no_grad():  # peft initialises B to zeros: give the adapter an effect
        for pname, param in peft_model.named_parameters():
            if "lora_B" in pname:
                param.copy_(0.3 * torch.randn(param.shape))
    peft_model.eval()
    peft_model.save_pretrained(str(tmp_path / "peft"))
    tokens, mask = _batch(rng, 128)
    want = hf_utils.hf_logits(peft_model, tokens, mask)

    config, base = models.load_pretrained(path, dtype=jnp.float32)
    read, adapters = lora.load_peft_adapter(tmp_path / "peft", config)
    assert read == LoraSpec(RANK, ALPHA, ("q", "v", "down"), dropout=0.0)
    config = dataclasses.replace(config, lora=read)
    got = np.asarray(
        models.logits(lora.combine(base, adapters), config, tokens, attention_mask=mask)
    )
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], want[valid], atol=1e-4, rtol=1e-4)


def test_save_and_load_round_trip(checkpoints, tmp_path):
    path, _ = checkpoints["qwen3"]
    config, params = _lora_model(path, targets=("o", "gate", "k"))
    lora.save_peft_adapter(tmp_path / "a", config, params)
    spec, adapters = lora.load_peft_adapter(tmp_path / "a", lora.base_config(config))
    assert spec == config.lora
    chex.assert_trees_all_close(adapters, lora.split(params)[1], atol=0, rtol=0)


def test_fresh_adapters_leave_the_model_unchanged(checkpoints, rng):
    path, _ = checkpoints["llama"]
    config, base = models.load_pretrained(path, dtype=jnp.float32)
    adapted = dataclasses.replace(config, lora=LoraSpec(RANK, ALPHA))
    params = lora.combine(base, lora.init_adapters(adapted, jax.random.key(3)))
    chex.assert_trees_all_equal_structs(params, models.param_shapes(adapted))
    tokens, mask = _batch(rng, config.vocab_size)
    np.testing.assert_array_equal(
        np.asarray(models.logits(params, adapted, tokens, attention_mask=mask)),
        np.asarray(models.logits(base, config, tokens, attention_mask=mask)),
    )
    # A follows PEFT's init: uniform in +-1/sqrt(fan_in); B starts at zero.
    a = np.asarray(params["layers"]["wo_lora_a"])
    fan_in = config.num_attention_heads * config.head_dim
    assert a.shape == (config.num_hidden_layers, config.num_attention_heads, config.head_dim, 4)
    assert 0.8 / np.sqrt(fan_in) < np.abs(a).max() <= 1 / np.sqrt(fan_in)
    assert not np.asarray(params["layers"]["wo_lora_b"]).any()


def test_merged_weights_compute_the_adapted_model(checkpoints, rng):
    path, _ = checkpoints["qwen2"]
    config, params = _lora_model(path)
    merged = lora.merge_weights(params, config)
    # The merged weight is W + (alpha / r) A B, checked on one layer in float64.
    layers = jax.tree.map(lambda x: np.asarray(x, np.float64), params["layers"])
    want = layers["w_up"][1] + ALPHA / RANK * layers["w_up_lora_a"][1] @ layers["w_up_lora_b"][1]
    np.testing.assert_allclose(np.asarray(merged["layers"]["w_up"][1]), want, atol=1e-5)
    tokens, mask = _batch(rng, config.vocab_size)
    np.testing.assert_allclose(
        np.asarray(models.logits(merged, lora.base_config(config), tokens, attention_mask=mask)),
        np.asarray(models.logits(params, config, tokens, attention_mask=mask)),
        atol=1e-4,
    )


def test_gradients_reach_only_the_adapters_and_b_first(checkpoints, rng):
    """With ``split`` / ``combine`` only the adapters are differentiated; at init (B = 0)
    A's gradient is exactly zero and B's is not, as in LoRA."""
    path, _ = checkpoints["mistral"]
    config, base = models.load_pretrained(path, dtype=jnp.float32)
    config = dataclasses.replace(config, lora=LoraSpec(RANK, ALPHA, ("q", "up")))
    adapters = lora.init_adapters(config, jax.random.key(0))
    tokens, mask = _batch(rng, config.vocab_size)

    def loss(adapters):
        out = models.logits(lora.combine(base, adapters), config, tokens, attention_mask=mask)
        return jnp.mean(jax.nn.log_softmax(out)[..., 5])

    grads = jax.grad(loss)(adapters)
    assert set(grads["layers"]) == {"wq_lora_a", "wq_lora_b", "w_up_lora_a", "w_up_lora_b"}
    assert not np.asarray(grads["layers"]["wq_lora_a"]).any()
    assert np.abs(np.asarray(grads["layers"]["wq_lora_b"])).max() > 1e-6


def test_dropout_needs_a_key_and_changes_the_adapter_path_only(checkpoints, rng):
    path, _ = checkpoints["qwen3"]
    config, params = _lora_model(path)
    config = dataclasses.replace(config, lora=dataclasses.replace(config.lora, dropout=0.5))
    tokens, mask = _batch(rng, config.vocab_size)
    plain, _ = models.forward(params, config, tokens, attention_mask=mask)
    dropped, _ = models.forward(
        params, config, tokens, attention_mask=mask, dropout_key=jax.random.key(1)
    )
    assert np.abs(np.asarray(plain) - np.asarray(dropped)).max() > 1e-3
    # Zero adapters: dropout on their input changes nothing.
    base, adapters = lora.split(params)
    zero = lora.combine(base, jax.tree.map(jnp.zeros_like, adapters))
    a, _ = models.forward(zero, config, tokens, attention_mask=mask)
    b, _ = models.forward(zero, config, tokens, attention_mask=mask, dropout_key=jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_logical_axes_shard_adapters_like_their_base_weight():
    config = dataclasses.replace(
        models.architecture_config("Qwen2.5-0.5B"), lora=LoraSpec(16, 32.0)
    )
    axes = models.logical_axes(config)["layers"]
    assert axes["wq_lora_a"] == ("layers", "embed", None)
    assert axes["wq_lora_b"] == ("layers", None, "heads", "head_dim")
    assert axes["wo_lora_a"] == ("layers", "heads", "head_dim", None)
    assert axes["w_down_lora_b"] == ("layers", None, "embed")
    shapes = lora.adapter_shapes(config)["layers"]
    chex.assert_trees_all_equal_shapes(
        shapes, {k: v for k, v in models.param_shapes(config)["layers"].items() if "lora" in k}
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=0, alpha=1.0), "rank"),
        (dict(rank=4, alpha=0.0), "alpha"),
        (dict(rank=4, alpha=1.0, targets=("q", "qkv")), "targets"),
        (dict(rank=4, alpha=1.0, targets=("q", "q")), "targets"),
        (dict(rank=4, alpha=1.0, dropout=1.0), "dropout"),
        (dict(rank=4, alpha=1.0, rslora="yes"), "rslora"),
    ],
)
def test_bad_specs_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoraSpec(**kwargs)


def test_bad_adapter_dirs_are_named(checkpoints, tmp_path):
    path, _ = checkpoints["qwen2"]
    config, params = _lora_model(path)
    base_config = lora.base_config(config)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        lora.load_peft_adapter(tmp_path / "none", base_config)
    lora.save_peft_adapter(tmp_path / "a", config, params)
    meta_file = tmp_path / "a" / lora.ADAPTER_CONFIG
    meta = json.loads(meta_file.read_text())
    for key, value, match in (
        ("use_dora", True, "use_dora"),
        ("target_modules", ["q_proj", "lm_head"], "lm_head"),
        ("peft_type", "IA3", "LORA"),
        ("r", 8, "expected"),
    ):
        meta_file.write_text(json.dumps({**meta, key: value}))
        with pytest.raises(ValueError, match=match):
            lora.load_peft_adapter(tmp_path / "a", base_config)
    meta_file.write_text(json.dumps(meta))
    other = dataclasses.replace(base_config, hidden_size=32)
    with pytest.raises(ValueError, match="expected"):
        lora.load_peft_adapter(tmp_path / "a", other)
    assert os.path.exists(tmp_path / "a" / lora.ADAPTER_WEIGHTS)
    with pytest.raises(ValueError, match="no LoRA"):
        lora.init_adapters(base_config, jax.random.key(0))


def test_rslora_scales_by_the_square_root_of_the_rank():
    assert LoraSpec(16, 32.0).scale == 2.0
    assert LoraSpec(16, 32.0, rslora=True).scale == 8.0  # 32 / sqrt(16)
    assert LoraSpec(1, 3.0, rslora=True).scale == LoraSpec(1, 3.0).scale == 3.0


def test_rslora_adapters_match_peft_both_ways(checkpoints, tmp_path, rng):
    """``rslora``: ours loads in peft (``use_rslora``) with our logits, and an rsLoRA adapter
    peft initialised and saved reads back with peft's logits (scale ``alpha / sqrt(r)``)."""
    path, torch_model = checkpoints["llama"]
    config, params = _lora_model(path, targets=("q", "v", "up"))
    config = dataclasses.replace(config, lora=dataclasses.replace(config.lora, rslora=True))
    lora.save_peft_adapter(tmp_path / "ours", config, params, base_model=path)
    assert json.loads((tmp_path / "ours" / lora.ADAPTER_CONFIG).read_text())["use_rslora"]
    tokens, mask = _batch(rng, config.vocab_size)
    valid = mask.astype(bool)
    peft_model = peft.PeftModel.from_pretrained(torch_model, str(tmp_path / "ours")).eval()
    want = hf_utils.hf_logits(peft_model, tokens, mask)
    peft_model.unload()
    got = np.asarray(models.logits(params, config, tokens, attention_mask=mask))
    np.testing.assert_allclose(got[valid], want[valid], atol=1e-4, rtol=1e-4)
    plain = dataclasses.replace(config, lora=dataclasses.replace(config.lora, rslora=False))
    other = np.asarray(models.logits(params, plain, tokens, attention_mask=mask))
    assert np.abs(other[valid] - want[valid]).max() > 1e-2  # the scale matters (2 vs 4)

    theirs = peft.get_peft_model(
        hf_utils.build_model("llama"),
        peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["k_proj"], use_rslora=True),
    )
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if "lora_B" in name:
                param.copy_(0.3 * torch.randn(param.shape))
    theirs.eval().save_pretrained(str(tmp_path / "theirs"))
    want = hf_utils.hf_logits(theirs, tokens, mask)
    base_config, base = models.load_pretrained(path, dtype=jnp.float32)
    spec, adapters = lora.load_peft_adapter(tmp_path / "theirs", base_config)
    assert spec == LoraSpec(RANK, ALPHA, ("k",), rslora=True)
    adapted = dataclasses.replace(base_config, lora=spec)
    got = np.asarray(
        models.logits(lora.combine(base, adapters), adapted, tokens, attention_mask=mask)
    )
    np.testing.assert_allclose(got[valid], want[valid], atol=1e-4, rtol=1e-4)
