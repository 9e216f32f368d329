"""Scalar-head (value / reward) models: alignment, HF sequence-classifier parity, init, sharding."""

import dataclasses
import functools
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import NamedSharding
from safetensors.numpy import load_file, save_file

from jaxrl_llm.data import build_char_tokenizer
from jaxrl_llm.models import (
    forward,
    init_scalar_params,
    load_scalar_model,
    save_scalar_model,
    scalar_logical_axes,
    scalar_param_shapes,
    sequence_scores,
    token_values,
)
from jaxrl_llm.models.heads import SEQ_CLS_ARCHITECTURES, backbone_config
from jaxrl_llm.packing import plan_sequences
from jaxrl_llm.parallel import PARAM_RULES, logical_to_sharding, logical_to_spec, make_mesh
from jaxrl_llm.parallel.rules import spec_for_mesh
from tests.jit_traces import count_traces
from tests.models import hf_utils
from tests.reference import heads as ref

NAMES = sorted(hf_utils.VARIANTS)
PAD_ID = hf_utils.TINY["pad_token_id"]
# Per row: real prompt length (of P=5) and real completion length (of T=6); row 2 has an empty
# completion, so its score comes from its last prompt token.
PROMPT_LENGTHS = [5, 3, 1, 4]
COMPLETION_LENGTHS = [4, 6, 0, 2]

jit_values = jax.jit(token_values, static_argnums=1, static_argnames="remat")
jit_scores = jax.jit(sequence_scores, static_argnums=1, static_argnames="remat")


@functools.partial(jax.jit, static_argnums=1)
def jit_forward(params, config, tokens, mask):
    return forward(params, config, tokens, attention_mask=mask)


def _batch(rng, vocab):
    """Left-padded prompts ``[4, 5]`` and right-padded completions ``[4, 6]`` (pad id 0)."""
    prompt, prompt_mask = hf_utils.padded_batch(rng, PROMPT_LENGTHS, 5, vocab=vocab, side="left")
    completion, completion_mask = hf_utils.padded_batch(
        rng, COMPLETION_LENGTHS, 6, vocab=vocab, side="right"
    )
    return prompt, prompt_mask, completion, completion_mask


def _hf_seq_cls(name, path, *, seed, num_labels=1):
    """A randomised float32 ``*ForSequenceClassification`` saved to ``path``."""
    config = hf_utils.hf_config(name, num_labels=num_labels)
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_config(
        config, attn_implementation="eager"
    )
    # O(1) weights as in ``hf_utils.build_model``, the classifier's ``score`` included.
    model = hf_utils.randomise_weights(model.to(torch.float32).eval(), seed + 1)
    model.save_pretrained(path)
    return model


def _hf_run(model, prompt, prompt_mask, completion, completion_mask):
    """HF scores ``[B]`` and final hidden states on right-padded compact rows."""
    tokens, mask, lengths = ref.compact_right_padded(
        prompt, prompt_mask, completion, completion_mask, PAD_ID
    )
    with torch.no_grad():
        ids = torch.as_tensor(tokens)
        attn = torch.as_tensor(mask)
        scores = model(input_ids=ids, attention_mask=attn).logits[:, 0].numpy()
        hidden = model.model(input_ids=ids, attention_mask=attn).last_hidden_state.numpy()
    return scores, hidden, lengths


def _hf_token_values(model, hidden, lengths, completion_mask):
    """``score(h)`` at the compact column that predicts each completion token."""
    weights = model.score.weight.detach().numpy().T
    out = np.zeros(completion_mask.shape)
    for b, start in enumerate(lengths):
        for t in range(completion_mask.shape[1]):
            if completion_mask[b, t]:
                out[b, t] = hidden[b, start - 1 + t] @ weights[:, 0]
    return out


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    """name -> (causal-LM directory, config, f32 policy params)."""
    loaded = hf_utils.load_variants(tmp_path_factory, NAMES, first_seed=20, prefix="policy_")
    return {name: (path, config, params) for name, (_, config, params, path) in loaded.items()}


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory):
    """name -> (seq-cls directory, torch model)."""
    out = {}
    for i, name in enumerate(NAMES):
        path = str(tmp_path_factory.mktemp(f"seqcls_{name}"))
        out[name] = (path, _hf_seq_cls(name, path, seed=40 + i))
    return out


