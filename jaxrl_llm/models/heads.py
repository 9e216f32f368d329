"""Scalar-head models: the decoder backbone with a ``[D, 1]`` linear head (value / reward models).

``ScalarParams = {"backbone": <policy params without lm_head>, "score": [D, 1]}``. The backbone
is exactly the params of the same config with tied embeddings (``embed``, ``layers``,
``final_norm``), so ``transformer.forward`` runs it unchanged. On disk the model is a Hugging
Face ``*ForSequenceClassification`` directory with ``num_labels=1``: the backbone's ``model.*``
tensors plus ``score.weight [1, D]``, which ``transformers.AutoModelForSequenceClassification``
loads (the layout TRL's reward models and PPO value models use).
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from jaxrl_llm.models import checkpoint as _ckpt
from jaxrl_llm.models.config import ARCHITECTURES, ModelConfig
from jaxrl_llm.models.layers import gathered
from jaxrl_llm.models.transformer import Params, forward, init_params, logical_axes, param_shapes
from jaxrl_llm.packing import PackingPlan, pack, unpack
from jaxrl_llm.types import join_sequences

Array = jax.Array
ScalarParams = dict[str, Any]

SCORE_NAME = "score.weight"
# Causal-LM architecture (what ModelConfig holds) -> the HF sequence-classification class that
# shares its backbone.
SEQ_CLS_ARCHITECTURES = {
    arch: arch.replace("ForCausalLM", "ForSequenceClassification") for arch in ARCHITECTURES
}
# Gemma3ForSequenceClassification is the vision-language model's; the text-only one is this.
SEQ_CLS_ARCHITECTURES["Gemma3ForCausalLM"] = "Gemma3TextForSequenceClassification"
_CAUSAL_OF = {v: k for k, v in SEQ_CLS_ARCHITECTURES.items()}
# HF's default ``initializer_range``: ``*ForSequenceClassification`` draws ``score`` from
# N(0, initializer_range^2), which is what TRL's reward and PPO value models start from.
DEFAULT_SCORE_STD = 0.02


def backbone_config(config: ModelConfig) -> ModelConfig:
    """The config whose params are exactly the backbone: same model, no ``lm_head``."""
    return dataclasses.replace(config, tie_word_embeddings=True)


def scalar_param_shapes(config: ModelConfig, dtype: Any = jnp.float32) -> ScalarParams:
    """``jax.ShapeDtypeStruct`` tree of ``ScalarParams``: backbone leaves and ``score [D, 1]``."""
    return {
        "backbone": param_shapes(backbone_config(config), dtype),
        "score": jax.ShapeDtypeStruct((config.hidden_size, 1), jnp.dtype(dtype)),
    }


def scalar_logical_axes(config: ModelConfig) -> ScalarParams:
    """Logical axes of ``ScalarParams``: the backbone's, and ``("embed", None)`` for ``score``.

    Leaves are tuples (pytree nodes): map with ``is_leaf=jaxrl_llm.parallel.is_logical_axes``.
    """
    return {"backbone": logical_axes(backbone_config(config)), "score": ("embed", None)}


def init_scalar_params(
    config: ModelConfig,
    key: Array,
    *,
    dtype: Any = jnp.float32,
    backbone: Params | None = None,
    score_std: float = DEFAULT_SCORE_STD,
) -> ScalarParams:
    """A scalar-head model: ``score ~ N(0, score_std^2)`` ``[D, 1]`` on a new or copied backbone.

    ``score_std`` defaults to HF's ``initializer_range`` (0.02), as
    ``*ForSequenceClassification._init_weights`` (and hence TRL's reward / PPO value models)
    initialise the head. With ``backbone=None`` the backbone is drawn like ``init_params``.

    Args:
      config: the model's ``ModelConfig`` (static under jit).
      key: PRNG key.
      dtype: parameter dtype.
      backbone: policy params (``lm_head`` is dropped if present) or a ``ScalarParams`` (its
        ``"backbone"`` is used) to start from, e.g. PPO's value model from the policy (verl,
        TRL). Leaves are copied, never aliased, so donating one model's buffers in a jitted
        step cannot delete the other's.
      score_std: standard deviation of the head (0 gives a zero head).

    Returns:
      ``{"backbone": ..., "score": [D, 1]}`` in ``dtype``.

    Raises:
      ValueError: ``backbone`` does not match ``config`` (structure or shapes), or
        ``score_std < 0``.
    """
    if not score_std >= 0:
        raise ValueError(f"score_std must be >= 0, got {score_std}")
    backbone_key, score_key = jax.random.split(key)
    if backbone is None:
        backbone = init_params(backbone_config(config), backbone_key, dtype=dtype)
    else:
        backbone = _extract_backbone(backbone)
        _check_tree("backbone", backbone, param_shapes(backbone_config(config), dtype))
        backbone = jax.tree.map(lambda x: jnp.array(x, dtype=dtype, copy=True), backbone)
    score = score_std * jax.random.normal(score_key, (config.hidden_size, 1), jnp.float32)
    return {"backbone": backbone, "score": score.astype(dtype)}


def _extract_backbone(params: Params) -> Params:
    if not isinstance(params, dict):
        raise ValueError(f"backbone must be a dict of params, got {type(params).__name__}")
    if set(params) == {"backbone", "score"}:
        params = params["backbone"]
    return {k: v for k, v in params.items() if k != "lm_head"}


def _check_tree(name: str, tree: Any, want: Any) -> None:
    """ValueError naming the missing/unexpected paths or the first mis-shaped leaf of ``tree``."""

    def shapes(t: Any) -> dict[str, tuple[int, ...]]:
        leaves = jax.tree_util.tree_flatten_with_path(t)[0]
        return {jax.tree_util.keystr(p): tuple(jnp.shape(x)) for p, x in leaves}

    got, expected = shapes(tree), shapes(want)
    missing, unexpected = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{name} does not match the model: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    for path, shape in expected.items():
        if got[path] != shape:
            raise ValueError(f"{name}{path} has shape {got[path]}, expected {shape}")


def check_scalar_params(params: ScalarParams, config: ModelConfig) -> None:
    """Raises ValueError unless ``params`` has the structure and shapes of ``config``'s model."""
    if not isinstance(params, dict) or set(params) != {"backbone", "score"}:
        keys = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(
            f"scalar params must be a dict with keys ['backbone', 'score'], got {keys}"
        )
    _check_tree("params", params, scalar_param_shapes(config))


