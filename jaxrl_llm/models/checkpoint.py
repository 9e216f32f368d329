"""Hugging Face safetensors checkpoints: load (optionally straight into a mesh) and save.

HF stores one ``[out, in]`` matrix per layer (``model.layers.{i}.self_attn.q_proj.weight``)
and, in a mixture-of-experts model, per layer and expert
(``model.layers.{i}.mlp.experts.{j}.gate_proj.weight``); we keep ``[L, in, heads, head_dim]``
and ``[L, E, in, out]`` stacks. Each parameter's correspondence is a ``_Layout``:
the HF tensor's dims split into ours, then permuted, and possibly one index taken of a split
dim (gpt-oss keeps every layer's experts in one ``[E, D, 2F]`` ``gate_up_proj`` with the gate
and up columns interleaved, ``gate = [..., ::2]``, ``up = [..., 1::2]``: our ``expert_w_gate``
and ``expert_w_up`` each take one of the pair). The same layout drives loading, saving,
and reading only the block of a tensor that one device shard needs, so a sharded load never
holds a full host copy of a parameter per device.

gpt-oss checkpoints as released store their experts in MXFP4 (``<name>_blocks`` and
``<name>_scales`` in place of ``<name>``): such a pair is read as the tensor it stands for,
dequantised block by block (``models.mxfp4``), into the load dtype. Saving always writes plain
(unquantised) tensors.

A multimodal ``Gemma3ForConditionalGeneration`` checkpoint loads as its language model (the
config's ``text_config``, ``config.language_model_dict``): the same tensors under the prefix
``language_model.model.`` (what transformers writes and the released checkpoints hold) or
``model.language_model.`` (transformers 5's in-memory names), the vision tower's and the
projector's tensors left on disk. ``save_pretrained(..., source=that checkpoint)`` writes the
wrapper back: the language model's tensors updated under the source's prefix, every vision
tower and projector tensor copied through unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl_llm.models import mxfp4
from jaxrl_llm.models.config import ModelConfig, is_multimodal
from jaxrl_llm.models.transformer import Params, logical_axes, param_shapes

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_LAYER_PREFIX = "model.layers.{}."
_TOP_LEVEL = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight"}
_IN_LAYER = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "bo": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "router": "mlp.gate.weight",
    "expert_w_gate": "mlp.experts.{}.gate_proj.weight",
    "expert_w_up": "mlp.experts.{}.up_proj.weight",
    "expert_w_down": "mlp.experts.{}.down_proj.weight",
    "shared_w_gate": "mlp.shared_expert.gate_proj.weight",
    "shared_w_up": "mlp.shared_expert.up_proj.weight",
    "shared_w_down": "mlp.shared_expert.down_proj.weight",
    "shared_expert_gate": "mlp.shared_expert_gate.weight",
}
# Mixtral keeps the original names of its sparse block.
_IN_LAYER_MIXTRAL = {
    **_IN_LAYER,
    "router": "block_sparse_moe.gate.weight",
    "expert_w_gate": "block_sparse_moe.experts.{}.w1.weight",
    "expert_w_up": "block_sparse_moe.experts.{}.w3.weight",
    "expert_w_down": "block_sparse_moe.experts.{}.w2.weight",
}
# gpt-oss: one tensor per layer for all experts ([E, in, out], gate and up interleaved in
# gate_up_proj), a biased router, per-head attention sinks.
_IN_LAYER_GPT_OSS = {
    **_IN_LAYER,
    "sinks": "self_attn.sinks",
    "router": "mlp.router.weight",
    "router_bias": "mlp.router.bias",
    "expert_w_gate": "mlp.experts.gate_up_proj",
    "expert_w_up": "mlp.experts.gate_up_proj",
    "expert_b_gate": "mlp.experts.gate_up_proj_bias",
    "expert_b_up": "mlp.experts.gate_up_proj_bias",
    "expert_w_down": "mlp.experts.down_proj",
    "expert_b_down": "mlp.experts.down_proj_bias",
}
# Gemma 2 / 3 norm both sides of each sub-block: post_attention_layernorm is the attention
# output's norm there, and the MLP's input norm is pre_feedforward_layernorm.
_IN_LAYER_SANDWICH = {
    **_IN_LAYER,
    "post_attn_norm": "post_attention_layernorm.weight",
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
}


# Multimodal wrappers: where the language model's ``model.*`` tensors and its (tied, so
# usually absent) ``lm_head`` live, in the layout transformers writes and the released
# checkpoints use, then in transformers 5's in-memory layout; and the prefixes of the other
# towers' tensors, copied through on save.
_WRAPPER_LAYOUTS = (
    ("language_model.model.", "language_model.lm_head.weight"),
    ("model.language_model.", "lm_head.weight"),
)
_PASSTHROUGH_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """``ours = hf.reshape(concat(split))[pick].transpose(perm)``.

    ``split[i]`` lists the sizes of the dims packed (row-major) into HF dim ``i``; ``pick``
    lists ``(split dim, index)`` pairs: split dims of which ours holds one index (and so does
    not have); our dim ``d`` is the ``perm[d]``-th of the remaining split dims. E.g.
    ``q_proj [N*H, D] -> wq [D, N, H]``: split ``((N, H), (D,))``, perm ``(2, 0, 1)``; gpt-oss's
    interleaved ``gate_up_proj [E, D, 2F] -> expert_w_up [E, D, F]``: split
    ``((E,), (D,), (F, 2))``, pick ``((3, 1),)``, perm ``(0, 1, 2)``.
    """

    split: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]
    pick: tuple[tuple[int, int], ...] = ()

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.split)

    @property
    def _flat(self) -> list[int]:
        return [n for sub in self.split for n in sub]

    @property
    def _kept(self) -> list[int]:
        """The split dims ours has (all but the picked ones), in order."""
        picked = {dim for dim, _ in self.pick}
        return [d for d in range(len(self._flat)) if d not in picked]

    @property
    def shape(self) -> tuple[int, ...]:
        flat, kept = self._flat, self._kept
        return tuple(flat[kept[p]] for p in self.perm)

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        if self.pick:
            raise ValueError("a picking layout fills part of an HF tensor: use fill_hf")
        return np.ascontiguousarray(ours.transpose(np.argsort(self.perm)).reshape(self.hf_shape))

    def fill_hf(self, ours: np.ndarray, out: np.ndarray) -> None:
        """Writes ``ours`` into its part of ``out`` (the HF tensor, ``hf_shape``, contiguous)."""
        view = out.reshape(self._flat)
        index: list[Any] = [slice(None)] * len(self._flat)
        for dim, value in self.pick:
            index[dim] = value
        view[tuple(index)] = ours.transpose(np.argsort(self.perm))

    def read(self, tensor: Any, index: Sequence[tuple[int, int]]) -> np.ndarray:
        """The block ``ours[index]`` reading only the HF rows/columns it covers.

        Args:
          tensor: a safetensors slice (``tensor[slices]`` reads that block from disk).
          index: ``(start, stop)`` per dim of ours.
        """
        kept = self._kept
        split_index: list[tuple[int, int]] = [(0, 0)] * len(self._flat)
        for dim, p in enumerate(self.perm):
            split_index[kept[p]] = index[dim]
        for dim, value in self.pick:
            split_index[dim] = (value, value + 1)
        hf_index, block_shape, post, pos = [], [], [], 0
        for sub in self.split:
            (start, stop), rest = split_index[pos], split_index[pos + 1 : pos + len(sub)]
            # Only the leading packed dim maps to a contiguous HF range; inner ones are cut
            # after the read.
            inner = math.prod(sub[1:])
            hf_index.append(slice(start * inner, stop * inner))
            block_shape.extend([stop - start, *sub[1:]])
            post.extend([slice(None)] + [slice(a, b) for a, b in rest])
            pos += len(sub)
        leading = {sum(len(sub) for sub in self.split[:i]) for i in range(len(self.split))}
        for dim, value in self.pick:  # an int index drops the picked dim
            post[dim] = 0 if dim in leading else value
        block = np.asarray(tensor[tuple(hf_index)]).reshape(block_shape)
        return block[tuple(post)].transpose(self.perm)


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One of our parameters: its HF tensor names and their layout.

    ``stack`` is the leading dims ours has over one HF tensor: ``()``, ``(L,)`` (one tensor per
    layer) or ``(L, E)`` (per layer and expert); ``names`` lists the tensors row-major over it.
    """

    names: tuple[str, ...]
    layout: _Layout
    stack: tuple[int, ...] = ()

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.stack, *self.layout.shape)


