"""LoRA adapters (Hu et al. 2021): their pytree, the frozen base, merging, and PEFT files.

A model whose ``ModelConfig.lora`` is a ``LoraSpec`` holds, beside each targeted base weight
``layers/<w>`` (``[L, in..., out...]``), ``layers/<w>_lora_a: [L, in..., r]`` and
``layers/<w>_lora_b: [L, r, out...]``; the layer computes ``x W + (alpha / r) · (x A) B``
(``models.layers.DecoderLayer``). Everything that runs the model (training forward, log-probs,
the sampler) therefore takes one params tree; training splits it into the adapters (trained)
and the base (frozen) with :func:`split` and joins them with :func:`combine`.

The PEFT files (:func:`save_peft_adapter`, :func:`load_peft_adapter`) are what
``peft.PeftModel.from_pretrained(base, dir)`` reads: ``adapter_config.json`` and
``adapter_model.safetensors`` with ``base_model.model.model.layers.{i}.<module>.lora_A.weight
[r, in]`` and ``lora_B.weight [out, r]``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from jaxrl_llm.models.config import LoraSpec, ModelConfig
from jaxrl_llm.models.layers import LORA_WEIGHTS, lora_init

Array = jax.Array
Params = dict[str, Any]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
SUFFIXES = ("_lora_a", "_lora_b")
# Target name -> the HF module it adapts (PEFT's target_modules names).
HF_MODULES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
_PEFT_PREFIX = "base_model.model.model.layers.{}."


def is_adapter(name: str) -> bool:
    """Whether a parameter name (the last key of its path) is a LoRA factor."""
    return name.endswith(SUFFIXES)


def base_config(config: ModelConfig) -> ModelConfig:
    """``config`` without adapters: the base model (the reference policy of a LoRA run)."""
    return dataclasses.replace(config, lora=None)


def split(params: Params) -> tuple[Params, Params]:
    """``(base, adapters)``: the base weights, and ``{"layers": {<w>_lora_a/b: ...}}``."""
    layers = params.get("layers", {})
    if isinstance(layers, tuple):
        raise ValueError("split takes stacked params (not the sampler's per-layer split)")
    adapters = {k: v for k, v in layers.items() if is_adapter(k)}
    base = {**params, "layers": {k: v for k, v in layers.items() if not is_adapter(k)}}
    return base, {"layers": adapters}


def combine(base: Params, adapters: Params) -> Params:
    """The model's params: ``base`` with the ``adapters`` (from :func:`split`) added."""
    return {**base, "layers": {**base["layers"], **adapters["layers"]}}


def without_adapters(params: Params) -> Params:
    """The base of ``params`` (adapters switched off: run it with ``base_config(config)``)."""
    return split(params)[0]


def adapter_shapes(config: ModelConfig, dtype: Any = jnp.float32) -> Params:
    """``jax.ShapeDtypeStruct`` tree of ``init_adapters(config, .)``."""
    spec = _spec(config)
    layers = {}
    for target in spec.targets:
        weight, contract = LORA_WEIGHTS[target]
        shape = _weight_shape(config, weight)
        a = (config.num_hidden_layers, *shape[:contract], spec.rank)
        b = (config.num_hidden_layers, spec.rank, *shape[contract:])
        layers[f"{weight}_lora_a"] = jax.ShapeDtypeStruct(a, jnp.dtype(dtype))
        layers[f"{weight}_lora_b"] = jax.ShapeDtypeStruct(b, jnp.dtype(dtype))
    return {"layers": layers}


def init_adapters(config: ModelConfig, key: Array, *, dtype: Any = jnp.float32) -> Params:
    """Fresh adapters for ``config.lora`` (``A`` uniform ``±1/sqrt(in)``, ``B`` zeros), to add
    to a loaded base with :func:`combine`; jit-able with ``config`` static."""
    spec = _spec(config)
    layers = {}
    for i, target in enumerate(spec.targets):
        weight, contract = LORA_WEIGHTS[target]
        shape = _weight_shape(config, weight)
        keys = jax.random.split(jax.random.fold_in(key, i), config.num_hidden_layers)
        init = functools.partial(
            lora_init, shape=shape, contract=contract, rank=spec.rank, dtype=dtype
        )
        a, b = jax.vmap(init)(keys)
        layers[f"{weight}_lora_a"], layers[f"{weight}_lora_b"] = a, b
    return {"layers": layers}


