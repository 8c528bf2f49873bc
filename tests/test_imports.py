"""graphc's modules import each other without a circle: the import graph of every `import` and
`from ... import` in src/graphc that runs (at module level or inside a function; not the
annotation-only ones under `if TYPE_CHECKING:`) is acyclic."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

import graphc

SOURCE = Path(graphc.__file__).parent


def module_name(path: Path) -> str:
    parts = ("graphc", *path.relative_to(SOURCE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _running_nodes(tree: ast.AST):
    """Every node of `tree` outside `if TYPE_CHECKING:` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in [child, *_running_nodes(child)])
            continue
        yield node
        yield from _running_nodes(node)


def import_graph(sources: dict[str, str]) -> nx.DiGraph:
    """Module -> each graphc module it imports (a package's own parents excluded: importing
    `a.b.c` runs `a.b`, which is no edge of `a.b`'s making)."""
    graph = nx.DiGraph()
    graph.add_nodes_from(sources)
    for name, text in sources.items():
        for node in _running_nodes(ast.parse(text)):
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


def test_a_circle_is_found_through_a_function_but_not_through_annotations():
    sources = {"graphc.a": "from graphc.b import x", "graphc.b": "def f():\n    import graphc.a\n"}
    assert [sorted(cycle) for cycle in nx.simple_cycles(import_graph(sources))] == [["graphc.a", "graphc.b"]]
    sources["graphc.b"] = "if TYPE_CHECKING:\n    import graphc.a\n"
    assert list(nx.simple_cycles(import_graph(sources))) == []
