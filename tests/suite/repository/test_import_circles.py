"""No import circle in the two packages (issue 58): the graph of every import between their modules (at the top of
a file, inside a function, or for type checking only: each is a dependency a reader has to follow) has no cycle.
Two modules that need each other's names share a third that both import (``report_records``, ``history_data``,
``ledger_rows``, ``example_plant_base``), or one of them states what it needs as a Protocol (``layer.FusedGroup``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("lora_core", "lora_suite")


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of the two packages under ``root`` (a package by its ``__init__``)."""
    out = {}
    for pkg in PACKAGES:
        for path in (root / pkg).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``path`` (module ``name``) imports, anywhere in the file."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                full = f"{mod}.{a.name}"
                found.add(full if full in known else mod)
    return {m for m in found if m in known and m != name}


def circles(root: Path) -> list[list[str]]:
    """The import circles among the two packages' modules: each strongly connected component of more than one
    module (Tarjan's algorithm), sorted."""
    known = modules(root)
    graph = {m: _imported(m, p, known) for m, p in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_packages_have_no_import_circle():
    assert circles(ROOT) == []


def test_a_circle_is_found_whether_the_import_is_lazy_or_for_types(tmp_path):
    results = tmp_path / "lora_suite" / "results"
    results.mkdir(parents=True)
    (tmp_path / "lora_core").mkdir()
    (tmp_path / "lora_suite" / "__init__.py").write_text("")
    (results / "__init__.py").write_text("")
    (results / "a.py").write_text("def f():\n    from lora_suite.results import b\n")
    (results / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n")
    (results / "c.py").write_text("from lora_suite.results.a import f\n")  # one way only: no circle
    assert circles(tmp_path) == [["lora_suite.results.a", "lora_suite.results.b"]]
