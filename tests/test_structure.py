"""The package's modules import one another without circles, so each stage can be read
and tested with only the stages below it."""

from __future__ import annotations

import ast
import graphlib
import pathlib

import offload_pass

PACKAGE = pathlib.Path(offload_pass.__file__).parent


def _type_checking_only(tree: ast.AST) -> set[ast.AST]:
    """Nodes under ``if TYPE_CHECKING:``, which never run."""
    blocks = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    ]
    return {inner for block in blocks for inner in ast.walk(block)}


def _imports(path: pathlib.Path) -> set[str]:
    """The package's modules that ``path`` imports when it runs, at any depth of its code."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree)
    found = set()
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "offload_pass":
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("offload_pass."):
            found.add(node.module.split(".")[1])
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    return found & modules - {path.stem}


def test_modules_import_each_other_without_circles():
    graph = {p.stem: _imports(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    order = list(graphlib.TopologicalSorter(graph).static_order())
    assert set(order) >= set(graph)


def test_graph_facts_sit_below_the_stages_that_read_them():
    graph = {p.stem: _imports(p) for p in PACKAGE.glob("*.py")}
    assert graph["graphs"] <= {"_compat"}
    assert "analysis" not in graph["order"] and "costs" not in graph["order"]
    for stage in ("order", "analysis", "costs", "rewrite"):
        assert "graphs" in graph[stage], stage
