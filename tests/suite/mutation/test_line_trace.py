"""``lora_suite.mutation.line_trace``: the lines a process executes, recorded where the environment asks (in a process of
its own, as a mutation run's source run does), and the statement a line belongs to."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lora_suite.mutation import line_trace as T

ROOT = Path(__file__).resolve().parents[3]
MOD = """\
def f(x):
    if x > 0:
        return x + 1
    y = (x
         - 1)
    return y
"""


def test_a_process_records_the_lines_it_ran_of_the_traced_file_only(tmp_path):
    (tmp_path / "mod.py").write_text(MOD)
    (tmp_path / "other.py").write_text("def g():\n    return 2\n")
    script = "from lora_suite.mutation.line_trace import start_from_env\nstart_from_env()\nimport mod, other\nmod.f(1)\nother.g()\n"
    out = tmp_path / "lines.json"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]), **T.trace_env([tmp_path / "mod.py"], out)
    )
    subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=tmp_path)
    trace = json.loads(out.read_text())
    assert trace["every_thread"] == (sys.version_info >= (3, 12))  # sys.monitoring sees threads Python did not start
    lines = trace["lines"]
    assert list(lines) == [str((tmp_path / "mod.py").resolve())]
    ran = set(next(iter(lines.values())))
    assert {2, 3} <= ran and not ran & {4, 5, 6}


def test_a_line_of_a_statement_that_ran_counts_as_run():
    starts = T.statement_starts(MOD)
    assert starts[5] == 4 and starts[3] == 3 and starts[2] == 2
    assert T.executed(5, {4}, starts)  # the second line of `y = (x - 1)`: its statement ran
    assert not T.executed(3, {2, 4}, starts)


def test_a_trace_without_somewhere_to_write_is_refused():
    with pytest.raises(ValueError, match="LORA_SUITE_TRACE_OUT"):
        T.start_from_env({T.FILES_ENV: "x.py"})
    assert T.start_from_env({}) is None


def test_each_line_names_the_tests_that_ran_it_and_import_time_runs_name_none(tmp_path):
    (tmp_path / "mod.py").write_text(MOD)
    script = (
        "import os\nfrom lora_suite.mutation.line_trace import start_from_env\nstart_from_env()\nimport mod\n"
        "os.environ['PYTEST_CURRENT_TEST'] = 'a.py::t1 (call)'\nmod.f(1)\n"
        "os.environ['PYTEST_CURRENT_TEST'] = 'a.py::t2[x (y)] (setup)'\nmod.f(1)\nmod.f(-1)\n"
    )
    out = tmp_path / "lines.json"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]), **T.trace_env([tmp_path / "mod.py"], out)
    )
    env.pop(T.TEST_ENV, None)
    subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=tmp_path)
    tests = next(iter(json.loads(out.read_text())["tests"].values()))
    starts = T.statement_starts(MOD)
    assert T.tests_of(2, tests, starts) == {"a.py::t1", "a.py::t2[x (y)]"}  # a line two tests ran names both
    assert T.tests_of(4, tests, starts) == {"a.py::t2[x (y)]"} == T.tests_of(5, tests, starts)  # x < 0: t2 only
    assert T.tests_of(1, tests, starts) is None  # `def f` ran at import, outside any test: every test may need it
    assert T.tests_of(7, tests, starts) == set()  # no test ran it
