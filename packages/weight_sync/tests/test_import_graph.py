"""No import circles between the modules of ppo_weight_sync (its test engines included), counting
every import: at the top, inside a function, and under ``TYPE_CHECKING`` (a circle there is still two
modules that each need the other to be read). A submodule importing its package is not a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import ppo_weight_sync

ROOT = Path(ppo_weight_sync.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports (packages' ``__init__`` left out as targets)."""
    files = {_module_name(p): p for p in root.rglob("*.py")}
    packages = {_module_name(p) for p in root.rglob("__init__.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        base = name if name in packages else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    anchor = base.split(".")[: len(base.split(".")) - node.level + 1]
                    module = ".".join([*anchor, module] if module else anchor)
                targets = [module, *(f"{module}.{a.name}" for a in node.names)]
            for target in targets:
                if target in files and target not in packages and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each circle once, as the path from its first module back to it."""
    found: list[list[str]] = []
    seen: set[frozenset[str]] = set()

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt == start:
                key = frozenset(path)
                if key not in seen:
                    seen.add(key)
                    found.append([*path, start])
            elif nxt not in path and nxt > start:  # each circle from its smallest module
                walk(start, nxt, [*path, nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return found


def test_the_graph_sees_the_imports() -> None:
    graph = import_graph(ROOT)
    assert "ppo_weight_sync.requests" in graph["ppo_weight_sync.ops"]
    assert "ppo_weight_sync.testing.sglang_receiver" in graph["ppo_weight_sync.testing.sglang_tp"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_module_imports_itself_through_another() -> None:
    assert cycles(import_graph(ROOT)) == []
