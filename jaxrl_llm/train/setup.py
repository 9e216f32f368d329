"""What every job is made of before its first step: the mesh, the policy, batch placement.

Shared by the RL and preference wings: ``make_run_mesh`` (``mesh.*``), ``build_policy``
(``model.*``: a Hugging Face checkpoint or the built-in tiny model), ``to_device`` (host rows →
a batch sharded over the mesh's batch axes, each process feeding only its own rows) and the
size checks that turn a batch not dividing the mesh into a message naming the config key.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import data, models, parallel, sampling
from jaxrl_llm.data import char_tokenizer
from jaxrl_llm.models import lora
from jaxrl_llm.parallel import fetch  # noqa: F401 (re-exported: its old home)
from jaxrl_llm.train.precision import (  # noqa: F401 (re-exported: their old home)
    COMPUTE_DTYPES,
    DTYPES,
    Precision,
    compute_dtype,
    job_model,
    param_dtype,
    resolve_precision,
)

log = logging.getLogger("jaxrl_llm")


def make_run_mesh(section, reserve: int = 0) -> jax.sharding.Mesh:
    """The mesh of ``mesh.*`` over the devices after the ``mesh.rollout_devices`` sampling
    ones, less the last ``reserve`` of them (an RL job's ``teacher.devices``:
    :func:`reserved_mesh`); without a ``-1`` the first ``data·fsdp·expert·tensor`` of them are
    used. With ``mesh.expert > 1`` the mesh has an ``expert`` axis (``parallel.make_mesh``),
    which the batch also splits over (``parallel.batch_shards`` counts it); with
    ``mesh.sequence > 1`` a ``sequence`` axis (context parallelism), which splits positions."""
    return mesh_over(section, trainer_devices(section, reserve))


def mesh_over(section, devices: list) -> jax.sharding.Mesh:
    """The mesh of ``mesh.*`` (``data``, ``fsdp``, ``tensor``, ``expert``, ``sequence``) over
    ``devices``: a ``-1`` fills with what is left, else the first ``data·fsdp·sequence·
    expert·tensor`` of them are used. What ``train`` runs on and what ``plan`` compiles for.

    Raises:
      ValueError: the sizes need more devices than given, or do not multiply to them.
    """
    sizes = (section.data, section.fsdp, section.tensor)
    extra = {a: getattr(section, a, 1) for a in ("expert", "sequence")}
    devices = list(devices)
    if -1 not in sizes:
        count = int(np.prod(sizes)) * extra["expert"] * extra["sequence"]
        if count > len(devices):
            shape = (*sizes, *(f"{a}={n}" for a, n in extra.items() if n > 1))
            raise ValueError(f"mesh {shape} needs {count} devices; {len(devices)} available")
        devices = devices[:count]
    return parallel.make_mesh(*sizes, **extra, devices=devices)


def trainer_devices(section, reserve: int = 0) -> list:
    """The devices the trainer's mesh may take: those after the ``mesh.rollout_devices``
    sampling ones, less the last ``reserve`` (held for :func:`reserved_mesh`).

    Raises:
      ValueError: ``reserve`` leaves the trainer no device.
    """
    return split_reserved(split_devices(rollout_devices(section))[1], reserve)[0]


def split_reserved(devices: Sequence[Any], reserve: int) -> tuple[list, list]:
    """``(the trainer's, the reserved)`` of ``devices`` (those after ``mesh.rollout_devices``'):
    the last ``reserve`` are held for a frozen model of its own (``teacher.devices``; none
    with 0). ``plan`` splits a slice's compile-only devices with it.

    Raises:
      ValueError: ``reserve`` leaves the trainer no device.
    """
    devices = list(devices)
    if not reserve:
        return devices, []
    if not 0 < reserve < len(devices):
        raise ValueError(
            f"teacher.devices={reserve} must leave the trainer a device: {len(devices)} "
            "device(s) after mesh.rollout_devices"
        )
    return devices[: len(devices) - reserve], devices[len(devices) - reserve :]


def reserved_mesh(section, reserve: int) -> jax.sharding.Mesh:
    """An fsdp mesh over the last ``reserve`` of the trainer's devices
    (:func:`trainer_devices`): a frozen model's devices of its own (``teacher.devices``)."""
    return own_mesh(split_reserved(split_devices(rollout_devices(section))[1], reserve)[1])