def _layout(config: ModelConfig, key: str) -> _Layout:
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    n, k, h = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    e, fe = config.num_experts, config.moe_intermediate_size
    fs = config.shared_expert_intermediate_size
    table = {
        "embed": (((v,), (d,)), (0, 1)),
        "lm_head": (((v,), (d,)), (1, 0)),
        "final_norm": (((d,),), (0,)),
        "attn_norm": (((d,),), (0,)),
        "mlp_norm": (((d,),), (0,)),
        "post_attn_norm": (((d,),), (0,)),
        "post_mlp_norm": (((d,),), (0,)),
        "wq": (((n, h), (d,)), (2, 0, 1)),
        "wk": (((k, h), (d,)), (2, 0, 1)),
        "wv": (((k, h), (d,)), (2, 0, 1)),
        "wo": (((d,), (n, h)), (1, 2, 0)),
        "bq": (((n, h),), (0, 1)),
        "bk": (((k, h),), (0, 1)),
        "bv": (((k, h),), (0, 1)),
        "bo": (((d,),), (0,)),
        "q_norm": (((h,),), (0,)),
        "k_norm": (((h,),), (0,)),
        "w_gate": (((f,), (d,)), (1, 0)),
        "w_up": (((f,), (d,)), (1, 0)),
        "w_down": (((d,), (f,)), (1, 0)),
        "router": (((e,), (d,)), (1, 0)),
        # One expert's matrix; the [L, E] stack is the entry's.
        "expert_w_gate": (((fe,), (d,)), (1, 0)),
        "expert_w_up": (((fe,), (d,)), (1, 0)),
        "expert_w_down": (((d,), (fe,)), (1, 0)),
        "shared_w_gate": (((fs,), (d,)), (1, 0)),
        "shared_w_up": (((fs,), (d,)), (1, 0)),
        "shared_w_down": (((d,), (fs,)), (1, 0)),
        "shared_expert_gate": (((1,), (d,)), (1, 0)),
    }
    if config.model_type == "gpt_oss":
        table.update(_gpt_oss_layouts(config))
    split, perm, *pick = table[key]
    return _Layout(split, perm, *pick)


