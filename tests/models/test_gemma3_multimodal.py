"""Multimodal Gemma 3 checkpoints (``Gemma3ForConditionalGeneration``) trained on text: the
loader reads their language model, the logits equal transformers' wrapper on text-only input,
and a save with ``source=`` writes a wrapper transformers loads, with the vision tower and
projector copied through bit for bit and the language model's tensors updated.

The tiny checkpoint (``hf_utils.build_gemma3_multimodal``) is the ``gemma3`` text variant (four
layers, a window of 6 slots, its own RoPE base on the sliding layers) beside a one-layer SigLIP
tower, saved by transformers (tensor names ``language_model.model.*``, ``vision_tower.*``,
``multi_modal_projector.*``; the tied ``lm_head`` not stored).
"""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from jaxrl_llm.models import ModelConfig, load_pretrained, logits, save_pretrained
from jaxrl_llm.models.config import language_model_dict
from tests.models import hf_utils

SEQ = 20  # > the window of 6: the sliding layers drop keys
LM_PREFIX = "language_model.model."
OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.")

jit_logits = jax.jit(logits, static_argnums=1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(torch wrapper, checkpoint dir, config, f32 params)."""
    path = str(tmp_path_factory.mktemp("gemma3_mm"))
    model = hf_utils.build_gemma3_multimodal(path, seed=90)
    config, params = load_pretrained(path, dtype=jnp.float32)
    return model, path, config, params


def _read_config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _checkpoint_of(tensors, config_from, out):
    """Writes ``tensors`` as ``out/model.safetensors`` beside ``config_from``'s config.json."""
    os.makedirs(out)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(config_from, "config.json"), os.path.join(out, "config.json"))
    return out


def test_config_is_the_text_model(checkpoint):
    _, path, config, _ = checkpoint
    assert _read_config(path)["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert config == ModelConfig.from_hf_dict(hf_utils.hf_dict("gemma3"))
    assert config.architecture == "Gemma3ForCausalLM" and config.sliding_window == 6


@pytest.mark.parametrize("side", ["left", "none"])
def test_logits_match_the_transformers_wrapper_on_text(checkpoint, side, rng):
    """Prefill logits past the window (f32, relative 1e-4) against transformers' wrapper fed
    the same token ids, padding mask and positions."""
    model, _, config, params = checkpoint
    lengths = [SEQ, SEQ] if side == "none" else [SEQ, 15, 3]
    tokens, mask = hf_utils.padded_batch(rng, lengths, SEQ, vocab=128, side=side)
    want = hf_utils.hf_logits(model, tokens, mask)
    got = np.asarray(jit_logits(params, config, tokens, attention_mask=mask))
    real = mask.astype(bool)
    assert np.abs(want[real]).max() > 3.0
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=1e-4)


def test_transformers5_in_memory_names_load_the_same(checkpoint, tmp_path):
    """The ``model.language_model.*`` / ``model.vision_tower.*`` layout (transformers 5's
    module names) loads as the same parameters."""
    model, path, config, params = checkpoint
    state = {k: v.numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert any(k.startswith("model.language_model.") for k in state)
    out = _checkpoint_of(state, path, str(tmp_path / "renamed"))
    config2, params2 = load_pretrained(out, dtype=jnp.float32)
    assert config2 == config
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_save_writes_the_wrapper_with_the_towers_copied_through(checkpoint, tmp_path, rng):
    model, path, config, params = checkpoint
    # A training step's worth of change to every language-model tensor.
    trained = jax.tree.map(lambda x: x + 0.01 * jnp.sign(x) + 0.003, params)
    out = str(tmp_path / "saved")
    save_pretrained(out, config, trained, source=path)
    source = load_file(os.path.join(path, "model.safetensors"))
    saved = load_file(os.path.join(out, "model.safetensors"))
    assert set(saved) == set(source)
    towers = [k for k in source if k.startswith(OTHER_TOWERS)]
    assert len(towers) > 10
    for key in towers:
        np.testing.assert_array_equal(saved[key], source[key], err_msg=key)
    lm = [k for k in source if k.startswith(LM_PREFIX)]
    assert len(lm) + len(towers) == len(source)
    assert all(not np.array_equal(saved[k], source[k]) for k in lm)
    written = _read_config(out)
    assert written["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert written["vision_config"] == _read_config(path)["vision_config"]
    # transformers loads it as a wrapper computing our logits of the trained params.
    reloaded = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32
    ).eval()
    tokens, mask = hf_utils.padded_batch(rng, [SEQ, 11], SEQ, vocab=128, side="left")
    real = mask.astype(bool)
    want = hf_utils.hf_logits(reloaded, tokens, mask)
    got = np.asarray(jit_logits(trained, config, tokens, attention_mask=mask))
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=1e-4)
    theirs = model.model.vision_tower.state_dict()
    for name, param in reloaded.model.vision_tower.state_dict().items():
        np.testing.assert_array_equal(param.numpy(), theirs[name].numpy(), err_msg=name)
    # And we read it back as the trained params.
    config2, params2 = load_pretrained(out, dtype=jnp.float32)
    assert config2 == config
    jax.tree.map(np.testing.assert_array_equal, params2, trained)