def _scalar_from_policy(policies, name, seed=0):
    _, config, policy = policies[name]
    # A head of O(1) scores so a misaligned or mis-pooled state cannot hide in the tolerance.
    std = 1.0 / np.sqrt(config.hidden_size)
    params = init_scalar_params(config, jax.random.key(seed), backbone=policy, score_std=std)
    # Committed like loaded params, so both share one compiled program per config.
    return config, jax.device_put(params, jax.devices()[0])


# --- token_values ---------------------------------------------------------------------------


# Tied (llama) and untied with q/k norms (qwen3); the other variants' backbones differ only
# inside `forward`, which tests/models/test_transformer.py checks against transformers.
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_token_values_equal_hidden_at_prompt_minus_one_times_score(policies, name, rng):
    config, params = _scalar_from_policy(policies, name)
    prompt, prompt_mask, completion, completion_mask = _batch(rng, config.vocab_size)
    values = jit_values(params, config, prompt, prompt_mask, completion, completion_mask)
    chex.assert_shape(values, completion.shape)
    chex.assert_type(values, jnp.float32)

    tokens = np.concatenate([prompt, completion], axis=1)
    mask = np.concatenate([prompt_mask, completion_mask], axis=1)
    hidden, _ = jit_forward(params["backbone"], backbone_config(config), tokens, mask)
    want = ref.token_values(hidden, params["score"], prompt.shape[1], completion_mask)
    np.testing.assert_allclose(values, want, atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(values)[completion_mask == 0] == 0.0)
    assert np.abs(want[completion_mask == 1]).max() > 0.1


def test_token_values_match_transformers_hidden_times_score(classifiers, rng):
    path, model = classifiers["qwen3"]
    config, params = load_scalar_model(path)
    prompt, prompt_mask, completion, completion_mask = _batch(rng, config.vocab_size)
    values = jit_values(params, config, prompt, prompt_mask, completion, completion_mask)
    _, hidden, lengths = _hf_run(model, prompt, prompt_mask, completion, completion_mask)
    want = _hf_token_values(model, hidden, lengths, completion_mask)
    np.testing.assert_allclose(values, want, atol=1e-4, rtol=1e-4)


def test_left_padded_prompts_give_the_unpadded_values(policies, rng):
    config, params = _scalar_from_policy(policies, "llama")
    prompt, prompt_mask, completion, completion_mask = _batch(rng, config.vocab_size)
    args = (completion, completion_mask)
    values = jit_values(params, config, prompt, prompt_mask, *args)
    scores = jit_scores(params, config, prompt, prompt_mask, *args)
    # Row 1 (3 real tokens left-padded to 5) equals the same row run alone without padding.
    b, length = 1, PROMPT_LENGTHS[1]
    alone = (prompt[b : b + 1, -length:], prompt_mask[b : b + 1, -length:])
    row = (completion[b : b + 1], completion_mask[b : b + 1])
    np.testing.assert_allclose(
        jit_values(params, config, *alone, *row)[0], values[b], atol=1e-5, rtol=1e-5
    )
    np.testing.assert_allclose(
        jit_scores(params, config, *alone, *row)[0], scores[b], atol=1e-5, rtol=1e-5
    )


def test_masked_completion_tokens_change_nothing(policies, rng):
    config, params = _scalar_from_policy(policies, "llama")
    prompt, prompt_mask, completion, completion_mask = _batch(rng, config.vocab_size)
    other = np.where(completion_mask == 1, completion, rng.integers(3, config.vocab_size, 1))
    args = (prompt, prompt_mask)
    values = jit_values(params, config, *args, completion, completion_mask)
    values_other = jit_values(params, config, *args, other.astype(np.int32), completion_mask)
    np.testing.assert_array_equal(values, values_other)
    scores = jit_scores(params, config, *args, completion, completion_mask)
    scores_other = jit_scores(params, config, *args, other.astype(np.int32), completion_mask)
    np.testing.assert_array_equal(scores, scores_other)


