"""Reading optimized HLO text (``compiled.as_text()``): collectives and loop trip counts.

``cost_analysis()`` counts a ``while`` body once, however often it runs, and says nothing about
collectives. This parses the optimized SPMD module (every shape is one device's shard) and
weights what it finds by the trip counts of the loops around it:

* ``collective_ops`` / ``collective_bytes``: every all-gather, all-reduce, reduce-scatter,
  all-to-all and collective-permute, with its result bytes (element size x shape, tuple results
  summed) and replica-group size. Async ``X-start`` / ``X-done`` pairs count once (bytes from the
  ``-done`` result); ops inside called computations (fusions, ``async-start`` wrappers, calls,
  conditional branches, loop bodies) count where they are called from. XLA:TPU lowers a
  reduce-scatter as a fusion of an all-reduce and a dynamic-slice (``all-reduce-scatter``);
  that fusion counts as one reduce-scatter of its (sharded) result.
* ``while_loops``: each loop's trip count, from ``backend_config={"known_trip_count":...}``
  (XLA:CPU keeps it) or else from the condition ``iv < N`` against a constant, the induction
  variable's start and step read from the loop's init tuple and body (XLA:TPU drops the backend
  config). Nested loops multiply.
* ``walk``: every instruction reachable from the entry with its loop multiplier (over which
  ``estimate.hlo_hbm_bytes`` sums HBM traffic; ``estimate.ici_time_s`` prices collectives).

Conditional branches are all counted (an upper bound). A loop whose trip count cannot be read
counts once and is flagged (``trip_count_known=False``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Mapping

COLLECTIVE_KINDS = tuple(
    "all-gather all-reduce reduce-scatter all-to-all collective-permute".split()
)
_KIND_OF_OPCODE = dict(zip(COLLECTIVE_KINDS, COLLECTIVE_KINDS, strict=True))
_KIND_OF_OPCODE.update(
    {"ragged-all-to-all": "all-to-all", "collective-broadcast": "collective-permute"}
)
_VIEWS = ("bitcast", "copy", "reshape", "convert")
_CALL_KEYS = "calls to_apply condition body branch_computations true_computation false_computation"

_COMMENT = re.compile(r"/\*.*?\*/")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s+=\s+(.*)$")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")
_OPCODE = re.compile(r"([a-z][a-z0-9\-]*)\(")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: ``name = type opcode(operands), attributes``."""

    name: str
    opcode: str
    type_text: str
    operands: tuple[str, ...]
    operand_text: str
    attributes: str
    is_root: bool = False

    def attribute(self, key: str) -> str | None:
        """The value of ``key=...`` (a computation name or a ``{...}`` list), or None."""
        pattern = rf"(?:^|[\s,]){re.escape(key)}=(\{{[^}}]*\}}|%?[\w.\-]+)"
        match = re.search(pattern, self.attributes)
        return None if match is None else match.group(1).lstrip("%")

    def called(self, keys: str = _CALL_KEYS) -> list[str]:
        """Computations this instruction calls (``keys``: attribute names, space separated)."""
        names = []
        for key in keys.split():
            value = self.attribute(key)
            if value is not None:
                names += [n.strip().lstrip("%") for n in value.strip("{}").split(",") if n.strip()]
        return names


@dataclasses.dataclass(frozen=True)
class Computation:
    """A named HLO computation: its instructions in order, by name, and its root."""

    name: str
    is_entry: bool
    instructions: tuple[Instruction, ...]
    by_name: Mapping[str, Instruction] = dataclasses.field(compare=False, repr=False)

    @property
    def root(self) -> Instruction:
        """The ``ROOT`` instruction (the last one when none is marked)."""
        return next((i for i in self.instructions if i.is_root), self.instructions[-1])


