"""The import contracts hold: layers point one way (.importlinter, checked by lint-imports) and no
module of shardlm imports itself back through others (a cycle), function-local imports included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Every set of two or more modules that import each other, directly or through others
    (the strongly connected components of the import graph, Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(part) > 1:
                found.append(sorted(part))

    for m in sorted(graph.modules):
        if m not in index:
            visit(m)
    return found


def test_no_import_cycle_and_the_check_sees_one():
    graph = grimp.build_graph("shardlm")
    assert cycles(graph) == []
    graph.add_import(importer="shardlm.parallel.dims", imported="shardlm.engine.engine")  # engine -> ... -> dims
    assert any("shardlm.parallel.dims" in c and "shardlm.engine.engine" in c for c in cycles(graph))


def test_import_contracts_are_kept():
    lint = Path(sys.executable).parent / "lint-imports"
    r = subprocess.run([str(lint), "--config", str(ROOT / ".importlinter")], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 kept, 0 broken" in r.stdout