def own_mesh(devices: Sequence[Any]) -> jax.sharding.Mesh:
    """The mesh of a frozen model on devices of its own: ``fsdp`` over all of them."""
    return parallel.make_mesh(1, len(devices), 1, devices=list(devices))


def split_devices(rollout_devices: int, devices: Sequence[Any] | None = None) -> tuple[list, list]:
    """``(sampler devices, trainer devices)`` for ``mesh.rollout_devices = n``: the first n
    sample in one process; on several processes the last n (the last processes' devices),
    so process 0, which writes the run's files, trains. ``devices``: ``jax.devices()`` unless
    given (``plan`` passes a slice's compile-only devices)."""
    devices = jax.devices() if devices is None else list(devices)
    if not rollout_devices:
        return [], devices
    if process_count(devices) > 1:
        return devices[-rollout_devices:], devices[:-rollout_devices]
    return devices[:rollout_devices], devices[rollout_devices:]


def process_count(devices: Sequence[Any]) -> int:
    """How many processes (hosts) ``devices`` belong to."""
    return len({d.process_index for d in devices})


def rollout_devices(section) -> int:
    """``mesh.rollout_devices``, checked: fewer than the devices and, on several processes,
    every device of the last processes (``process_roles``)."""
    n = getattr(section, "rollout_devices", 0)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < jax.device_count():
        raise ValueError(
            f"mesh.rollout_devices must be an int in [0, {jax.device_count()}) (devices that "
            f"only sample; the trainer keeps the rest), got {n!r}"
        )
    if n and jax.process_count() > 1:
        process_roles(n)
    return n