def test_gradient_wrt_score_is_the_sum_of_scored_hidden_states(policies, rng):
    config, params = _scalar_from_policy(policies, "llama")
    prompt, prompt_mask, completion, completion_mask = _batch(rng, config.vocab_size)
    args = (prompt, prompt_mask, completion, completion_mask)

    def total(score):
        # Only the head's gradient: the backbone's backward pass is the transformer's, tested
        # with the train step, and compiling it here would double this test's time.
        p = {**params, "score": score}
        return jnp.sum(token_values(p, config, *args)) + jnp.sum(sequence_scores(p, config, *args))

    grad = jax.jit(jax.grad(total))(params["score"])
    assert bool(jnp.all(jnp.isfinite(grad)))
    tokens = np.concatenate([prompt, completion], axis=1)
    mask = np.concatenate([prompt_mask, completion_mask], axis=1)
    hidden, _ = jit_forward(params["backbone"], backbone_config(config), tokens, mask)
    hidden = np.asarray(hidden, np.float64)
    want = np.zeros(config.hidden_size)
    for b in range(prompt.shape[0]):
        for t in range(completion.shape[1]):
            if completion_mask[b, t]:
                want += hidden[b, prompt.shape[1] - 1 + t]
        want += hidden[b, np.flatnonzero(mask[b])[-1]]
    np.testing.assert_allclose(grad[:, 0], want, atol=1e-4, rtol=1e-5)


def test_bfloat16_params_give_float32_values(policies, rng):
    config, params = _scalar_from_policy(policies, "qwen3")
    prompt, prompt_mask, completion, completion_mask = _batch(rng, config.vocab_size)
    args = (prompt, prompt_mask, completion, completion_mask)
    values = jit_values(params, config, *args)
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    half_values = jit_values(half, config, *args)
    chex.assert_type(half_values, jnp.float32)
    # bf16 weights and activations: a loose check that it computes the same function.
    np.testing.assert_allclose(half_values, values, atol=0.25)


# --- sequence_scores vs transformers --------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_saved_model_scores_like_transformers_sequence_classifier(policies, name, rng, tmp_path):
    config, params = _scalar_from_policy(policies, name, seed=3)
    prompt, prompt_mask, completion, completion_mask = _batch(rng, config.vocab_size)
    scores = jit_scores(params, config, prompt, prompt_mask, completion, completion_mask)
    chex.assert_shape(scores, (prompt.shape[0],))

    out = str(tmp_path / "rm")
    save_scalar_model(out, config, params)
    model, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(model).__name__ == SEQ_CLS_ARCHITECTURES[config.architecture]
    assert model.config.num_labels == 1 and model.config.pad_token_id == PAD_ID
    want, _, _ = _hf_run(model.eval(), prompt, prompt_mask, completion, completion_mask)
    np.testing.assert_allclose(scores, want, atol=1e-4, rtol=1e-4)
    assert np.abs(want).max() > 0.1

    # Our loader reads back exactly what was written, with the same (causal) config.
    config2, params2 = load_scalar_model(out)
    assert config2 == config
    chex.assert_trees_all_equal(params2, params)


@pytest.mark.parametrize("name", NAMES)
def test_transformers_classifier_loads_with_same_scores(classifiers, name, rng):
    path, model = classifiers[name]
    config, params = load_scalar_model(path)
    assert config.architecture == model.config.architectures[0].replace(
        "ForSequenceClassification", "ForCausalLM"
    )
    chex.assert_trees_all_equal_shapes_and_dtypes(params, scalar_param_shapes(config))
    np.testing.assert_array_equal(params["score"][:, 0], model.score.weight.detach().numpy()[0])
    prompt, prompt_mask, completion, completion_mask = _batch(rng, config.vocab_size)
    scores = jit_scores(params, config, prompt, prompt_mask, completion, completion_mask)
    want, hidden, _ = _hf_run(model, prompt, prompt_mask, completion, completion_mask)
    np.testing.assert_allclose(scores, want, atol=1e-4, rtol=1e-4)
    # And HF's pooling agrees with the float64 reference pooling over its own states.
    _, compact_mask, _ = ref.compact_right_padded(
        prompt, prompt_mask, completion, completion_mask, PAD_ID
    )
    np.testing.assert_allclose(
        ref.sequence_scores(hidden, params["score"], compact_mask), want, atol=1e-5, rtol=1e-5
    )