# gpt-oss's gate_up_proj interleaves the two: gate at even columns, up at odd ones.
_GATE_UP_INDEX = {"gate": 0, "up": 1}


def _gpt_oss_layouts(config: ModelConfig) -> dict[str, tuple]:
    """gpt-oss's expert layouts (per layer, all experts: ``[E, in, out]`` as ours) and the
    sinks' and router bias's."""
    d, e, fe = config.hidden_size, config.num_experts, config.moe_intermediate_size
    out: dict[str, tuple] = {
        "sinks": (((config.num_attention_heads,),), (0,)),
        "router_bias": (((e,),), (0,)),
        "expert_w_down": (((e,), (fe,), (d,)), (0, 1, 2)),
        "expert_b_down": (((e,), (d,)), (0, 1)),
    }
    for name, column in _GATE_UP_INDEX.items():
        out[f"expert_w_{name}"] = (((e,), (d,), (fe, 2)), (0, 1, 2), ((3, column),))
        out[f"expert_b_{name}"] = (((e,), (fe, 2)), (0, 1), ((2, column),))
    return out


def _plan(config: ModelConfig) -> dict[tuple[str, ...], _Entry]:
    """Our parameter path -> HF names and layout, for every parameter of ``config``."""
    plan = {}
    in_layer = _IN_LAYER
    if config.model_type == "mixtral":
        in_layer = _IN_LAYER_MIXTRAL
    elif config.model_type == "gpt_oss":
        in_layer = _IN_LAYER_GPT_OSS
    elif config.sandwich_norms:
        in_layer = _IN_LAYER_SANDWICH
    layers = config.num_hidden_layers
    for path, shape in _flat(param_shapes(config)).items():
        # One HF tensor per layer and expert ("...experts.{}...") or per layer.
        if path[0] == "layers" and "{}" in in_layer[path[1]]:
            template = _LAYER_PREFIX + in_layer[path[1]]
            stack = (layers, config.num_experts)
            names = tuple(template.format(i, j) for i in range(layers) for j in range(stack[1]))
            entry = _Entry(names, _layout(config, path[1]), stack)
        elif path[0] == "layers":
            names = tuple(_LAYER_PREFIX.format(i) + in_layer[path[1]] for i in range(layers))
            entry = _Entry(names, _layout(config, path[1]), (layers,))
        else:
            name = "lm_head.weight" if path[0] == "lm_head" else _TOP_LEVEL[path[0]]
            entry = _Entry((name,), _layout(config, path[0]))
        if tuple(shape.shape) != entry.shape:
            raise AssertionError(f"layout of {path} gives {entry.shape}, model has {shape.shape}")
        plan[path] = entry
    return plan


