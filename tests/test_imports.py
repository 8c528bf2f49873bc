"""graphc's modules import each other without a circle: the import graph of every `import` and
`from ... import` in src/graphc (module level or inside a function, TYPE_CHECKING blocks too) is
acyclic."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

import graphc

SOURCE = Path(graphc.__file__).parent


def module_name(path: Path) -> str:
    parts = ("graphc", *path.relative_to(SOURCE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(sources: dict[str, str]) -> nx.DiGraph:
    """Module -> each graphc module it imports (a package's own parents excluded: importing
    `a.b.c` runs `a.b`, which is no edge of `a.b`'s making)."""
    graph = nx.DiGraph()
    graph.add_nodes_from(sources)
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            graph.add_edges_from((name, t) for t in targets
                                 if t in sources and t != name and not name.startswith(t + "."))
    return graph


def test_no_module_imports_itself_through_others():
    sources = {module_name(path): path.read_text() for path in SOURCE.rglob("*.py")}
    assert len(sources) > 100
    assert list(nx.simple_cycles(import_graph(sources))) == []


def test_a_circle_is_found():
    sources = {"graphc.a": "from graphc.b import x", "graphc.b": "def f():\n    import graphc.a\n"}
    assert [sorted(cycle) for cycle in nx.simple_cycles(import_graph(sources))] == [["graphc.a", "graphc.b"]]