def test_sequence_scores_pool_the_last_real_token(policies, rng):
    config, params = _scalar_from_policy(policies, "llama")
    prompt, prompt_mask, completion, completion_mask = _batch(rng, config.vocab_size)
    scores = jit_scores(params, config, prompt, prompt_mask, completion, completion_mask)
    tokens = np.concatenate([prompt, completion], axis=1)
    mask = np.concatenate([prompt_mask, completion_mask], axis=1)
    hidden, _ = jit_forward(params["backbone"], backbone_config(config), tokens, mask)
    np.testing.assert_allclose(
        scores, ref.sequence_scores(hidden, params["score"], mask), atol=1e-5, rtol=1e-5
    )
    # The value of the last real completion token's predecessor differs from the pooled score:
    # the score reads the state *after* the last token.
    values = jit_values(params, config, prompt, prompt_mask, completion, completion_mask)
    assert not np.isclose(scores[0], values[0, COMPLETION_LENGTHS[0] - 1])


def test_sharded_checkpoint_files_round_trip(policies, tmp_path, rng):
    config, params = _scalar_from_policy(policies, "qwen2")
    out = str(tmp_path / "sharded")
    save_scalar_model(out, config, params, max_shard_size=20_000)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert "score.weight" in index["weight_map"]
    assert len(set(index["weight_map"].values())) > 1
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        out, dtype=torch.float32
    ).eval()
    np.testing.assert_array_equal(
        model.score.weight.detach().numpy().T, np.asarray(params["score"])
    )
    config2, params2 = load_scalar_model(out)
    assert config2 == config
    chex.assert_trees_all_equal(params2, params)


def test_save_writes_tokenizer_and_takes_its_pad_id(policies, tmp_path):
    config, params = _scalar_from_policy(policies, "llama")
    tokenizer = build_char_tokenizer("abc")
    no_pad = dataclasses.replace(config, pad_token_id=None)
    out = str(tmp_path / "with_tok")
    save_scalar_model(out, no_pad, params, tokenizer=tokenizer)
    assert os.path.exists(os.path.join(out, "tokenizer_config.json"))
    with open(os.path.join(out, "config.json")) as f:
        hf = json.load(f)
    assert hf["pad_token_id"] == tokenizer.pad_token_id
    assert hf["architectures"] == ["LlamaForSequenceClassification"]
    assert hf["tie_word_embeddings"] == config.tie_word_embeddings
    reloaded = transformers.AutoTokenizer.from_pretrained(out)
    assert reloaded.pad_token_id == tokenizer.pad_token_id


# --- init -----------------------------------------------------------------------------------


def test_init_from_policy_copies_the_backbone(policies):
    _, config, policy = policies["qwen3"]
    assert "lm_head" in policy
    params = init_scalar_params(config, jax.random.key(1), backbone=policy)
    assert "lm_head" not in params["backbone"]
    want = {k: v for k, v in policy.items() if k != "lm_head"}
    chex.assert_trees_all_equal(params["backbone"], want)
    # Copies, not aliases: donating one model's buffers must not delete the other's.
    for got, orig in zip(jax.tree.leaves(params["backbone"]), jax.tree.leaves(want)):
        assert got.unsafe_buffer_pointer() != orig.unsafe_buffer_pointer()
    chex.assert_shape(params["score"], (config.hidden_size, 1))
    assert 0.01 < float(jnp.std(params["score"])) < 0.04  # HF initializer_range 0.02
    # A scalar model is accepted as the backbone source too (e.g. critic from a reward model).
    again = init_scalar_params(config, jax.random.key(2), backbone=params)
    chex.assert_trees_all_equal(again["backbone"], params["backbone"])
    zero = init_scalar_params(config, jax.random.key(2), backbone=policy, score_std=0.0)
    assert not np.any(np.asarray(zero["score"]))


def test_random_init_traces_to_the_declared_shapes_and_axes(policies):
    _, config, _ = policies["llama"]
    # eval_shape traces the whole init (what jit(init, out_shardings=...) needs) without the
    # slow compile of every random leaf.
    shapes = jax.eval_shape(
        functools.partial(init_scalar_params, config, dtype=jnp.bfloat16), jax.random.key(0)
    )
    chex.assert_trees_all_equal_shapes_and_dtypes(shapes, scalar_param_shapes(config, jnp.bfloat16))
    axes = scalar_logical_axes(config)
    assert axes["score"] == ("embed", None)
    is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
    assert jax.tree.structure(axes, is_leaf=is_axes) == jax.tree.structure(shapes)
    for leaf_axes, leaf in zip(jax.tree.leaves(axes, is_leaf=is_axes), jax.tree.leaves(shapes)):
        assert len(leaf_axes) == leaf.ndim