def _wrapper_layout(names: Sequence[str], path: str) -> tuple[str, str]:
    """``(prefix, lm_head name)`` of the wrapper layout whose embedding ``names`` holds."""
    for prefix, lm_head in _WRAPPER_LAYOUTS:
        if prefix + "embed_tokens.weight" in names:
            return prefix, lm_head
    tried = [prefix + "embed_tokens.weight" for prefix, _ in _WRAPPER_LAYOUTS]
    raise ValueError(
        f"multimodal checkpoint {path!r} holds none of {tried}: no language model to load"
    )


def _in_wrapper(
    plan: dict[tuple[str, ...], _Entry], prefix: str, lm_head: str
) -> dict[tuple[str, ...], _Entry]:
    """``plan`` with its HF names moved into a wrapper: ``model.x -> prefix + x``,
    ``lm_head.weight -> lm_head``."""

    def rename(name: str) -> str:
        if name == "lm_head.weight":
            return lm_head
        return prefix + name.removeprefix("model.")

    return {
        key: dataclasses.replace(entry, names=tuple(rename(n) for n in entry.names))
        for key, entry in plan.items()
    }


def _flat(tree: Params) -> dict[tuple[str, ...], Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(k.key for k in path): leaf for path, leaf in leaves}


def _unflat(flat: dict[tuple[str, ...], Any]) -> Params:
    out: Params = {}
    for path, leaf in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return out


class _Tensors(contextlib.ExitStack):
    """Name -> lazily readable tensor over every safetensors file of a checkpoint directory."""

    def __init__(self, path: str):
        super().__init__()
        index_file = os.path.join(path, INDEX_FILE)
        if os.path.exists(index_file):
            with open(index_file) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(
                os.path.basename(p) for p in glob.glob(os.path.join(path, "*.safetensors"))
            )
        if not files:
            raise ValueError(f"no *.safetensors files in {path!r}")
        self.files: dict[str, Any] = {}
        for name in files:
            full = os.path.join(path, name)
            if not os.path.exists(full):
                raise ValueError(f"{INDEX_FILE} names {name!r}, which is not in {path!r}")
            handle = self.enter_context(safe_open(full, framework="numpy"))
            for key in handle.keys():
                if key in self.files:
                    raise ValueError(f"tensor {key!r} appears in more than one file of {path!r}")
                self.files[key] = handle
        # MXFP4 pairs (gpt-oss's experts) stand for the tensor they dequantise to.
        for key in [k for k in self.files if k.endswith(mxfp4.BLOCKS_SUFFIX)]:
            base = key.removesuffix(mxfp4.BLOCKS_SUFFIX)
            scales = base + mxfp4.SCALES_SUFFIX
            if scales in self.files and base not in self.files:
                handles = (self.files.pop(key), self.files.pop(scales))
                self.files[base] = _Mxfp4Handle(*handles)

    def tensor(self, name: str) -> np.ndarray:
        """The whole tensor ``name`` as stored."""
        return np.asarray(self.files[name].get_tensor(name))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.files[name].get_slice(name).get_shape())

    def slice(self, name: str) -> Any:
        return self.files[name].get_slice(name)


