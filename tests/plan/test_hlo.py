"""HLO parsing: collectives with their bytes, groups and loop multipliers; loop trip counts.

References are hand-computed byte counts (elements x element size): on hand-written HLO covering
each syntax the parser must read, and on real programs compiled here, on XLA:CPU with 8 fake
devices and (with libtpu) deviceless for a TPU v5e 2x2.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.plan import hlo
from jaxrl_llm.plan.topology import get_devices, libtpu_available, resolve_topology

MiB = 2**20

needs_libtpu = pytest.mark.skipif(
    not libtpu_available(),
    reason="libtpu not importable (pip install 'jax[tpu]'): no deviceless TPU compiles",
)

# Hand-written optimized HLO: one of each construct. Expected values are in the test below.
SYNTH = """HloModule synth, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%async_rs (p: f32[64,32]) -> f32[16,32] {
  %p = f32[64,32]{1,0} parameter(0)
  ROOT %rs = f32[16,32]{1,0} reduce-scatter(%p), channel_id=7, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
}

%all-reduce-scatter (input: bf16[256,256]) -> bf16[256,64] {
  %input = bf16[256,256]{0,1:T(8,128)(2,1)S(1)} parameter(0)
  %all-reduce.1 = bf16[256,256]{0,1:T(8,128)(2,1)} all-reduce(%input), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %zero = u32[] constant(0)
  %pid = u32[] partition-id()
  ROOT %dynamic-slice.4 = bf16[256,64]{0,1:T(8,128)(2,1)} dynamic-slice(%all-reduce.1, %zero, %pid), dynamic_slice_sizes={256,64}
}

%inner_cond (c: (s32[], bf16[8,256])) -> pred[] {
  %c = (s32[], bf16[8,256]{1,0}) parameter(0)
  %iv = s32[] get-tuple-element(%c), index=0
  %limit = s32[] constant(14)
  ROOT %lt = pred[] compare(%limit, %iv), direction=GT
}