def test_second_call_does_not_recompile(policies, rng):
    config, params = _scalar_from_policy(policies, "llama")
    prompt, prompt_mask, completion, completion_mask = _batch(rng, config.vocab_size)
    with count_traces("sequence_scores") as traced:
        jit_scores(params, config, prompt, prompt_mask, completion, completion_mask)
        jit_scores(params, config, prompt + 1, prompt_mask, completion, completion_mask)
    assert len(traced) <= 1  # the first call's (none when an earlier test compiled it)


# --- sharding -------------------------------------------------------------------------------


def test_sharded_load_and_init_land_in_named_shardings(classifiers):
    path, _ = classifiers["llama"]
    mesh = make_mesh(data=1, fsdp=4, tensor=2)
    config, sharded = load_scalar_model(path, mesh=mesh)
    _, plain = load_scalar_model(path)
    axes = scalar_logical_axes(config)
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    for leaf, leaf_axes in zip(jax.tree.leaves(sharded), flat_axes):
        assert isinstance(leaf.sharding, NamedSharding)
        want = spec_for_mesh(logical_to_spec(leaf_axes, PARAM_RULES), mesh.axis_names)
        assert leaf.sharding.spec == want
    assert sharded["score"].sharding.spec[0] == "fsdp"
    chex.assert_trees_all_equal(jax.device_get(sharded), jax.device_get(plain))

    # A critic born sharded from a sharded backbone (PPO's value model from the policy).
    shardings = logical_to_sharding(axes, mesh, PARAM_RULES, shapes=scalar_param_shapes(config))
    init = jax.jit(
        lambda key, backbone: init_scalar_params(config, key, backbone=backbone),
        out_shardings=shardings,
    )
    born = init(jax.random.key(0), sharded["backbone"])
    chex.assert_trees_all_equal(jax.device_get(born["backbone"]), jax.device_get(plain["backbone"]))
    # Outside jit the copied backbone keeps the policy's shardings (no gather to one device).
    eager = init_scalar_params(config, jax.random.key(0), backbone=sharded)
    for leaf, orig in zip(jax.tree.leaves(eager["backbone"]), jax.tree.leaves(sharded["backbone"])):
        assert leaf.sharding == orig.sharding
    for leaf, want_sharding in zip(jax.tree.leaves(born), jax.tree.leaves(shardings)):
        assert leaf.sharding == want_sharding


# --- loading a causal LM, errors ------------------------------------------------------------


def test_causal_lm_directory_needs_init_score_key(policies):
    path, config, policy = policies["qwen3"]
    with pytest.raises(ValueError, match="score.weight"):
        load_scalar_model(path)
    loaded_config, params = load_scalar_model(path, init_score_key=jax.random.key(0))
    assert loaded_config == config
    chex.assert_trees_all_equal(
        params["backbone"], {k: v for k, v in policy.items() if k != "lm_head"}
    )
    chex.assert_shape(params["score"], (config.hidden_size, 1))
    assert 0.01 < float(jnp.std(params["score"])) < 0.04


def test_wrong_params_raise(policies, rng):
    config, params = _scalar_from_policy(policies, "llama")
    prompt, prompt_mask, completion, completion_mask = _batch(rng, config.vocab_size)
    args = (prompt, prompt_mask, completion, completion_mask)
    bad_score = {**params, "score": jnp.zeros((config.hidden_size, 2))}
    with pytest.raises(ValueError, match=r"\['score'\] has shape \(64, 2\)"):
        token_values(bad_score, config, *args)
    with pytest.raises(ValueError, match="keys"):
        sequence_scores({"backbone": params["backbone"]}, config, *args)
    backbone = {k: v for k, v in params["backbone"].items() if k != "final_norm"}
    with pytest.raises(ValueError, match="final_norm"):
        token_values({**params, "backbone": backbone}, config, *args)
    with pytest.raises(ValueError, match="final_norm"):
        init_scalar_params(config, jax.random.key(0), backbone=backbone)
    with pytest.raises(ValueError, match="score"):
        save_scalar_model("/nonexistent/never", config, bad_score)
    with pytest.raises(ValueError, match="score_std"):
        init_scalar_params(config, jax.random.key(0), score_std=-1.0)


