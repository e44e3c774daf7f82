"""A run report spread over pytest-xdist workers (lora_suite.harness.worker_records), merged in the controller: the
hand-off of changed records by position, and a real ``-n 2`` session whose report holds every worker's records once."""

from __future__ import annotations

import dataclasses
import json
import os
import textwrap
from pathlib import Path

import pytest

from lora_suite.harness.report import RunReport, Series
from lora_suite.harness.worker_records import FIELDS, Inbox, Outbox, merge_variants
from lora_suite.settings.environment import collect_environment

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[3]


def _run():
    return RunReport("r", "quick", collect_environment())


def test_only_new_and_changed_records_are_handed_off():
    worker, out = _run(), Outbox()
    worker.check("t", "a", 1, "==", 1)
    worker.add_row("t", "table", ("x",), (1,))
    first = out.changes(worker)
    assert set(first) == {"environment", "checks", "series"} and first["checks"][0][0] == 0
    assert out.changes(worker) == {}  # nothing new
    worker.add_row("t", "table", ("x",), (2,))  # the table is rewritten in place
    worker.notes.append("n")
    second = out.changes(worker)
    assert [i for i, _ in second["series"]] == [0] and second["series"][0][1]["rows"] == [[1], [2]]
    assert second["notes"] == [(0, "n")]


def test_the_controller_holds_each_record_once_and_replaces_rewritten_ones():
    controller, inbox = _run(), Inbox()
    controller.check("own", "c", 0, "==", 0)
    workers = {w: (_run(), Outbox()) for w in ("gw0", "gw1")}
    for w, (run, out) in workers.items():
        run.check(f"{w}::t", "a", 1, "<=", 2)
        run.add_row(f"{w}::t", f"table {w}", ("x",), (1,))
        inbox.apply(controller, w, out.changes(run))
    for w, (run, out) in workers.items():
        run.add_row(f"{w}::t", f"table {w}", ("x",), (2,))
        run.mark_module_not_applicable("m.py", "feature", "why")
        run.mark_module_not_applicable("m.py", "feature", "why")
        inbox.apply(controller, w, out.changes(run))
    assert [c.test for c in controller.checks] == ["own", "gw0::t", "gw1::t"]
    assert [s.rows for s in controller.series] == [((1,), (2,)), ((1,), (2,))]
    assert all(isinstance(s, Series) and s.columns == ("x",) for s in controller.series)
    assert [n.name for n in controller.not_applicable] == ["every check of the 2 test(s) of this module (feature)"] * 2
    (folded,) = controller.to_dict()["not_applicable"]  # one feature, one reason: one record of the run
    assert (folded["test"], folded["name"]) == ("m.py", "every check of the 4 test(s) of 1 module(s) (feature)")
    assert controller.summary()["checks_passed"] == 3


def test_an_unknown_field_from_a_worker_is_refused_by_name():
    with pytest.raises(ValueError, match="'outcomes'.*expected one of"):
        Inbox().apply(_run(), "gw0", {"outcomes": [(0, {})]})
    assert "outcomes" not in FIELDS  # the controller records outcomes from the test reports themselves


def test_variant_launches_add_up_over_workers():
    merged = merge_variants(
        [[("k", "bf16", "a", 2, [4], [256])], [("k", "bf16", "a", 3, [9], [256]), ("k", "fp32", "b", 1, [1], [32])]]
    )
    assert merged == {("k", "bf16", "a"): (5, (4,), (256,)), ("k", "fp32", "b"): (1, (1,), (32,))}


# what the controlling process had imported when its session ended
CONTROLLER_MODULES = """
import json, sys

def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):
        open("controller_modules.json", "w").write(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in
            ("torch", "transformers", "cupy", "peft"))))
"""


def test_the_environment_is_handed_once_and_the_first_workers_is_kept():
    controller, inbox = _run(), Inbox()
    controller.environment = dataclasses.replace(controller.environment, gpu_name=None, cuda=None, torch="package")
    first, second = _run(), _run()
    first.environment = dataclasses.replace(
        first.environment, gpu_name="GPU of gw1", cuda="13.0", timestamp_utc="a worker's later time"
    )
    second.environment = dataclasses.replace(second.environment, gpu_name="GPU of gw0")
    out1, out0 = Outbox(), Outbox()
    inbox.apply(controller, "gw1", out1.changes(first))
    inbox.apply(controller, "gw0", out0.changes(second))
    started = controller.environment.timestamp_utc
    assert controller.environment == dataclasses.replace(first.environment, timestamp_utc=started)
    assert inbox.environment_from == "gw1"
    first.check("t", "a", 1, "==", 1)
    assert set(out1.changes(first)) == {"checks"}  # once per worker


@pytest.fixture
def two_workers(pytester, monkeypatch):
    """Runs a test file's ``body`` over two xdist workers as lora-suite does; returns (pytest result, report.json)."""
    pytest.importorskip("xdist", reason="pytest-xdist is a declared dependency: pip install pytest-xdist")
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    pytester.makeconftest((ROOT / "conftest.py").read_text() + CONTROLLER_MODULES)
    pytester.makeini("[pytest]\nmarkers =\n    gpu: gpu\n")

    def run(body: str):
        pytester.makepyfile(test_sample=textwrap.dedent(body))
        xdist = ["-p", "xdist.plugin"] if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD") else []
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *xdist, "-n", "2", "--report-dir", "out")
        return result, json.loads((pytester.path / "out" / "report.json").read_text())

    return run