def _sequence_hidden(
    params: ScalarParams,
    config: ModelConfig,
    seqs: tuple,
    remat: str,
    dropout_key: Array | None,
    packing: PackingPlan | None = None,
) -> tuple[Array, Array]:
    """Hidden states ``[B, P+T, D]`` of ``[prompt ; completion]`` (``seqs``: prompt tokens and
    mask, completion tokens and mask) and its mask ``[B, P+T]``. With a ``packing`` plan
    (``jaxrl_llm.packing``) the backbone runs over the packed rows and the states come back to
    the padded layout (zeros on padding), so what reads them is unchanged."""
    prompt_tokens, prompt_mask, completion_tokens, completion_mask = seqs
    check_scalar_params(params, config)
    tokens, mask = join_sequences(prompt_tokens, prompt_mask, completion_tokens, completion_mask)
    backbone = backbone_config(config)
    if packing is not None:
        hidden, _ = forward(
            params["backbone"],
            backbone,
            pack(tokens, packing),
            positions=packing.flat("positions"),
            segment_ids=packing.flat("segment_ids"),
            remat=remat,
            dropout_key=dropout_key,
        )
        return unpack(hidden, packing, tokens.shape), mask
    kwargs = {"attention_mask": mask, "remat": remat, "dropout_key": dropout_key}
    hidden, _ = forward(params["backbone"], backbone, tokens, **kwargs)
    return hidden, mask


def _head(hidden: Array, score: Array) -> Array:
    """``h w`` in f32: ``[..., D] @ [D, 1] -> [...]``; the (tiny) head is gathered over fsdp
    where used, so the batch-sharded activations stay where they are."""
    score = gathered(score, "embed", None)
    return jnp.einsum("...d,dk->...k", hidden, score, preferred_element_type=jnp.float32)[..., 0]


