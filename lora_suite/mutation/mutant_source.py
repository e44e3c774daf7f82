"""A mutant's source put in place of a module before anything imports it (``lora-suite mutate``).

The mutation run writes each mutant to a file of its own and starts a test process with

    LORA_SUITE_MUTANT_MODULE=<module name>   LORA_SUITE_MUTANT_FILE=<the mutant's file>

and a test process imports ``lora_suite.mutation.child`` first (``PYTEST_ADDOPTS``), which calls
``install_from_env`` before any implementation is imported: a finder at the head
of ``sys.meta_path`` then loads that module name from the mutant's file, wherever it is imported from (a module on
PYTHONPATH such as ``plain_lora``, or a submodule of an installed package such as
``lora_suite.implementations.peft_impl``, whose package imports it by name). A module already imported when the
finder is installed would keep its original code, and the run would judge the unmutated stack: that is an error.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

from lora_suite.mutation.line_trace import start_from_env, with_child_plugin

MODULE_ENV, FILE_ENV = "LORA_SUITE_MUTANT_MODULE", "LORA_SUITE_MUTANT_FILE"


class MutantError(RuntimeError):
    """The mutant cannot replace its module (the message names the module and the file)."""


class MutantFinder(importlib.abc.MetaPathFinder):
    """Finds ``module`` at ``path`` (the mutant), and nothing else."""

    def __init__(self, module: str, path: Path):
        self.module, self.path = module, path

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.module:
            return None
        return importlib.util.spec_from_file_location(fullname, self.path)


def install(module: str, path: str | Path) -> MutantFinder:
    """Put a finder for ``module`` -> ``path`` first on ``sys.meta_path`` (once per module name)."""
    path = Path(path)
    if not path.is_file():
        raise MutantError(f"{FILE_ENV}={path}: no such file (the mutant of {module})")
    if module in sys.modules and getattr(sys.modules[module], "__file__", None) != str(path):
        raise MutantError(
            f"{MODULE_ENV}={module}: the module was imported before its mutant could replace it; the run would judge "
            "the original source"
        )
    for finder in sys.meta_path:
        if isinstance(finder, MutantFinder) and finder.module == module:
            return finder
    finder = MutantFinder(module, path)
    sys.meta_path.insert(0, finder)
    return finder


def install_from_env(environ=None) -> MutantFinder | None:
    """``install`` from the two environment variables; None (nothing done) where neither is set. A line trace the
    environment asks for (``lora_suite.mutation.line_trace``: the source's own run) starts first."""
    env = os.environ if environ is None else environ
    start_from_env(env)
    module, path = env.get(MODULE_ENV), env.get(FILE_ENV)
    if not module and not path:
        return None
    if not module or not path:
        raise MutantError(f"{MODULE_ENV} and {FILE_ENV} go together; got {MODULE_ENV}={module!r}, {FILE_ENV}={path!r}")
    return install(module, path)


def mutant_env(module: str, path: str | Path) -> dict[str, str]:
    """The environment variables that make a test process load ``module`` from ``path``."""
    return with_child_plugin({MODULE_ENV: module, FILE_ENV: str(path)})


def fingerprint_command(python: str, spec: str, device: str) -> list[str]:
    """The command that prints the fingerprint of implementation ``spec`` (a mutant in the environment replaces its
    module first: ``python -c``, which no pytest plugin precedes)."""
    code = (
        "from lora_suite.mutation.mutant_source import install_from_env; install_from_env(); "
        "from lora_suite.engine.fingerprint import main; main()"
    )
    return [python, "-c", code, spec, device]
