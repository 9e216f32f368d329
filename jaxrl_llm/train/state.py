"""The train state, created already sharded (the MaxText recipe).

``jax.eval_shape(init)`` gives the abstract state; the model's logical axis names map it to
``NamedSharding``s through a rule table; ``jax.jit(init, out_shardings=...)`` then materialises
every leaf directly in its shard, so no host ever holds the full state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm import models, parallel

Array = jax.Array
PyTree = Any


class TrainState(NamedTuple):
    """Everything a policy update changes.

    Attributes:
      step: scalar int32, optimizer steps taken.
      params: model parameters (plain nested dict).
      opt_state: optax state.
      rng: PRNG key carried across steps.
      entropy_control: ``objectives.EntropyControl`` of an adaptive entropy coefficient
        (``objective.entropy.target``), else None.
    """

    step: Array
    params: PyTree
    opt_state: PyTree
    rng: Array
    entropy_control: PyTree = None


def _path_tuple(path) -> tuple:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def optimizer_logical_axes(opt_state_shapes: PyTree, params_axes: PyTree, params_shapes: PyTree):
    """Logical axes of an optax state, from the parameters it mirrors.

    An optimizer leaf whose tree path ends with a parameter's path and has that parameter's shape
    (Adam's ``mu`` / ``nu``, momentum, ...) takes the parameter's axes; any other leaf (step
    counts, scalars) is replicated.
    """
    is_axes = lambda x: isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)  # noqa: E731
    flat_axes = {
        _path_tuple(p): a
        for p, a in jax.tree_util.tree_flatten_with_path(params_axes, is_leaf=is_axes)[0]
    }
    flat_shapes = {
        _path_tuple(p): tuple(s.shape)
        for p, s in jax.tree_util.tree_flatten_with_path(params_shapes)[0]
    }

    def axes_for(path, leaf):
        key = _path_tuple(path)
        for start in range(len(key)):
            suffix = key[start:]
            if suffix in flat_axes and flat_shapes[suffix] == tuple(leaf.shape):
                return flat_axes[suffix]
        return (None,) * len(leaf.shape)

    return jax.tree_util.tree_map_with_path(axes_for, opt_state_shapes)


def state_logical_axes(
    abstract_state: TrainState, model_config, params_axes: PyTree | None = None
) -> TrainState:
    """Logical axis names of every leaf of a (abstract) ``TrainState``.

    ``params_axes`` overrides the policy's axes (``models.logical_axes(model_config)``) for
    other parameter trees, e.g. a value model's.
    """
    if params_axes is None:
        params_axes = models.logical_axes(model_config)
    return TrainState(
        step=(),
        params=params_axes,
        opt_state=optimizer_logical_axes(
            abstract_state.opt_state, params_axes, abstract_state.params
        ),
        rng=(None,) * len(abstract_state.rng.shape),
        entropy_control=jax.tree.map(lambda _: (), abstract_state.entropy_control),
    )


def state_shardings(
    abstract_state: TrainState, model_config, mesh: Mesh, rules=None, params_axes=None
) -> TrainState:
    """``NamedSharding`` of every leaf of the state under ``rules`` (default: parameter rules).

    Raises:
      ValueError: a dimension that does not divide its mesh axis (naming the leaf).
    """
    rules = parallel.PARAM_RULES if rules is None else rules
    axes = state_logical_axes(abstract_state, model_config, params_axes)
    return parallel.logical_to_sharding(axes, mesh, rules, shapes=abstract_state)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def with_shardings(abstract: PyTree, shardings: PyTree) -> PyTree:
    """``ShapeDtypeStruct``s of ``abstract`` carrying ``shardings`` (same structure)."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )


def _state_init(model_config, optimizer, param_dtype, init_params, key: Array, control=None):
    """``params or None -> TrainState``: the init ``create_train_state`` runs (``None``: fresh
    parameters from ``init_params``, else the model's initialiser)."""
    init_key, state_key = jax.random.split(key)

    def init(params):
        if params is None and init_params is not None:
            params = init_params(init_key)
        elif params is None:
            params = models.init_params(model_config, init_key, dtype=param_dtype)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=optimizer.init(params),
            rng=state_key,
            entropy_control=control,
        )

    return init


