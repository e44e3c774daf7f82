"""The suite's pytest plugin: options, the implementation under test, checks, GPU skips, CUDA-error stop,
seeding, cleanup and the run report. The repository's root ``conftest.py`` only loads it.

Options: ``harness/options.py``. Tests that need a GPU carry the ``gpu`` marker and skip with a reason when torch
sees no CUDA device (a run that judged nothing says so). A CUDA error (illegal address, device-side assert, a failed
cuBLAS call) leaves the CUDA context unusable: the session stops there instead of failing every later test.

Checks: a test records every criterion with the ``check`` fixture, ``check(name, value, op, threshold,
unit=, source=, detail=)``. Every check is recorded in the report, also after one has failed; a test with a
failed check fails when it ends, with each failed check and the line of the test that made it. A check the
implementation under test cannot take by design is recorded with ``check.not_applicable(name, reason)``;
a test that only makes sense with a feature carries ``@pytest.mark.needs_feature("<feature>")`` and is
recorded as not applicable (and skipped) when the implementation declares the feature unavailable.
"""

from __future__ import annotations

from lora_suite.core.mutant_source import install_from_env

install_from_env()  # lora-suite mutate: a mutant's file replaces its module before any implementation is imported
import dataclasses
import datetime as dt
import gc
import logging
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest

from lora_suite.core.environment import collect_environment, package_environment
from lora_suite.core.registry import registry
from lora_suite.harness import session_tables, worker_groups, worker_records
from lora_suite.harness.checks import Checker, CheckFailed, failure_text
from lora_suite.harness.cuda_errors import is_cuda_error
from lora_suite.harness.header import header_lines
from lora_suite.harness.options import (
    check_report_dir,
    pytest_addoption,  # noqa: F401  (a hook: pytest finds it here)
)
from lora_suite.harness.progress import ProgressLines
from lora_suite.harness.report import Outcome, RunReport
from lora_suite.implementations import (
    DEFAULT,
    FEATURES,
    ImplementationError,
    LoRAImplementation,
    implementation_record,
    resolve_implementation,
)
from lora_suite.measure import wall_time

_REPORT_KEY = pytest.StashKey[RunReport]()
_SUMMARY_KEY = pytest.StashKey[list]()  # lines for the terminal summary (report path, wall-time failure)
_IMPL_KEY = pytest.StashKey[LoRAImplementation]()
_FAILED_KEY = pytest.StashKey[list]()  # a test's failed checks: (check, "file:line")
# (test module, feature) -> (its not-applicable record, tests covered)
_NA_MODULES_KEY = pytest.StashKey[dict]()


class Terminated(KeyboardInterrupt):
    """SIGTERM (a CI job's timeout, a scheduler) turned into pytest's own interruption path, so that the
    session finishes its hooks and the run report is written with status ``terminated``."""


def _on_sigterm(signum, frame):
    _RUN["terminated"] = True
    raise Terminated(f"received signal {signum} (SIGTERM)")


