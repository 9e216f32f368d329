"""make_mesh / resolve_mesh_shape on the 8 fake CPU devices."""

import jax
import pytest
from jax.sharding import AxisType

from jaxrl_llm.parallel import MESH_AXES, make_mesh, resolve_mesh_shape
from jaxrl_llm.parallel.mesh import EXPERT_MESH_AXES


def test_eight_fake_devices():
    assert jax.device_count() == 8


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 8, 1), (1, 1, 8)])
def test_shapes(shape):
    mesh = make_mesh(*shape)
    assert mesh.axis_names == MESH_AXES == ("data", "fsdp", "tensor")
    assert tuple(mesh.shape.values()) == shape
    assert mesh.devices.shape == shape
    assert {d.id for d in mesh.devices.flat} == {d.id for d in jax.devices()}


@pytest.mark.parametrize(
    "args, expected",
    [
        ((), (1, 8, 1)),
        ((2,), (2, 4, 1)),
        ((2, 2, -1), (2, 2, 2)),
        ((-1, 2, 2), (2, 2, 2)),
        ((-1, 1, 1), (8, 1, 1)),
        ((1, 1, -1), (1, 1, 8)),
    ],
)
def test_minus_one_fills(args, expected):
    assert tuple(make_mesh(*args).shape.values()) == expected


def test_axis_types_default_auto_and_explicit():
    assert make_mesh(2, 4, 1).axis_types == (AxisType.Auto,) * 3
    assert make_mesh(2, 4, 1, axis_types="explicit").axis_types == (AxisType.Explicit,) * 3
    assert make_mesh(2, 4, 1, axis_types=AxisType.Explicit).axis_types == (AxisType.Explicit,) * 3
    assert make_mesh(axis_types="auto").axis_types == (AxisType.Auto,) * 3


def test_subset_of_devices():
    devices = jax.devices()[4:]
    mesh = make_mesh(2, 2, 1, devices=devices)
    assert {d.id for d in mesh.devices.flat} == {d.id for d in devices}


@pytest.mark.parametrize(
    "args, match",
    [
        ((3, 1, 1), r"data=3 x fsdp=1 x tensor=1 = 3 must equal the number of devices \(8\)"),
        ((2, 2, 4), r"= 16 must equal the number of devices \(8\)"),
        ((-1, -1, 1), "at most one mesh axis may be -1"),
        ((3, -1, 1), r"cannot fill mesh axis 'fsdp'.*multiply to 3.*8 devices"),
        ((0, -1, 1), "mesh axis 'data' must be a positive int or -1, got 0"),
        ((1, -2, 1), "mesh axis 'fsdp' must be a positive int or -1, got -2"),
        ((1, 2.0, 4), "mesh axis 'fsdp' must be a positive int"),
        ((True, -1, 1), "mesh axis 'data' must be a positive int"),
    ],
)
def test_bad_sizes(args, match):
    with pytest.raises(ValueError, match=match):
        make_mesh(*args)


def test_bad_axis_types_and_devices():
    with pytest.raises(ValueError, match="unknown axis_types 'manual'"):
        make_mesh(axis_types="manual")
    with pytest.raises(ValueError, match="axis_types must be Auto or Explicit"):
        make_mesh(axis_types=AxisType.Manual)
    with pytest.raises(ValueError, match="at least one device"):
        make_mesh(devices=[])
    with pytest.raises(ValueError, match=r"= 4 must equal the number of devices \(2\)"):
        make_mesh(2, 2, 1, devices=jax.devices()[:2])


def test_resolve_mesh_shape_is_pure():
    assert resolve_mesh_shape(1, -1, 1, num_devices=256) == (1, 256, 1)
    assert resolve_mesh_shape(4, 16, -1, num_devices=256) == (4, 16, 4)
    assert resolve_mesh_shape(1, 1, 1, num_devices=1) == (1, 1, 1)
    with pytest.raises(ValueError, match="must equal the number of devices"):
        resolve_mesh_shape(2, 1, 1, num_devices=1)


@pytest.mark.parametrize(
    "args, expert, expected",
    [
        ((1, 2, 1), 4, (1, 2, 4, 1)),
        ((2, 1, 1), 4, (2, 1, 4, 1)),
        ((1, 2, 2), 2, (1, 2, 2, 2)),
        ((1, -1, 1), 4, (1, 2, 4, 1)),
        ((-1, 2, 1), 2, (2, 2, 2, 1)),
        ((1, 1, -1), 8, (1, 1, 8, 1)),
    ],
)
def test_expert_axis(args, expert, expected):
    """``expert > 1`` adds the ``expert`` axis (next to ``tensor``); -1 fills what it leaves."""
    mesh = make_mesh(*args, expert=expert)
    assert mesh.axis_names == EXPERT_MESH_AXES == ("data", "fsdp", "expert", "tensor")
    assert tuple(mesh.shape.values()) == expected
    assert {d.id for d in mesh.devices.flat} == {d.id for d in jax.devices()}
    assert mesh.axis_types == (AxisType.Auto,) * 4
    assert make_mesh(*args, expert=expert, axis_types="explicit").axis_types == (
        (AxisType.Explicit,) * 4
    )


def test_expert_one_is_the_three_axis_mesh():
    assert make_mesh(2, 4, 1, expert=1).axis_names == MESH_AXES
    assert resolve_mesh_shape(1, -1, 1, num_devices=8, expert=4) == (1, 2, 1)


@pytest.mark.parametrize(
    "args, expert, match",
    [
        ((1, 2, 1), 0, "mesh axis 'expert' must be a positive int, got 0"),
        ((1, -1, 1), -1, "mesh axis 'expert' must be a positive int, got -1"),
        ((1, 2, 1), True, "mesh axis 'expert' must be a positive int, got True"),
        ((1, 2, 1), 2.0, "mesh axis 'expert' must be a positive int, got 2.0"),
        ((1, 2, 1), 2, r"data=1 x fsdp=2 x tensor=1 x expert=2 = 4 must equal .* \(8\)"),
        ((1, -1, 1), 3, r"cannot fill mesh axis 'fsdp'.*'expert': 3.*multiply to 3"),
    ],
)
def test_bad_expert_sizes(args, expert, match):
    with pytest.raises(ValueError, match=match):
        make_mesh(*args, expert=expert)


def test_mesh_section_expert_key():
    from jaxrl_llm.train.config import MeshSection  # noqa: PLC0415

    assert MeshSection().expert == 1
    assert MeshSection(expert=4, fsdp=2).expert == 4
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="mesh.expert must be a positive int"):
            MeshSection(expert=bad)


def test_mesh_section_sequence_key():
    from jaxrl_llm.train.config import MeshSection  # noqa: PLC0415

    assert MeshSection().sequence == 1
    assert MeshSection(sequence=4, fsdp=2).sequence == 4
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="mesh.sequence must be a positive int"):
            MeshSection(sequence=bad)
    with pytest.raises(ValueError, match="expert and context parallelism do not combine"):
        MeshSection(expert=2, sequence=2)
