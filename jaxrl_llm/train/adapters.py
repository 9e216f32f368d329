"""LoRA training state: adapters trained (``TrainState.params``), the base frozen beside it.

A run with ``model.lora`` keeps two parameter trees on the mesh: the **base** (every weight of
the model, in the compute dtype, never updated, no gradient and no optimizer moments) and the
**adapters** (``layers/<w>_lora_a`` / ``_lora_b``, master weights in ``param_dtype``, with the
optimizer state). Both follow the model's logical-axis rules (an adapter factor is sharded like
its base weight on the axes they share; the rank axis is unsharded). The step reads
``merge_trees(base, adapters)`` (``train.step.make_step``'s ``frozen``), checkpoints hold the
adapters only, and the reference policy is the base itself (adapters switched off: no copy).

A base that is not a checkpoint on disk (the built-in tiny model, possibly after its SFT
warm-up) is written once to ``run_dir/base/`` so a resumed run and the exported PEFT adapter
find it.
"""

from __future__ import annotations

import math
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm import models, parallel
from jaxrl_llm.models import heads, lora
from jaxrl_llm.train.state import TrainState, create_train_state

PyTree = Any
BASE_DIR = "base"


class LoraState(NamedTuple):
    """What ``create_lora_state`` returns."""

    state: TrainState  # params: the adapters
    shardings: TrainState
    base: PyTree  # the frozen base, in the compute dtype
    base_shardings: PyTree


def start_line(config: models.ModelConfig) -> dict[str, str]:
    """The run's ``lora`` first line (nothing without adapters)."""
    if config.lora is None:
        return {}
    spec = config.lora
    trained = sum(math.prod(x.shape) for x in jax.tree.leaves(lora.adapter_shapes(config)))
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(models.param_shapes(config)))
    return {
        "lora": f"rank {spec.rank}, alpha {spec.alpha:g}{' (rsLoRA)' * spec.rslora} on "
        f"{', '.join(spec.targets)}: "
        f"{trained / 1e6:.3f}M trained of {total / 1e6:.2f}M parameters (the base frozen)"
    }


def shardings_of(config: models.ModelConfig, mesh, rules=None) -> tuple[PyTree, PyTree]:
    """``(base, adapters)`` ``NamedSharding`` trees of a LoRA model on ``mesh``."""
    rules = parallel.PARAM_RULES if rules is None else rules
    base_axes, adapter_axes = lora.split(models.logical_axes(config))
    base_shapes, adapter_shapes = lora.split(models.param_shapes(config))
    return (
        parallel.logical_to_sharding(base_axes, mesh, rules, shapes=base_shapes),
        parallel.logical_to_sharding(adapter_axes, mesh, rules, shapes=adapter_shapes),
    )


def has_dropout(config: models.ModelConfig) -> bool:
    """Whether the update's loss needs a dropout key (LoRA dropout > 0)."""
    return config.lora is not None and config.lora.dropout > 0


def base_dtype(config: models.ModelConfig, param_dtype) -> Any:
    """The frozen base's dtype: the compute dtype (its master copy is never updated)."""
    return jnp.dtype(config.compute_dtype or param_dtype)


