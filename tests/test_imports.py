"""The package's import graph: no module imports itself back through others, and layers go down.

Every ``import`` counts, also one inside a function: a lazy import still ties two modules together
for whoever reads or moves them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import icefloe

ROOT = Path(icefloe.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the icefloe modules it imports. ``from pkg import mod`` imports ``mod``; the parent
    packages Python runs on the way are not counted (a package's ``__init__`` re-exports, it is not a layer)."""
    modules = {_module_name(path): path for path in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:  # a submodule named here is imported; else a name of ``base``
                    submodule = f"{base}.{alias.name}"
                    found.add(submodule if submodule in modules else base)
        graph[name] = {target for target in found if target in modules and target != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_no_module_of_icefloe_imports_itself_back():
    found = circles(import_graph())
    assert found == [], f"import circles (break each with a module both sides import): {found}"


def test_the_circle_finder_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_client_never_imports_the_service():
    graph = import_graph()
    wrong = sorted(
        (name, target)
        for name, targets in graph.items()
        if name.startswith("icefloe.client")
        for target in targets
        if target.startswith("icefloe.service")
    )
    assert wrong == []
