"""The import graph of systems/: every import statement (TYPE_CHECKING and function-local ones included) read
from the source, so that a lower layer importing a higher one fails here rather than as a cycle that some
import order happens to survive."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SYSTEMS = Path(__file__).resolve().parents[1] / "systems"


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """{module: the systems modules it imports}; `from package import name` counts as importing package.name
    where that is a module, else the package."""
    paths = {module_name(path, root): path for path in root.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in paths else node.module
                            for alias in node.names}
        graph[name] = {target for target in targets if target in paths and target != name}
    return graph


def package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` as the path that closes it, or None."""
    state, path = {}, []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


GRAPH = import_graph(SYSTEMS)


def test_no_module_imports_itself_through_others():
    assert cycle(GRAPH) is None, " -> ".join(cycle(GRAPH))


def test_no_two_packages_import_each_other():
    packages = {}
    for module, targets in GRAPH.items():
        packages.setdefault(package(module), set()).update(package(t) for t in targets if package(t) != package(module))
    assert cycle(packages) is None, " -> ".join(cycle(packages))


@pytest.mark.parametrize("lower, higher", [("systems.levers", "systems.accounting"),
                                           ("systems.levers", "systems.parallel"),
                                           ("systems.accounting", "systems.parallel")])
def test_a_lower_layer_imports_no_higher_one(lower, higher):
    """The levers lie below both the accounting and the parallel code, and the accounting predicts from
    configs without the code that runs them."""
    offending = sorted(f"{module} -> {target}" for module, targets in GRAPH.items() if package(module) == lower
                       for target in targets if package(target) == higher)
    assert not offending


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """A function-local import and a TYPE_CHECKING one count like any other."""
    root = tmp_path / "systems"
    (root / "a").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "a" / "__init__.py").write_text("")
    (root / "a" / "x.py").write_text("from typing import TYPE_CHECKING\n"
                                     "if TYPE_CHECKING:\n    from systems.b import y\n")
    (root / "b.py").write_text("def f():\n    from systems.a import x\n")
    assert cycle(import_graph(root)) == ["systems.a.x", "systems.b", "systems.a.x"]