def pytest_configure(config):
    _RUN["configured"] = time.time()
    config.addinivalue_line(
        "markers",
        "needs_feature(name): needs a feature of the LoRA implementation under test "
        "(lora_suite.implementations.FEATURES); not applicable where it declares it unavailable",
    )
    config.addinivalue_line("markers", worker_groups.DESCRIPTION)
    for tier in _tiers().values():  # the tier registry's markers: a new tier needs no edit of any Python or ini
        config.addinivalue_line("markers", f"{tier.marker}: {tier.entry.description}")
    selection = config.getoption("markexpr") or "all"
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    run_id = os.environ.get("LORA_SUITE_RUN_ID") or f"{now}-{re.sub(r'[^A-Za-z0-9]+', '_', selection)}"
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", run_id):
        raise pytest.UsageError(f"LORA_SUITE_RUN_ID must be a folder name (letters, digits, _ . -), got {run_id!r}")
    # the controlling process of workers imports no torch (4.1-4.6 s of a fresh runner): its report takes the first
    # worker's environment (harness/worker_records.py); every test process reads its own
    environment = package_environment() if _drives_workers(config) else collect_environment()
    config.stash[_REPORT_KEY] = report = RunReport(run_id=run_id, selection=selection, environment=environment)
    spec = config.getoption("lora_impl") or DEFAULT
    try:
        impl = resolve_implementation(spec)
        if not _drives_workers(config):  # a process that runs tests
            start = time.perf_counter()
            impl.preload()
            _RUN["preload_s"] = time.perf_counter() - start
    except Exception as exc:  # an ImplementationError, or what the user's preload raised: a usage error, one line
        why = exc if isinstance(exc, ImplementationError) else repr(exc)
        raise pytest.UsageError(f"--lora-impl {spec}: {why}") from None
    config.stash[_IMPL_KEY] = impl
    report.implementation = implementation_record(impl, spec)
    if config.getoption("report_dir"):
        check_report_dir(config.getoption("report_dir"))
    if _is_worker(config):  # an xdist worker: hands its records to the controller, which alone writes the report
        _RUN["outbox"] = worker_records.Outbox()
    else:  # the controlling process
        signal.signal(signal.SIGTERM, _on_sigterm)
        _RUN["inbox"], _RUN["worker_outputs"] = worker_records.Inbox(), []
    if not config.getini("log_cli") and not config.getoption("log_cli_level", None):
        handler = ProgressLines(config)
        logger = logging.getLogger("lora_suite")  # the trainer logs as lora_suite.engine.trainer
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        config.add_cleanup(lambda: logger.removeHandler(handler))


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def _drives_workers(config) -> bool:
    """The controlling process of a run spread over pytest-xdist workers (``-n N``): it runs no test itself."""
    return not _is_worker(config) and bool(getattr(config.option, "numprocesses", None))


def pytest_report_header(config):
    env, impl = config.stash[_REPORT_KEY].environment, config.stash[_IMPL_KEY]
    return header_lines(env, impl.describe(), drives_workers=_drives_workers(config))


