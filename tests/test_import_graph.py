"""No import cycle between the package's modules.

Every module of the package (``colibri_aio/`` and the trees pyproject maps into
it: ``io/``, ``kernels/``, ``bench/``) is parsed with :mod:`ast`, without being
imported. An edge goes from a module to each package module it imports,
wherever the import stands (module level or inside a function: a function's
import runs too, only later), except under ``if TYPE_CHECKING:``, which never
runs. ``from colibri_aio.x import y`` is an edge to ``colibri_aio.x.y`` when
that is a module, else to ``colibri_aio.x``; a package's ``__init__`` is the
package's module, so its re-exports are edges like any other import.
``importlib.import_module`` with a literal name counts as an import.

A cycle is a strongly connected component of more than one module, or a
module importing itself.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "colibri_aio"
# Where each package's source lives (pyproject's [tool.setuptools.package-dir]).
TREES = {PACKAGE: ROOT / "colibri_aio", f"{PACKAGE}.io": ROOT / "io",
         f"{PACKAGE}.kernels": ROOT / "kernels", f"{PACKAGE}.bench": ROOT / "bench"}

# Cycles that are known and allowed: none. (A listed module that no longer sits in a cycle fails too.)
KNOWN_CYCLES: frozenset[str] = frozenset()


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    out: dict[str, Path] = {}
    for base, tree in TREES.items():
        for path in sorted(tree.rglob("*.py")):
            parts = path.relative_to(tree).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((base, *parts))
            # A nested tree (colibri_aio/io would shadow io/) is not part of the package twice.
            if name in out and out[name] != path:
                raise AssertionError(f"{name} is both {out[name]} and {path}")
            out[name] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every node below ``node`` except the bodies of ``if TYPE_CHECKING:`` (their ``else`` runs)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield other
                yield from _runtime_nodes(other)
            continue
        yield child
        yield from _runtime_nodes(child)


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name a (possibly relative) ``from`` import names."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(module: str, path: Path, modules: set[str]) -> set[str]:
    """The package modules ``module`` (its source at ``path``) imports when it runs."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def add(name: str) -> None:
        # "import colibri_aio.a.b" binds the package and runs a, then a.b: the edge is to the module named.
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name.startswith(PACKAGE):
            found.add(name)

    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, is_package, node.level, node.module)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                add(sub if sub in modules else target)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and (
                    (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module") or
                    (isinstance(node.func, ast.Name) and node.func.id == "import_module")):
            add(node.args[0].value)
    found.discard(module)  # "from colibri_aio.x import y" inside x itself names x's own attribute
    return found


def import_graph() -> dict[str, set[str]]:
    """Each package module and the package modules it imports."""
    files = module_files()
    names = set(files)
    return {m: imports_of(m, p, names) for m, p in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        component.append(m)
                        if m == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return sorted(out)


def a_cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One import path around ``component`` that comes back to where it starts (breadth-first: the shortest
    from its first module), to read in a failure."""
    start = component[0]
    members = set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt: list[str] = []
        for m in frontier:
            for t in sorted(graph[m] & members):
                if t == start:
                    path = [m]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if t not in came_from:
                    came_from[t] = m
                    nxt.append(t)
        frontier = nxt
    raise AssertionError(f"{component} is not strongly connected")


def test_the_graph_finds_the_package() -> None:
    """The parse sees the modules and edges it should: a test that finds nothing would pass forever."""
    graph = import_graph()
    assert {"colibri_aio", "colibri_aio.engine.engine", "colibri_aio.io.reader", "colibri_aio.kernels.backend",
            "colibri_aio.bench.iobench"} <= set(graph)
    assert "colibri_aio.engine.engine" in graph["colibri_aio.engine"]  # a package's re-export
    assert "colibri_aio.io.reader" in graph["colibri_aio.engine.placement"]


def test_cycles_are_found_however_the_import_is_written(tmp_path) -> None:
    """Function-level and relative imports are edges; an import under ``if TYPE_CHECKING:`` is not."""
    (tmp_path / "a.py").write_text("def f():\n    from colibri_aio.b import thing\n")
    (tmp_path / "b.py").write_text("from . import c\n")
    (tmp_path / "c.py").write_text("import colibri_aio.a\nfrom typing import TYPE_CHECKING\n"
                                   "if TYPE_CHECKING:\n    from colibri_aio import d\n")
    (tmp_path / "d.py").write_text("from colibri_aio.c import x\n")
    names = {f"{PACKAGE}.{n}" for n in "abcd"}
    graph = {f"{PACKAGE}.{n}": imports_of(f"{PACKAGE}.{n}", tmp_path / f"{n}.py", names | {PACKAGE})
             for n in "abcd"}
    assert graph["colibri_aio.b"] == {"colibri_aio.c"} and graph["colibri_aio.c"] == {"colibri_aio.a"}
    assert cycles(graph) == [["colibri_aio.a", "colibri_aio.b", "colibri_aio.c"]]


def test_no_import_cycle_between_modules() -> None:
    graph = import_graph()
    found = cycles(graph)
    unknown = [c for c in found if not set(c) <= KNOWN_CYCLES]
    assert not unknown, "import cycles:\n" + "\n".join(" -> ".join(a_cycle_in(c, graph)) + f"  (all of {c})"
                                                       for c in unknown)
    left = KNOWN_CYCLES - {m for c in found for m in c}
    assert not left, f"no longer in a cycle, drop from KNOWN_CYCLES: {sorted(left)}"


# Planning (the plan command, placement, memory, the speed record) runs no model: none of it may reach the
# engine, whose opening plans. Measuring speed does open an engine, from beside it (engine.speed_probe).
PLANNING = ("colibri_aio.engine.plan", "colibri_aio.engine.placement", "colibri_aio.engine.memory",
            "colibri_aio.engine.speed")
RUNNING = frozenset({"colibri_aio.engine", "colibri_aio.engine.engine", "colibri_aio.engine.opening",
                     "colibri_aio.engine.speed_probe", "colibri_aio.engine.sync"})


def test_planning_does_not_import_the_engine() -> None:
    graph = import_graph()
    for start in PLANNING:
        seen, todo = {start}, [start]
        while todo:
            for t in graph[todo.pop()] - seen:
                seen.add(t)
                todo.append(t)
        assert not seen & RUNNING, f"{start} imports {sorted(seen & RUNNING)}"