def test_a_session_over_two_workers_writes_one_report_with_every_record(two_workers, pytester):
    result, report = two_workers(
        """
            import os, pytest
            from lora_suite.harness.report import Series

            @pytest.mark.parametrize("i", range(6))
            def test_many(i, check, run_report):
                check(f"case {i}", i, "<", 6, source=os.environ.get("PYTEST_XDIST_WORKER", "none"))
                run_report.add_row("t", "shared table", ("i",), (i,))

            def test_fails(check):
                check("bad", 2, "<=", 1, detail="why")

            @pytest.mark.parametrize("j", range(4))
            def test_launches(j):  # what a worker hands over only when it ends: its RawKernel launches
                from lora_core.ops import kernel_variants as kv

                kv.note("swiglu_forward", "bf16", "VEC=8, I%8=0", (4, 37), (256,))
        """
    )
    assert result.ret == 1, result.stdout.str()
    assert sorted(c["name"] for c in report["checks"]) == ["bad"] + [f"case {i}" for i in range(6)]
    assert {c["source"] for c in report["checks"] if c["name"].startswith("case")} == {"gw0", "gw1"}
    assert len(report["outcomes"]) == 11 and report["summary"]["checks_failed"] == 1
    failed = [o for o in report["outcomes"] if o["outcome"] == "failed"]
    assert len(failed) == 1 and "bad: 2 is not <= 1 (why)" in failed[0]["reason"]
    # each worker's "shared table" arrives as its own table, each row once
    tables = [s for s in report["series"] if s["name"] == "shared table"]
    assert sorted(r[0] for s in tables for r in s["rows"]) == list(range(6))
    assert report["status"] == "complete" and not list((pytester.path / "out").glob("gw*"))
    (swiglu,) = [s for s in report["series"] if s["name"] == "RawKernel variants reached: swiglu_forward"]
    assert ["bf16", "VEC=8, I%8=0", 4, "(4, 37) x (256,)", "yes"] in swiglu["rows"]  # 4 launches over 2 workers
    (breakdown,) = [s for s in report["series"] if s["name"] == "wall-time breakdown"]
    phases = {r[0]: r for r in breakdown["rows"]}  # each worker's timeline arrived: where its own time went
    assert phases["workers' start-up (2)"][1] > 0 and "imports" in phases["workers' start-up (2)"][2]
    assert "11 tests" not in phases["last worker to finish"][2] and " tests " in phases["last worker to finish"][2]


def test_the_controlling_process_imports_no_torch_and_reports_a_workers_environment(two_workers, pytester):
    """The controller runs no test: importing torch there cost 4.1-4.6 s of a fresh GPU runner's quick tier. Its
    report holds the environment a worker read (torch's own version and CUDA build), not the packages' metadata."""
    result, report = two_workers(
        """
            def test_one(check):
                check("one", 1, "==", 1)
        """
    )
    assert result.ret == 0, result.stdout.str()
    assert json.loads((pytester.path / "controller_modules.json").read_text()) == []
    expected = collect_environment()
    assert (report["environment"]["torch"], report["environment"]["cuda"]) == (expected.torch, expected.cuda)
    assert report["environment"]["gpu_name"] == expected.gpu_name
    result.stdout.fnmatch_lines(["*the GPU and CUDA as the workers see them are in the report*"])


def test_a_cuda_error_in_a_worker_stops_every_worker(two_workers):
    """A CUDA error leaves its process's context untrusted: the worker stops (the plugin sets shouldstop) and xdist
    shuts the others down, so the run ends instead of running on; the report says what ran and how it ended."""
    result, report = two_workers(
        """
            import time, pytest

            @pytest.mark.parametrize("i", range(40))
            def test_many(i):
                if i == 0:
                    raise RuntimeError("CUDA error: misaligned address")
                time.sleep(0.1)
        """
    )
    assert result.ret != 0
    failed = [o["test"] for o in report["outcomes"] if o["outcome"] == "failed"]
    assert failed == ["test_sample.py::test_many[0]"]
    assert len(report["outcomes"]) < 40, "the other worker ran on to the end"


def test_module_records_fold_per_feature_and_reason_and_nothing_else():
    from lora_suite.harness.report_records import NotApplicable, folded_not_applicable

    run = _run()
    run.mark_module_not_applicable("a.py", "kernels", "why")
    run.mark_not_applicable("t.py::x", "the probe on a 4-bit base", "no nf4")
    run.mark_module_not_applicable("b.py", "kernels", "why")
    run.mark_module_not_applicable("b.py", "kernels", "why")
    run.mark_module_not_applicable("c.py", "kernels", "another reason")
    run.mark_module_not_applicable("d.py", "graphs", "why")
    got = folded_not_applicable(run.not_applicable)
    assert got == [
        NotApplicable("a.py, b.py", "every check of the 3 test(s) of 2 module(s) (kernels)", "why"),
        NotApplicable("t.py::x", "the probe on a 4-bit base", "no nf4"),
        NotApplicable("c.py", "every check of the 1 test(s) of 1 module(s) (kernels)", "another reason"),
        NotApplicable("d.py", "every check of the 1 test(s) of 1 module(s) (graphs)", "why"),
    ]
    assert folded_not_applicable(got) == got  # a report read back is not folded twice
    assert run.summary()["checks_not_applicable"] == 4


def test_a_record_each_worker_repeats_is_one_row():
    from lora_suite.harness.report_records import NotApplicable, folded_not_applicable

    same = [NotApplicable(f"t{i}.py::x", "bfloat16 base; the tier runs on an NF4 base", "4-bit only") for i in (1, 2)]
    other = NotApplicable("t3.py::y", "bfloat16 base; the tier runs on an NF4 base", "another reason")
    assert folded_not_applicable([*same, other]) == [
        NotApplicable("t1.py::x, t2.py::x", "bfloat16 base; the tier runs on an NF4 base", "4-bit only"),
        other,
    ]
