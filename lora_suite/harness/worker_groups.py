"""Which tests share a worker process when a tier is spread over pytest-xdist workers (``--workers N``).

A test that builds a model imports the model code (transformers' Llama, PEFT): 5.9 s of imports a process from cached
bytecode on an H100 runner, 14-15 s without (reports/README.md, issue 34, item 4), paid by every worker that runs one
such test. Tests marked ``model_code`` are therefore dealt into a few groups, each run in one worker, so that the other
workers never import the model code and run the kernel-level tests meanwhile.

``make_scheduler``: the scheduler of ``--dist loadgroup`` runs (the suite's command line passes it): xdist's
``LoadGroupScheduling`` (a group is one work unit, the largest units are sent first, the others one at a time to
whichever worker is nearly out of work), with the ``model_code`` tests as groups too. The controlling process does not
collect, so it reads the marker from the test files' source (``marked``): a module's ``pytestmark`` or a test
function's decorators. (xdist's own ``xdist_group`` marks still group where the pytest in use lets xdist rename the
node ids: pytest 9.2 does not.)

``groups_for(workers)``: 3 of 8 workers (at least 1) build models, side by side; the marked tests are dealt
round-robin in collection order.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

MARK = "model_code"
DESCRIPTION = (
    f"{MARK}: the test imports the model code (transformers, PEFT); over workers such tests share a few processes "
    "(lora_suite.harness.worker_groups)"
)


def groups_for(workers: int) -> int:
    return max(1, round(workers * 3 / 8))


@functools.cache
def marked(path: Path) -> tuple[bool, frozenset[str]]:
    """(whether the module's ``pytestmark`` names ``MARK``, the test functions whose decorators do) of a test file;
    (False, {}) for a file that cannot be read or parsed (its tests are not grouped)."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return False, frozenset()
    module = any(
        isinstance(n, ast.Assign)
        and any(getattr(t, "id", None) == "pytestmark" for t in n.targets)
        and MARK in ast.unparse(n.value)
        for n in tree.body
    )
    functions = frozenset(
        n.name
        for n in tree.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        and any(MARK in ast.unparse(d) for d in n.decorator_list)
    )
    return module, functions


def is_marked(nodeid: str, root: Path) -> bool:
    """Whether the test ``nodeid`` (``file.py::test_name[params]``, relative to ``root``) carries ``MARK``."""
    file, _, rest = nodeid.partition("::")
    if not rest or not file.endswith(".py"):
        return False
    module, functions = marked(root / file)
    return module or rest.split("::")[0].split("[")[0] in functions


def make_scheduler(config, log):
    """xdist's LoadGroupScheduling with the ``model_code`` tests dealt into ``groups_for(workers)`` groups."""
    from xdist.scheduler import LoadGroupScheduling

    class ModelCodeScheduling(LoadGroupScheduling):
        def __init__(self, config, log=None) -> None:
            super().__init__(config, log)
            self._root = Path(config.rootpath)
            self._groups: dict[str, str] = {}  # test id -> its group's name

        def _split_scope(self, nodeid: str) -> str:  # asked again for each test as it completes: the same answer
            if nodeid.rfind("@") > nodeid.rfind("]") or not is_marked(nodeid, self._root):
                return super()._split_scope(nodeid)
            if nodeid not in self._groups:
                self._groups[nodeid] = f"{MARK}-{len(self._groups) % groups_for(self.numnodes)}"
            return self._groups[nodeid]

    return ModelCodeScheduling(config, log)
