"""The import graph of `reservoir` read from the `ast` of every module: which reservoir module
imports which, at module level or inside a function, and where."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# package -> its folder, as pyproject.toml's package-dir maps them
FOLDERS = {"reservoir": ROOT / "platform" / "reservoir",
           "reservoir.operators": ROOT / "operators",
           "reservoir.migrations": ROOT / "migrations"}


@dataclass
class Graph:
    """Modules (dotted name -> file) and their imports of other reservoir modules."""

    files: dict[str, Path] = field(default_factory=dict)
    trees: dict[str, ast.Module] = field(default_factory=dict)
    edges: dict[str, list[tuple[str, int]]] = field(default_factory=dict)

    def is_package(self, name: str) -> bool:
        return self.files[name].name == "__init__.py"


def module_name(path: Path, package: str, folder: Path) -> str:
    parts = [*package.split("."), *path.relative_to(folder).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def read(folders: dict[str, Path] = FOLDERS) -> Graph:
    """The graph of the packages in folders (dotted name -> folder holding __init__.py)."""
    graph = Graph()
    for package, folder in folders.items():
        for path in sorted(folder.rglob("*.py")):
            name = module_name(path, package, folder)
            graph.files[name] = path
            graph.trees[name] = ast.parse(path.read_text(), str(path))
    for name, tree in graph.trees.items():
        graph.edges[name] = sorted(set(_imports(graph, name, tree)), key=lambda e: (e[1], e[0]))
    return graph


def _imports(graph: Graph, name: str, tree: ast.Module):
    """(module imported, line) for every import of a module of the graph's package."""
    package = name if graph.is_package(name) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _known(graph, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                yield from _known(graph, submodule if submodule in graph.files else base,
                                  node.lineno)


def _known(graph: Graph, dotted: str, line: int):
    while dotted and dotted not in graph.files:
        dotted = dotted.rpartition(".")[0]
    if dotted:
        yield dotted, line
