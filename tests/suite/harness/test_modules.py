"""lora_suite.harness.modules: test modules loaded by path."""

from __future__ import annotations

import sys

import pytest

from lora_suite.harness.modules import load_test_module


def test_a_file_is_executed_as_a_fresh_module_outside_sys_modules(tmp_path):
    path = tmp_path / "test_thing.py"
    path.write_text("VALUE = 41 + 1\n")
    first, second = load_test_module(path, "thing_for_test"), load_test_module(path, "thing_for_test")
    assert first.VALUE == 42 and first is not second and "thing_for_test" not in sys.modules


def test_a_file_that_is_not_python_is_named(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("x")
    with pytest.raises(ImportError, match="notes.txt: not a Python file that can be loaded as module 'n'"):
        load_test_module(path, "n")