def token_values(
    params: ScalarParams,
    config: ModelConfig,
    prompt_tokens: Array,
    prompt_mask: Array,
    completion_tokens: Array,
    completion_mask: Array,
    *,
    remat: str = "none",
    dropout_key: Array | None = None,
    packing: PackingPlan | None = None,
) -> Array:
    """``V_t = h_{P-1+t} . w``: the value of the state that predicts completion token ``t``.

    PPO's critic (Schulman et al., 2017; Ouyang et al., 2022): the backbone runs once over
    ``[prompt ; completion]`` with attention mask ``[prompt_mask ; completion_mask]`` and
    positions ``cumsum(mask) - 1``; ``h_j`` is the final-norm hidden state at column ``j``.
    Column ``P - 1 + t`` is the state that predicts completion token ``t``, the same alignment
    as ``jaxrl_llm.logprobs.completion_logprobs``, so ``V_t`` pairs with ``logprobs[:, t]`` in
    GAE. Masked positions are exactly 0 (value and gradient). The head matmul accumulates in
    f32 whatever the params' dtype.

    Each row needs at least one real prompt token (column ``P - 1`` must be a real state).

    Args:
      params: ``ScalarParams``.
      config: the model's ``ModelConfig`` (static).
      prompt_tokens: ``[B, P]`` int32, left-padded.
      prompt_mask: ``[B, P]``, 1 on real prompt tokens.
      completion_tokens: ``[B, T]`` int32, right-padded.
      completion_mask: ``[B, T]``, 1 on real completion tokens.
      remat: the backbone's remat policy (``models.REMAT_POLICIES``: ``"none"``, ``"layer"``,
        ``"offload"``).
      dropout_key: a PRNG key for LoRA dropout (training a LoRA scalar model), or None.
      packing: a ``jaxrl_llm.packing.PackingPlan`` of the ``[B, P+T]`` rows: the backbone runs
        packed (the same values to rounding), or None.

    Returns:
      ``values [B, T]`` f32.

    Raises:
      ValueError: mis-shaped inputs or params (at trace time, naming the shapes).
    """
    seqs = (prompt_tokens, prompt_mask, completion_tokens, completion_mask)
    hidden, _ = _sequence_hidden(params, config, seqs, remat, dropout_key, packing)
    prompt_len, length = prompt_tokens.shape[1], completion_tokens.shape[1]
    values = _head(hidden[:, prompt_len - 1 : prompt_len - 1 + length], params["score"])
    return jnp.where(completion_mask.astype(bool), values, 0.0)


def sequence_scores(
    params: ScalarParams,
    config: ModelConfig,
    prompt_tokens: Array,
    prompt_mask: Array,
    completion_tokens: Array,
    completion_mask: Array,
    *,
    remat: str = "none",
    dropout_key: Array | None = None,
    packing: PackingPlan | None = None,
) -> Array:
    """``r = h_last . w``, the head at the last real token of ``[prompt ; completion]``.

    The pooled reward of a Bradley-Terry reward model (Ouyang et al., 2022), as HF's
    ``*ForSequenceClassification`` pools the last non-pad token; here the last column whose
    mask is 1, so pad ids never matter. A row with an empty completion is scored at its last
    real prompt token; a row with no real token at all scores 0. The head accumulates in f32.

    Args:
      params: ``ScalarParams``.
      config: the model's ``ModelConfig`` (static).
      prompt_tokens: ``[B, P]`` int32, left-padded.
      prompt_mask: ``[B, P]``, 1 on real prompt tokens.
      completion_tokens: ``[B, T]`` int32, right-padded.
      completion_mask: ``[B, T]``, 1 on real completion tokens.
      remat: the backbone's remat policy (``models.REMAT_POLICIES``: ``"none"``, ``"layer"``,
        ``"offload"``).
      dropout_key: a PRNG key for LoRA dropout (training a LoRA scalar model), or None.
      packing: a ``jaxrl_llm.packing.PackingPlan`` of the ``[B, P+T]`` rows: the backbone runs
        over the packed rows and the states come back to the padded layout (``unpack``)
        before the last real token is pooled (the same scores to rounding), or None.

    Returns:
      ``scores [B]`` f32.

    Raises:
      ValueError: mis-shaped inputs or params (at trace time, naming the shapes).
    """
    seqs = (prompt_tokens, prompt_mask, completion_tokens, completion_mask)
    hidden, mask = _sequence_hidden(params, config, seqs, remat, dropout_key, packing)
    columns = jnp.arange(mask.shape[1], dtype=jnp.int32)
    last = jnp.max(jnp.where(mask, columns, 0), axis=1)
    pooled = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    return jnp.where(jnp.any(mask, axis=1), _head(pooled, params["score"]), 0.0)


def _pad_token_id(config: ModelConfig, tokenizer: Any) -> int:
    """The pad id HF pools with: the config's, else the tokenizer's, else the first EOS."""
    if config.pad_token_id is not None:
        return config.pad_token_id
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is not None:
        return int(pad)
    if config.eos_token_ids:
        return config.eos_token_ids[0]
    raise ValueError(
        "save_scalar_model needs a pad token id (transformers' sequence classifiers refuse "
        "batches without one): set config.pad_token_id, or pass a tokenizer with a pad token"
    )