@dataclasses.dataclass(frozen=True)
class HloModule:
    """A parsed HLO module: computations by name, the entry's name and the device count."""

    name: str
    computations: Mapping[str, Computation]
    entry: str
    num_devices: int  # num_partitions x replica_count


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective, per device: where (``computation``, instruction ``name``: the ``-start``
    of an async pair, the fusion of an XLA:TPU all-reduce-scatter), ``kind``, result ``bytes`` of
    one execution (reduce-scatter: the shard, all-gather: the gathered buffer), devices per
    replica group (permute: devices taking part), ``multiplier`` (trip counts of the loops around
    it), ``is_async``, ``trip_count_known`` (every enclosing trip count read, else counted once),
    ``op_name``: the JAX operation it came from (``metadata={op_name=...}``, e.g.
    ``jit(step)/while/body/shard_map/all_to_all``; "" when the HLO carries none).
    """

    computation: str
    name: str
    kind: str
    bytes: int
    group_size: int
    multiplier: int
    is_async: bool
    trip_count_known: bool
    op_name: str = ""

    @property
    def total_bytes(self) -> int:
        """``bytes x multiplier``: the bytes over one call of the program."""
        return self.bytes * self.multiplier


@dataclasses.dataclass(frozen=True)
class WhileLoop:
    """A ``while``: where, what it runs, ``trip_count`` (None: unread), ``source``
    (``backend_config`` / ``condition`` / ``unknown``), ``multiplier`` (loops around it)."""

    computation: str
    name: str
    body: str
    condition: str
    trip_count: int | None
    source: str
    multiplier: int


def parse_hlo_module(text: str) -> HloModule:
    """Parses ``compiled.as_text()`` into computations; ValueError if it has no ENTRY."""
    if not isinstance(text, str):
        raise ValueError(f"expected HLO text (str), got {type(text).__name__}")
    header = re.search(r"^HloModule\s+([^\s,]+)(.*)$", text, flags=re.MULTILINE)
    attrs = header.group(2) if header else ""
    counts = [re.search(rf"{key}=(\d+)", attrs) for key in ("num_partitions", "replica_count")]
    computations: dict[str, Computation] = {}
    entry, current, pending = None, None, ""
    for raw in [*_COMMENT.sub("", text).splitlines(), "  "]:
        line = raw.rstrip()
        if current is None:
            match = _HEADER.match(line)
            if match and not line.startswith("HloModule"):
                current, pending = (match.group(2), bool(match.group(1)), []), ""
            continue
        if pending.count("{") > pending.count("}") and line and not line[0].isspace():
            # An attribute spanning lines, its next lines unindented (a Pallas kernel's
            # ``frontend_attributes={kernel_metadata={\n"xprof_metadata":...\n}}, ...``).
            pending += line
            continue
        if pending and (ins := _parse_instruction(pending)) is not None:
            current[2].append(ins)
        pending = line
        if line.startswith("}"):  # the computation's closing brace
            name, is_entry, body = current
            if body:
                computations[name] = Computation(
                    name, is_entry, tuple(body), {i.name: i for i in body}
                )
                entry = name if is_entry else entry
            current, pending = None, ""
    if not computations:
        raise ValueError("no HLO computations found in the text (expected compiled.as_text())")
    if entry is None:
        raise ValueError("the HLO text has no ENTRY computation")
    num_devices = math.prod(int(m.group(1)) for m in counts if m)
    return HloModule(header.group(1) if header else "", computations, entry, num_devices)


def _parse_instruction(line: str) -> Instruction | None:
    match = _INSTRUCTION.match(line)
    if match is None:
        return None
    is_root, name, rest = bool(match.group(1)), match.group(2), match.group(3).lstrip()
    if rest.startswith("("):
        end = _matching_paren(rest, 0)
        type_text, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        type_text, _, rest = rest.partition(" ")
        rest = rest.lstrip()
    op = _OPCODE.match(rest)
    if op is None:
        return None
    end = _matching_paren(rest, op.end() - 1)
    operand_text = rest[op.end() : end]
    operands = tuple(t.split()[-1].lstrip("%") for t in _split_top_level(operand_text) if t.strip())
    attributes = rest[end + 1 :].lstrip(", ")
    return Instruction(name, op.group(1), type_text, operands, operand_text, attributes, is_root)


def _matching_paren(text: str, start: int) -> int:
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise ValueError(f"unbalanced parentheses in HLO text: {text[:200]!r}")


def _split_top_level(text: str) -> list[str]:
    parts, depth, last = [], 0, 0
    for i, ch in enumerate(text):
        depth += 1 if ch in "([{" else -1 if ch in ")]}" else 0
        if ch == "," and depth == 0:
            parts.append(text[last:i])
            last = i + 1
    return [*parts, text[last:]]


def element_bits(dtype: str) -> int:
    """Bits of one element of an HLO element type (``bf16`` 16, ``pred`` 8, ``s4`` 4, ``f8e4m3fn``
    8; ``token`` 0). Raises ValueError on an unknown type."""
    if dtype in ("token", "opaque"):
        return 0
    if dtype in ("pred", "bf16"):
        return {"pred": 8, "bf16": 16}[dtype]
    match = re.fullmatch(r"[sufc](\d+)(?:[a-z][a-z0-9]*)?", dtype)
    if match is None:
        raise ValueError(f"unknown HLO element type {dtype!r}")
    return int(match.group(1))


def array_bytes(type_text: str, *, memory_space: int | None = None) -> int:
    """Bytes of an HLO type (tuple elements summed), e.g. ``f32[1024,512]{1,0}`` -> 2 MiB;
    with ``memory_space`` only arrays in it (layout ``S(n)``, none = 0: TPU HBM; 1: VMEM)."""
    total = 0
    for dtype, dims, layout in _ARRAY.findall(type_text):
        space = re.search(r"S\((\d+)\)", layout or "")
        if memory_space is not None and (int(space.group(1)) if space else 0) != memory_space:
            continue
        count = math.prod(int(d.lstrip("<=")) for d in dims.split(",") if d.strip())
        total += (count * element_bits(dtype) + 7) // 8
    return total


def array_shapes(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(element type, dims)`` of each array of an HLO type, tuples flattened in order, e.g.
    ``(bf16[16,2048]{1,0}, s32[])`` -> ``[("bf16", (16, 2048)), ("s32", ())]``."""
    return [
        (dtype, tuple(int(d.lstrip("<=")) for d in dims.split(",") if d.strip()))
        for dtype, dims, _ in _ARRAY.findall(type_text)
    ]