def create_lora_state(
    config: models.ModelConfig,
    optimizer,
    *,
    key: jax.Array,
    mesh,
    params: PyTree | None,
    param_dtype=jnp.float32,
    entropy_control: PyTree = None,
) -> LoraState:
    """The adapters' train state and the frozen base, born sharded on ``mesh``.

    Args:
      config: the policy's ``ModelConfig`` with ``lora`` set.
      optimizer: the optax transformation (its state covers the adapters only).
      key: initialisation key (adapters; a random base when ``params`` is None).
      mesh: the run's mesh.
      params: the base (``load_pretrained``, or after a warm-up), optionally with adapters
        already (``lora.load_adapted``: training continues from them); None: a random base.
      param_dtype: the adapters' master weights' dtype (and a random base's before its cast).
      entropy_control: the state's adaptive entropy coefficient (``TrainState``), or None.
    """
    if config.lora is None:
        raise ValueError("create_lora_state needs a ModelConfig with lora set")
    base_key, adapter_key, state_key = jax.random.split(key, 3)
    base_shardings, adapter_shardings = shardings_of(config, mesh)
    dtype = base_dtype(config, param_dtype)
    cast = lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree)  # noqa: E731
    if params is None:
        base_config = lora.base_config(config)
        base = jax.jit(
            lambda k: cast(models.init_params(base_config, k, dtype=param_dtype)),
            out_shardings=base_shardings,
        )(base_key)
        adapters = None
    else:
        base, adapters = lora.split(params)
        adapters = adapters if adapters["layers"] else None
        base = jax.jit(cast, out_shardings=base_shardings)(base)
    if adapters is None:
        adapters = fresh_adapters(config, key=adapter_key, mesh=mesh, param_dtype=param_dtype)[0]
    else:
        adapters = jax.jit(
            lambda a: jax.tree.map(lambda x: x.astype(param_dtype), a),
            out_shardings=adapter_shardings,
        )(adapters)
    adapter_axes = lora.split(models.logical_axes(config))[1]
    state, shardings = create_train_state(
        config,
        optimizer,
        key=state_key,
        mesh=mesh,
        params=adapters,
        params_axes=adapter_axes,
        entropy_control=entropy_control,
    )
    return LoraState(state, shardings, base, base_shardings)


# -- scalar-head models (reward model, critic) and extra policies (PRIME's PRM) ----------------


def backbone_view(base: PyTree) -> PyTree:
    """The frozen tree of a LoRA scalar-head model over a policy's ``base``: ``{"backbone":
    base without lm_head}``, the same arrays (no copy)."""
    return {"backbone": {k: v for k, v in base.items() if k != "lm_head"}}


def _cast_to(tree: PyTree, dtype, shardings: PyTree) -> PyTree:
    return jax.jit(lambda t: jax.tree.map(lambda x: x.astype(dtype), t), out_shardings=shardings)(
        tree
    )


def fresh_adapters(
    config: models.ModelConfig, *, key: jax.Array, mesh, param_dtype=jnp.float32
) -> tuple[PyTree, PyTree]:
    """``(adapters, logical_axes)``: new adapters for ``config.lora`` (PEFT's init: ``B = 0``,
    so the model starts as its base), born sharded like their base weights on ``mesh``."""
    adapter_axes = lora.split(models.logical_axes(config))[1]
    shardings = parallel.logical_to_sharding(
        adapter_axes, mesh, parallel.PARAM_RULES, shapes=lora.adapter_shapes(config)
    )
    made = jax.jit(
        lambda k: lora.init_adapters(config, k, dtype=param_dtype), out_shardings=shardings
    )(key)
    return made, adapter_axes


def scalar_lora_params(
    config: models.ModelConfig, score: jax.Array, *, key: jax.Array, mesh, param_dtype=jnp.float32
) -> tuple[PyTree, PyTree]:
    """``(params, logical_axes)`` a LoRA scalar-head model trains: ``{"backbone": fresh
    adapters, "score": score}`` in ``param_dtype`` (``config``: the scalar model's, ``lora``
    set); its frozen half is ``{"backbone": base}`` (:func:`backbone_view`,
    :func:`frozen_scalar_base`)."""
    if config.lora is None:
        raise ValueError("a LoRA scalar-head model needs a ModelConfig with lora set")
    made, axes = fresh_adapters(
        heads.backbone_config(config), key=key, mesh=mesh, param_dtype=param_dtype
    )
    params = {"backbone": made, "score": jnp.asarray(score, param_dtype)}
    return params, {"backbone": axes, "score": heads.scalar_logical_axes(config)["score"]}


def scalar_lora_state(
    config: models.ModelConfig,
    optimizer,
    *,
    key: jax.Array,
    mesh,
    frozen: PyTree,
    frozen_shardings: PyTree,
    score: jax.Array,
    param_dtype=jnp.float32,
) -> LoraState:
    """A LoRA scalar-head model (reward model, critic) with its own optimizer: the
    :func:`scalar_lora_params` trained (masters and moments), over ``frozen`` (e.g.
    :func:`backbone_view` of the policy's base: one copy of the base serves both)."""
    adapter_key, state_key = jax.random.split(key)
    params, axes = scalar_lora_params(
        config, score, key=adapter_key, mesh=mesh, param_dtype=param_dtype
    )
    state, shardings = create_train_state(
        config, optimizer, key=state_key, mesh=mesh, params=params, params_axes=axes
    )
    return LoraState(state, shardings, frozen, frozen_shardings)