def save_scalar_model(
    path: str | os.PathLike,
    config: ModelConfig,
    params: ScalarParams,
    *,
    tokenizer: Any = None,
    max_shard_size: int | None = None,
) -> None:
    """Writes a HF ``*ForSequenceClassification`` directory (``num_labels=1``).

    The backbone goes through ``save_pretrained`` with a tied config (``model.*`` tensors), then
    ``score.weight [1, D]`` is added to the (last) safetensors file and ``config.json`` becomes
    the sequence classifier's: ``architectures`` ``LlamaForSequenceClassification`` (or the
    Mistral / Qwen2 / Qwen3 one), one label, the model's own ``tie_word_embeddings`` and a
    ``pad_token_id`` (the config's, else the tokenizer's, else the first EOS id). Reloadable by
    ``transformers.AutoModelForSequenceClassification`` and by ``load_scalar_model``.

    transformers pools the last token whose id is not ``pad_token_id``; where the pad id is
    also a real token (pad = EOS, and completions end in EOS), its scores differ from
    ``sequence_scores``, which pools by the attention mask.

    Args:
      path: output directory (created if needed).
      config: the model's ``ModelConfig`` (a ``*ForCausalLM`` architecture).
      params: ``ScalarParams`` (any dtype; sharded arrays are gathered).
      tokenizer: optional; saved alongside with its ``save_pretrained``.
      max_shard_size: split the safetensors into files of at most this many bytes.

    Raises:
      ValueError: params that do not match ``config``, no pad id to be found, or a tokenizer
        without ``save_pretrained``.
    """
    path = os.fspath(path)
    check_scalar_params(params, config)
    if tokenizer is not None and not hasattr(tokenizer, "save_pretrained"):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no save_pretrained method")
    pad_id = _pad_token_id(config, tokenizer)
    _ckpt.save_pretrained(
        path, backbone_config(config), params["backbone"], max_shard_size=max_shard_size
    )
    score = np.ascontiguousarray(np.asarray(jax.device_get(params["score"])).T)
    _add_tensor(path, SCORE_NAME, score)

    config_file = os.path.join(path, _ckpt.CONFIG_FILE)
    with open(config_file) as f:
        hf = json.load(f)
    hf.update(
        architectures=[SEQ_CLS_ARCHITECTURES[config.architecture]],
        tie_word_embeddings=config.tie_word_embeddings,
        pad_token_id=pad_id,
        id2label={"0": "LABEL_0"},
        label2id={"LABEL_0": 0},
    )
    with open(config_file, "w") as f:
        json.dump(hf, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def _add_tensor(path: str, name: str, value: np.ndarray) -> None:
    """Adds one tensor to the checkpoint at ``path`` (into its last file, updating the index)."""
    index_file = os.path.join(path, _ckpt.INDEX_FILE)
    index = None
    file_name = _ckpt.SINGLE_FILE
    if os.path.exists(index_file):
        with open(index_file) as f:
            index = json.load(f)
        file_name = max(index["weight_map"].values())
    file = os.path.join(path, file_name)
    tensors = load_file(file)
    tensors[name] = value
    save_file(tensors, file, metadata={"format": "pt"})
    if index is not None:
        index["weight_map"][name] = file_name
        index["metadata"]["total_size"] = index["metadata"].get("total_size", 0) + value.nbytes
        with open(index_file, "w") as f:
            json.dump(index, f, indent=2)


def read_scalar_config(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, Any]]:
    """``(ModelConfig, config.json)`` of a scalar-model directory (``load_scalar_model``'s,
    no weights read): the causal architecture of a one-label ``*ForSequenceClassification``,
    or a causal LM's own.

    Raises:
      FileNotFoundError: no directory or no config.json.
      ValueError: a classifier with more than one label, or an unsupported config.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"scalar model directory {path!r} does not exist")
    file = os.path.join(path, _ckpt.CONFIG_FILE)
    if not os.path.exists(file):
        raise FileNotFoundError(f"no {_ckpt.CONFIG_FILE} in {path!r}")
    with open(file) as f:
        hf = json.load(f)
    archs = hf.get("architectures") or []
    if len(archs) == 1 and archs[0] in _CAUSAL_OF:
        # transformers omits id2label for its default of two labels.
        labels = hf.get("id2label")
        num_labels = len(labels) if labels else hf.get("num_labels", 2)
        if num_labels != 1:
            raise ValueError(
                f"{path!r} is a {archs[0]} with {num_labels} labels; a scalar head needs "
                "num_labels=1"
            )
        hf = {**hf, "architectures": [_CAUSAL_OF[archs[0]]]}
    return ModelConfig.from_hf_dict(hf), hf


def _target_shardings(
    config: ModelConfig, shapes: ScalarParams, mesh: Any, rules: Any
) -> ScalarParams:
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda _: device, shapes)
    from jaxrl_llm.parallel import PARAM_RULES, logical_to_sharding  # noqa: PLC0415

    rules = PARAM_RULES if rules is None else rules
    return logical_to_sharding(scalar_logical_axes(config), mesh, rules, shapes=shapes)


def load_scalar_model(
    path: str | os.PathLike,
    *,
    dtype: Any = jnp.float32,
    mesh: jax.sharding.Mesh | None = None,
    rules: Any = None,
    init_score_key: Array | None = None,
) -> tuple[ModelConfig, ScalarParams]:
    """Reads a ``*ForSequenceClassification`` directory (one label) into ``(config, params)``.

    The returned config names the matching ``*ForCausalLM`` architecture (what ``ModelConfig``
    describes) with the directory's ``tie_word_embeddings``. Tensors are read shard by shard
    into their target sharding, as ``load_pretrained`` does.

    A plain ``*ForCausalLM`` directory has no ``score.weight``: that is a ``ValueError``
    unless ``init_score_key`` is given, in which case its backbone is loaded (``lm_head``
    skipped) under a fresh head ``N(0, initializer_range^2)`` (``config.json``'s
    ``initializer_range``, default 0.02, as HF initialises a new classifier head).

    Args:
      path: the directory (``config.json`` + safetensors).
      dtype: parameter dtype after conversion.
      mesh: place params on this mesh per ``scalar_logical_axes`` and ``rules``.
      rules: logical-axis rule table (default ``jaxrl_llm.parallel.PARAM_RULES``).
      init_score_key: PRNG key for a fresh head when the checkpoint has none.

    Returns:
      ``(ModelConfig, ScalarParams)``.

    Raises:
      FileNotFoundError: ``path`` or its ``config.json`` does not exist.
      ValueError: unsupported config, more than one label, missing / unexpected / mis-shaped
        tensors (named), ``score.weight`` missing without ``init_score_key``.
    """
    path = os.fspath(path)
    config, hf = read_scalar_config(path)
    bconfig = backbone_config(config)
    shapes = scalar_param_shapes(config, dtype)
    target = _target_shardings(config, shapes, mesh, rules)
    np_dtype = np.dtype(jnp.dtype(dtype))
    plan = _ckpt._plan(bconfig)
    flat_targets = _ckpt._flat(target["backbone"])
    backbone = {}
    with _ckpt._Tensors(path) as tensors:
        # The backbone check sees every tensor but the head; a causal LM's lm_head is ignored
        # because the backbone config is tied.
        rest = {k: v for k, v in tensors.files.items() if k != SCORE_NAME}
        view = types.SimpleNamespace(files=rest, shape=tensors.shape)
        _ckpt._check_tensors(bconfig, plan, view, path)
        for key, entry in plan.items():
            read = _ckpt._read_param(entry, tensors, np_dtype, entry.shape)
            backbone[key] = jax.make_array_from_callback(entry.shape, flat_targets[key], read)
        has_score = SCORE_NAME in tensors.files
        if has_score:
            score_hf = _read_score(tensors, config, path)
    if has_score:
        score_np = np.ascontiguousarray(score_hf.T.astype(np_dtype))
        score = jax.make_array_from_callback(
            score_np.shape, target["score"], lambda index: score_np[index]
        )
    elif init_score_key is None:
        raise ValueError(
            f"checkpoint {path!r} has no {SCORE_NAME!r} tensor (a *ForCausalLM checkpoint?); "
            "pass init_score_key= to load its backbone under a freshly initialised head"
        )
    else:
        std = float(hf.get("initializer_range", DEFAULT_SCORE_STD))
        fresh = std * jax.random.normal(init_score_key, (config.hidden_size, 1), jnp.float32)
        score = jax.device_put(fresh.astype(dtype), target["score"])
    return config, {"backbone": _ckpt._unflat(backbone), "score": score}


def _read_score(tensors: Any, config: ModelConfig, path: str) -> np.ndarray:
    got = tensors.shape(SCORE_NAME)
    want = (1, config.hidden_size)
    if got != want:
        raise ValueError(
            f"tensor {SCORE_NAME!r} in {path!r} has shape {got}, expected {want} "
            "(one label x hidden_size)"
        )
    return np.asarray(tensors.slice(SCORE_NAME)[:])


__all__ = [
    "DEFAULT_SCORE_STD",
    "SCORE_NAME",
    "SEQ_CLS_ARCHITECTURES",
    "ScalarParams",
    "backbone_config",
    "check_scalar_params",
    "init_scalar_params",
    "load_scalar_model",
    "read_scalar_config",
    "save_scalar_model",
    "scalar_logical_axes",
    "scalar_param_shapes",
    "sequence_scores",
    "token_values",
]
