"""``lora_suite.mutation.child``: a pytest process started with a mutant's environment imports the mutant, even where
a ``conftest.py`` imports the module under mutation at once, and the harness never imports the mutation package."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from lora_suite.mutation import line_trace, mutant_source

ROOT = Path(__file__).resolve().parents[3]


def _run_pytest(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    (tmp_path / "stack_under_mutation.py").write_text("VALUE = 1\n")
    (tmp_path / "conftest.py").write_text("import stack_under_mutation  # imported before any test\n")
    (tmp_path / "test_value.py").write_text(
        "import stack_under_mutation\n\ndef test_value():\n    assert stack_under_mutation.VALUE == 1\n"
    )
    full = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", str(tmp_path)]
    return subprocess.run(cmd, env=full, cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_a_pytest_child_judges_the_mutant_not_the_original(tmp_path):
    mutant = tmp_path / "mutant.py"
    mutant.write_text("VALUE = 2\n")
    env = mutant_source.mutant_env("stack_under_mutation", mutant)
    assert line_trace.CHILD_PLUGIN_OPTION in env["PYTEST_ADDOPTS"]
    out = _run_pytest(tmp_path, env)
    assert out.returncode == 1 and "assert 2 == 1" in out.stdout, out.stdout + out.stderr


def test_without_the_mutant_the_child_judges_the_original(tmp_path):
    out = _run_pytest(tmp_path, {})
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_caller_s_own_pytest_options_are_kept(monkeypatch):
    monkeypatch.setenv("PYTEST_ADDOPTS", "-x")
    env = line_trace.with_child_plugin({})
    assert env["PYTEST_ADDOPTS"] == f"-x {line_trace.CHILD_PLUGIN_OPTION}"
    monkeypatch.setenv("PYTEST_ADDOPTS", env["PYTEST_ADDOPTS"])
    assert line_trace.with_child_plugin({})["PYTEST_ADDOPTS"] == env["PYTEST_ADDOPTS"]  # never twice


def test_the_harness_imports_nothing_of_mutation_testing():
    found = []
    for path in (ROOT / "lora_suite" / "harness").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}: {n}" for n in names if n.startswith("lora_suite.mutation")]
    assert found == []
