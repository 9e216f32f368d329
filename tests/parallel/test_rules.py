"""Rule tables, logical_to_spec, logical_to_sharding and with_logical_constraint."""

import re
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.parallel import (
    ACTIVATION_RULES,
    LOGICAL_AXES,
    MESH_AXES,
    PARAM_RULES,
    SAMPLING_RULES,
    batch_mesh_axes,
    batch_shards,
    is_logical_axes,
    logical_to_sharding,
    logical_to_spec,
    make_mesh,
    with_logical_constraint,
)
from jaxrl_llm.parallel.mesh import EXPERT_MESH_AXES, SEQUENCE_AXIS
from jaxrl_llm.parallel.rules import OPTIONAL_MESH_AXES, present_mesh_axes, spec_for_mesh

PARAM_TREE = {
    "embed": ("vocab", "embed"),
    "layers": {
        "wq": ("layers", "embed", "heads", "head_dim"),
        "wk": ("layers", "embed", "kv_heads", "head_dim"),
        "w_up": ("layers", "embed", "mlp"),
        "w_down": ("layers", "mlp", "embed"),
        "norm": ("layers", "embed"),
    },
    "final_norm": ("embed",),
}
SHAPES = {
    "embed": (128, 64),
    "layers": {
        "wq": (2, 64, 4, 16),
        "wk": (2, 64, 2, 16),
        "w_up": (2, 64, 96),
        "w_down": (2, 96, 64),
        "norm": (2, 64),
    },
    "final_norm": (64,),
}
# Hand-written from the PARAM_RULES contract: embed -> fsdp; heads/kv_heads/mlp/vocab -> tensor.
EXPECTED_PARAM_SPECS = {
    "embed": P("tensor", "fsdp"),
    "layers": {
        "wq": P(None, "fsdp", "tensor", None),
        "wk": P(None, "fsdp", "tensor", None),
        "w_up": P(None, "fsdp", "tensor"),
        "w_down": P(None, "tensor", "fsdp"),
        "norm": P(None, "fsdp"),
    },
    "final_norm": P("fsdp"),
}


@pytest.mark.parametrize("rules", [PARAM_RULES, ACTIVATION_RULES, SAMPLING_RULES])
def test_tables_cover_every_logical_axis_with_valid_mesh_axes(rules):
    assert set(rules) == set(LOGICAL_AXES)
    for value in rules.values():
        axes = (value,) if isinstance(value, str) else (value or ())
        assert set(axes) <= {*EXPERT_MESH_AXES, SEQUENCE_AXIS} == {*MESH_AXES, *OPTIONAL_MESH_AXES}
    with pytest.raises(TypeError):
        rules["embed"] = None


def test_table_contents():
    # Context parallelism's sequence axis (optional: absent at size 1) is one more FSDP axis.
    assert PARAM_RULES["embed"] == ("fsdp", "sequence")
    assert ACTIVATION_RULES["sequence"] == "sequence" and PARAM_RULES["sequence"] is None
    for name in ("heads", "kv_heads", "mlp", "vocab"):
        assert PARAM_RULES[name] == "tensor"
        assert ACTIVATION_RULES[name] == "tensor"
    assert PARAM_RULES["layers"] is None and PARAM_RULES["head_dim"] is None
    assert ACTIVATION_RULES["embed"] is None
    # Expert parallelism: the experts' dim on the expert axis (in storage and in use), which is
    # also one more batch axis.
    for rules in (PARAM_RULES, ACTIVATION_RULES):
        assert rules["batch"] == ("data", "fsdp", "expert")
    for rules in (PARAM_RULES, ACTIVATION_RULES, SAMPLING_RULES):
        assert rules["expert"] == "expert"
    # Decoding has no sequence to split: the sequence axis splits sampling rows.
    assert SAMPLING_RULES["batch"] == ("data", "fsdp", "expert", "sequence")
    assert SAMPLING_RULES["kv_heads"] == "tensor"
    assert SAMPLING_RULES["cache_seq"] is None


def test_logical_to_spec():
    assert logical_to_spec(("layers", "embed", "heads", "head_dim"), PARAM_RULES) == P(
        None, ("fsdp", "sequence"), "tensor", None
    )
    assert logical_to_spec(("batch", None, "embed"), ACTIVATION_RULES) == P(
        ("data", "fsdp", "expert"), None, None
    )
    assert logical_to_spec(
        ("layers", "batch", "cache_seq", "kv_heads", "head_dim"), SAMPLING_RULES
    ) == P(None, ("data", "fsdp", "expert", "sequence"), None, "tensor", None)
    assert logical_to_spec(("layers", "expert", "embed", "mlp"), PARAM_RULES) == P(
        None, "expert", ("fsdp", "sequence"), "tensor"
    )
    assert logical_to_spec((), PARAM_RULES) == P()
    assert logical_to_spec(("x",), {"x": ("fsdp",)}) == P("fsdp")
    assert logical_to_spec(("x",), {"x": ()}) == P(None)