def process_roles(
    rollout_devices: int, devices: Sequence[Any] | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(sampler processes, trainer processes)`` of a multi-process job whose last
    ``rollout_devices`` devices only sample: each process is one or the other.

    Raises:
      ValueError: a process holding both sampler and trainer devices.
    """
    devices = jax.devices() if devices is None else list(devices)
    sampler_devices, trainer_devices = split_devices(rollout_devices, devices)
    sampler = sorted({d.process_index for d in sampler_devices})
    trainer = sorted({d.process_index for d in trainer_devices})
    shared = sorted(set(sampler) & set(trainer))
    if shared:
        per_process = sorted({sum(d.process_index == p for d in devices) for p in shared})
        raise ValueError(
            f"mesh.rollout_devices={rollout_devices} splits process(es) {shared} between the "
            f"sampler and the trainer; on {process_count(devices)} processes the sampler takes "
            f"whole processes: a multiple of their {'/'.join(map(str, per_process))} devices"
        )
    return tuple(sampler), tuple(trainer)


def load_model(
    path: str,
    precision: Precision,
    *,
    head: str = "causal",
    frozen: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    lora: models.LoraSpec | None = None,
    policy: models.ModelConfig | None = None,
    key: str = "model.path",
    weights: bool = True,
) -> tuple[models.ModelConfig, Any]:
    """``(config, params)`` of a checkpoint directory as a model of the job: every model a job
    loads (the policy, a critic or reward model, the sampler's copy, ``plan``'s) comes through
    here and computes in ``precision.compute_dtype`` (``precision.job_model``).

    Args:
      path: a Hugging Face directory (config.json and safetensors).
      precision: the job's dtypes: a trained model's weights are read in ``param_dtype``, a
        ``frozen`` one's (nothing updates it) in ``compute_dtype``.
      head: ``causal`` (a language model) or ``scalar`` (a one-label sequence classifier, or
        a causal LM's backbone under a fresh head: ``models.load_scalar_model``).
      mesh: where the weights are placed (the parameter rules); None: one device.
      lora: the adapters the model trains (None: none).
      policy: the job's policy; a model whose vocabulary differs is refused (they share the
        tokenizer).
      key: the config key naming ``path`` (in errors).
      weights: False reads only config.json (params None).

    Raises:
      ValueError: an unknown ``head``, or a vocabulary other than the policy's.
      FileNotFoundError: no such directory or config.json.
    """
    if head not in ("causal", "scalar"):
        raise ValueError(f"head must be 'causal' or 'scalar', got {head!r}")
    dtype = precision.compute if frozen else precision.param
    params = None
    if head == "causal" and weights:
        config, params = models.load_pretrained(path, dtype=dtype, mesh=mesh)
    elif head == "causal":
        config = models.load_config(path)
    elif weights:
        config, params = models.load_scalar_model(path, dtype=dtype, mesh=mesh)
    else:
        config, _ = models.read_scalar_config(path)
    if policy is not None and config.vocab_size != policy.vocab_size:
        raise ValueError(
            f"{key} {path} has vocab_size {config.vocab_size}, the policy "
            f"{policy.vocab_size}: they must share the tokenizer"
        )
    return job_model(config, precision, lora=lora), params


def tiny_model_config(section, tokenizer, mesh) -> models.ModelConfig:
    """The built-in Llama-shaped model of ``model.tiny`` over the character tokenizer.

    Like Megatron's make-vocab-size-divisible-by, the embedding rows are rounded up to a
    multiple of the tensor axis (and of ``model.tiny.vocab_multiple``); the extra ids decode
    to nothing and earn no reward.
    """
    tiny = section.tiny
    tensor = 1 if mesh is None else dict(mesh.shape).get("tensor", 1)
    multiple = math.lcm(tiny.vocab_multiple, tensor)
    experts = {}  # model.tiny.experts > 0: a Mixtral-shaped mixture of experts
    if tiny.experts:
        experts = dict(
            num_experts=tiny.experts,
            num_experts_per_tok=tiny.experts_per_token,
            moe_intermediate_size=tiny.intermediate_size,
            norm_topk_prob=True,
            router_aux_loss_coef=0.001,
        )
    return models.ModelConfig(
        architecture="MixtralForCausalLM" if tiny.experts else "LlamaForCausalLM",
        vocab_size=-(-len(tokenizer) // multiple) * multiple,
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        head_dim=tiny.head_dim,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=(tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id,
        **experts,
    )


def build_policy(cfg, mesh, precision: Precision | None = None):
    """``(tokenizer, model_config, params or None)`` of ``cfg.model``; None = random init.

    ``precision``: the job's (``resolve_precision``; default: ``cfg.model``'s on this backend).

    Raises:
      ValueError: an unknown ``model.param_dtype`` / ``model.compute_dtype`` / ``model.remat``.
      FileNotFoundError: ``model.path`` is not a checkpoint directory.
    """
    if precision is None:
        precision = resolve_precision(cfg.model)
    if cfg.model.remat not in models.REMAT_POLICIES:
        raise ValueError(
            f"model.remat must be one of {models.REMAT_POLICIES}, got {cfg.model.remat!r}"
        )
    if cfg.model.path is None and cfg.model.architecture is not None:
        raise ValueError(
            f"model.architecture={cfg.model.architecture!r} names an architecture without "
            "weights or a tokenizer: `jaxrl-llm plan` compiles it; to train, set model.path to "
            "a Hugging Face checkpoint directory"
        )
    spec = lora_spec(cfg.model)
    if cfg.model.path is not None and lora.is_adapter_dir(cfg.model.path):
        model_config, params = lora.load_adapted(cfg.model.path, dtype=precision.param, mesh=mesh)
        if spec is not None and spec != model_config.lora:
            raise ValueError(
                f"model.lora {spec} differs from the adapter at model.path ({model_config.lora})"
            )
        model_config = job_model(model_config, precision, lora=model_config.lora)
        return models.load_tokenizer(cfg.model.path), model_config, params
    if cfg.model.path is not None:
        model_config, params = load_model(cfg.model.path, precision, mesh=mesh, lora=spec)
        return models.load_tokenizer(cfg.model.path), model_config, params
    tokenizer = data.build_char_tokenizer(tiny_alphabet(cfg))
    model_config = job_model(tiny_model_config(cfg.model, tokenizer, mesh), precision, lora=spec)
    return tokenizer, model_config, None


LORA_SAMPLERS = ("auto", "adapters", "merged")


def lora_spec(section) -> models.LoraSpec | None:
    """The ``LoraSpec`` of ``model.lora`` (None: full fine-tuning).

    Raises:
      ValueError: a bad rank, alpha, dropout or target, naming the ``model.lora`` key.
    """
    if section.lora is None:
        return None
    section = section.lora
    if section.sampler not in LORA_SAMPLERS:
        raise ValueError(
            f"model.lora.sampler must be one of {LORA_SAMPLERS}, got {section.sampler!r}"
        )
    try:
        return models.LoraSpec(
            rank=section.rank,
            alpha=section.alpha,
            targets=tuple(section.targets),
            dropout=section.dropout,
            rslora=section.rslora,
        )
    except ValueError as err:
        raise ValueError(f"model.{err}") from None


def tiny_alphabet(cfg) -> str:
    """The built-in model's characters: arithmetic, and those of tool calls when the run has
    an environment (``env.name``)."""
    env = getattr(cfg, "env", None)
    has_env = env is not None and env.name is not None
    return char_tokenizer.TOOL_ALPHABET if has_env else char_tokenizer.ARITHMETIC_ALPHABET


def sft_warmup_steps(cfg, builtin_default: int) -> int:
    """``sft_warmup.steps``, resolving ``null`` (the default): ``builtin_default`` steps for the
    built-in tiny model (it knows nothing yet), 0 for a loaded checkpoint (never train a user's
    model on the gold answers unasked)."""
    steps = cfg.sft_warmup.steps
    if steps is None:
        return builtin_default if cfg.model.path is None else 0
    if steps < 0:
        raise ValueError(f"sft_warmup.steps must be >= 0, got {steps}")
    return steps


def check_batch_sizes(sizes: Mapping[str, int], mesh) -> None:
    """Raises ValueError naming the first config key whose size the batch shards do not divide."""
    shards = parallel.batch_shards(mesh)
    for name, size in sizes.items():
        if size % shards:
            raise ValueError(
                f"{name}={size} does not divide into the {shards} batch shards of the mesh "
                f"{dict(mesh.shape)}"
            )


def row_sharding(mesh) -> jax.sharding.NamedSharding:
    """Rows split over the mesh's batch axes, other dimensions replicated."""
    axes = parallel.batch_mesh_axes(mesh)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(parallel.spec_entry(axes)))


def bucket_prompts(host):
    """Left-pads ``prompt_tokens`` / ``prompt_mask`` to a bucketed width (few programs)."""
    width = sampling.bucket_length(host.prompt_tokens.shape[1])
    extra = width - host.prompt_tokens.shape[1]
    if not extra:
        return host
    return host._replace(
        prompt_tokens=np.pad(host.prompt_tokens, ((0, 0), (extra, 0))),
        prompt_mask=np.pad(host.prompt_mask, ((0, 0), (extra, 0))),
    )


def to_device(host, mesh):
    """Shards a host batch (any pytree of ``[B, ...]`` arrays) over the mesh's batch axes.

    On several processes each feeds only its own rows
    (``jax.make_array_from_process_local_data``).
    """
    if jax.process_count() > 1:
        rows = parallel.process_local_slice(jax.tree.leaves(host)[0].shape[0], mesh)
        host = jax.tree.map(lambda x: x[rows], host)
    return parallel.shard_batch(host, mesh)


def copy_fn(shardings):
    """A jitted copy of a parameter tree into ``shardings`` (a reference, a PRM, ...)."""
    return jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings)