def test_wrong_inputs_raise(policies, rng):
    config, params = _scalar_from_policy(policies, "llama")
    prompt, prompt_mask, completion, completion_mask = _batch(rng, config.vocab_size)
    with pytest.raises(ValueError, match="batch"):
        token_values(params, config, prompt[:2], prompt_mask[:2], completion, completion_mask)
    with pytest.raises(ValueError, match="completion_mask"):
        sequence_scores(params, config, prompt, prompt_mask, completion, completion_mask[:, :3])
    with pytest.raises(ValueError, match="prompt_tokens"):
        token_values(params, config, prompt[0], prompt_mask[0], completion, completion_mask)


def test_missing_files_and_bad_checkpoints_raise(classifiers, policies, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_scalar_model(str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_scalar_model(str(empty))

    path, _ = classifiers["mistral"]
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    with open(no_weights / "config.json", "w") as f:
        json.dump(hf, f)
    with pytest.raises(ValueError, match="safetensors"):
        load_scalar_model(str(no_weights))

    two_labels = tmp_path / "two_labels"
    _hf_seq_cls("mistral", str(two_labels), seed=0, num_labels=2)
    with pytest.raises(ValueError, match="num_labels=1"):
        load_scalar_model(str(two_labels))

    config, params = _scalar_from_policy(policies, "mistral")
    bad = str(tmp_path / "bad_score")
    save_scalar_model(bad, config, params)
    file = os.path.join(bad, "model.safetensors")
    tensors = load_file(file)
    tensors["score.weight"] = np.zeros((1, config.hidden_size + 1), np.float32)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"score.weight.*\(1, 65\)"):
        load_scalar_model(bad)
    del tensors["score.weight"], tensors["model.norm.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_scalar_model(bad, init_score_key=jax.random.key(0))


def test_save_without_any_pad_id_raises(policies, tmp_path):
    config, params = _scalar_from_policy(policies, "llama")
    bare = dataclasses.replace(config, pad_token_id=None, eos_token_ids=())
    with pytest.raises(ValueError, match="pad token id"):
        save_scalar_model(str(tmp_path / "x"), bare, params)


@pytest.mark.parametrize("name", NAMES)
def test_packed_rows_give_the_padded_values(policies, name, rng):
    """``packing``: the backbone over packed rows (two sequences a row), the head on the
    states put back: the padded values, to float rounding."""
    config, params = _scalar_from_policy(policies, name)
    prompt, prompt_mask, completion, completion_mask = _batch(rng, config.vocab_size)
    plan = plan_sequences(prompt_mask, completion_mask)
    assert plan.rows < len(prompt)  # some rows do share
    want = jit_values(params, config, prompt, prompt_mask, completion, completion_mask)
    got = jax.jit(token_values, static_argnums=1)(
        params, config, prompt, prompt_mask, completion, completion_mask, packing=plan
    )
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_packed_rows_give_the_padded_scores(policies, name, rng):
    """``sequence_scores(packing=)``: the backbone over packed rows, the states put back, the
    head at each row's last real token: the float64 pooling of the padded forward's states."""
    config, params = _scalar_from_policy(policies, name)
    prompt, prompt_mask, completion, completion_mask = _batch(rng, config.vocab_size)
    completion_mask[1] = 0  # an empty completion: scored at its last prompt token
    plan = plan_sequences(prompt_mask, completion_mask)
    assert plan.rows < len(prompt)  # some rows do share
    got = jax.jit(sequence_scores, static_argnums=1)(
        params, config, prompt, prompt_mask, completion, completion_mask, packing=plan
    )
    tokens = np.concatenate([prompt, completion], axis=1)
    mask = np.concatenate([prompt_mask, completion_mask], axis=1)
    hidden, _ = jit_forward(params["backbone"], backbone_config(config), tokens, mask)
    want = ref.sequence_scores(hidden, params["score"], mask)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
