"""No module of ``multi_tensor`` or ``fused_optim`` takes part in an import cycle.

``lint-imports`` (.ci/run; the contracts in pyproject.toml) checks the layering and that no
sibling modules or subpackages import each other in a circle. This checks the modules
themselves on the same graph (grimp's, which import-linter builds on; imports inside functions
count): for every import ``a -> b``, no chain leads from ``b`` back to ``a``.
"""
from __future__ import annotations

import pytest

grimp = pytest.importorskip("grimp")


def cycles(graph) -> list:
    """Each import that closes a cycle, as the chain ``a -> b -> ... -> a``."""
    found = []
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            chain = graph.find_shortest_chain(imported, module)
            if chain:
                found.append(" -> ".join((module,) + tuple(chain)))
    return found


def test_no_module_is_in_an_import_cycle():
    graph = grimp.build_graph("multi_tensor", "fused_optim", cache_dir=None)
    assert "multi_tensor.backends.contract" in graph.modules
    assert cycles(graph) == []


def test_a_cycle_is_reported():
    graph = grimp.ImportGraph()
    for module in ("pkg", "pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(module)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.c")
    graph.add_import(importer="pkg.c", imported="pkg.a")
    assert cycles(graph) == ["pkg.a -> pkg.b -> pkg.c -> pkg.a", "pkg.b -> pkg.c -> pkg.a -> pkg.b",
                             "pkg.c -> pkg.a -> pkg.b -> pkg.c"]