def replica_group_size(ins: Instruction, num_devices: int) -> int:
    """Devices per replica group of a collective, from any of XLA's replica-group formats.

    ``{{0,1,2,3},{4,5,6,7}}`` (explicit), ``[2,4]<=[8]`` (iota: 2 groups of 4),
    ``mesh['x'=2,'y'=4] {'y'}`` (mesh axes; ``'y':(2)2`` is a sub-axis of size 2), ``{}`` or no
    groups (all ``num_devices``), ``source_target_pairs`` (the devices of a permute).
    """
    attrs = ins.attributes
    if pairs := re.search(r"source_target_pairs=\{(.*?)\}\}", attrs):
        return len(set(re.findall(r"\d+", pairs.group(1))))
    if mesh := re.search(r"replica_groups=mesh\[([^\]]*)\]", attrs):
        sizes = {}
        for axis in _split_top_level(mesh.group(1)):
            axis_name, _, size = axis.partition("=")
            sizes[axis_name.strip().strip("'\"")] = int(size)
        brace = attrs.index("{", mesh.end())
        size = 1
        for axis in _split_top_level(attrs[brace + 1 : attrs.index("}", brace)]):
            axis_name, _, sub = axis.partition(":")
            sub_size = re.search(r"\)\s*(\d+)", sub)
            if axis.strip():
                size *= int(sub_size.group(1)) if sub_size else sizes[axis_name.strip(" '\"")]
        return size
    if iota := re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs):
        return int(iota.group(2))
    if explicit := re.search(r"replica_groups=\{\{([^}]*)\}", attrs):
        return len(re.findall(r"\d+", explicit.group(1)))
    return num_devices


def op_name(ins: Instruction) -> str:
    """The JAX operation an instruction came from: its ``metadata={op_name="..."}`` ("" when
    it has none), e.g. ``jit(fn)/while/body/closed_call/shard_map/all_to_all``."""
    match = re.search(r'(?:^|[\s,{])op_name="([^"]*)"', ins.attributes)
    return "" if match is None else match.group(1)


def _module(hlo: str | HloModule) -> HloModule:
    return hlo if isinstance(hlo, HloModule) else parse_hlo_module(hlo)


@dataclasses.dataclass(frozen=True)
class Site:
    """An instruction reached from the entry: ``mult`` = trip counts of the loops around it,
    ``known``: all of them read, ``in_async``: inside an ``async-start``, ``fused``: inside a
    fusion's computation, ``done``: the ``-done`` of an async ``-start``."""

    comp: Computation
    ins: Instruction
    mult: int
    known: bool
    in_async: bool
    fused: bool
    done: Instruction | None


def walk(module: HloModule, trip_weighted: bool = True) -> Iterator[Site]:
    """Every instruction reachable from the entry, with its loop multiplier (depth first)."""

    def visit(name, mult, known, is_async, fused, stack):
        comp = module.computations.get(name)
        if comp is None or name in stack:
            return
        stack = (*stack, name)
        done = {
            i.operands[0]: i for i in comp.instructions if i.opcode.endswith("-done") and i.operands
        }
        for ins in comp.instructions:
            yield Site(comp, ins, mult, known, is_async, fused, done.get(ins.name))
            op = ins.opcode
            if op == "while":
                n, _ = loop_trip_count(module, comp, ins)
                m = mult * (n if n is not None and trip_weighted else 1)
                for sub in ins.called("body condition"):
                    yield from visit(sub, m, known and n is not None, is_async, fused, stack)
            elif not (op.endswith("-done") or _all_reduce_scatter(module, ins)):
                a, f = is_async or op == "async-start", fused or op == "fusion"
                for sub in ins.called():
                    yield from visit(sub, mult, known, a, f, stack)

    yield from visit(module.entry, 1, True, False, False, ())


