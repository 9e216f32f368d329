"""Hugging Face checkpoints of trained policies: ``run_dir/hf/`` and ``jaxrl-llm export``.

Every job ends by writing its final policy (a reward-model job: its scalar-head model) as a
Hugging Face directory — ``config.json``, safetensors, the tokenizer and a
``generation_config.json`` holding the stop tokens the run sampled with — that
``transformers.AutoModelForCausalLM`` (``AutoModelForSequenceClassification``) loads with the
same logits. ``jaxrl-llm export RUN_DIR [--step N] [--dtype D] [--out DIR]`` does the same for
any kept checkpoint of a run (``train.cli``). Beside the weights, ``prompt_format.json``
(``data.encoding.PromptFormat``, written by the run core and by ``export``) records whether the
run prompted through the chat template, so ``jaxrl-llm generate`` and ``eval`` prompt the
policy as it was trained.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxrl_llm import models, parallel

EXPORT_DTYPES = ("float32", "bfloat16", "float16")


def np_dtype(dtype: str):
    """The NumPy dtype of an export dtype name (``bfloat16`` through ml_dtypes)."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype must be one of {EXPORT_DTYPES}, got {dtype!r}")
    import ml_dtypes  # noqa: PLC0415  (a JAX dependency)

    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)


def _cast(params, dtype: str | None):
    if dtype is None:
        return params
    target = np_dtype(dtype)
    return jax.tree.map(lambda x: np.asarray(x).astype(target), params)


def write_generation_config(directory, model_config, tokenizer, stop_ids: Sequence[int]) -> None:
    """``generation_config.json`` with the run's stop tokens, pad and BOS ids."""
    pad = tokenizer.pad_token_id if tokenizer is not None else model_config.pad_token_id
    eos: Any = list(stop_ids)
    body = {
        "bos_token_id": model_config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": pad,
        "do_sample": True,
    }
    with open(os.path.join(os.fspath(directory), "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in body.items() if v is not None}, f, indent=2)


def export_policy(
    directory,
    model_config,
    params,
    tokenizer,
    *,
    stop_ids: Sequence[int] = (),
    dtype: str | None = None,
    source: str | os.PathLike | None = None,
) -> str:
    """Writes a causal-LM checkpoint (weights, config, tokenizer, generation config).

    Args:
      directory: output directory (created; existing weights replaced).
      model_config: the policy's ``ModelConfig``.
      params: its parameters (sharded arrays are gathered; only the main process writes).
      tokenizer: a Hugging Face tokenizer, saved beside the weights.
      stop_ids: the ids that end a completion (``data.stop_token_ids``).
      dtype: ``float32`` | ``bfloat16`` | ``float16``, or None to keep the parameters' dtype.
      source: the checkpoint the policy was loaded from (``model.path``): a multimodal one
        (Gemma 3's ``Gemma3ForConditionalGeneration``) is written back whole, its vision tower
        and projector copied through, so ``transformers`` loads the trained model as the model
        it was; any other source changes nothing.

    Returns:
      The directory, as a string.
    """
    directory = os.fspath(directory)
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype must be one of {EXPORT_DTYPES}, got {dtype!r}")
    host = jax.tree.map(gather_host, params)
    if parallel.is_primary():
        models.save_pretrained(directory, model_config, _cast(host, dtype), source=_local(source))
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
        write_generation_config(
            directory, model_config, tokenizer, stop_ids or (model_config.eos_token_ids or ())
        )
    return directory


def _local(source: str | os.PathLike | None) -> str | None:
    """``source`` when it is a local checkpoint directory (the only kind a wrapper is read from)."""
    if source is None or not os.path.isfile(os.path.join(os.fspath(source), "config.json")):
        return None
    return os.fspath(source)


def export_scalar_model(directory, model_config, params, tokenizer, *, dtype=None) -> str:
    """Writes a reward model / critic as a ``*ForSequenceClassification`` checkpoint."""
    directory = os.fspath(directory)
    host = jax.tree.map(gather_host, params)
    if parallel.is_primary():
        models.save_scalar_model(directory, model_config, _cast(host, dtype), tokenizer=tokenizer)
    return directory


def gather_host(x):
    """A (possibly multi-host sharded) array as a host NumPy array on every process."""
    if isinstance(x, jax.Array) and jax.process_count() > 1 and not x.is_fully_addressable:
        from jax.experimental import multihost_utils  # noqa: PLC0415

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))