def abstract_train_state(
    model_config,
    optimizer: optax.GradientTransformation,
    *,
    mesh: Mesh,
    params: PyTree | None = None,
    param_dtype=jnp.float32,
    rules=None,
    init_params: Callable[[Array], PyTree] | None = None,
    params_axes: PyTree | None = None,
    entropy_control: PyTree = None,
) -> tuple[TrainState, TrainState]:
    """The state ``create_train_state`` makes with these arguments, shapes only.

    ``jax.eval_shape`` of its init: nothing is allocated, so ``params`` may be abstract
    (``ShapeDtypeStruct``s) and ``mesh`` a deviceless topology's (``jaxrl-llm plan``).

    Returns:
      ``(abstract state, shardings)``: ``ShapeDtypeStruct``s carrying their shardings, and
      the matching pytree of ``NamedSharding``s.

    Raises:
      ValueError: ``init_params`` without ``params_axes``, or a dimension that does not
        divide its mesh axis (naming the leaf).
    """
    if init_params is not None and params_axes is None:
        raise ValueError("create_train_state with init_params also needs params_axes")
    init = _state_init(
        model_config, optimizer, param_dtype, init_params, jax.random.key(0), entropy_control
    )
    abstract = jax.eval_shape(init, params)
    shardings = state_shardings(abstract, model_config, mesh, rules, params_axes)
    return with_shardings(abstract, shardings), shardings


def create_train_state(
    model_config,
    optimizer: optax.GradientTransformation,
    *,
    key: Array,
    mesh: Mesh,
    params: PyTree | None = None,
    param_dtype=jnp.float32,
    rules=None,
    init_params: Callable[[Array], PyTree] | None = None,
    params_axes: PyTree | None = None,
    entropy_control: PyTree = None,
) -> tuple[TrainState, TrainState]:
    """A fresh (or pretrained-initialised) train state, born sharded on ``mesh``.

    Args:
      model_config: the model's ``ModelConfig``.
      optimizer: the optax transformation.
      key: PRNG key for initialisation and the state's carried key.
      mesh: device mesh (``parallel.make_mesh``).
      params: pretrained parameters (e.g. from ``load_pretrained(..., mesh=mesh)``); ``None``
        initialises randomly.
      param_dtype: dtype of freshly initialised parameters.
      rules: logical-axis rules for the state (default ``parallel.PARAM_RULES``).
      init_params: ``key -> params`` for another parameter tree than the policy's (e.g. a
        value model); needs ``params_axes``, that tree's logical axis names.
      params_axes: logical axes of the parameters (default: the policy's).

    Returns:
      ``(state, shardings)``: the state and the matching pytree of ``NamedSharding``s, to be
      used as ``in_shardings`` / ``out_shardings`` of the jitted step.
    """
    _, shardings = abstract_train_state(
        model_config,
        optimizer,
        mesh=mesh,
        params=params,
        param_dtype=param_dtype,
        rules=rules,
        init_params=init_params,
        params_axes=params_axes,
        entropy_control=entropy_control,
    )
    init = _state_init(model_config, optimizer, param_dtype, init_params, key, entropy_control)
    if params is None:
        state = jax.jit(lambda: init(None), out_shardings=shardings)()
    else:
        # No in_shardings: the given parameters keep whatever layout they come in and the
        # program reshards them. A multi-process jit refuses (rather than moves) an argument
        # whose sharding differs from its in_shardings, e.g. a replicated fresh value head.
        state = jax.jit(init, out_shardings=shardings)(params)
    return state, shardings
