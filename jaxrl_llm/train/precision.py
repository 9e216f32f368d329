"""A job's precision: every dtype named once, and the one place a model takes it.

``resolve_precision`` reads ``model.param_dtype``, ``model.compute_dtype`` (``auto`` resolved
for the backend) and the optimizer's state dtype, refusing an unknown name, and returns a
:class:`Precision` whose fields are never ``auto`` or None. ``job_model`` gives a
``ModelConfig`` the job's compute dtype (and its adapters): the policy, the reference, a
critic, an implicit PRM, a reward model and the sampler's copy all pass through it, so every
model of a job computes in one dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm import models
from jaxrl_llm.train.optim import STATE_DTYPES

#: The master-weight dtypes (``model.param_dtype``).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
#: ``model.compute_dtype``'s names: the models' compute dtypes and ``auto``.
COMPUTE_DTYPES = ("auto", *models.COMPUTE_DTYPES)


@dataclasses.dataclass(frozen=True)
class Precision:
    """Every dtype of a job, by name.

    Attributes:
      param_dtype: the master weights the optimizer updates (``model.param_dtype``).
      compute_dtype: matmuls and activations of every model of the job (``model.compute_dtype``
        with ``auto`` resolved for the backend: bfloat16 on TPU and GPU, float32 on CPU); a
        frozen model (a reward model) is stored in it too.
      cache_dtype: the sampler's KV cache (the compute dtype).
      optimizer_state_dtype: AdamW's moments (``trainer.optimizer_state_dtype``).
    """

    param_dtype: str
    compute_dtype: str
    cache_dtype: str
    optimizer_state_dtype: str

    @property
    def param(self) -> Any:
        """``param_dtype`` as a NumPy dtype."""
        return jnp.dtype(self.param_dtype)

    @property
    def compute(self) -> Any:
        """``compute_dtype`` as a NumPy dtype."""
        return jnp.dtype(self.compute_dtype)


def param_dtype(section: Any) -> Any:
    """The master-weight dtype of ``model.param_dtype``.

    Raises:
      ValueError: an unknown name.
    """
    if section.param_dtype not in DTYPES:
        raise ValueError(
            f"model.param_dtype must be one of {tuple(DTYPES)}, got {section.param_dtype!r}"
        )
    return DTYPES[section.param_dtype]


def compute_dtype(section: Any, backend: str | None = None) -> str:
    """The compute dtype name of ``model.compute_dtype``; ``auto`` is ``bfloat16`` on TPU and
    GPU, ``float32`` on CPU (``backend`` defaults to ``jax.default_backend()``).

    Raises:
      ValueError: an unknown name.
    """
    name = section.compute_dtype
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"model.compute_dtype must be one of {COMPUTE_DTYPES}, got {name!r}")
    if name == "auto":
        backend = jax.default_backend() if backend is None else backend
        return "float32" if backend == "cpu" else "bfloat16"
    return name


def resolve_precision(
    model_section: Any, optimizer_state_dtype: str = "float32", *, backend: str | None = None
) -> Precision:
    """The :class:`Precision` of a job's ``model`` section and its optimizer's state dtype,
    for ``backend`` (default ``jax.default_backend()``; ``plan`` passes ``"tpu"``).

    Raises:
      ValueError: naming the key of an unknown dtype.
    """
    param_dtype(model_section)
    compute = compute_dtype(model_section, backend)
    if optimizer_state_dtype not in STATE_DTYPES:
        raise ValueError(
            f"trainer.optimizer_state_dtype must be one of {STATE_DTYPES}, got "
            f"{optimizer_state_dtype!r}"
        )
    return Precision(
        param_dtype=model_section.param_dtype,
        compute_dtype=compute,
        cache_dtype=compute,
        optimizer_state_dtype=optimizer_state_dtype,
    )


def job_model(
    config: models.ModelConfig, precision: Precision, *, lora: models.LoraSpec | None = None
) -> models.ModelConfig:
    """``config`` as a model of the job: computing in ``precision.compute_dtype``, with
    ``lora``'s adapters (None: none)."""
    return dataclasses.replace(config, compute_dtype=precision.compute_dtype, lora=lora)


__all__ = [
    "COMPUTE_DTYPES",
    "DTYPES",
    "Precision",
    "compute_dtype",
    "job_model",
    "param_dtype",
    "resolve_precision",
]