class _Mxfp4Handle:
    """The file handles of an MXFP4 pair, opened as one tensor (``mxfp4.Mxfp4Tensor``)."""

    def __init__(self, blocks: Any, scales: Any):
        self.blocks, self.scales = blocks, scales

    def get_slice(self, name: str) -> mxfp4.Mxfp4Tensor:
        return mxfp4.Mxfp4Tensor(
            self.blocks.get_slice(name + mxfp4.BLOCKS_SUFFIX),
            self.scales.get_slice(name + mxfp4.SCALES_SUFFIX),
            name,
        )


def _check_tensors(
    config: ModelConfig,
    plan: dict,
    tensors: _Tensors,
    path: str,
    wrapper: tuple[str, str] | None = None,
) -> None:
    expected = {name: entry.layout.hf_shape for entry in plan.values() for name in entry.names}
    present = set(tensors.files)
    # Old checkpoints carry RoPE buffers; tied models sometimes also store the lm_head copy.
    ignored = {n for n in present if n.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        ignored.add("lm_head.weight" if wrapper is None else wrapper[1])
    if wrapper is not None:  # the vision tower and the projector stay on disk
        ignored.update(n for n in present if n.startswith(_PASSTHROUGH_PREFIXES))
    missing = sorted(set(expected) - present)
    if missing:
        raise ValueError(
            f"checkpoint {path!r} is missing {len(missing)} tensor(s) for "
            f"{config.architecture}: {missing[:8]}"
        )
    unexpected = sorted(present - set(expected) - ignored)
    if unexpected:
        raise ValueError(
            f"checkpoint {path!r} has {len(unexpected)} unexpected tensor(s) for "
            f"{config.architecture}: {unexpected[:8]}"
        )
    for name, want in expected.items():
        got = tensors.shape(name)
        if got != want:
            raise ValueError(f"tensor {name!r} has shape {got}, expected {want} from config.json")


def _read_param(
    entry: _Entry, tensors: _Tensors, dtype: np.dtype, shape: tuple[int, ...]
) -> Callable[[tuple[slice, ...]], np.ndarray]:
    def read(index: tuple[slice, ...]) -> np.ndarray:
        bounds = []
        for sl, size in zip(index, shape):
            start, stop, step = sl.indices(size)
            if step != 1:
                raise ValueError(f"strided shard index {index} is not supported")
            bounds.append((start, stop))
        outer, inner = bounds[: len(entry.stack)], bounds[len(entry.stack) :]
        ranges = [range(start, stop) for start, stop in outer]
        flat_index = np.arange(len(entry.names)).reshape(entry.stack or (1,))
        picked = flat_index[np.ix_(*ranges)] if ranges else flat_index
        blocks = [entry.layout.read(tensors.slice(entry.names[i]), inner) for i in picked.flat]
        block = np.stack(blocks).reshape(*picked.shape, *blocks[0].shape)
        if not entry.stack:
            block = block[0]
        return np.ascontiguousarray(block.astype(dtype))

    return read


def _resolve_shardings(
    config: ModelConfig, shapes: Params, mesh: Any, rules: Any, shardings: Any
) -> Params:
    if shardings is not None:
        if jax.tree.structure(shardings) != jax.tree.structure(shapes):
            raise ValueError(
                f"shardings must match the params structure {jax.tree.structure(shapes)}, "
                f"got {jax.tree.structure(shardings)}"
            )
        return shardings
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda _: device, shapes)
    try:
        from jaxrl_llm.parallel import PARAM_RULES, logical_to_sharding
    except ImportError as err:
        raise ValueError(
            "load_pretrained(mesh=...) needs jaxrl_llm.parallel.logical_to_sharding; "
            "pass shardings= (a pytree of jax.sharding.Sharding matching the params) instead"
        ) from err
    rules = PARAM_RULES if rules is None else rules
    return logical_to_sharding(logical_axes(config), mesh, rules, shapes=shapes)


def _read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    file = os.path.join(os.fspath(path), CONFIG_FILE)
    if not os.path.exists(file):
        raise ValueError(f"no {CONFIG_FILE} in {os.fspath(path)!r}")
    with open(file) as f:
        return json.load(f)


