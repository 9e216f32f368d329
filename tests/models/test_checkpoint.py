"""Safetensors load/save: HF round trips, sharded files, errors, and mesh placement."""

import glob
import json
import os
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from safetensors.numpy import load_file, save_file

from jaxrl_llm.models import checkpoint as ckpt
from jaxrl_llm.models import load_pretrained, logical_axes, save_pretrained
from tests.models import hf_utils

NAMES = sorted(hf_utils.VARIANTS)
# A small rule table of our own (the parallel layer has its own tables).
LOCAL_RULES = {
    "embed": "fsdp",
    "vocab": "tensor",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    **dict.fromkeys(("batch", "head_dim", "layers", "cache_seq")),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory, torch model)."""
    out = {}
    for i, name in enumerate(NAMES):
        path = str(tmp_path_factory.mktemp(name))
        out[name] = (path, hf_utils.build_checkpoint(name, path, seed=10 + i))
    return out


def _copy(src, tmp_path, name="copy"):
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path, edit):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("name", NAMES)
def test_save_reloads_in_transformers_with_same_logits(checkpoints, name, tmp_path, rng):
    path, torch_model = checkpoints[name]
    config, params = load_pretrained(path, dtype=jnp.float32)
    out = str(tmp_path / "saved")
    save_pretrained(out, config, params)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32
    ).eval()
    assert type(reloaded) is type(torch_model)
    tokens = rng.integers(3, config.vocab_size, size=(2, 9))
    np.testing.assert_allclose(
        _torch_logits(reloaded, tokens), _torch_logits(torch_model, tokens), atol=1e-5, rtol=1e-5
    )
    # And our own loader reads back exactly what was written.
    config2, params2 = load_pretrained(out, dtype=jnp.float32)
    assert config2 == config
    chex.assert_trees_all_equal(params2, params)


def test_index_sharded_checkpoint_loads(checkpoints, tmp_path):
    path, torch_model = checkpoints["qwen3"]
    sharded = str(tmp_path / "sharded")
    torch_model.save_pretrained(sharded, max_shard_size="40KB")
    assert os.path.exists(os.path.join(sharded, ckpt.INDEX_FILE))
    assert len(glob.glob(os.path.join(sharded, "*.safetensors"))) > 2
    config, params = load_pretrained(sharded, dtype=jnp.float32)
    config1, params1 = load_pretrained(path, dtype=jnp.float32)
    assert config == config1
    chex.assert_trees_all_equal(params, params1)


def test_save_sharded_round_trip(checkpoints, tmp_path, rng):
    path, torch_model = checkpoints["llama"]
    config, params = load_pretrained(path, dtype=jnp.float32)
    out = str(tmp_path / "ours_sharded")
    save_pretrained(out, config, params, max_shard_size=30_000)
    with open(os.path.join(out, ckpt.INDEX_FILE)) as f:
        weight_map = json.load(f)["weight_map"]
    assert len(set(weight_map.values())) > 2
    assert "lm_head.weight" not in weight_map  # tied
    chex.assert_trees_all_equal(load_pretrained(out, dtype=jnp.float32)[1], params)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = rng.integers(3, config.vocab_size, size=(1, 5))
    np.testing.assert_allclose(
        _torch_logits(reloaded, tokens), _torch_logits(torch_model, tokens), atol=1e-5, rtol=1e-5
    )
    # Saving again unsharded replaces the shards instead of leaving a stale index behind.
    save_pretrained(out, config, params)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


def test_transformers4_config_loads_the_same_model(checkpoints, tmp_path, rng):
    path, torch_model = checkpoints["llama"]
    old = _copy(path, tmp_path)
    with open(os.path.join(old, "config.json")) as f:
        rope = json.load(f)["rope_parameters"]
    theta = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    hf_utils.rewrite_config(
        old, {"rope_theta": theta, "rope_scaling": rope}, remove=("rope_parameters",)
    )
    config_old, params_old = load_pretrained(old, dtype=jnp.float32)
    config_new, params_new = load_pretrained(path, dtype=jnp.float32)
    assert config_old == config_new
    chex.assert_trees_all_equal(params_old, params_new)
    # transformers agrees that it is the same model.
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(old, dtype=torch.float32).eval()
    tokens = rng.integers(3, 128, size=(1, 20))
    np.testing.assert_allclose(
        _torch_logits(reloaded, tokens), _torch_logits(torch_model, tokens), atol=1e-5, rtol=1e-5
    )


def test_dtype_conversion_and_bf16_save(checkpoints, tmp_path):
    path, torch_model = checkpoints["mistral"]
    config, params = load_pretrained(path)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    want = torch_model.model.layers[1].self_attn.q_proj.weight.detach().numpy()
    got = np.asarray(params["layers"]["wq"][1], np.float32)  # [D, N, H]
    np.testing.assert_allclose(got.reshape(config.hidden_size, -1).T, want, rtol=1e-2, atol=1e-2)
    out = str(tmp_path / "bf16")
    save_pretrained(out, config, params)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert reloaded.dtype == torch.bfloat16
    chex.assert_trees_all_equal(load_pretrained(out)[1], params)


def test_ignores_rope_buffers_and_tied_lm_head_copy(checkpoints, tmp_path):
    path, _ = checkpoints["llama"]
    extra = _copy(path, tmp_path)

    def add(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]

    _edit_tensors(extra, add)
    chex.assert_trees_all_equal(
        load_pretrained(extra, dtype=jnp.float32)[1], load_pretrained(path, dtype=jnp.float32)[1]
    )


def _pop(name):
    return lambda tensors: tensors.pop(name)


def _set(name, value):
    return lambda tensors: tensors.__setitem__(name, value)


@pytest.mark.parametrize(
    "edit, match",
    [
        (_pop("model.layers.1.mlp.up_proj.weight"), r"missing .*model.layers.1.mlp.up_proj.weight"),
        (_pop("lm_head.weight"), r"missing .*lm_head.weight"),
        (
            _set("model.layers.0.self_attn.k_proj.weight", np.zeros((64, 64), np.float32)),
            r"'model.layers.0.self_attn.k_proj.weight' has shape \(64, 64\), expected \(32, 64\)",
        ),
        (
            _set("model.layers.0.self_attn.q_norm.weight", np.ones(16, np.float32)),
            r"unexpected .*q_norm",
        ),
        (_set("model.layers.2.input_layernorm.weight", np.ones(64, np.float32)), "unexpected"),
    ],
)
def test_bad_tensors_are_named(checkpoints, tmp_path, edit, match):
    path, _ = checkpoints["mistral"]
    bad = _copy(path, tmp_path)
    _edit_tensors(bad, edit)
    with pytest.raises(ValueError, match=match):
        load_pretrained(bad)


@pytest.mark.parametrize(
    "update, match",
    [
        ({"architectures": ["GPTNeoXForCausalLM"]}, "unsupported architecture"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "unknown rope type"),
    ],
)
def test_bad_configs(checkpoints, tmp_path, update, match):
    path, _ = checkpoints["qwen2"]
    bad = _copy(path, tmp_path)
    hf_utils.rewrite_config(bad, update)
    with pytest.raises(ValueError, match=match):
        load_pretrained(bad)


def test_missing_files(checkpoints, tmp_path):
    path, _ = checkpoints["qwen2"]
    no_weights = _copy(path, tmp_path)
    os.remove(os.path.join(no_weights, "model.safetensors"))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_pretrained(no_weights)
    with pytest.raises(ValueError, match="no config.json"):
        load_pretrained(str(tmp_path))


def test_save_rejects_mismatched_params(checkpoints, tmp_path):
    path, _ = checkpoints["qwen2"]
    config, params = load_pretrained(path, dtype=jnp.float32)
    wrong = jax.tree.map(lambda x: x, params)
    wrong["layers"]["wq"] = wrong["layers"]["wq"][:, :, :2]
    with pytest.raises(ValueError, match="layers/wq has shape"):
        save_pretrained(str(tmp_path / "x"), config, wrong)
    del wrong["layers"]["bq"]
    with pytest.raises(ValueError, match="missing"):
        save_pretrained(str(tmp_path / "x"), config, wrong)


def _mesh():
    return jax.make_mesh((1, 4, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 3)


def _local_shardings(config, mesh):
    def spec(axes):
        return NamedSharding(mesh, PartitionSpec(*[LOCAL_RULES.get(a) for a in axes]))

    return jax.tree.map(spec, logical_axes(config), is_leaf=lambda x: isinstance(x, tuple))


@pytest.mark.needs_devices(8)
@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_load_places_each_param_in_its_sharding(checkpoints, name, monkeypatch):
    path, _ = checkpoints[name]
    mesh = _mesh()
    config, reference = load_pretrained(path, dtype=jnp.float32)
    shardings = _local_shardings(config, mesh)
    reads = []
    original_read = ckpt._Layout.read

    def recording_read(self, tensor, index):
        block = original_read(self, tensor, index)
        reads.append((self.shape, block.shape))
        return block

    monkeypatch.setattr(ckpt._Layout, "read", recording_read)
    _, params = load_pretrained(path, dtype=jnp.float32, shardings=shardings)
    placed = jax.tree.map(lambda p, s: p.sharding.is_equivalent_to(s, p.ndim), params, shardings)
    assert all(jax.tree.leaves(placed))
    assert params["layers"]["wq"].sharding.spec == PartitionSpec(None, "fsdp", "tensor", None)
    assert params["embed"].sharding.spec == PartitionSpec("tensor", "fsdp")
    wq = params["layers"]["wq"]
    assert {s.data.shape for s in wq.addressable_shards} == {(2, 16, 2, wq.shape[-1])}
    chex.assert_trees_all_equal(jax.device_get(params), jax.device_get(reference))
    # Each device's callback read only its block: never a whole [D, N, H] matrix of wq.
    wq_reads = [block for shape, block in reads if shape == wq.shape[1:]]
    assert wq_reads and all(block == (16, 2, wq.shape[-1]) for block in wq_reads)


@pytest.mark.needs_devices(8)
def test_load_with_mesh_uses_parallel_rules(checkpoints):
    parallel = pytest.importorskip("jaxrl_llm.parallel")
    path, _ = checkpoints["qwen3"]
    mesh = _mesh()
    config, params = load_pretrained(path, dtype=jnp.float32, mesh=mesh, rules=LOCAL_RULES)
    expected = parallel.logical_to_sharding(logical_axes(config), mesh, LOCAL_RULES)
    chex.assert_trees_all_equal(
        jax.tree.map(lambda p: p.sharding.spec, params),
        jax.tree.map(lambda s: s.spec, expected),
    )
    _, default = load_pretrained(path, dtype=jnp.float32, mesh=mesh)
    # The table's optional mesh axes (expert, sequence) drop out on this mesh.
    assert default["layers"]["w_up"].sharding.spec == PartitionSpec(None, "fsdp", "tensor")


def test_shardings_must_match_params(checkpoints):
    path, _ = checkpoints["qwen3"]
    with pytest.raises(ValueError, match="shardings must match"):
        load_pretrained(path, shardings={"embed": None})


@pytest.mark.needs_devices(8)
def test_a_loaded_checkpoint_becomes_the_train_state_without_resharding(checkpoints):
    """``load_pretrained(mesh=...)`` places every tensor where ``create_train_state`` keeps it,
    so the state is built from the loaded arrays as they lie (no reshard, no host copy)."""
    from jaxrl_llm import parallel
    from jaxrl_llm.train.optim import make_optimizer
    from jaxrl_llm.train.state import create_train_state

    path, _ = checkpoints["llama"]
    mesh = parallel.make_mesh(2, 2, 2)
    config, params = load_pretrained(path, dtype=jnp.float32, mesh=mesh)
    loaded = jax.tree.map(lambda p: p.sharding, params)
    state, shardings = create_train_state(
        config, make_optimizer(1e-3), key=jax.random.key(0), mesh=mesh, params=params
    )
    same = jax.tree.map(
        lambda a, b, p: a.is_equivalent_to(b, p.ndim), loaded, shardings.params, params
    )
    assert all(jax.tree.leaves(same))
    chex.assert_trees_all_equal(jax.device_get(state.params), jax.device_get(params))
