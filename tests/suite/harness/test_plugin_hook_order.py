"""The plugin's hook order is stated on its hooks (``tryfirst``, ``trylast``, wrappers), never by the order of
``pytest_plugins`` in ``lora_suite/harness/pytest_plugin.py``; and the session's state is its config's, never a
module's (``lora_suite/harness/plugin/state.py``)."""

from __future__ import annotations

import importlib
import json
import os
import textwrap
from itertools import combinations
from pathlib import Path

import pytest

from lora_suite.harness import pytest_plugin
from lora_suite.harness.plugin.outcomes import PhaseRecords
from lora_suite.harness.plugin.state import STATE_KEY, session_state

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[3]
MODULES = tuple(pytest_plugin.pytest_plugins)
# (hook, module called first, module called after it): what one module's hook needs of another's
NEEDS = (
    ("pytest_configure", "run_report", "selection"),  # the "configured" moment, the report, before the markers
    ("pytest_configure", "run_report", "outcomes"),
    ("pytest_configure", "run_report", "log_frames"),
    ("pytest_runtest_call", "outcomes", "oom_retry"),  # outcomes' wrapper fails the test after oom_retry's call
)
# modules whose hooks of one name need nothing of each other: pytest may call them in either order
INDEPENDENT = {"pytest_configure": {frozenset({"selection", "outcomes"})}}


def call_order(modules: tuple[str, ...]) -> dict[str, list[str]]:
    """Hook -> the plugin modules whose implementations pytest calls, in the order it calls them, when the modules
    are registered in the order of ``modules`` (pluggy calls its list of implementations from the end)."""
    pm = pytest.PytestPluginManager()
    for name in modules:
        pm.register(importlib.import_module(name), name)
    order = {}
    for hook in dir(pm.hook):
        impls = (
            [i for i in getattr(pm.hook, hook).get_hookimpls() if i.plugin_name in modules] if hook[0] != "_" else []
        )
        if impls:
            order[hook] = [i.plugin_name.rsplit(".", 1)[-1] for i in reversed(impls)]
    return order


@pytest.mark.parametrize("modules", [MODULES, MODULES[::-1]], ids=["as listed", "reversed"])
def test_each_hook_that_needs_another_runs_after_it_whatever_the_list_order(modules):
    order = call_order(modules)
    for hook, first, then in NEEDS:
        assert order[hook].index(first) < order[hook].index(then), f"{hook}: {order[hook]}"


def test_reversing_the_list_reorders_only_hooks_that_need_nothing_of_each_other():
    listed, reversed_ = call_order(MODULES), call_order(MODULES[::-1])
    assert listed.keys() == reversed_.keys()
    for hook, calls in listed.items():
        flipped = {
            frozenset(pair)
            for pair in combinations(calls, 2)
            if reversed_[hook].index(pair[0]) > reversed_[hook].index(pair[1])
        }
        assert flipped <= INDEPENDENT.get(hook, set()), f"{hook}: {calls} as listed, {reversed_[hook]} reversed"


def test_a_session_with_the_list_reversed_writes_the_same_report(pytester, monkeypatch):
    """A whole session with the modules registered in reverse: a failed check fails its test (outcomes' wrapper
    around the call), every phase is recorded (``PhaseRecords``), the report completes."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    pytester.makeconftest(f"pytest_plugins = {list(MODULES[::-1])!r}\n")
    pytester.makeini("[pytest]\nmarkers =\n    gpu: gpu\n")
    pytester.makepyfile(
        test_sample=textwrap.dedent("""
            def test_passes(check):
                check("a", 1.0, "<=", 2.0)
            def test_fails(check):
                check("b", 3.0, "<=", 2.0)
        """)
    )
    result = pytester.runpytest_subprocess("--report-dir", "out", "-p", "no:cacheprovider")
    report = json.loads((pytester.path / "out" / "report.json").read_text())
    assert result.ret == 1, result.stdout.str()
    assert report["status"] == "complete"
    assert [(o["test"].split("::")[-1], o["outcome"]) for o in report["outcomes"]] == [
        ("test_passes", "passed"),
        ("test_fails", "failed"),
    ]
    assert [(c["name"], c["passed"]) for c in report["checks"]] == [("a", True), ("b", False)]


def test_a_session_inside_a_session_keeps_its_own_state(pytester, request):
    """pytester's in-process run is a second session in this process: it leaves this session's state alone (a
    module-level record of the run would have been overwritten by the inner session's)."""
    outer = session_state(request.config)
    report, start, outcomes = outer.report, outer.start, len(outer.report.outcomes) if outer.report else 0
    pytester.makeconftest('pytest_plugins = ("lora_suite.harness.pytest_plugin",)\n')
    pytester.makeini("[pytest]\nmarkers =\n    gpu: gpu\n")
    pytester.makepyfile(test_inner="def test_inner(run_report):\n    assert run_report.outcomes == []\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert request.config.stash[STATE_KEY] is outer
    assert (outer.report, outer.start) == (report, start)
    assert outer.report is None or len(outer.report.outcomes) == outcomes
    recorders = [p for p in request.config.pluginmanager.get_plugins() if isinstance(p, PhaseRecords)]
    assert [r.state for r in recorders] == [outer], "one phase recorder, with this session's state"