def load_config(path: str | os.PathLike) -> ModelConfig:
    """``ModelConfig`` from ``path/config.json`` (a multimodal wrapper's: its language model)."""
    return ModelConfig.from_hf_dict(_read_hf_config(path))


def load_pretrained(
    path: str | os.PathLike,
    *,
    dtype: Any = jnp.bfloat16,
    mesh: jax.sharding.Mesh | None = None,
    rules: Any = None,
    shardings: Params | None = None,
) -> tuple[ModelConfig, Params]:
    """Reads a HF checkpoint directory into ``(config, params)``.

    Reads ``*.safetensors`` (one file, or several listed by ``model.safetensors.index.json``),
    maps HF names to ours (transposing and stacking layers) and converts to ``dtype``. A
    ``Gemma3ForConditionalGeneration`` checkpoint loads as its language model (its vision tower
    and projector are not read). Every
    parameter is built with ``jax.make_array_from_callback``: each addressable device's shard
    is read straight from the memory-mapped file block it covers, so a sharded load never holds
    a full host copy of a parameter per device (and on a pod each host reads only its shards).

    Args:
      path: directory with ``config.json`` and the safetensors files.
      dtype: parameter dtype after conversion.
      mesh: place parameters on this mesh using ``jaxrl_llm.parallel.logical_to_sharding`` of
        ``logical_axes(config)`` under ``rules`` (default ``jaxrl_llm.parallel.PARAM_RULES``).
      rules: logical-axis rule table for ``mesh``.
      shardings: explicit pytree of ``jax.sharding.Sharding`` matching the params; overrides
        ``mesh``/``rules``. With neither, parameters go to the first device.

    Returns:
      ``(ModelConfig, params)`` with params a plain nested dict of ``jax.Array``.

    Raises:
      ValueError: unsupported config, or missing, unexpected or mis-shaped tensors (named).
    """
    path = os.fspath(path)
    hf_config = _read_hf_config(path)
    config = ModelConfig.from_hf_dict(hf_config)
    shapes = param_shapes(config, dtype)
    plan = _plan(config)
    target = _resolve_shardings(config, shapes, mesh, rules, shardings)
    np_dtype = np.dtype(jnp.dtype(dtype))
    flat_shardings = _flat(target)
    params = {}
    with _Tensors(path) as tensors:
        wrapper = _wrapper_layout(list(tensors.files), path) if is_multimodal(hf_config) else None
        if wrapper is not None:
            plan = _in_wrapper(plan, *wrapper)
        _check_tensors(config, plan, tensors, path, wrapper)
        for key, entry in plan.items():
            read = _read_param(entry, tensors, np_dtype, entry.shape)
            params[key] = jax.make_array_from_callback(entry.shape, flat_shardings[key], read)
    return config, _unflat(params)


