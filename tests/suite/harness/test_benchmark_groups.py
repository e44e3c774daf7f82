"""pytest-benchmark rows carry their group: `benchmark.group` must be set before `pedantic()` makes the row.

Issue 8: every row of benchmark.json had `group: null` because the group was set after `pedantic()`.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
BENCH_FILES = sorted((Path(__file__).resolve().parents[3] / "benchmarks").glob("test_*.py"))


@pytest.mark.parametrize("path", BENCH_FILES, ids=[p.name for p in BENCH_FILES])
def test_every_benchmark_sets_its_group_before_pedantic(path):
    tree = ast.parse(path.read_text())
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        pedantic = [n.lineno for n in ast.walk(fn) if isinstance(n, ast.Attribute) and n.attr == "pedantic"]
        if not pedantic:
            continue
        group = [
            n.lineno
            for n in ast.walk(fn)
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "group" for t in n.targets)
        ]
        assert group and min(group) < min(pedantic), f"{path.name}::{fn.name} sets no group before pedantic()"


@pytest.mark.parametrize("order,expected", [("before", "g"), ("after", None)])
def test_pytest_benchmark_reads_the_group_when_pedantic_runs(pytester, order, expected):
    set_group = "    benchmark.group = 'g'\n"
    run = "    benchmark.pedantic(lambda: None, rounds=2, iterations=1)\n"
    body = set_group + run if order == "before" else run + set_group
    pytester.makepyfile(test_b="def test_b(benchmark):\n" + body)
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "--benchmark-json=out.json")
    rows = json.loads((pytester.path / "out.json").read_text())["benchmarks"]
    assert rows[0]["group"] == expected
