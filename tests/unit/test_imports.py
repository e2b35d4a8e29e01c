"""No import cycle among the project's modules (issue 10), not even one hidden under ``if TYPE_CHECKING:`` or inside a
function: every ``import`` statement anywhere in a module counts, so a cycle cannot be papered over by a late import."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("controlplane", "sluice", "enginesim", "ratelimit")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "__pycache__" not in path.parts and not path.name.endswith("_pb2.py") \
                    and not path.name.endswith("_pb2_grpc.py"):
                found[_module_name(path)] = path
    return found


def _imported(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` (at ``path``) imports anywhere in its body."""
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets.add(module)
            targets.update(f"{module}.{alias.name}" for alias in node.names)  # ``from pkg import module``
    edges = set()
    for target in targets:
        # ``import a.b.c`` runs a, a.b and a.b.c; the deepest project module named is the one depended on.
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            edges.add(target)
    return edges


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(path, name, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): each is a set of modules importing each other
    in a ring."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component, as a closed path ``a -> b -> a``."""
    return [_a_cycle(graph, set(c)) for c in strongly_connected(graph)]


def _a_cycle(graph: dict[str, set[str]], members: set[str]) -> list[str]:
    """A shortest closed path through the component's first member, staying inside the component (every other member of
    the component is on some cycle with it too: the assertion names them all)."""
    start = min(members)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & members):
                if nxt == start:
                    return paths[node] + [start]
                if nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    following.append(nxt)
        frontier = following
    return sorted(members)


def test_the_graph_sees_type_checking_and_function_level_imports() -> None:
    graph = import_graph()
    assert "controlplane.config.policy" in graph and "controlplane.core.policy" in graph["controlplane.config.policy"]
    assert "controlplane.app" in graph["sluice.cli"]  # imported inside main()


def test_no_import_cycles() -> None:
    graph = import_graph()
    rings = [(_a_cycle(graph, set(c)), c) for c in strongly_connected(graph)]
    assert not rings, "import cycles:\n  " + "\n  ".join(
        f"{' -> '.join(cycle)}   (modules in this ring: {', '.join(members)})" for cycle, members in rings)


def test_the_control_plane_does_not_import_the_simulator() -> None:
    graph = import_graph()
    reached, todo = set(), ["controlplane.app"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(graph.get(module, ()))
    assert not {m for m in reached if m.startswith("enginesim")}, sorted(m for m in reached if m.startswith("enginesim"))