def save_pretrained(
    path: str | os.PathLike,
    config: ModelConfig,
    params: Params,
    *,
    max_shard_size: int | None = None,
    source: str | os.PathLike | None = None,
) -> None:
    """Writes ``config.json`` + safetensors that ``transformers.AutoModelForCausalLM`` loads.

    Tensors keep the params' dtype. Existing ``model*.safetensors`` files and the index in
    ``path`` are replaced. With ``source`` a ``Gemma3ForConditionalGeneration`` checkpoint
    (``config`` its language model), writes that wrapper instead, which
    ``transformers.Gemma3ForConditionalGeneration`` loads: the source's ``config.json`` with
    ``text_config`` rewritten from ``config``, the language model's tensors from ``params`` under
    the source's names, and every vision tower and projector tensor copied through unchanged
    (its stored dtype kept).

    Args:
      path: output directory (created if needed).
      config: the model config.
      params: parameters matching ``config`` (any dtype; sharded arrays are gathered).
      max_shard_size: if given (bytes), split into ``model-0000i-of-0000n.safetensors`` files
        with a ``model.safetensors.index.json``.
      source: the checkpoint directory ``params`` were loaded from; only a multimodal wrapper
        changes what is written (a text-only source is not read). May be ``path`` itself.

    Raises:
      ValueError: params that do not match ``config``, or a multimodal ``source`` whose
        language model is not ``config``.
    """
    path = os.fspath(path)
    wrapper = None if source is None else _wrapper_source(os.fspath(source), config)
    shapes = _flat(param_shapes(config))
    flat = _flat(params)
    if set(flat) != set(shapes):
        raise ValueError(
            f"params do not match {config.architecture}: missing "
            f"{sorted(set(shapes) - set(flat))}, unexpected {sorted(set(flat) - set(shapes))}"
        )
    for key, want in shapes.items():
        if tuple(np.shape(flat[key])) != tuple(want.shape):
            raise ValueError(
                f"param {'/'.join(key)} has shape {np.shape(flat[key])}, expected {want.shape}"
            )
    tensors: dict[str, np.ndarray] = {}
    plan = _plan(config)
    if wrapper is not None:
        plan = _in_wrapper(plan, *wrapper.layout)
        tensors.update(wrapper.passthrough)
    for key, entry in plan.items():
        value = np.asarray(jax.device_get(flat[key]))
        blocks = value.reshape(-1, *entry.layout.shape)
        for name, block in zip(entry.names, blocks, strict=True):
            if entry.layout.pick:  # one of several params sharing the tensor (gpt-oss gate_up)
                out = tensors.setdefault(name, np.zeros(entry.layout.hf_shape, block.dtype))
                entry.layout.fill_hf(block, out)
            else:
                tensors[name] = entry.layout.to_hf(block)

    os.makedirs(path, exist_ok=True)
    stale = glob.glob(os.path.join(path, "model*.safetensors")) + [os.path.join(path, INDEX_FILE)]
    for file in stale:
        if os.path.exists(file):
            os.remove(file)
    shards = _split_shards(tensors, max_shard_size)
    metadata = {"format": "pt"}
    if len(shards) == 1 and max_shard_size is None:
        save_file(shards[0], os.path.join(path, SINGLE_FILE), metadata=metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(path, name), metadata=metadata)
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(t.nbytes for t in tensors.values())
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    hf_config = config.to_hf_dict()
    if wrapper is not None:
        del hf_config["architectures"]
        hf_config = {**wrapper.hf_config, "text_config": hf_config}
        hf_config.pop("dtype", None)  # transformers 5's name for torch_dtype
    hf_config["torch_dtype"] = np.dtype(flat[("embed",)].dtype).name
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(hf_config, f, indent=2)


@dataclasses.dataclass(frozen=True)
class _WrapperSource:
    """What ``save_pretrained`` keeps of a multimodal source checkpoint."""

    hf_config: dict[str, Any]
    layout: tuple[str, str]  # (prefix, lm_head name): ``_WRAPPER_LAYOUTS``
    passthrough: dict[str, np.ndarray]  # the vision tower's and projector's tensors


def _wrapper_source(source: str, config: ModelConfig) -> _WrapperSource | None:
    """The wrapper config, layout and other towers' tensors of a multimodal ``source`` (read
    into memory, so ``source`` may be the output directory), or None for a text-only one."""
    hf_config = _read_hf_config(source)
    if not is_multimodal(hf_config):
        return None
    theirs = ModelConfig.from_hf_dict(hf_config)
    ours = dataclasses.replace(config, compute_dtype=None, lora=None)
    if theirs != ours:
        diff = [
            f.name
            for f in dataclasses.fields(ours)
            if getattr(ours, f.name) != getattr(theirs, f.name)
        ]
        raise ValueError(f"source {source!r}'s language model differs from config in {diff}")
    with _Tensors(source) as tensors:
        layout = _wrapper_layout(list(tensors.files), source)
        passthrough = {
            name: tensors.tensor(name)
            for name in tensors.files
            if name.startswith(_PASSTHROUGH_PREFIXES)
        }
    return _WrapperSource(hf_config, layout, passthrough)


def _split_shards(
    tensors: dict[str, np.ndarray], max_shard_size: int | None
) -> list[dict[str, np.ndarray]]:
    if max_shard_size is None:
        return [tensors]
    if max_shard_size < 1:
        raise ValueError(f"max_shard_size must be a positive number of bytes, got {max_shard_size}")
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and size + tensor.nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    return shards