%inner_body (q: (s32[], bf16[8,256])) -> (s32[], bf16[8,256]) {
  %q = (s32[], bf16[8,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%q), index=0
  %x = bf16[8,256]{1,0} get-tuple-element(%q), index=1
  %three = s32[] constant(3)
  %next = s32[] add(%i, %three)
  %ags = (bf16[8,256]{1,0}, bf16[32,256]{1,0}) all-gather-start(%x), channel_id=3, replica_groups=mesh['a'=2,'b'=4] {'b':(2)2}, dimensions={0}, use_global_device_ids=true
  %agd = bf16[32,256]{1,0} all-gather-done(%ags)
  %v = f32[4]{0} constant({1, 2, 3, 4})
  %ars = f32[4]{0} all-reduce-start(%v), channel_id=4, replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0','axis_1'}, to_apply=%add
  %ard = f32[4]{0} all-reduce-done(%ars)
  ROOT %t = (s32[], bf16[8,256]{1,0}) tuple(%next, %x)
}

%outer_cond (oc: (s32[], bf16[8,256], bf16[256,256])) -> pred[] {
  %oc = (s32[], bf16[8,256]{1,0}, bf16[256,256]{1,0}) parameter(0)
  %oi = s32[] get-tuple-element(%oc), index=0
  %ten = s32[] constant(10)
  ROOT %olt = pred[] compare(%oi, %ten), direction=LT
}

%outer_body (ob: (s32[], bf16[8,256], bf16[256,256])) -> (s32[], bf16[8,256], bf16[256,256]) {
  %ob = (s32[], bf16[8,256]{1,0}, bf16[256,256]{1,0}) parameter(0)
  %oi2 = s32[] get-tuple-element(%ob), index=0
  %ox = bf16[8,256]{1,0} get-tuple-element(%ob), index=1
  %g = bf16[256,256]{1,0} get-tuple-element(%ob), index=2
  %two = s32[] constant(2)
  %start = s32[] copy(%two)
  %inner_init = (s32[], bf16[8,256]{1,0}) tuple(%start, %ox)
  %inner = (s32[], bf16[8,256]{1,0}) while(%inner_init), condition=%inner_cond, body=%inner_body
  %fusion = bf16[256,64]{0,1:T(8,128)(2,1)} fusion(%g), kind=kCustom, calls=%all-reduce-scatter
  %one = s32[] constant(1)
  %oi3 = s32[] add(%oi2, %one)
  ROOT %ot = (s32[], bf16[8,256]{1,0}, /*index=2*/bf16[256,256]{1,0}) tuple(%oi3, %ox, %g)
}

%fused_lt (param_0: s32[], param_1: s32[]) -> pred[] {
  %param_0 = s32[] parameter(0)
  %param_1 = s32[] parameter(1)
  ROOT %lt.3 = pred[] compare(%param_0, %param_1), direction=LT
}

%fused_inc (param_0.1: s32[], param_1.1: s32[]) -> s32[] {
  %param_0.1 = s32[] parameter(0)
  %param_1.1 = s32[] parameter(1)
  ROOT %add.3 = s32[] add(%param_0.1, %param_1.1)
}

%cpu_cond (cc: (s32[], f32[4])) -> pred[] {
  %cc = (s32[], f32[4]{0}) parameter(0)
  %seven = s32[] constant(7)
  %ci = s32[] get-tuple-element(%cc), index=0
  ROOT %wrapped_compare = pred[] fusion(%ci, %seven), kind=kLoop, calls=%fused_lt
}

%cpu_body (cb: (s32[], f32[4])) -> (s32[], f32[4]) {
  %cb = (s32[], f32[4]{0}) parameter(0)
  %cone = s32[] constant(1)
  %cj = s32[] get-tuple-element(%cb), index=0
  %wrapped_add = s32[] fusion(%cj, %cone), kind=kLoop, calls=%fused_inc
  %cx = f32[4]{0} get-tuple-element(%cb), index=1
  %cps = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(%cx), channel_id=5, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[4]{0} collective-permute-done(%cps)
  ROOT %ct = (s32[], f32[4]{0}) tuple(%wrapped_add, %cpd)
}

%dyn_cond (dc: (s32[], s32[], f32[16])) -> pred[] {
  %dc = (s32[], s32[], f32[16]{0}) parameter(0)
  %d0 = s32[] get-tuple-element(%dc), index=0
  %d1 = s32[] get-tuple-element(%dc), index=1
  ROOT %dlt = pred[] compare(%d0, %d1), direction=LT
}

%dyn_body (db: (s32[], s32[], f32[16])) -> (s32[], s32[], f32[16]) {
  %db = (s32[], s32[], f32[16]{0}) parameter(0)
  %dx = f32[16]{0} get-tuple-element(%db), index=2
  %dag = f32[16]{0} all-gather(%dx), replica_groups=[1,8]<=[8], dimensions={0}
  %e0 = s32[] get-tuple-element(%db), index=0
  %e1 = s32[] get-tuple-element(%db), index=1
  ROOT %dt = (s32[], s32[], f32[16]{0}) tuple(%e0, %e1, %dag)
}

%branch0 (b0: f32[8]) -> f32[8] {
  %b0 = f32[8]{0} parameter(0)
  ROOT %a2a = f32[8]{0} all-to-all(%b0), replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
}

%branch1 (b1: f32[8]) -> f32[8] {
  ROOT %b1 = f32[8]{0} parameter(0)
}

ENTRY %main (p0: f32[100], p1: bf16[50], big: f32[64,32], pred: pred[]) -> f32[100] {
  %p0 = f32[100]{0} parameter(0)
  %p1 = bf16[50]{0} parameter(1)
  %big = f32[64,32]{1,0} parameter(2)
  %pred = pred[] parameter(3)
  %ar = (f32[100]{0}, bf16[50]{0}) all-reduce(%p0, %p1), channel_id=1, replica_groups={}, to_apply=%add
  %small = f32[10]{0} slice(%p0), slice={[0:10]}
  %cp = f32[10]{0} collective-permute(%small), channel_id=6, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %as = ((f32[64,32]{1,0}), f32[16,32]{1,0}, s32[]) async-start(%big), calls=%async_rs
  %ad = f32[16,32]{1,0} async-done(%as), calls=%async_rs
  %z = s32[] constant(0)
  %x0 = bf16[8,256]{1,0} constant({...})
  %g0 = bf16[256,256]{1,0} constant({...})
  %init = (s32[], bf16[8,256]{1,0}, bf16[256,256]{1,0}) tuple(%z, %x0, %g0)
  %outer = (s32[], bf16[8,256]{1,0}, bf16[256,256]{1,0}) while(%init), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"3"}}
  %v4 = f32[4]{0} constant({0, 0, 0, 0})
  %cinit = (s32[], f32[4]{0}) tuple(%z, %v4)
  %cpu = (s32[], f32[4]{0}) while(%cinit), condition=%cpu_cond, body=%cpu_body
  %n = s32[] parameter(4)
  %f16 = f32[16]{0} constant({...})
  %dinit = (s32[], s32[], f32[16]{0}) tuple(%z, %n, %f16)
  %dyn = (s32[], s32[], f32[16]{0}) while(%dinit), condition=%dyn_cond, body=%dyn_body
  %e8 = f32[8]{0} slice(%p0), slice={[0:8]}
  %cond = f32[8]{0} conditional(%pred, %e8, %e8), branch_computations={%branch0, %branch1}
  ROOT %out = f32[100]{0} get-tuple-element(%ar), index=0
}
"""  # noqa: E501

# name -> (kind, bytes, group size, multiplier, async, trip counts known)
SYNTH_EXPECTED = {
    "ar": ("all-reduce", 100 * 4 + 50 * 2, 8, 1, False, True),
    "cp": ("collective-permute", 10 * 4, 4, 1, False, True),
    "rs": ("reduce-scatter", 16 * 32 * 4, 4, 1, True, True),
    # inner loop: iv from 2 by 3 while 14 > iv -> 2, 5, 8, 11: 4 trips, inside 3 outer trips
    "ags": ("all-gather", 32 * 256 * 2, 2, 12, True, True),
    "ars": ("all-reduce", 4 * 4, 8, 12, True, True),
    "fusion": ("reduce-scatter", 256 * 64 * 2, 4, 3, False, True),
    "cps": ("collective-permute", 4 * 4, 2, 7, True, True),
    "dag": ("all-gather", 16 * 4, 8, 1, False, False),
    "a2a": ("all-to-all", 8 * 4, 2, 1, False, True),
}


def test_synthetic_module_collectives():
    ops = hlo.collective_ops(SYNTH)
    got = {
        op.name: (op.kind, op.bytes, op.group_size, op.multiplier, op.is_async, op.trip_count_known)
        for op in ops
    }
    assert got == SYNTH_EXPECTED  # each async pair and async wrapper counted once
    totals = hlo.collective_bytes(SYNTH)
    for kind in hlo.COLLECTIVE_KINDS:
        want = sum(v[1] * v[3] for v in SYNTH_EXPECTED.values() if v[0] == kind)
        assert totals[kind] == want
    once = hlo.collective_bytes(SYNTH, trip_weighted=False)
    assert once["all-gather"] == 32 * 256 * 2 + 16 * 4


def test_synthetic_module_loops():
    loops = {loop.name: loop for loop in hlo.while_loops(SYNTH)}
    assert {n: (lp.trip_count, lp.source, lp.multiplier) for n, lp in loops.items()} == {
        "outer": (3, "backend_config", 1),
        "inner": (4, "condition", 3),
        "cpu": (7, "condition", 1),  # compare and increment wrapped in fusions (XLA:CPU style)
        "dyn": (None, "unknown", 1),  # data-dependent bound
    }
    assert loops["inner"].body == "inner_body" and loops["inner"].condition == "inner_cond"


def _counted_loop(init: int, limit: int, step: int, direction: str, swap: bool = False) -> str:
    compare = f"%lim, %iv), direction={direction}" if swap else f"%iv, %lim), direction={direction}"
    return f"""HloModule loop, num_partitions=2