@pytest.mark.parametrize(
    "axes, rules, match",
    [
        (("heads", "mlp"), PARAM_RULES, r"mesh axis 'tensor' to both dim 0 \('heads'\) and dim 1"),
        (("batch", "embed"), PARAM_RULES, r"mesh axis 'fsdp' to both dim 0 \('batch'\) and dim 1"),
        (("embed", "embd"), PARAM_RULES, "unknown logical axis 'embd'"),
        (("x",), {"x": 3}, "rule for logical axis 'x' must be a mesh axis name"),
        (("x",), {"x": ("fsdp", 1)}, "rule for logical axis 'x' must be a mesh axis name"),
        ("embed", PARAM_RULES, "logical axes must be a tuple of names"),
        ((1,), PARAM_RULES, "logical axes must be a tuple of names"),
    ],
)
def test_logical_to_spec_errors(axes, rules, match):
    with pytest.raises(ValueError, match=match):
        logical_to_spec(axes, rules)


def test_is_logical_axes():
    assert is_logical_axes(("embed", None))
    assert is_logical_axes(())
    assert not is_logical_axes(["embed"])
    assert not is_logical_axes((("embed",),))

    class Pair(NamedTuple):
        a: tuple
        b: tuple

    assert not is_logical_axes(Pair(("embed",), ("vocab",)))


def test_logical_to_sharding_param_tree():
    mesh = make_mesh(2, 2, 2)
    shardings = logical_to_sharding(PARAM_TREE, mesh, PARAM_RULES, shapes=SHAPES)
    chex.assert_trees_all_equal_structs(shardings, EXPECTED_PARAM_SPECS)
    for sharding, spec in zip(
        jax.tree.leaves(shardings), jax.tree.leaves(EXPECTED_PARAM_SPECS), strict=True
    ):
        assert isinstance(sharding, NamedSharding)
        assert sharding.mesh == mesh
        assert sharding.spec == spec
    # Without shapes: the same specs, nothing to check sizes against.
    unchecked = logical_to_sharding(PARAM_TREE, mesh, PARAM_RULES)
    assert jax.tree.map(lambda s: s.spec, unchecked) == jax.tree.map(lambda s: s.spec, shardings)


def test_sharding_places_the_expected_blocks(rng):
    mesh = make_mesh(2, 2, 2)
    sharding = logical_to_sharding(
        ("layers", "embed", "heads", "head_dim"), mesh, PARAM_RULES, shapes=(2, 64, 4, 16)
    )
    value = rng.normal(size=(2, 64, 4, 16)).astype(np.float32)
    array = jax.device_put(value, sharding)
    for shard in array.addressable_shards:
        assert shard.data.shape == (2, 32, 2, 16)
        np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])
    np.testing.assert_array_equal(np.asarray(array), value)


def test_shapes_may_be_arrays_or_shape_dtype_structs():
    mesh = make_mesh(1, 4, 2)
    abstract = jax.eval_shape(
        lambda: jax.tree.map(lambda s: jnp.zeros(s), SHAPES, is_leaf=lambda x: isinstance(x, tuple))
    )
    chex.assert_trees_all_equal_structs(abstract, EXPECTED_PARAM_SPECS)
    shardings = logical_to_sharding(PARAM_TREE, mesh, PARAM_RULES, shapes=abstract)
    assert shardings["layers"]["wq"].spec == P(None, "fsdp", "tensor", None)
    arrays = {"w": np.zeros((8, 6))}
    out = logical_to_sharding({"w": ("embed", None)}, mesh, PARAM_RULES, shapes=arrays)
    assert out["w"].spec == P("fsdp", None)


def test_namedtuple_container_of_axes():
    class Cache(NamedTuple):
        k: tuple
        v: tuple
        mask: tuple

    mesh = make_mesh(2, 2, 2)
    axes = Cache(
        k=("layers", "batch", "cache_seq", "kv_heads", "head_dim"),
        v=("layers", "batch", "cache_seq", "kv_heads", "head_dim"),
        mask=("batch", "cache_seq"),
    )
    shapes = Cache(
        k=jax.ShapeDtypeStruct((2, 8, 32, 2, 16), jnp.bfloat16),
        v=jax.ShapeDtypeStruct((2, 8, 32, 2, 16), jnp.bfloat16),
        mask=jax.ShapeDtypeStruct((8, 32), jnp.bool_),
    )
    out = logical_to_sharding(axes, mesh, SAMPLING_RULES, shapes=shapes)
    assert isinstance(out, Cache)
    assert out.k.spec == P(None, ("data", "fsdp"), None, "tensor", None)
    assert out.mask.spec == P(("data", "fsdp"), None)


