"""The shape of the code under packages/*/src: import cycles between modules, and the longest functions.

Run from the repository root: ``python3 benchmarks/code_shape.py``. Standard library only.

Import cycles: every ``import`` and ``from ... import`` statement anywhere in a module counts (also
inside functions and ``if TYPE_CHECKING:`` blocks), and ``from pkg import name`` is an edge to ``pkg``
(its ``__init__``) and, when ``pkg.name`` is a module, to that module too. Each strongly connected
component of more than one module is printed with its size. Then the longest functions and methods
(lines from ``def`` to their last line, nested functions counted on their own too).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``packages/<pkg>/src/**/*.py``."""
    mods: dict[str, Path] = {}
    for f in sorted(root.glob("packages/*/src/**/*.py")):
        rel = f.relative_to(root).parts[3:]  # after packages/<pkg>/src
        name = ".".join(Path(*rel).with_suffix("").parts)
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        mods[name] = f
    return mods


def _type_only(tree: ast.Module) -> set[int]:
    """The ids of the nodes inside ``if TYPE_CHECKING:`` blocks (imports for annotations only)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def import_graph(mods: dict[str, Path], runtime_only: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of ``mods`` it imports (anywhere in its source; ``runtime_only``: not
    counting the imports under ``if TYPE_CHECKING:``)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        tree = ast.parse(f.read_text())
        skipped = _type_only(tree) if runtime_only else set()
        package = m if f.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            graph[m].update(t for t in targets if t in mods and t != m)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def longest_functions(mods: dict[str, Path], root: Path, count: int) -> list[tuple[int, str]]:
    """The ``count`` longest functions: (lines, ``path:line name``), longest first."""
    rows: list[tuple[int, str]] = []
    for f in mods.values():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                rows.append((lines, f"{f.relative_to(root)}:{node.lineno} {node.name}"))
    rows.sort(key=lambda r: (-r[0], r[1]))
    return rows[:count]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("."), help="the repository root")
    parser.add_argument("--functions", type=int, default=10, help="how many of the longest functions")
    args = parser.parse_args()
    root = args.root.resolve()
    mods = module_files(root)
    found = cycles(import_graph(mods))
    print(f"import cycles ({len(found)}):")
    for component in found:
        print(len(component), component)
    runtime = cycles(import_graph(mods, runtime_only=True))
    print(f"of which at run time, not counting `if TYPE_CHECKING:` imports ({len(runtime)}):")
    for component in runtime:
        print(len(component), component)
    print(f"\nlongest functions ({args.functions}):")
    for lines, where in longest_functions(mods, root, args.functions):
        print(lines, where)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
