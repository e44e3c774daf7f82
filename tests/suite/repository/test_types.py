"""The type check (issue 46): mypy, configured in pyproject.toml ([tool.mypy]), finds no error in the system under
test (``lora_core``) or the suite (``lora_suite``, every layer: settings to cli, its tiers and benchmarks included).
Without mypy the check skips, saying so, unless ``LORA_SUITE_REQUIRE_TYPES=1``, which makes a missing mypy a failure.
How an error may be silenced where the types cannot say a correct thing: tests/suite/repository/test_type_ignores.py.

The first run on a machine takes ~80 s (mypy reads torch's inline types); later runs reuse ``.mypy_cache``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CHECKED = ("lora_core", "lora_suite")


def _require_mypy() -> None:
    if importlib.util.find_spec("mypy") is None:
        if os.environ.get("LORA_SUITE_REQUIRE_TYPES") == "1":
            pytest.fail("LORA_SUITE_REQUIRE_TYPES=1 and mypy is not installed (pip install -e '.[test]')")
        pytest.skip("mypy is not installed (the test extra): lora_core and lora_suite are not type-checked")


def test_lora_core_and_lora_suite_type_check():
    _require_mypy()
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *CHECKED]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"mypy {' '.join(CHECKED)} exited {out.returncode}:\n{out.stdout}{out.stderr}"