def test_non_divisible_names_path_dim_and_axis():
    mesh = make_mesh(2, 2, 2)
    shapes = {**SHAPES, "layers": {**SHAPES["layers"], "wq": (2, 64, 3, 16)}}
    with pytest.raises(ValueError) as err:
        logical_to_sharding(PARAM_TREE, mesh, PARAM_RULES, shapes=shapes)
    message = str(err.value)
    assert "['layers']['wq']" in message
    assert "dim 2 ('heads') of size 3" in message
    assert "mesh axis 'tensor' of size 2" in message


def test_non_divisible_tuple_of_mesh_axes():
    mesh = make_mesh(2, 2, 2)
    with pytest.raises(ValueError, match=re.escape("'x']: dim 0 ('batch') of size 6")) as err:
        logical_to_sharding({"x": ("batch", None)}, mesh, ACTIVATION_RULES, shapes={"x": (6, 3)})
    assert "of size 4 (data=2 x fsdp=2)" in str(err.value)


def test_replication_is_never_a_fallback():
    # fsdp=8 does not divide embed=12: an error, not a replicated weight.
    mesh = make_mesh(1, 8, 1)
    with pytest.raises(ValueError, match="not divisible"):
        logical_to_sharding(("vocab", "embed"), mesh, PARAM_RULES, shapes=(128, 12))


@pytest.mark.parametrize(
    "tree, shapes, match",
    [
        ({"w": ("embed", "mlp")}, {"w": (8, 4, 2)}, r"\['w'\]: logical axes .* name 2 dims"),
        ({"w": ("embed", "mlp")}, {"v": (8, 4)}, r"only in the axes tree: \[\"\['w'\]\"\]"),
        ({"w": ("embed", "mlp")}, {"w": (8, 4), "b": (4,)}, "only in the shapes tree"),
        ({"w": ("embed", "mlp", "heads")}, None, r"\['w'\]: logical axes .* 'tensor' to both"),
        ({"w": ("emb",)}, None, r"\['w'\]: unknown logical axis 'emb'"),
        ({"w": ["embed"]}, None, r"\['w'\]\[0\]: expected a tuple of logical axis names"),
    ],
)
def test_logical_to_sharding_errors(tree, shapes, match):
    with pytest.raises(ValueError, match=match):
        logical_to_sharding(tree, make_mesh(2, 2, 2), PARAM_RULES, shapes=shapes)


def test_mesh_axis_missing_from_mesh():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    with pytest.raises(ValueError, match=r"mesh axes \['fsdp'\].*mesh, whose axes are \('x',\)"):
        logical_to_sharding({"w": ("embed",)}, mesh, PARAM_RULES)


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_with_logical_constraint_under_jit(axis_types, rng):
    mesh = make_mesh(2, 2, 2, axis_types=axis_types)
    value = rng.normal(size=(8, 6, 4)).astype(np.float32)

    def f(x):
        h = with_logical_constraint(x * 2.0, ("batch", None, "heads"), ACTIVATION_RULES)
        return h + 1.0

    with jax.set_mesh(mesh):
        out = jax.jit(f)(value)
        eager = with_logical_constraint(jnp.asarray(value), ("batch", None, None), ACTIVATION_RULES)
    assert eager.sharding.spec[0] == ("data", "fsdp")
    np.testing.assert_allclose(np.asarray(out), value * 2.0 + 1.0, rtol=1e-6)
    # Without the constraint the result would follow the unsharded input.
    assert out.sharding.spec == P(("data", "fsdp"), None, "tensor")


def test_with_logical_constraint_is_a_no_op_without_mesh_or_on_one_device():
    x = jnp.ones((3, 5))
    assert with_logical_constraint(x, ("batch", "embed"), ACTIVATION_RULES) is x
    one = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    with jax.set_mesh(one):
        assert with_logical_constraint(x, ("batch", "embed"), ACTIVATION_RULES) is x