def merge_weights(params: Params, config: ModelConfig) -> Params:
    """Base params with each adapted weight replaced by ``W + (alpha / r) · A B`` (in the
    weight's dtype): the same function as ``params`` under ``config``, for
    ``base_config(config)``. Jit-able."""
    spec = _spec(config)
    base, adapters = split(params)
    layers = dict(base["layers"])
    for target in spec.targets:
        weight, contract = LORA_WEIGHTS[target]
        a = adapters["layers"][f"{weight}_lora_a"].astype(jnp.float32)
        b = adapters["layers"][f"{weight}_lora_b"].astype(jnp.float32)
        w = layers[weight]
        delta = jax.vmap(lambda x, y: jnp.tensordot(x, y, 1))(a, b)  # per layer: A B
        layers[weight] = (w.astype(jnp.float32) + spec.scale * delta).astype(w.dtype)
    return {**base, "layers": layers}


# -- PEFT files --------------------------------------------------------------------------------


def save_peft_adapter(
    path: str | os.PathLike,
    config: ModelConfig,
    params: Params,
    *,
    base_model: str | os.PathLike | None = None,
    dtype: Any = np.float32,
) -> None:
    """Writes the adapters of ``params`` as a PEFT LoRA adapter directory.

    Args:
      path: output directory (created if needed).
      config: the model config (with ``lora``).
      params: the model's params (base and adapters; only the adapters are written).
      base_model: written as ``base_model_name_or_path`` (the checkpoint the adapter is for).
      dtype: the tensors' dtype on disk.
    """
    spec = _spec(config)
    _, adapters = split(params)
    tensors = {}
    for target in spec.targets:
        weight, contract = LORA_WEIGHTS[target]
        a = np.asarray(jax.device_get(adapters["layers"][f"{weight}_lora_a"]), np.float32)
        b = np.asarray(jax.device_get(adapters["layers"][f"{weight}_lora_b"]), np.float32)
        for i in range(config.num_hidden_layers):
            prefix = _PEFT_PREFIX.format(i) + HF_MODULES[target]
            tensors[f"{prefix}.lora_A.weight"] = _to_hf(a[i].reshape(-1, spec.rank).T, dtype)
            tensors[f"{prefix}.lora_B.weight"] = _to_hf(b[i].reshape(spec.rank, -1).T, dtype)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(peft_config(spec, base_model), f, indent=2)