def frozen_scalar_base(
    config: models.ModelConfig, params: PyTree, *, key: jax.Array, mesh, param_dtype=jnp.float32
) -> tuple[PyTree, PyTree, jax.Array]:
    """``(frozen, frozen_shardings, score)`` of a LoRA scalar-head model from loaded weights:
    a ``ScalarParams`` (a reward model: its backbone frozen in the compute dtype, its head
    trained on) or a causal LM's params (its ``lm_head`` dropped; a fresh head
    ``N(0, 0.02²)``, HF's classifier initialisation). Adapters already in ``params`` are
    dropped (the job trains new ones)."""
    if set(params) == {"backbone", "score"}:
        backbone, score = params["backbone"], params["score"]
    else:
        backbone = {k: v for k, v in params.items() if k != "lm_head"}
        fresh = jax.random.normal(key, (config.hidden_size, 1), jnp.float32)
        score = heads.DEFAULT_SCORE_STD * fresh
    abstract, shardings = frozen_scalar_layout(config, mesh, param_dtype=param_dtype)
    dtype = jax.tree.leaves(abstract)[0].dtype
    frozen = _cast_to({"backbone": lora.split(backbone)[0]}, dtype, shardings)
    return frozen, shardings, score


def frozen_scalar_layout(
    config: models.ModelConfig, mesh, *, param_dtype=jnp.float32
) -> tuple[PyTree, PyTree]:
    """``(abstract, shardings)`` of a LoRA scalar-head model's frozen ``{"backbone": base}``
    of its own (:func:`frozen_scalar_base`): ``ShapeDtypeStruct``s in the compute dtype
    carrying their ``NamedSharding``s on ``mesh``, and those shardings."""
    backbone = heads.backbone_config(config)
    base_axes = lora.split(models.logical_axes(backbone))[0]
    base_shapes = lora.split(models.param_shapes(backbone))[0]
    shardings = {
        "backbone": parallel.logical_to_sharding(
            base_axes, mesh, parallel.PARAM_RULES, shapes=base_shapes
        )
    }
    dtype = base_dtype(config, param_dtype)
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, dtype, sharding=s),
        {"backbone": base_shapes},
        shardings,
    )
    return abstract, shardings


def merged_scalar(config: models.ModelConfig, params: PyTree) -> PyTree:
    """A scalar-head model's params for ``base_config(config)``: the adapters merged into its
    backbone (unchanged without adapters)."""
    if config.lora is None:
        return params
    backbone = jax.jit(lambda p: lora.merge_weights(p, heads.backbone_config(config)))(
        params["backbone"]
    )
    return {"backbone": backbone, "score": params["score"]}


def save_base(run_dir, config: models.ModelConfig, base: PyTree) -> str:
    """Writes the frozen base as a Hugging Face checkpoint under ``run_dir/base``."""
    path = os.path.join(os.fspath(run_dir), BASE_DIR)
    if parallel.is_primary():
        from jaxrl_llm.train.export import gather_host  # noqa: PLC0415

        host = jax.tree.map(gather_host, base)
        models.save_pretrained(path, lora.base_config(config), host)
    return path


def load_base(run_dir, *, mesh, dtype=jnp.float32) -> PyTree:
    """The base a run wrote with :func:`save_base`.

    Raises:
      FileNotFoundError: the run has no ``base/`` (it was not a LoRA run of a built-in model).
    """
    path = os.path.join(os.fspath(run_dir), BASE_DIR)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} not found: a LoRA run's frozen base is kept there")
    return models.load_pretrained(path, dtype=dtype, mesh=mesh)[1]


def base_model_path(cfg, run_dir) -> str:
    """Where a LoRA run's base lives on disk: ``model.path`` (the base an adapter at
    ``model.path`` names), else the run's own ``base/``; an absolute path."""
    path = cfg.model.path
    if path is None:
        return os.path.abspath(os.path.join(os.fspath(run_dir), BASE_DIR))
    return os.path.abspath(lora.adapter_base(path) if lora.is_adapter_dir(path) else path)