def _tiers() -> dict:
    if "tiers" not in _RUN:
        _RUN["tiers"] = registry()
    return _RUN["tiers"]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` (lora-suite's workers): the tests that import the model code share a few workers."""
    return worker_groups.make_scheduler(config, log) if config.getoption("dist") == "loadgroup" else None


def pytest_collection_modifyitems(config, items):
    """Every test in a registered tier's folder carries the tier's marker (and ``gpu``); GPU tests skip without one."""
    folders = {t.tests_dir.resolve(): t.marker for t in _tiers().values()}
    for item in items:
        marker = folders.get(Path(item.path).resolve().parent)
        if marker and item.get_closest_marker(marker) is None:
            item.add_marker(getattr(pytest.mark, marker))
            item.add_marker(pytest.mark.gpu)
    import torch  # a process that collects runs tests: torch is its own import

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: none found (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item):
    """A test marked ``needs_feature(f)`` is not applicable to an implementation that declares f unavailable."""
    impl = item.config.stash[_IMPL_KEY]
    for mark in item.iter_markers("needs_feature"):
        feature = mark.args[0]
        if feature not in FEATURES:
            raise pytest.UsageError(f"{item.nodeid}: needs_feature({feature!r}) is not one of {sorted(FEATURES)}")
        reason = impl.reason_not_applicable(feature)
        if reason:
            module = item.nodeid.split("::", 1)[0]
            item.config.stash[_REPORT_KEY].mark_module_not_applicable(module, FEATURES[feature], reason)
            pytest.skip(f"not applicable to --lora-impl {impl.name}: {reason}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Fail a test whose recorded checks failed, after it ran to its end (every check is in the report)."""
    __tracebackhide__ = True
    result = yield
    failed = item.stash.get(_FAILED_KEY, [])
    if failed:
        lines = [
            f"{where}: {c.name}: {c.value}{c.unit} is not {c.op} {c.threshold}{c.unit}"
            + (f" ({c.detail})" if c.detail else "")
            for c, where in failed
        ]
        raise CheckFailed(f"{len(failed)} check(s) failed:\n" + "\n".join(lines), failed[0][1])
    return result


@pytest.fixture(autouse=True)
def _seed_and_cleanup():
    """Every test starts from the same seeds and leaves no cached GPU memory behind for the next.

    A full ``gc.collect()`` walks every tracked object (300k after importing torch and transformers, 470k
    once torch.compile has run: 0.15-0.25 s each time), which after every test was 15 s of the quick tier's
    37 s (reports/20261122T080902Z-quick, junit times minus call times). So the collection runs only when it
    can matter: when the test leaves more GPU memory allocated than it found (memory that only a cycle may
    still hold). Tests that measure memory collect before they measure (tiers/conftest.py).
    """
    import torch

    random.seed(0)
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    allocated_before = torch.cuda.memory_allocated() if cuda else 0
    yield
    if cuda:
        torch.cuda.synchronize()
        if torch.cuda.memory_allocated() > allocated_before:
            gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.excinfo is not None and isinstance(call.excinfo.value, CheckFailed):
        report.user_properties.append(("first_failed_check", call.excinfo.value.where))
    if call.excinfo is not None and is_cuda_error(call.excinfo.value):
        item.session.shouldstop = (
            f"CUDA error in {item.nodeid}: {call.excinfo.typename}: {str(call.excinfo.value)[:300]} -- the CUDA "
            "context is no longer trustworthy, so the session stops here instead of cascading"
        )
    if "outbox" in _RUN:  # an xdist worker: this phase's new and changed records travel with its report
        changes = _RUN["outbox"].changes(item.config.stash[_REPORT_KEY])
        if changes:
            report.user_properties.append((worker_records.KEY, {"worker": _worker_id(item.config), "changes": changes}))
    return report


def _worker_id(config) -> str:
    return str(config.workerinput.get("workerid", "worker"))


# pytest_runtest_logreport gets no config: the session's report and start time are kept here.
_RUN: dict[str, object] = {}


def pytest_runtest_logreport(report):
    run = _RUN.get("report")
    if run is None:
        return
    if "inbox" in _RUN:  # the controller: records a worker handed off with this report
        for key, value in getattr(report, "user_properties", ()):
            if key == worker_records.KEY:
                _RUN["inbox"].apply(run, value["worker"], value["changes"])
    _RUN["clock"].add_phase(report.nodeid, report.when, report.duration)
    if report.when == "call" or (report.when != "call" and report.outcome != "passed"):
        outcome = report.outcome if report.when == "call" else ("skipped" if report.skipped else "error")
        reason, location = "", ""
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = report.longrepr[2]
        elif report.failed:
            reason, location = failure_text(report)
        run.outcomes.append(Outcome(report.nodeid, outcome, round(report.duration, 3), reason, location))
        if _RUN.get("report_dir"):  # report.json after every test: a killed run still leaves what it did
            _RUN["clock"].timed(run.write_json, Path(_RUN["report_dir"]))


def pytest_sessionstart(session):
    _RUN["session_start"] = time.time()
    _RUN["cuda_context_s"] = None
    _RUN["workers"] = (
        int(getattr(session.config.option, "numprocesses", 0) or 0) if _drives_workers(session.config) else 0
    )
    if not _RUN["workers"]:  # a process that runs tests (the controlling process of workers imports no torch)
        import torch

        if torch.cuda.is_available():  # on its own, so the wall-time breakdown can name it
            start = time.perf_counter()
            torch.zeros(1, device="cuda")
            torch.cuda.synchronize()
            _RUN["cuda_context_s"] = time.perf_counter() - start
    _RUN["report"] = session.config.stash[_REPORT_KEY]
    _RUN["clock"] = wall_time.SessionClock()
    _RUN["start"] = time.perf_counter()
    _RUN["terminated"] = False
    _RUN["report_dir"] = None if _is_worker(session.config) else session.config.getoption("report_dir")
    if _RUN["report_dir"]:
        _RUN["report"].write_json(Path(_RUN["report_dir"]))  # status "running" from the first second


def _report_tier_wall_time(session, run: RunReport) -> None:
    """``-m <tier>`` GPU runs: the session's wall time against the tier's target (session_tables.tier_wall_time)."""
    tier = session.config.getoption("markexpr")
    if not tier or run.environment.gpu_name is None or not (session.testscollected or run.outcomes):
        return
    line = session_tables.tier_wall_time(run, tier, time.perf_counter() - _RUN["start"])
    if line:
        session.config.stash[_SUMMARY_KEY].append(line)


def _drop_unfinished_benchmarks(config, run: RunReport) -> None:
    """A benchmark stopped by a signal before its first round finished has no timings: pytest-benchmark would
    fail computing their statistics while it saves (``min() iterable argument is empty``) and lose every other
    benchmark's too. Drop it from the session, and name it in the report's notes."""
    bench = getattr(config, "_benchmarksession", None)
    if bench is None:
        return
    kept = []
    for b in bench.benchmarks:  # pytest_benchmark.stats.Metadata: .stats is its Stats, .stats.data its timings
        data = getattr(getattr(b, "stats", None), "data", None)
        if data is not None and len(data) == 0:
            run.notes.append(
                f"benchmark {b.fullname} stopped before its first round finished: no figures "
                "(left out of benchmark.json)"
            )
        else:
            kept.append(b)
    bench.benchmarks[:] = kept


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    """Before pytest-benchmark saves (its own wrapper runs inside this one): unfinished benchmarks out; after it,
    whatever it did, the run report is written. An xdist worker hands its last records over before the others:
    xdist's own wrapper (inside this one) sends ``workeroutput`` to the controller when it ends."""
    _drop_unfinished_benchmarks(session.config, session.config.stash[_REPORT_KEY])
    if "outbox" in _RUN:
        run = session.config.stash[_REPORT_KEY]
        out = session_tables.worker_output(run, _RUN, _worker_id(session.config))
        session.config.workeroutput[worker_records.KEY] = out
    try:
        return (yield)
    finally:
        _finish_report(session, session.exitstatus)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller: a worker ended; its last records, its RawKernel variants and kernel load times arrive."""
    out = getattr(node, "workeroutput", {}).get(worker_records.KEY)
    if out is None or "inbox" not in _RUN or _RUN.get("report") is None:
        return
    _RUN["inbox"].apply(_RUN["report"], out["worker"], out["changes"])
    _RUN["worker_outputs"].append(out)


def _finish_report(session, exitstatus):
    report_dir = session.config.getoption("report_dir")
    run = session.config.stash[_REPORT_KEY]
    if "outbox" in _RUN:  # an xdist worker: the controller writes the report (pytest_sessionfinish handed over)
        return
    session_tables.wall_time_breakdown(run, _RUN)
    session_tables.kernel_variants(run, _RUN.get("worker_outputs") or [])
    if _RUN.get("terminated"):
        run.status = "terminated"
    elif exitstatus == pytest.ExitCode.INTERRUPTED:
        run.status = "interrupted"
    else:
        run.status = "complete"
    session.config.stash[_SUMMARY_KEY] = []
    _report_tier_wall_time(session, run)
    if report_dir:
        session.config.stash[_SUMMARY_KEY].append(f"report: {run.write(Path(report_dir))}")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    run, tr = config.stash[_REPORT_KEY], terminalreporter
    s = run.summary()
    tr.section("lora-gpu-suite")
    # a test process's own reading of the GPU (a controller of workers has one once a worker handed it over)
    own_reading = not _RUN.get("workers") or _RUN["inbox"].environment_from is not None
    if own_reading and run.environment.gpu_name is None:
        skipped_gpu = sum(1 for o in run.outcomes if o.outcome == "skipped" and "CUDA GPU" in o.reason)
        nothing = not (s["checks_passed"] or s["checks_failed"] or s.get("passed"))
        tr.write_line(
            f"No CUDA GPU was found: {skipped_gpu} GPU test(s) skipped; {s.get('passed', 0)} passed and "
            f"{s.get('failed', 0)} failed on the CPU{': nothing was judged (no check ran)' if nothing else '.'}"
        )
    tr.write_line(f"checks: {s['checks_passed']} passed, {s['checks_failed']} failed")
    for line in config.stash.get(_SUMMARY_KEY, []):
        tr.write_line(line, red=line.startswith("FAILED"))


def pytest_benchmark_update_machine_info(config, machine_info):
    """pytest-benchmark's JSON carries the GPU name, versions and git commit of the run."""
    machine_info["lora_gpu_suite"] = dataclasses.asdict(config.stash[_REPORT_KEY].environment)


@pytest.fixture(scope="session")
def run_report(request) -> RunReport:
    return request.config.stash[_REPORT_KEY]


@pytest.fixture
def check(run_report, request) -> Checker:
    failed = request.node.stash.setdefault(_FAILED_KEY, [])
    return Checker(run_report, request.node.nodeid, failed)


@pytest.fixture(scope="session")
def lora_impl(request) -> LoRAImplementation:
    """The LoRA implementation under test (--lora-impl, default cupy)."""
    return request.config.stash[_IMPL_KEY]