def test_save_in_place_and_sharded(checkpoint, tmp_path):
    """``source`` may be the output directory; sharded saves keep every tensor."""
    _, path, config, params = checkpoint
    first = str(tmp_path / "first")
    save_pretrained(first, config, params, source=path)
    want = load_file(os.path.join(first, "model.safetensors"))
    save_pretrained(first, config, params, source=first, max_shard_size=20_000)
    assert not os.path.exists(os.path.join(first, "model.safetensors"))
    got = {}
    for name in os.listdir(first):
        if name.endswith(".safetensors"):
            got.update(load_file(os.path.join(first, name)))
    assert set(got) == set(want)
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_text_only_source_writes_a_text_checkpoint(checkpoint, tmp_path):
    _, _, config, params = checkpoint
    text = str(tmp_path / "text")
    save_pretrained(text, config, params)
    out = str(tmp_path / "out")
    save_pretrained(out, config, params, source=text)
    assert _read_config(out)["architectures"] == ["Gemma3ForCausalLM"]


def test_save_refuses_a_source_of_another_model(checkpoint, tmp_path):
    _, path, config, params = checkpoint
    other = dataclasses.replace(config, rope_local_theta=50.0)
    with pytest.raises(ValueError, match=r"differs from config in \['rope_local_theta'\]"):
        save_pretrained(str(tmp_path / "x"), other, params, source=path)


def test_load_refuses_a_wrapper_without_a_language_model(checkpoint, tmp_path):
    _, path, _, _ = checkpoint
    tensors = load_file(os.path.join(path, "model.safetensors"))
    towers = {k: v for k, v in tensors.items() if k.startswith(OTHER_TOWERS)}
    out = _checkpoint_of(towers, path, str(tmp_path / "towers_only"))
    with pytest.raises(ValueError, match="language_model.model.embed_tokens.weight"):
        load_pretrained(out, dtype=jnp.float32)


def test_load_refuses_unknown_tensors_in_a_wrapper(checkpoint, tmp_path):
    _, path, _, _ = checkpoint
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["audio_tower.weight"] = np.zeros(3, np.float32)
    out = _checkpoint_of(tensors, path, str(tmp_path / "extra"))
    with pytest.raises(ValueError, match="unexpected tensor.*audio_tower.weight"):
        load_pretrained(out, dtype=jnp.float32)


def _wrapper(**update):
    hf = hf_utils.gemma3_multimodal_config().to_dict()
    hf["architectures"] = ["Gemma3ForConditionalGeneration"]
    hf.update(update)
    return hf


@pytest.mark.parametrize(
    "update, match",
    [
        ({"text_config": None}, "needs a text_config mapping"),
        ({"text_config": {"model_type": "gemma2"}}, "model_type 'gemma2'"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings=False"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantised"),
    ],
)
def test_refuses_what_it_does_not_run(update, match):
    with pytest.raises(ValueError, match=match) as err:
        ModelConfig.from_hf_dict(_wrapper(**update))
    assert "\n" not in str(err.value)


def test_refuses_text_settings_the_wrapper_ignores():
    hf = _wrapper()
    hf["text_config"] = {**hf["text_config"], "final_logit_softcapping": 30.0}
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        ModelConfig.from_hf_dict(hf)
    hf = _wrapper()
    hf["text_config"] = {**hf["text_config"], "tie_word_embeddings": False}
    with pytest.raises(ValueError, match="text_config.tie_word_embeddings=False"):
        ModelConfig.from_hf_dict(hf)


def test_wrapper_token_ids_take_precedence():
    """The released wrappers list the end-of-turn id beside eos at the top level."""
    hf = _wrapper(eos_token_id=[1, 106])
    assert language_model_dict(hf)["eos_token_id"] == [1, 106]
    assert ModelConfig.from_hf_dict(hf).eos_token_ids == (1, 106)
    # model_type alone (no architectures) is recognised too.
    del hf["architectures"]
    assert ModelConfig.from_hf_dict(hf).architecture == "Gemma3ForCausalLM"
