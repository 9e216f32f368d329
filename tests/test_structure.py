"""Package structure: no import cycle among ``jaxrl_llm`` modules, and no import against the
declared layers (``LAYERS``: lower layers never import higher ones, lazy imports included).

The import graph is read statically with ``ast`` from every ``.py`` file under ``jaxrl_llm/``,
so nothing is imported to check it. (The old 500-line rule is retired: a module is one
concept, whatever its length.)

Which imports are edges of the graph
------------------------------------
Every ``import`` statement counts, at module level and inside functions or methods alike (a
function-level import only postpones the cycle to the first call), except those under
``if TYPE_CHECKING:``, which never run. Imports built from strings (``importlib.import_module``)
are not seen. A module is named by its dotted path; a package by its ``__init__.py``.

For an import statement in module ``X``, Python first executes every package on the dotted
path of the imported module ``t`` that is not imported yet, outermost first, then ``t`` itself;
``from t import name`` then reads ``name`` from ``t``'s namespace, importing ``t.name`` when it
is a submodule not imported yet. So the edges are:

1. ``X -> m`` for every module ``m`` on ``t``'s dotted path (its packages and ``t``), plus
   ``X -> t.sub`` for ``from t import sub`` with ``sub`` a submodule:
   ``from jaxrl_llm.q.r import f`` gives ``X -> jaxrl_llm.q`` and ``X -> jaxrl_llm.q.r``;
   ``from jaxrl_llm import models`` gives ``X -> jaxrl_llm.models``;
2. except the packages containing ``X``: Python has initialised (or is initialising) them before
   ``X``'s first line runs, so entering them again executes nothing. That is why a package's
   ``__init__`` importing its own submodules, and a submodule importing a sibling
   (``import jaxrl_llm.p.sibling``, ``from jaxrl_llm.p import sibling``, ``from . import
   sibling``), is not a cycle;
3. but taking a *name* that is not a submodule from a package containing ``X``
   (``from jaxrl_llm.p import name`` or ``from . import name`` in ``jaxrl_llm/p/m.py``) reads
   that package's namespace at once, so ``X -> jaxrl_llm.p`` IS an edge. With ``p/__init__.py``
   importing ``m`` (directly or through other modules) that is a cycle: importing ``p`` runs
   ``m`` while ``p`` is half-initialised, and ``name`` may not exist yet.

Namespace packages (folders without ``__init__.py``, such as ``jaxrl_llm/train/``) run no code
and are no nodes. A module importing itself is ignored (Python hands back the module being
executed).
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path
from typing import NamedTuple

import pytest

PACKAGE = "jaxrl_llm"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / PACKAGE
# The package's layers, lowest first: a module may import its own layer and those below it,
# never one above (lazy imports included). A module of a listed package belongs to its layer.
LAYERS: tuple[tuple[str, ...], ...] = (
    # Containers, checks and the console toolkit everything shares.
    (
        "jaxrl_llm.types",
        "jaxrl_llm._checks",
        "jaxrl_llm.console",
        "jaxrl_llm.user_code",
        "jaxrl_llm.packing",
    ),
    ("jaxrl_llm.parallel",),
    ("jaxrl_llm.models",),
    # The loss layer: pure functions over arrays (log-probs over a model's hidden states).
    (
        "jaxrl_llm.losses",
        "jaxrl_llm.logprobs",
        "jaxrl_llm.preference",
        "jaxrl_llm.objectives",
    ),
    ("jaxrl_llm.data", "jaxrl_llm.rewards"),
    ("jaxrl_llm.sampling",),
    ("jaxrl_llm.envs", "jaxrl_llm.evaluation"),
    ("jaxrl_llm.train",),
    ("jaxrl_llm.plan", "jaxrl_llm.bench"),
    ("jaxrl_llm.cli", "jaxrl_llm"),
)


class Edge(NamedTuple):
    """``source`` imports ``target`` at ``line`` of ``source``'s file (``where``: scope)."""

    source: str
    target: str
    line: int
    where: str