%cond (c: (s32[], f32[8])) -> pred[] {{
  %c = (s32[], f32[8]{{0}}) parameter(0)
  %iv = s32[] get-tuple-element(%c), index=0
  %lim = s32[] constant({limit})
  ROOT %cmp = pred[] compare({compare}
}}

%body (b: (s32[], f32[8])) -> (s32[], f32[8]) {{
  %b = (s32[], f32[8]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %x = f32[8]{{0}} get-tuple-element(%b), index=1
  %step = s32[] constant({abs(step)})
  %next = s32[] {"add" if step > 0 else "subtract"}(%i, %step)
  %ag = f32[8]{{0}} all-gather(%x), replica_groups={{{{0,1}}}}, dimensions={{0}}
  ROOT %t = (s32[], f32[8]{{0}}) tuple(%next, %ag)
}}

ENTRY %main (x: f32[8]) -> (s32[], f32[8]) {{
  %x = f32[8]{{0}} parameter(0)
  %init = s32[] constant({init})
  %copy = s32[] copy(%init)
  %tuple = (s32[], f32[8]{{0}}) tuple(%copy, %x)
  ROOT %w = (s32[], f32[8]{{0}}) while(%tuple), condition=%cond, body=%body
}}
"""


@pytest.mark.parametrize(
    "init, limit, step, direction, swap, trips",
    [
        (0, 5, 1, "LT", False, 5),
        (2, 14, 3, "LT", False, 4),
        (0, 5, 1, "LE", False, 6),
        (10, 0, -2, "GT", False, 5),
        (10, 0, -2, "GE", False, 6),
        (0, 5, 1, "GT", True, 5),  # 5 > iv
        (0, 6, 2, "NE", False, 3),
        (7, 5, 1, "LT", False, 0),
    ],
)
def test_trip_count_from_condition(init, limit, step, direction, swap, trips):
    text = _counted_loop(init, limit, step, direction, swap)
    [loop] = hlo.while_loops(text)
    assert (loop.trip_count, loop.source) == (trips, "condition")
    [op] = hlo.collective_ops(text)
    assert (op.bytes, op.group_size, op.multiplier) == (32, 2, trips)


@pytest.mark.parametrize(
    "type_text, nbytes, hbm_only",
    [
        ("f32[1024,512]{1,0}", 2 * MiB, 2 * MiB),
        ("bf16[8,128]{1,0:T(8,128)(2,1)S(1)}", 2048, 0),
        ("(s32[]{:T(128)}, pred[3,5]{1,0}, /*c*/ u8[7])", 4 + 15 + 7, 4 + 15 + 7),
        ("s4[3]{0}", 2, 2),
        ("f8e4m3fn[10]{0}", 10, 10),
        ("c64[2]", 16, 16),
        ("f32[<=6,2]", 48, 48),
        ("token[]", 0, 0),
    ],
)
def test_array_bytes(type_text, nbytes, hbm_only):
    assert hlo.array_bytes(type_text) == nbytes
    assert hlo.array_bytes(type_text, memory_space=0) == hbm_only


def test_bad_input_raises():
    with pytest.raises(ValueError, match="element type"):
        hlo.array_bytes("q7[3]")
    with pytest.raises(ValueError, match="ENTRY"):
        hlo.parse_hlo_module(
            "HloModule m\n\n%f (a: f32[]) -> f32[] {\n  ROOT %a = f32[] parameter(0)\n}\n"
        )
    with pytest.raises(ValueError, match="no HLO computations"):
        hlo.parse_hlo_module("not hlo at all")
    with pytest.raises(ValueError, match="HLO text"):
        hlo.parse_hlo_module(None)


# --- real programs ---------------------------------------------------------------------------


def _mesh(devices, shape, names):
    return Mesh(
        np.array(devices).reshape(shape), names, axis_types=(AxisType.Explicit,) * len(names)
    )


def _fsdp_scan(mesh, steps, rows, cols, dtype):
    """A scan of ``steps`` layers, each all-gathering its [rows, cols] weight (sharded on rows)."""

    def f(w, x):
        def body(x, w):
            w = jax.sharding.reshard(w, NamedSharding(mesh, P(None, None)))
            return jnp.tanh(jnp.dot(x, w, precision="highest")) @ w.T, None

        return jax.lax.scan(body, x, w)[0]

    w = jax.ShapeDtypeStruct((steps, rows, cols), dtype, sharding=NamedSharding(mesh, P(None, "x")))
    x = jax.ShapeDtypeStruct((8, rows), dtype, sharding=NamedSharding(mesh, P()))
    return jax.jit(f).lower(w, x).compile().as_text()


def test_cpu_scan_all_gather_is_weighted_by_trip_count():
    mesh = _mesh(jax.devices()[:4], (4,), ("x",))
    text = _fsdp_scan(mesh, 5, 1024, 512, jnp.float32)
    [op] = hlo.collective_ops(text)
    assert (op.kind, op.bytes, op.group_size, op.multiplier) == ("all-gather", 2 * MiB, 4, 5)
    assert hlo.collective_bytes(text)["all-gather"] == 5 * 2 * MiB
    assert hlo.collective_bytes(text, trip_weighted=False)["all-gather"] == 2 * MiB


def test_cpu_nested_scans_multiply():
    mesh = _mesh(jax.devices()[:4], (4,), ("x",))

    def f(w, x):
        def inner(x, w):
            w = jax.sharding.reshard(w, NamedSharding(mesh, P(None, None)))
            return jnp.tanh(x @ w), None

        def outer(x, w):
            return jax.lax.scan(inner, x, w)[0], None

        return jax.lax.scan(outer, x, w)[0]

    w = jax.ShapeDtypeStruct(
        (3, 4, 256, 256), jnp.float32, sharding=NamedSharding(mesh, P(None, None, "x"))
    )
    x = jax.ShapeDtypeStruct((8, 256), jnp.float32, sharding=NamedSharding(mesh, P()))
    text = jax.jit(f).lower(w, x).compile().as_text()
    assert sorted((lp.trip_count, lp.multiplier) for lp in hlo.while_loops(text)) == [
        (3, 1),
        (4, 3),
    ]
    [op] = hlo.collective_ops(text)
    assert (op.bytes, op.multiplier) == (256 * 256 * 4, 12)


def test_cpu_shard_map_collectives_of_every_kind():
    mesh = _mesh(jax.devices(), (2, 4), ("d", "x"))

    def inner(a, b):
        g = jax.lax.all_gather(a, "x", tiled=True)  # [1024, 512] f32: 2 MiB
        h = jnp.tanh(g @ b)  # [1024, 256]
        s = jax.lax.psum_scatter(h, "x", scatter_dimension=0, tiled=True)  # [256, 256]
        r = jax.lax.psum(s, "d")  # over the 2-way axis
        p = jax.lax.ppermute(r, "x", [(i, (i + 1) % 4) for i in range(4)])
        return jax.lax.all_to_all(p, "x", 0, 1, tiled=True)

    def f(a, b):
        return jax.shard_map(inner, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))(a, b)

    a = jax.ShapeDtypeStruct((1024, 512), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    b = jax.ShapeDtypeStruct((512, 256), jnp.float32, sharding=NamedSharding(mesh, P()))
    text = jax.jit(f).lower(a, b).compile().as_text()
    got = {(op.kind, op.bytes, op.group_size, op.multiplier) for op in hlo.collective_ops(text)}
    shard = 256 * 256 * 4
    assert got == {
        ("all-gather", 2 * MiB, 4, 1),
        ("reduce-scatter", shard, 4, 1),
        ("all-reduce", shard, 2, 1),
        ("collective-permute", shard, 8, 1),  # 4-cycles in both rows: 8 devices take part
        ("all-to-all", shard, 4, 1),
    }


@needs_libtpu
@pytest.mark.parametrize("dtype, nbytes", [(jnp.float32, 2 * MiB), (jnp.bfloat16, 1 * MiB)])
def test_tpu_scan_all_gather_weighted_by_condition_trip_count(dtype, nbytes):
    mesh = _mesh(get_devices(resolve_topology("v5e:2x2")), (4,), ("x",))
    text = _fsdp_scan(mesh, 5, 1024, 512, dtype)
    [op] = hlo.collective_ops(text)
    assert (op.kind, op.bytes, op.group_size, op.multiplier) == ("all-gather", nbytes, 4, 5)
    # XLA:TPU drops known_trip_count: the count comes from the loop condition.
    assert [(lp.trip_count, lp.source) for lp in hlo.while_loops(text)] == [(5, "condition")]
    assert hlo.collective_bytes(text)["all-gather"] == 5 * nbytes


@needs_libtpu
def test_tpu_reduce_scatter_fusion_counts_as_reduce_scatter():
    mesh = _mesh(get_devices(resolve_topology("v5e:2x2")), (4,), ("x",))

    def loss(w, x):
        w = jax.sharding.reshard(w, NamedSharding(mesh, P(None, None)))
        return jnp.square(x @ w).sum()

    w = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    text = jax.jit(jax.grad(loss)).lower(w, x).compile().as_text()
    got = sorted((op.kind, op.bytes, op.group_size) for op in hlo.collective_ops(text))
    # forward: gather the [256, 256] bf16 weight; backward: its gradient reduce-scattered.
    assert got == [("all-gather", 256 * 256 * 2, 4), ("reduce-scatter", 256 * 64 * 2, 4)]
