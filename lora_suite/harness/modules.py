"""Test modules loaded by path: the tiers' and benchmarks' test files are not a package, and the planted-defect
self-tests and the CPU tests reuse their helpers (``load_test_module(path, name)``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def load_test_module(path: str | Path, name: str) -> ModuleType:
    """Execute the file at ``path`` as a fresh module called ``name`` (not entered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, Path(path))
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not a Python file that can be loaded as module {name!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