def collective_ops(hlo: str | HloModule) -> list[CollectiveOp]:
    """Every collective of the program, each with the trip-count product around it."""
    module = _module(hlo)
    ops = []
    for site in walk(module):
        ins, op = site.ins, site.ins.opcode
        is_start = op.endswith("-start") and op[:-6] in _KIND_OF_OPCODE
        scatter = _all_reduce_scatter(module, ins)
        if not (is_start or op in _KIND_OF_OPCODE or scatter):
            continue
        if scatter:
            kind, nbytes, group_from = "reduce-scatter", array_bytes(ins.type_text), scatter
        else:
            kind, group_from = _KIND_OF_OPCODE[op[:-6] if is_start else op], ins
            nbytes = _start_bytes(ins, site.done) if is_start else array_bytes(ins.type_text)
        group = replica_group_size(group_from, module.num_devices)
        is_async = is_start or site.in_async
        ops.append(
            CollectiveOp(
                site.comp.name,
                ins.name,
                kind,
                nbytes,
                group,
                site.mult,
                is_async,
                site.known,
                op_name(ins) or op_name(group_from),
            )
        )
    return ops


def while_loops(hlo: str | HloModule) -> list[WhileLoop]:
    """Every ``while`` loop reachable from the entry, with its trip count."""
    module = _module(hlo)
    loops = []
    for site in walk(module):
        if site.ins.opcode == "while":
            trip, source = loop_trip_count(module, site.comp, site.ins)
            body, cond = site.ins.attribute("body") or "", site.ins.attribute("condition") or ""
            loops.append(
                WhileLoop(site.comp.name, site.ins.name, body, cond, trip, source, site.mult)
            )
    return loops


def collective_bytes(hlo: str | HloModule, *, trip_weighted: bool = True) -> dict[str, int]:
    """Per-device collective result bytes of one call by kind (every kind present, maybe 0);
    ``trip_weighted=False`` counts each op once, as ``cost_analysis`` counts loop bodies."""
    totals = dict.fromkeys(COLLECTIVE_KINDS, 0)
    for op in collective_ops(hlo):
        totals[op.kind] += op.total_bytes if trip_weighted else op.bytes
    return totals