def sft_config(cfg, config: models.ModelConfig) -> models.ModelConfig:
    """The model config of a run's SFT warm-up: with ``model.lora`` and a pretrained base
    (``model.path``) the adapters (an adapter-only warm-up, merged into the base after it);
    the built-in model's warm-up trains every weight (it makes the base from random)."""
    if config.lora is not None and cfg.model.path is not None:
        return config
    return lora.base_config(config)


def check_lora_job(cfg, job: str, objective=None) -> None:
    """Raises ValueError naming what a LoRA run (``model.lora``) of ``job`` does not support."""
    if cfg.model.lora is None:
        return
    critic = getattr(cfg, "critic", None)
    if objective is not None and objective.needs_critic and critic.init == "random":
        raise ValueError(
            "critic.init=random with model.lora: a LoRA critic trains adapters over a frozen "
            "backbone, which would stay random; use critic.init=policy (the policy's base) or "
            "critic.init=reward_model"
        )
    reference = getattr(cfg, "reference", None)
    if reference is not None and reference.mode != "frozen":
        raise ValueError(
            f"reference.mode={reference.mode!r} with model.lora: a LoRA run's reference is the "
            "frozen base (adapters off), so only reference.mode=frozen applies"
        )
    if job not in ("rl", "preference", "reward_model"):
        raise ValueError(
            f"model.lora is not supported for {job} jobs (RL, preference and reward-model "
            "jobs only)"
        )


def setup_run(
    cfg,
    config: models.ModelConfig,
    optimizer,
    mesh,
    *,
    run_dir,
    resuming: bool,
    params: PyTree | None,
    key: jax.Array,
    entropy_control: PyTree = None,
) -> LoraState:
    """A LoRA run's state and base: the base from ``params`` (a loaded checkpoint, or the
    built-in model after its warm-up) on a fresh run, from ``run_dir/base`` when a built-in
    model's run resumes; ``run_dir/base`` written on a fresh built-in run.
    ``entropy_control``: the state's adaptive entropy coefficient (``TrainState``), or None."""
    from jaxrl_llm.train import setup  # noqa: PLC0415

    dtype = setup.param_dtype(cfg.model)
    builtin = cfg.model.path is None
    if builtin and resuming:
        params = load_base(run_dir, mesh=mesh, dtype=dtype)
    created = create_lora_state(
        config,
        optimizer,
        key=key,
        mesh=mesh,
        params=params,
        param_dtype=dtype,
        entropy_control=entropy_control,
    )
    if builtin and not resuming:
        save_base(run_dir, config, created.base)
    return created


