"""Optional dependencies never break collection (issue 20): after a bare ``pip install -e .`` the test modules,
conftests and packages import only the declared dependencies at module level; an extra's package is imported
inside the test or fixture that needs it, or through ``pytest.importorskip`` with the extra to install."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
# Import names of the declared dependencies (pyproject [project] dependencies) and what they bring with them.
DECLARED = {
    "torch": "torch",
    "transformers": "transformers",
    "pyyaml": "yaml",
    "nvidia-ml-py": "pynvml",
    "pytest": "pytest",
    "pytest-benchmark": "pytest_benchmark",
    "safetensors": "safetensors",
    "matplotlib": "matplotlib",
    "filelock": "filelock",
    "pytest-xdist": "xdist",
    "sqlalchemy": "sqlalchemy",
    "plotly": "plotly",
    "hypothesis": "hypothesis",
    "psutil": "psutil",
}
TRANSITIVE = {"numpy", "_pytest"}  # matplotlib requires numpy; _pytest is pytest's own package
OURS = {"lora_core", "lora_suite", "tests", "tiers", "benchmarks", "__future__"}


def _collected_modules() -> list[Path]:
    mods = [p for d in ("lora_core", "lora_suite") for p in (ROOT / d).rglob("*.py")]
    for d in ("tests", "tiers", "benchmarks"):
        mods += [p for p in (ROOT / d).rglob("*.py") if p.name.startswith("test_") or p.name == "conftest.py"]
    return sorted(mods)


def module_level_imports(path: Path) -> list[str]:
    """Top-level package names imported when ``path`` is imported (not inside functions, try blocks or ifs)."""
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names += [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module.split(".")[0])
    return names


def test_the_declared_dependencies_are_the_ones_this_test_allows():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip() for d in deps}
    assert names == set(DECLARED), "pyproject's dependencies changed: update DECLARED here"


@pytest.mark.parametrize("path", _collected_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_module_imports_only_declared_dependencies_at_module_level(path):
    allowed = set(DECLARED.values()) | TRANSITIVE | OURS | set(sys.stdlib_module_names)
    extra = [n for n in module_level_imports(path) if n not in allowed]
    assert not extra, (
        f"{path.relative_to(ROOT)} imports {extra} at module level: an optional extra's package "
        "must be imported where it is used, or via pytest.importorskip naming the extra"
    )


def test_the_scan_sees_a_module_level_import_of_an_extra(tmp_path):
    bad = tmp_path / "test_bad.py"
    bad.write_text("import jsonschema\nimport pytest\n\ndef test_x():\n    import peft\n")
    assert module_level_imports(bad) == ["jsonschema", "pytest"]
