"""The run report survives failure: full failure messages, Ctrl-C, SIGTERM, a killed process, permissions.

Each test runs a small pytest session in a temporary directory with the repository's root conftest (the
suite's pytest plumbing) copied in, and reads the report.json it leaves.
"""

from __future__ import annotations

import json
import os
import stat
import textwrap
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
ROOT_CONFTEST = Path(__file__).resolve().parents[3] / "conftest.py"


def _with_repo_on_path(monkeypatch):
    """Sessions run in a subprocess: the repository's packages must be importable there."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT_CONFTEST.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture
def session(pytester, monkeypatch):
    _with_repo_on_path(monkeypatch)
    pytester.makeconftest(ROOT_CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    gpu: gpu\n")

    def run(body: str, *args):
        pytester.makepyfile(test_sample=textwrap.dedent(body))
        result = pytester.runpytest_subprocess("--report-dir", "out", "-p", "no:cacheprovider", *args)
        path = pytester.path / "out" / "report.json"
        return result, (json.loads(path.read_text()) if path.exists() else None), pytester.path / "out"

    return run


def test_failure_reason_keeps_the_whole_assertion_message(session):
    result, report, _ = session("""
        def test_a():
            assert False, "adapters beyond tolerance: " + "; ".join(f"layer{i}.lora_A err 0.9" for i in range(40))
    """)
    assert result.ret == 1
    (outcome,) = report["outcomes"]
    assert "layer39.lora_A err 0.9" in outcome["reason"], "the message was cut"
    assert "test_sample.py:" in outcome["location"]
    assert report["status"] == "complete" and report["schema_version"] == 5


def test_ctrl_c_marks_the_report_interrupted(session):
    result, report, out = session("""
        def test_first():
            pass
        def test_second():
            raise KeyboardInterrupt
        def test_never():
            pass
    """)
    assert result.ret == 2
    assert report["status"] == "interrupted"
    assert [o["outcome"] for o in report["outcomes"]] == ["passed"]
    assert "did not finish: status `interrupted`" in (out / "report.md").read_text()


@pytest.mark.parametrize(
    "how, status",
    [("SIGTERM", "terminated"), ("SIGKILL", "running")],
    ids=["SIGTERM writes the report, status terminated", "SIGKILL leaves report.json of what ran"],
)
def test_a_killed_session_leaves_the_report_of_what_ran(session, how, status):
    """SIGTERM (a CI timeout) is caught: the report is written, report.md too. SIGKILL (the OOM killer) is not: the
    report.json written after each test stays, status running."""
    result, report, out = session(f"""
        import os, signal
        def test_first():
            pass
        def test_killed():
            os.kill(os.getpid(), signal.{how})
    """)
    assert report is not None, f"no report after {how}"
    assert report["status"] == status
    assert [(o["test"].split("::")[-1], o["outcome"]) for o in report["outcomes"]][:1] == [("test_first", "passed")]
    if how == "SIGTERM":
        assert (out / "report.md").exists()
    else:
        assert len(report["outcomes"]) == 1


@pytest.mark.parametrize("how, status", [("SIGTERM", "terminated"), ("SIGINT", "interrupted")])
def test_a_bench_stopped_by_a_signal_keeps_the_rows_it_measured(session, how, status):
    """Issue 20: a real signal while a pedantic benchmark runs (the training bench's rounds=1 runs) used to end
    in pytest-benchmark's ``min() iterable argument is empty`` while it saved its JSON, losing every row. The
    unfinished benchmark is dropped (and named in the notes); the finished one stays in benchmark.json and the
    report keeps its rows."""
    result, report, out = session(
        f"""
        import os, signal, time
        def test_measured(benchmark, run_report):
            benchmark.pedantic(lambda: sum(range(1000)), rounds=3, iterations=1)
            run_report.add_row("benchmarks", "rows", ("case", "ms"), ("measured", 1.5))
        def test_stopped(benchmark, run_report):
            def run():
                os.kill(os.getpid(), signal.{how})
                time.sleep(5)
            benchmark.pedantic(run, rounds=1, iterations=1)
            run_report.add_row("benchmarks", "rows", ("case", "ms"), ("stopped", 9.9))
    """,
        "--benchmark-json=out/benchmark.json",
    )
    assert "min() iterable argument is empty" not in result.stdout.str() + result.stderr.str()
    assert "Traceback" not in result.stderr.str()
    assert report["status"] == status
    assert [r for s in report["series"] for r in s["rows"]] == [["measured", 1.5]]
    assert any("test_stopped" in n and "no figures" in n for n in report["notes"])
    saved = json.loads((out / "benchmark.json").read_text())
    assert [b["name"] for b in saved["benchmarks"]] == ["test_measured"]
    assert "stopped before its first round finished" in (out / "report.md").read_text()


def test_report_files_are_readable_by_others(session):
    old = os.umask(0o022)
    try:
        _, _, out = session("def test_a():\n    pass\n")
    finally:
        os.umask(old)
    for name in ("report.json", "report.md"):
        mode = stat.S_IMODE((out / name).stat().st_mode)
        assert mode == 0o644, f"{name} has mode {oct(mode)}, expected 0o644 (mkstemp makes 0600)"


def test_an_unwritable_report_dir_stops_before_any_test(pytester, tmp_path, monkeypatch):
    _with_repo_on_path(monkeypatch)
    pytester.makeconftest(ROOT_CONFTEST.read_text())
    pytester.makepyfile(test_sample="def test_a():\n    raise SystemExit('must not run')\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = pytester.runpytest_subprocess(f"--report-dir={blocker}/sub", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--report-dir*not a writable directory*"])


def test_progress_lines_show_up_while_a_test_runs(pytester, monkeypatch):
    """The full tier ran 396 s without a line: progress is written past pytest's capture, at most every 10 s."""
    _with_repo_on_path(monkeypatch)
    monkeypatch.setenv("LORA_SUITE_PROGRESS_INTERVAL_S", "0")
    pytester.makeconftest(ROOT_CONFTEST.read_text())
    pytester.makepyfile(
        test_progress="""
        import logging
        def test_long():
            log = logging.getLogger("lora_suite.engine.trainer")
            for step in range(3):
                log.info("step %d/3 loss 1.0 eta 0m0%ds", step + 1, 3 - step)
    """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*[[]trainer[]] step 3/3 loss 1.0 eta 0m01s*"])


def test_every_check_is_recorded_and_a_failed_one_fails_the_test_at_its_line(session):
    result, report, _ = session("""
        def test_a(check):
            check("first", 1.0, "<=", 0.5, source="yaml")
            check("second", 2, "==", 2)
            check("third", 3.0, "<", 1.0, detail="why")
    """)
    assert result.ret == 1
    assert [(c["name"], c["passed"]) for c in report["checks"]] == [
        ("first", False),
        ("second", True),
        ("third", False),
    ]
    (outcome,) = report["outcomes"]
    assert outcome["outcome"] == "failed"
    assert "2 check(s) failed" in outcome["reason"]
    assert "test_sample.py:2: first: 1.0 is not <= 0.5" in outcome["reason"]
    assert "test_sample.py:4: third: 3.0 is not < 1.0 (why)" in outcome["reason"]
    assert outcome["location"] == "test_sample.py:2"


def test_lora_impl_names_the_implementation_and_its_not_applicable_tests(session, pytester):
    pytester.makepyfile(
        toy_impl="""
        from lora_suite.implementations import LoRAImplementation

        class Toy(LoRAImplementation):
            name = expected_path = "toy"
            not_applicable = {"lora_core_ops": "the toy does not use lora_core"}
            inject = adapter_parameters = save_adapter = load_adapter = served_by = lambda self, *a: None

        def make():
            return Toy()
    """
    )
    result, report, _ = session(
        """
        import pytest

        @pytest.mark.needs_feature("lora_core_ops")
        def test_kernels():
            raise AssertionError("must not run")

        def test_model(lora_impl, check):
            check.not_applicable("op calls", lora_impl.not_applicable["lora_core_ops"])
    """,
        "--lora-impl",
        "toy_impl:make",
        "-p",
        "no:randomly",
    )
    assert result.ret == 0, result.stdout.str()
    assert report["implementation"]["name"] == "toy" and report["implementation"]["spec"] == "toy_impl:make"
    outcomes = {o["test"].split("::")[1]: o for o in report["outcomes"]}
    assert outcomes["test_kernels"]["outcome"] == "skipped"
    assert "not applicable to --lora-impl toy: the toy does not use lora_core" in outcomes["test_kernels"]["reason"]
    # a needs_feature module is one record (the module, how many of its tests), a check's own is its test's
    module, check = report["not_applicable"]
    assert "::" not in module["test"] and module["test"].endswith(".py")
    assert (check["test"].split("::")[-1], module["reason"], check["reason"]) == (
        "test_model",
        "the toy does not use lora_core",
        "the toy does not use lora_core",
    )
    assert report["not_applicable"][0]["name"].startswith("every check of the 1 test(s) of 1 module(s)")
    assert report["summary"]["checks_not_applicable"] == 2


def test_an_unknown_lora_impl_is_a_usage_error_naming_it(session):
    result, report, _ = session("def test_a():\n    pass\n", "--lora-impl", "triton")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--lora-impl triton: LoRA implementation 'triton' is not known" in result.stderr.str()


@pytest.mark.parametrize("who", ["controller", "controller and worker"])
def test_sigterm_over_workers_ends_quietly_with_the_report(session, who):
    """Issue 56: a run spread over pytest-xdist workers (quick's default on a GPU) stopped by SIGTERM, to the
    controlling process alone (a job's timeout) or to the workers too (a process group's): the report reads
    terminated, and no traceback reaches the console."""
    pytest.importorskip("xdist")
    also_self = "os.kill(os.getpid(), signal.SIGTERM)" if who == "controller and worker" else "pass"
    result, report, out = session(
        f"""
        import os, signal, time
        def test_first():
            pass
        def test_stops_the_run():
            os.kill(os.getppid(), signal.SIGTERM)
            {also_self}
            time.sleep(4)
        def test_other():
            time.sleep(4)
    """,
        "-n",
        "2",
    )
    console = result.stdout.str() + result.stderr.str()
    assert "Traceback" not in console and "During handling" not in console, console[-3000:]
    assert report is not None and report["status"] == "terminated", console[-2000:]
    assert report["verdict"]["result"] == "TERMINATED"


LOG_CALLS = {
    "exc_info": 'logging.getLogger("somelib").warning("fused op unavailable, falling back", exc_info=True)',
    # what the H200 run kept: the exception as one of four arguments of the message (record.args)
    "argument": 'logging.getLogger("somelib").warning("%s %s: %s (%r)", "fused", "op", exc, model)',
}


@pytest.mark.parametrize("how", sorted(LOG_CALLS))
def test_a_logged_exception_does_not_keep_what_its_frames_held(session, how):
    """Issue 56, item 5: a model built, an exception caught and logged inside a call that held it (with ``exc_info``,
    or as an argument of the message), the model dropped: with pytest's log capture on it is freed at once (the
    message and traceback are kept as text), and the log still shows them."""
    result, report, out = session(
        """
        import gc, logging, weakref

        class Model:
            def __repr__(self):
                return "Model()"

        def build_and_fall_back():
            model = Model()
            try:
                raise ImportError("cannot import name 'tanh' from 'triton.language.math'")
            except ImportError as exc:
                LOG_CALL
            return weakref.ref(model)

        def test_the_model_is_freed(caplog):
            ref = build_and_fall_back()
            gc.collect()
            assert ref() is None, "a captured log record keeps the model alive"
            (record,) = caplog.records
            assert "cannot import name 'tanh'" in caplog.text and record.exc_info is None and not record.args

        def test_the_report_section_still_shows_the_traceback():
            build_and_fall_back()
            assert False
    """.replace("LOG_CALL", LOG_CALLS[how])
    )
    result.assert_outcomes(passed=1, failed=1)
    shown = {"exc_info": "ImportError: cannot import name 'tanh'", "argument": "fused op: cannot import name 'tanh'"}
    assert shown[how] in result.stdout.str()


@pytest.mark.parametrize("fail_from", [1, 3], ids=["every write after collection", "the disk fills mid-run"])
def test_a_full_disk_ends_the_run_failed_saying_why_never_internalerror(session, fail_from):
    """Every write of the report from the ``fail_from``-th on refused with ENOSPC (a full filesystem)."""
    result, _, _ = session(
        f"""
        import errno
        import pytest
        from lora_suite.harness import report

        calls = [0]
        real = report.atomic_write_text

        def full(path, text):
            calls[0] += 1
            if calls[0] >= {fail_from}:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            real(path, text)

        report.atomic_write_text = full

        def test_a():
            pass

        def test_b():
            pass
        """
    )
    out = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in out and "Traceback" not in out, out[-3000:]
    assert result.ret == 1, out[-3000:]
    assert "the run report was not written to" in out and "No space left on device" in out