def _start_bytes(start: Instruction, done: Instruction | None) -> int:
    """Result bytes of an async collective: its ``-done`` result, else read off the start's
    tuple (all-gather-start: operands then results; collective-permute-start: element 1)."""
    if done is not None:
        return array_bytes(done.type_text)
    text = start.type_text.strip()
    parts = [p for p in _split_top_level(text[1:-1]) if p.strip()] if text.startswith("(") else []
    if start.opcode == "all-gather-start" and len(parts) >= 2:
        return sum(array_bytes(p) for p in parts[len(parts) // 2 :])
    if start.opcode == "collective-permute-start" and len(parts) >= 2:
        return array_bytes(parts[1])
    return array_bytes(text)


def _skip_views(comp: Computation, ins: Instruction | None) -> Instruction | None:
    while ins is not None and ins.opcode in _VIEWS and ins.operands:
        ins = comp.by_name.get(ins.operands[0])
    return ins


def _all_reduce_scatter(module: HloModule, fusion: Instruction) -> Instruction | None:
    """The all-reduce of an XLA:TPU reduce-scatter fusion (root: a slice of an all-reduce)."""
    callees = fusion.called("calls") if fusion.opcode == "fusion" else []
    comp = module.computations.get(callees[0]) if len(callees) == 1 else None
    if comp is None:
        return None
    ins = _skip_views(comp, comp.root)
    if ins is None or ins.opcode not in ("dynamic-slice", "slice"):
        return None
    source = _skip_views(comp, comp.by_name.get(ins.operands[0]))
    return source if source is not None and source.opcode == "all-reduce" else None


def loop_trip_count(
    module: HloModule, comp: Computation, loop: Instruction
) -> tuple[int | None, str]:
    """Trip count of ``loop`` (a ``while`` in ``comp``) and where it came from.

    ``(n, "backend_config")`` from ``known_trip_count``; ``(n, "condition")`` from a condition
    ``iv <cmp> constant`` (possibly wrapped in a fusion), with the induction variable's init from
    the loop's init tuple (through copies; 0 when not a constant) and step from the body's
    ``iv + constant`` (1 when not read); else ``(None, "unknown")``.
    """
    if known := re.search(r'"known_trip_count":\{"n":"(\d+)"\}', loop.attributes):
        return int(known.group(1)), "backend_config"
    cond = module.computations.get(loop.attribute("condition") or "")
    compare = _root_compare(module, cond) if cond is not None else None
    if compare is None:
        return None, "unknown"
    direction, index, limit = compare
    init = 0
    init_tuple = comp.by_name.get(loop.operands[0]) if loop.operands else None
    if init_tuple is not None and init_tuple.opcode == "tuple" and index < len(init_tuple.operands):
        value = _resolve(comp, init_tuple.operands[index], ())
        init = value[1] if value is not None and value[0] == "const" else 0
    body = module.computations.get(loop.attribute("body") or "")
    step = (_body_step(module, body, index) if body is not None else None) or 1
    trips = _count(direction, init, limit, step)
    return (None, "unknown") if trips is None else (trips, "condition")


def _count(direction: str, init: int, limit: int, step: int) -> int | None:
    """Iterations of ``for (iv = init; iv <direction> limit; iv += step)``, or None."""
    if direction == "NE" and step and (limit - init) % step == 0 and (limit - init) // step >= 0:
        return (limit - init) // step
    if step > 0 and direction in ("LT", "LE"):
        span, stride = limit - init, step
    elif step < 0 and direction in ("GT", "GE"):
        span, stride = init - limit, -step
    else:
        return None
    return max(0, -(-span // stride) if direction in ("LT", "GT") else span // stride + 1)


_FLIP = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "EQ": "EQ", "NE": "NE"}


def _unfuse(module: HloModule, comp: Computation, ins: Instruction | None):
    """``(computation, instruction, outer)`` looking through a fusion to its root."""
    if ins is not None and ins.opcode == "fusion":
        callee = module.computations.get(next(iter(ins.called("calls")), ""))
        if callee is not None:
            return callee, callee.root, ((comp, ins),)
    return comp, ins, ()


def _root_compare(module: HloModule, cond: Computation) -> tuple[str, int, int] | None:
    """``(direction, iv tuple index, limit)`` of a loop condition ``iv <cmp> constant``."""
    comp, root, outer = _unfuse(module, cond, cond.root)
    direction = re.search(r"direction=(\w+)", root.attributes)
    if root.opcode != "compare" or len(root.operands) != 2 or direction is None:
        return None
    lhs, rhs = (_resolve(comp, o, outer) for o in root.operands)
    if lhs is not None and rhs is not None and {lhs[0], rhs[0]} == {"iv", "const"}:
        if lhs[0] == "iv":
            return direction.group(1), lhs[1], rhs[1]
        return _FLIP[direction.group(1)], rhs[1], lhs[1]
    return None


def _resolve(comp: Computation, name: str, outer: tuple) -> tuple[str, int] | None:
    """``("const", v)``, ``("iv", tuple index)`` or ``("param", k)`` for a scalar value, through
    views and (via ``outer``: ``(computation, fusion)`` pairs) fusion parameters."""
    ins = _skip_views(comp, comp.by_name.get(name))
    if ins is None:
        return None
    text = ins.operand_text.strip()
    if ins.opcode == "constant":
        return ("const", int(text)) if re.fullmatch(r"-?\d+", text) else None
    if ins.opcode == "parameter":
        if not outer:
            return "param", int(text)
        outer_comp, fusion = outer[-1]
        if int(text) >= len(fusion.operands):
            return None
        return _resolve(outer_comp, fusion.operands[int(text)], outer[:-1])
    index = re.search(r"index=(\d+)", ins.attributes)
    if ins.opcode == "get-tuple-element" and index and ins.operands:
        source = _resolve(comp, ins.operands[0], outer)
        return ("iv", int(index.group(1))) if source is not None and source[0] == "param" else None
    return None


def _body_step(module: HloModule, body: Computation, index: int) -> int | None:
    """The constant ``k`` of the body's update ``iv <- iv + k`` (root tuple element ``index``)."""
    root = body.root
    if root.opcode != "tuple" or index >= len(root.operands):
        return None
    comp, update, outer = _unfuse(module, body, body.by_name.get(root.operands[index]))
    if update is None or update.opcode not in ("add", "subtract") or len(update.operands) != 2:
        return None
    a, b = (_resolve(comp, o, outer) for o in update.operands)
    if update.opcode == "add" and b == ("iv", index):
        a, b = b, a
    if a == ("iv", index) and b is not None and b[0] == "const":
        return b[1] if update.opcode == "add" else -b[1]
    return None