def export_adapter(
    directory,
    config: models.ModelConfig,
    params: PyTree,
    tokenizer,
    *,
    base_model: str,
    stop_ids=(),
    merge: bool = False,
    dtype: str | None = None,
) -> str:
    """Writes a LoRA policy: a PEFT adapter directory (adapter files, the tokenizer and the
    generation config; ``peft.PeftModel.from_pretrained(base, directory)`` loads it), or with
    ``merge`` the merged full weights as a plain Hugging Face checkpoint. ``params``: the
    base with the adapters (without ``merge`` the adapters alone will do)."""
    from jaxrl_llm.train import export  # noqa: PLC0415

    if merge:
        merged = jax.jit(lambda p: lora.merge_weights(p, config))(params)
        return export.export_policy(
            directory,
            lora.base_config(config),
            merged,
            tokenizer,
            stop_ids=stop_ids,
            dtype=dtype,
            source=base_model,
        )
    directory = os.fspath(directory)
    host = jax.tree.map(export.gather_host, lora.split(params)[1])
    if parallel.is_primary():
        np_dtype = export.np_dtype(dtype or "float32")
        lora.save_peft_adapter(directory, config, host, base_model=base_model, dtype=np_dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
        export.write_generation_config(
            directory, config, tokenizer, stop_ids or (config.eos_token_ids or ())
        )
    return directory


def _targeted_shapes(config: models.ModelConfig) -> list[Any]:
    targeted = {lora.LORA_WEIGHTS[t][0] for t in config.lora.targets}
    layers = models.param_shapes(lora.base_config(config))["layers"]
    return [layers[name] for name in sorted(targeted)]


_DEVICE_MEMORY = object()


def merged_sampler(
    cfg, config: models.ModelConfig, layout, free_bytes: Any = _DEVICE_MEMORY
) -> bool:
    """Whether a LoRA run's sampler decodes merged weights (``model.lora.sampler``).

    ``auto`` compares the bytes each costs per policy update, as a memory-bound decode step
    reads every weight once: applying adapters on the fly reads them at each of the
    ``rollout.max_new_tokens`` decode steps (``T · N_A``, plus their small matmuls); merging
    reads the targeted base weights and writes their merged copy once (``2 · N_W``). It merges
    when ``T · N_A > 2 · N_W`` (about ``T > d / r``) and the sampler's devices have room for the
    merged copy beside the base (``N_W`` over its tensor axis); the sampler's log-probs then
    come from ``W + (alpha / r) A B`` rounded to the compute dtype. ``free_bytes``: the
    sampler devices' free memory (default: what they report; ``plan`` passes the chip's usable
    HBM less the resident state; None: unknown, assumed to fit).
    """
    mode = cfg.model.lora.sampler
    if mode != "auto":
        return mode == "merged"
    itemsize = jnp.dtype(config.compute_dtype or cfg.model.param_dtype).itemsize
    adapter = sum(math.prod(x.shape) for x in jax.tree.leaves(lora.adapter_shapes(config)))
    targeted = sum(math.prod(x.shape) for x in _targeted_shapes(config))
    if free_bytes is _DEVICE_MEMORY:
        from jaxrl_llm.sampling import serving  # noqa: PLC0415

        free_bytes = serving.free_device_bytes(layout.mesh)
    fits = free_bytes is None or free_bytes > 1.25 * targeted * itemsize / layout.tensor
    return cfg.rollout.max_new_tokens * adapter > 2 * targeted and fits


class _Merge:
    """``(base, adapters) -> merged base``: one jitted program computes the targeted weights
    only; the others are the base's own arrays (never copied)."""

    def __init__(self, config: models.ModelConfig, shardings: PyTree):
        targeted = sorted({lora.LORA_WEIGHTS[t][0] for t in config.lora.targets})

        def merged(base, trained):
            layers = lora.merge_weights(lora.combine(base, trained), config)["layers"]
            return {name: layers[name] for name in targeted}

        out = {name: shardings["layers"][name] for name in targeted}
        self.jitted = jax.jit(merged, out_shardings=out)
        self.mesh = out[targeted[0]].mesh

    def __call__(self, base: PyTree, trained: PyTree) -> PyTree:
        # Under the mesh of its shardings: a sampler on devices of its own
        # (``mesh.rollout_devices``) merges there, while the trainer's mesh is the context's.
        with jax.set_mesh(self.mesh):
            merged = self.jitted(base, trained)
        return {**base, "layers": {**base["layers"], **merged}}

    def lower(self, base: PyTree, trained: PyTree):
        return self.jitted.lower(base, trained)


def merge_program(config: models.ModelConfig, shardings: PyTree) -> _Merge:
    """A jitted ``(base, adapters) -> merged base`` (``base_config``'s parameters; the targeted
    weights ``W + (alpha / r) A B`` in the base's dtype on ``shardings``, the rest the base's
    arrays): the sampler's weights for ``model.lora.sampler=merged``, the SFT warm-up's
    result."""
    return _Merge(config, shardings)


def serving_reshards(config: models.ModelConfig, layout) -> tuple[Any, Any]:
    """``(base, adapters)`` reshard programs into the sampler's layout (compute dtype), so the
    base moves once per run and each policy update moves only the adapters (copied across to
    a sampler on devices of its own, ``mesh.rollout_devices``)."""
    from jaxrl_llm.sampling import serving  # noqa: PLC0415

    base_shardings, adapter_shardings = lora.split(layout.shardings)
    return (
        serving.cast_to(config, base_shardings, separate=layout.separate),
        serving.cast_to(config, adapter_shardings, separate=layout.separate),
    )