def peft_config(spec: LoraSpec, base_model: str | os.PathLike | None = None) -> dict[str, Any]:
    """The ``adapter_config.json`` of ``spec`` (PEFT's ``LoraConfig`` fields)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None if base_model is None else os.fspath(base_model),
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(HF_MODULES[t].split(".")[-1] for t in spec.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": spec.rslora,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def load_peft_adapter(
    path: str | os.PathLike, config: ModelConfig, *, dtype: Any = jnp.float32
) -> tuple[LoraSpec, Params]:
    """Reads a PEFT LoRA adapter directory written for a model of ``config``'s architecture.

    Returns:
      ``(spec, adapters)``: ``dataclasses.replace(config, lora=spec)`` runs
      ``combine(base, adapters)``.

    Raises:
      FileNotFoundError: a missing ``adapter_config.json`` / ``adapter_model.safetensors``.
      ValueError: not a LoRA adapter, options this model does not implement (bias, DoRA,
        fan_in_fan_out, per-module ranks, modules_to_save), modules other than the seven
        projections, or tensors that do not fit ``config``.
    """
    path = os.fspath(path)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not os.path.exists(os.path.join(path, name)):
            raise FileNotFoundError(f"{os.path.join(path, name)} not found (a PEFT adapter dir)")
    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        meta = json.load(f)
    if meta.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {meta.get('peft_type')!r}, expected 'LORA'")
    for key, ok in (
        ("bias", "none"),
        ("use_dora", False),
        ("fan_in_fan_out", False),
        ("modules_to_save", None),
        ("rank_pattern", {}),
        ("alpha_pattern", {}),
    ):
        if meta.get(key) not in (None, ok):
            raise ValueError(f"{path}: {key}={meta[key]!r} is not supported (expected {ok!r})")
    modules = meta.get("target_modules") or []
    if isinstance(modules, str):
        raise ValueError(f"{path}: target_modules as a regex ({modules!r}) is not supported")
    by_module = {m.split(".")[-1]: t for t, m in HF_MODULES.items()}
    unknown = sorted(set(modules) - set(by_module))
    if unknown:
        raise ValueError(f"{path}: target modules {unknown} are not LoRA targets here")
    spec = LoraSpec(
        rank=int(meta["r"]),
        alpha=float(meta["lora_alpha"]),
        targets=tuple(t for t in HF_MODULES if HF_MODULES[t].split(".")[-1] in modules),
        dropout=float(meta.get("lora_dropout") or 0.0),
        rslora=bool(meta.get("use_rslora") or False),
    )
    tensors = load_file(os.path.join(path, ADAPTER_WEIGHTS))
    model = dataclasses.replace(config, lora=spec)
    shapes = adapter_shapes(model)["layers"]
    layers = {}
    for target in spec.targets:
        weight, _ = LORA_WEIGHTS[target]
        for suffix, hf in (("_lora_a", "lora_A"), ("_lora_b", "lora_B")):
            want = shapes[weight + suffix].shape
            blocks = []
            for i in range(config.num_hidden_layers):
                name = f"{_PEFT_PREFIX.format(i)}{HF_MODULES[target]}.{hf}.weight"
                if name not in tensors:
                    raise ValueError(f"{path}: tensor {name} missing")
                block = np.asarray(tensors.pop(name), np.float32)
                if suffix == "_lora_a":
                    hf_shape = (spec.rank, math.prod(want[1:-1]))
                else:
                    hf_shape = (math.prod(want[2:]), spec.rank)
                if block.shape != hf_shape:
                    raise ValueError(
                        f"{path}: {name} has shape {block.shape}, expected {hf_shape} for "
                        f"{config.architecture} at rank {spec.rank}"
                    )
                blocks.append(block.T.reshape(want[1:]))
            layers[weight + suffix] = jnp.asarray(np.stack(blocks), dtype)
    if tensors:
        raise ValueError(f"{path}: unexpected tensors {sorted(tensors)[:5]}")
    return spec, {"layers": layers}


def is_adapter_dir(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is a PEFT adapter directory (holds ``adapter_config.json``)."""
    return path is not None and os.path.isfile(os.path.join(os.fspath(path), ADAPTER_CONFIG))


def adapter_base(path: str | os.PathLike) -> str:
    """The base checkpoint a PEFT adapter directory names (``base_model_name_or_path``).

    Raises:
      ValueError: it names none, or a directory that does not exist here (nothing is
        downloaded: point it at a local checkpoint).
    """
    with open(os.path.join(os.fspath(path), ADAPTER_CONFIG)) as f:
        base = json.load(f).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{path}: adapter_config.json names no base_model_name_or_path")
    if not os.path.isdir(base):
        raise ValueError(
            f"{path}: its base model {base!r} is not a local directory (nothing is downloaded: "
            "edit base_model_name_or_path to a local checkpoint)"
        )
    return base


def load_adapted(
    path: str | os.PathLike, *, dtype: Any = jnp.float32, mesh: Any = None
) -> tuple[ModelConfig, Params]:
    """``(config with lora, base + adapters)`` of a PEFT adapter directory and its base."""
    from jaxrl_llm.models.checkpoint import load_pretrained  # noqa: PLC0415

    config, base = load_pretrained(adapter_base(path), dtype=dtype, mesh=mesh)
    spec, adapters = load_peft_adapter(path, config, dtype=dtype)
    return dataclasses.replace(config, lora=spec), combine(base, adapters)


def _to_hf(x: np.ndarray, dtype: Any) -> np.ndarray:
    return np.ascontiguousarray(x).astype(dtype)


def _spec(config: ModelConfig) -> LoraSpec:
    if config.lora is None:
        raise ValueError("the model config has no LoRA adapters (ModelConfig.lora is None)")
    return config.lora


def _weight_shape(config: ModelConfig, weight: str) -> tuple[int, ...]:
    d, f = config.hidden_size, config.intermediate_size
    n, k, h = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    return {
        "wq": (d, n, h),
        "wk": (d, k, h),
        "wv": (d, k, h),
        "wo": (n, h, d),
        "w_gate": (d, f),
        "w_up": (d, f),
        "w_down": (f, d),
    }[weight]