def test_with_logical_constraint_errors():
    mesh = make_mesh(2, 2, 2)
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"name 2 dims but the array has shape \(8, 6, 4\)"):
            jax.jit(lambda x: with_logical_constraint(x, ("batch", None), ACTIVATION_RULES))(
                jnp.ones((8, 6, 4))
            )
        with pytest.raises(ValueError, match=r"dim 0 \('batch'\) of size 6 .* of size 4"):
            jax.jit(lambda x: with_logical_constraint(x, ("batch", None), ACTIVATION_RULES))(
                jnp.ones((6, 4))
            )


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_with_logical_constraint_drops_manual_axes_inside_shard_map(axis_types):
    mesh = make_mesh(2, 4, 1, axis_types=axis_types)
    x = jnp.arange(32.0).reshape(16, 2)

    def per_data_shard(block):
        # Inside shard_map over "data" the block is [8, 2]; only fsdp (4) may still split it.
        return with_logical_constraint(block * 2.0, ("batch", None), ACTIVATION_RULES)

    with jax.set_mesh(mesh):
        f = jax.shard_map(
            per_data_shard, in_specs=P("data"), out_specs=P("data"), axis_names={"data"}
        )
        out = jax.jit(f)(x)
    np.testing.assert_array_equal(np.asarray(out), 2.0 * np.arange(32.0).reshape(16, 2))


# --- the optional expert axis ----------------------------------------------------------------

EXPERT_TREE = {
    "router": ("layers", "embed", "expert"),
    "w_gate": ("layers", "expert", "embed", "mlp"),
    "w_down": ("layers", "expert", "mlp", "embed"),
    "wq": ("layers", "embed", "heads", "head_dim"),
}
EXPERT_SHAPES = {
    "router": (2, 64, 8),
    "w_gate": (2, 8, 64, 96),
    "w_down": (2, 8, 96, 64),
    "wq": (2, 64, 4, 16),
}


def test_optional_axis_is_dropped_only_where_the_mesh_lacks_it():
    assert present_mesh_axes(("data", "fsdp", "expert"), MESH_AXES) == ("data", "fsdp")
    assert present_mesh_axes(("data", "expert"), EXPERT_MESH_AXES) == ("data", "expert")
    assert present_mesh_axes(("nope", "expert"), MESH_AXES) == ("nope",)  # refused later
    spec = P(None, ("data", "fsdp", "expert"), "expert", None)
    assert spec_for_mesh(spec, MESH_AXES) == P(None, ("data", "fsdp"), None, None)
    assert spec_for_mesh(spec, EXPERT_MESH_AXES) == spec


def test_expert_weights_on_meshes_with_and_without_the_expert_axis():
    plain = logical_to_sharding(EXPERT_TREE, make_mesh(1, 4, 2), PARAM_RULES, shapes=EXPERT_SHAPES)
    assert plain["w_gate"].spec == P(None, None, "fsdp", "tensor")  # today's layout
    assert plain["router"].spec == P(None, "fsdp", None)
    mesh = make_mesh(1, 2, 2, expert=2)
    sharded = logical_to_sharding(EXPERT_TREE, mesh, PARAM_RULES, shapes=EXPERT_SHAPES)
    assert sharded["w_gate"].spec == P(None, "expert", "fsdp", "tensor")
    assert sharded["w_down"].spec == P(None, "expert", "tensor", "fsdp")
    assert sharded["router"].spec == P(None, "fsdp", "expert")
    assert sharded["wq"].spec == P(None, "fsdp", "tensor", None)  # dense: replicated over expert
    array = jax.device_put(np.zeros(EXPERT_SHAPES["w_gate"], np.float32), sharded["w_gate"])
    assert {s.data.shape for s in array.addressable_shards} == {(2, 4, 32, 48)}
    with pytest.raises(ValueError, match=r"dim 1 \('expert'\) of size 5 .* 'expert' of size 2"):
        logical_to_sharding(
            ("layers", "expert", "embed", "mlp"), mesh, PARAM_RULES, shapes=(2, 5, 64, 96)
        )


def test_batch_splits_over_the_expert_axis():
    assert batch_mesh_axes(make_mesh(2, 2, 2)) == ("data", "fsdp")
    assert batch_shards(make_mesh(2, 2, 2)) == 4
    mesh = make_mesh(2, 1, 1, expert=4)
    assert batch_mesh_axes(mesh) == ("data", "fsdp", "expert")
    assert batch_shards(mesh) == 8
    with jax.set_mesh(mesh):
        x = jax.jit(lambda x: with_logical_constraint(x, ("batch", None), ACTIVATION_RULES))(
            jnp.ones((16, 4))
        )
    assert "expert" in x.sharding.spec[0]  # (JAX leaves the size-1 fsdp out of the spec)
    assert {s.data.shape for s in x.addressable_shards} == {(2, 4)}