def find_modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file for every ``.py`` under ``root`` (a package named ``package``).

    ``p/__init__.py`` is module ``p``. A folder without ``__init__.py`` is a namespace package
    (PEP 420): importable, but it runs no code, so it is no module of the graph.
    """
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join((package, *parts))] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_statements(node: ast.AST, scope: str = "module level", *, type_checking: bool = False):
    """``(node, scope)`` for every import statement that can run, skipping ``TYPE_CHECKING``
    blocks unless ``type_checking`` (the imports a type checker follows)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test) and not type_checking:
            children = child.orelse  # the ``if`` body never runs
        else:
            children = [child]
        for stmt in children:
            if isinstance(stmt, ast.Import | ast.ImportFrom):
                yield stmt, scope
            inner = scope
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                inner = f"in {stmt.name}()"
            yield from _import_statements(stmt, inner, type_checking=type_checking)


def _packages_on_path(module: str) -> list[str]:
    """``a.b.c`` -> ``["a", "a.b"]``: the packages Python enters before importing ``a.b.c``."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_edges(
    modules: dict[str, Path], package: str, *, type_checking: bool = False
) -> list[Edge]:
    """The edges of the import graph among ``modules`` (the rules in this file's docstring);
    with ``type_checking``, the ``if TYPE_CHECKING:`` imports count too."""
    edges = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        own_packages = {*_packages_on_path(name), *([name] if is_package else [])}
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, scope in _import_statements(tree, type_checking=type_checking):
            # (imported module, whether a name is read from its namespace)
            if isinstance(node, ast.Import):
                targets = [(alias.name, False) for alias in node.names]
            else:
                if node.level:
                    base_parts = name.split(".")
                    if not is_package:
                        base_parts = base_parts[:-1]
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                    base = ".".join([*base_parts, *([node.module] if node.module else [])])
                else:
                    base = node.module or ""
                targets = []
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.append((submodule, False) if submodule in modules else (base, True))
            for target, reads_name in targets:
                if target != package and not target.startswith(package + "."):
                    continue
                path_modules = [*_packages_on_path(target), target]
                reached = [m for m in path_modules if m not in own_packages]
                if reads_name and target not in reached:
                    reached.append(target)
                for module in reached:
                    if module != name and module in modules:
                        edges.append(Edge(name, module, node.lineno, scope))
    return edges


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def _shortest_cycle_through(start: str, graph: dict[str, set[str]], allowed: set[str]):
    """Shortest ``[start, ..., start]`` path inside ``allowed`` (breadth first), or None."""
    parent = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node] & allowed):
            if child == start:
                path = [node]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if child not in parent:
                parent[child] = node
                queue.append(child)
    return None


def find_cycles(edges: list[Edge]) -> list[list[str]]:
    """Import cycles as ``[a, b, ..., a]`` chains.

    Per strongly connected component (modules that all import each other, directly or not):
    the shortest cycle through its first module not yet on a reported cycle, until every
    module of the component is on one. Breaking every reported cycle may leave others in the
    component; the test then reports those.
    """
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    cycles = []
    for component in _strongly_connected(graph):
        if len(component) < 2:
            continue
        covered: set[str] = set()
        for start in component:
            if start in covered:
                continue
            cycle = _shortest_cycle_through(start, graph, set(component))
            covered.update(cycle)
            ring = cycle[:-1]
            first = ring.index(min(ring))
            cycles.append([*ring[first:], *ring[:first], ring[first]])
    return cycles


def describe_cycle(cycle: list[str], edges: list[Edge], modules: dict[str, Path]) -> str:
    """``a -> b -> a`` followed by the statements making each step (file:line, scope)."""
    lines = [" -> ".join(cycle)]
    for source, target in zip(cycle, cycle[1:]):
        where = dict.fromkeys((e.line, e.where) for e in edges if e[:2] == (source, target))
        sites = ", ".join(f"line {line} ({scope})" for line, scope in where)
        root = modules[source.split(".")[0]].parent.parent
        rel = modules[source].relative_to(root)
        lines.append(f"    {source} -> {target}: {rel} {sites}")
    return "\n".join(lines)


def layer_of(module: str, layers: tuple[tuple[str, ...], ...]) -> int | None:
    """The index of the layer holding ``module`` (a listed module or package, or a module
    inside a listed package; the longest match wins), or None."""
    best, index = -1, None
    for i, members in enumerate(layers):
        for member in members:
            if (module == member or module.startswith(member + ".")) and len(member) > best:
                best, index = len(member), i
    return index


def layer_violations(edges: list[Edge], layers: tuple[tuple[str, ...], ...]) -> list[Edge]:
    """The edges from a module to a module of a higher layer (within a layer, any import)."""
    return [
        e
        for e in edges
        if layer_of(e.source, layers) is not None
        and layer_of(e.target, layers) is not None
        and layer_of(e.target, layers) > layer_of(e.source, layers)
    ]


# --------------------------------------------------------------------------------------
# The rules, on jaxrl_llm
# --------------------------------------------------------------------------------------


def test_no_import_cycle_among_jaxrl_llm_modules():
    modules = find_modules(PACKAGE_DIR, PACKAGE)
    edges = import_edges(modules, PACKAGE)
    cycles = find_cycles(edges)
    if cycles:
        report = "\n".join(describe_cycle(cycle, edges, modules) for cycle in cycles)
        pytest.fail(f"{len(cycles)} import cycle(s) among {PACKAGE} modules:\n{report}", False)


def test_no_import_cycle_even_among_type_only_imports():
    """Type-only imports (``if TYPE_CHECKING:``) run nowhere, but a cycle among them still ties
    two modules into one concept: the types belong to the lower one."""
    modules = find_modules(PACKAGE_DIR, PACKAGE)
    edges = import_edges(modules, PACKAGE, type_checking=True)
    cycles = find_cycles(edges)
    report = "\n".join(describe_cycle(cycle, edges, modules) for cycle in cycles)
    assert not cycles, f"{len(cycles)} import cycle(s) with type-only imports:\n{report}"


def test_no_import_against_the_layers():
    modules = find_modules(PACKAGE_DIR, PACKAGE)
    against = layer_violations(import_edges(modules, PACKAGE), LAYERS)
    if against:
        root = PACKAGE_DIR.parent
        report = "\n".join(
            f"    {modules[e.source].relative_to(root)}:{e.line} ({e.where}): {e.source} "
            f"(layer {layer_of(e.source, LAYERS)}) imports {e.target} "
            f"(layer {layer_of(e.target, LAYERS)})"
            for e in against
        )
        pytest.fail(f"{len(against)} import(s) against the declared layers:\n{report}", False)


def top_level_names(path: Path) -> set[str] | None:
    """The names a module binds at its top level (None when a star import hides them)."""
    names = set()
    for stmt in ast.parse(path.read_text(), filename=str(path)).body:
        statements = [stmt]
        if isinstance(stmt, ast.If | ast.Try):  # guarded definitions
            statements = [*stmt.body, *getattr(stmt, "orelse", [])]
        for node in statements:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                for alias in node.names:
                    if alias.name == "*":
                        return None
                    names.add(alias.asname or alias.name.split(".")[0])
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def unresolved_imports(modules: dict[str, Path], package: str) -> list[str]:
    """``file:line: target`` for every import of ``package`` that names no file of it and no
    top-level name of the module it reads from.

    The graph's edges skip such targets, so an import through an alias (the loss modules' old
    root names, which ``jaxrl_llm/__init__.py`` resolves at run time) would hide its edge.
    """
    missing = []
    for path in modules.values():
        for node, _ in _import_statements(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                continue  # relative imports: by construction inside the package
            if isinstance(node, ast.Import):
                pairs = [(alias.name, None) for alias in node.names]
            else:
                pairs = [(node.module or "", alias.name) for alias in node.names]
            for base, name in pairs:
                if base != package and not base.startswith(package + "."):
                    continue
                if base not in modules:
                    missing.append(f"{path.relative_to(PACKAGE_DIR.parent)}:{node.lineno}: {base}")
                    continue
                if name is None or f"{base}.{name}" in modules:
                    continue
                defined = top_level_names(modules[base])
                if defined is not None and name not in defined:
                    where = f"{path.relative_to(PACKAGE_DIR.parent)}:{node.lineno}"
                    missing.append(f"{where}: {base}.{name}")
    return missing


def test_every_import_names_a_module_of_the_package():
    missing = unresolved_imports(find_modules(PACKAGE_DIR, PACKAGE), PACKAGE)
    assert not missing, f"imports of no {PACKAGE} file (use the module's own path): {missing}"


def test_every_module_has_a_layer():
    unplaced = [m for m in find_modules(PACKAGE_DIR, PACKAGE) if layer_of(m, LAYERS) is None]
    assert not unplaced, f"modules in no layer of LAYERS: {unplaced}"


# --------------------------------------------------------------------------------------
# The checker itself, on small hand-written packages
# --------------------------------------------------------------------------------------


def _write_package(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for relative, text in files.items():
        path = root / "pkg" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return find_modules(root / "pkg", "pkg")


def _cycles(tmp_path: Path, files: dict[str, str]) -> list[list[str]]:
    modules = _write_package(tmp_path, files)
    return find_cycles(import_edges(modules, "pkg"))


def test_module_names_and_namespace_packages(tmp_path):
    files = {
        "__init__.py": "",
        "a.py": "from pkg.loose.c import f\n",
        "sub/__init__.py": "",
        "sub/b.py": "",
        "loose/c.py": "from pkg.loose import d\n",
        "loose/d.py": "import pkg.a\n",
    }
    modules = _write_package(tmp_path, files)
    assert sorted(modules) == ["pkg", "pkg.a", "pkg.loose.c", "pkg.loose.d", "pkg.sub", "pkg.sub.b"]
    # The namespace package pkg.loose runs nothing; the cycle goes through its modules.
    assert _cycles(tmp_path, files) == [["pkg.a", "pkg.loose.c", "pkg.loose.d", "pkg.a"]]


def test_module_level_and_function_level_cycles_are_found(tmp_path):
    files = {
        "__init__.py": "",
        "a.py": "from pkg.b import g\n",
        "b.py": "def g():\n    from pkg import a\n    return a\n",
        "c.py": "import pkg.d\n",
        "d.py": "class K:\n    def m(self):\n        from pkg.c import x\n",
    }
    assert _cycles(tmp_path, files) == [["pkg.a", "pkg.b", "pkg.a"], ["pkg.c", "pkg.d", "pkg.c"]]


def test_three_module_cycle_is_one_chain(tmp_path):
    files = {
        "__init__.py": "",
        "a.py": "from pkg import b\n",
        "b.py": "from . import c\n",
        "c.py": "from .a import f\n",
    }
    assert _cycles(tmp_path, files) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]


def test_package_importing_its_submodules_is_not_a_cycle(tmp_path):
    files = {
        "__init__.py": "from pkg.sub import f\n",
        "sub/__init__.py": "from pkg.sub.x import f\nfrom . import y\n",
        "sub/x.py": "from pkg.sub.y import g\nfrom pkg.sub import y\nfrom . import y as yy\n",
        "sub/y.py": "import pkg.other\ndef g(): pass\n",
        "other.py": "import pkg\n",
    }
    assert _cycles(tmp_path, files) == []


def test_submodule_reading_its_parent_init_is_a_cycle(tmp_path):
    files = {
        "__init__.py": "",
        "sub/__init__.py": "from pkg.sub.x import f\nLIMIT = 3\n",
        "sub/x.py": "from pkg.sub import LIMIT\ndef f(): pass\n",
    }
    assert _cycles(tmp_path, files) == [["pkg.sub", "pkg.sub.x", "pkg.sub"]]
    files["sub/x.py"] = "from . import LIMIT\ndef f(): pass\n"
    assert _cycles(tmp_path, files) == [["pkg.sub", "pkg.sub.x", "pkg.sub"]]


def test_entering_another_package_runs_its_init(tmp_path):
    # pkg.a -> pkg.q (entered to reach pkg.q.r) -> pkg.a: Python runs q/__init__ from a.
    files = {
        "__init__.py": "",
        "a.py": "from pkg.q.r import f\n",
        "q/__init__.py": "from pkg.a import g\n",
        "q/r.py": "def f(): pass\n",
    }
    assert _cycles(tmp_path, files) == [["pkg.a", "pkg.q", "pkg.a"]]


def test_type_checking_imports_are_not_edges(tmp_path):
    files = {
        "__init__.py": "",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
        "b.py": "import typing\nfrom pkg.a import f\nif typing.TYPE_CHECKING:\n    import pkg.a\n",
    }
    assert _cycles(tmp_path, files) == []
    modules = _write_package(tmp_path, files)
    typed = find_cycles(import_edges(modules, "pkg", type_checking=True))
    assert typed == [["pkg.a", "pkg.b", "pkg.a"]]  # the type-only cycle, when asked for
    files["a.py"] += "else:\n    from pkg.b import B\n"
    assert _cycles(tmp_path, files) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_cycle_report_names_files_and_lines(tmp_path):
    modules = _write_package(
        tmp_path,
        {"__init__.py": "", "a.py": "\nimport pkg.b\n", "b.py": "def f():\n    import pkg.a\n"},
    )
    edges = import_edges(modules, "pkg")
    text = describe_cycle(find_cycles(edges)[0], edges, modules)
    assert text.splitlines() == [
        "pkg.a -> pkg.b -> pkg.a",
        "    pkg.a -> pkg.b: pkg/a.py line 2 (module level)",
        "    pkg.b -> pkg.a: pkg/b.py line 2 (in f())",
    ]


def test_an_import_of_a_higher_layer_is_found(tmp_path):
    files = {
        "__init__.py": "",
        "low.py": "def f():\n    from pkg.high import g  # lazy: still an edge\n",
        "mid/__init__.py": "",
        "mid/m.py": "from pkg import low\nfrom pkg.mid import n\n",
        "mid/n.py": "",
        "high.py": "from pkg.mid import m\n",
    }
    modules = _write_package(tmp_path, files)
    layers = (("pkg.low",), ("pkg.mid",), ("pkg.high", "pkg"))
    assert layer_of("pkg.mid.m", layers) == 1 and layer_of("pkg", layers) == 2
    against = layer_violations(import_edges(modules, "pkg"), layers)
    assert [(e.source, e.target, e.where) for e in against] == [("pkg.low", "pkg.high", "in f()")]


# --- Function size: no function takes more than 12 parameters --------------------------------

MAX_PARAMETERS = 12


def wide_functions(root: Path, limit: int = MAX_PARAMETERS) -> list[str]:
    """``file:line name (n)`` of every function or method under ``root`` taking more than
    ``limit`` parameters (``*args`` and ``**kwargs`` count one each; a method's ``self`` /
    ``cls`` does not): a job's settings travel in a resolved record, not as loose arguments."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
            names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
            if names[:1] in (["self"], ["cls"]):
                names = names[1:]
            if len(names) > limit:
                where = path.relative_to(root.parent)
                found.append(f"{where}:{node.lineno} {node.name} ({len(names)})")
    return found


def test_no_function_takes_more_than_twelve_parameters():
    assert wide_functions(PACKAGE_DIR) == []


def test_the_width_check_counts_every_kind_of_parameter(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text(
        "def ok(a, b, c, d, e, f, g, h, i, j, k, l): pass\n"
        "def wide(a, /, b, *args, c, d, e, f, g, h, i, j, k, **kwargs): pass\n"
        "class C:\n"
        "    def method(self, a, b, c, d, e, f, g, h, i, j, k, l): pass\n"
        "    def wider(self, a, b, c, d, e, f, g, h, i, j, k, *, l, m): pass\n",
        encoding="utf-8",
    )
    assert wide_functions(package) == ["pkg/m.py:2 wide (13)", "pkg/m.py:5 wider (13)"]
