"""The run report's life: opened when pytest is configured (the run id, the environment, the implementation under
test, resolved and preloaded), stated in the header, clocked from the session's start, finished and written when the
session ends (also when it was interrupted or terminated: SIGTERM takes pytest's own interruption path), summed up in
the terminal summary. In a run spread over pytest-xdist workers only the controlling process writes it, with what
each worker handed over."""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Generator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

import pytest

from lora_suite.harness import session_tables, worker_records
from lora_suite.harness.header import header_lines
from lora_suite.harness.plugin.options import check_report_dir
from lora_suite.harness.plugin.state import (
    IMPL_KEY,
    REPORT_KEY,
    SUMMARY_KEY,
    SessionState,
    drives_workers,
    is_worker,
    session_state,
    worker_id,
)
from lora_suite.harness.progress import ProgressLines
from lora_suite.harness.report import RunReport
from lora_suite.implementations import DEFAULT, ImplementationError, implementation_record, resolve_implementation
from lora_suite.settings.env_vars import environment_problem
from lora_suite.settings.environment import collect_environment, package_environment

if TYPE_CHECKING:
    from xdist.workermanage import WorkerController


class Terminated(KeyboardInterrupt):
    """SIGTERM (a CI job's timeout, a scheduler) turned into pytest's own interruption path, so that the
    session finishes its hooks and the run report is written with status ``terminated``."""


def _on_sigterm(state: SessionState, signum: int, frame: FrameType | None) -> NoReturn:
    """The first SIGTERM stops the session; the ones after it are ignored, so that none interrupts the report being
    written (a job's timeout may signal the process group and then the command, which hands it on)."""
    state.terminated = True
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated(f"received signal {signum} (SIGTERM)")


def _catch_sigterm(config: pytest.Config, state: SessionState) -> None:
    """SIGTERM ends the session through ``_on_sigterm`` until the config is cleaned up; then the former handler is
    back (unless a SIGTERM came: the process ignores the next ones to its end)."""
    former = signal.signal(signal.SIGTERM, functools.partial(_on_sigterm, state))

    def restore() -> None:
        if not state.terminated and former is not None:
            signal.signal(signal.SIGTERM, former)

    config.add_cleanup(restore)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Open the run report with the implementation under test; the mailboxes of a run over workers; progress lines.
    First of the plugin's ``pytest_configure`` hooks (``tryfirst``): the session's "configured" moment comes before
    the others' work (selection reads the tier registry)."""
    if (problem := environment_problem()) is not None:  # before any work: one line, exit 4 (a usage error)
        raise pytest.UsageError(problem)
    state = session_state(config)
    state.configured = time.time()
    selection = config.getoption("markexpr") or "all"
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    run_id = os.environ.get("LORA_SUITE_RUN_ID") or f"{now}-{re.sub(r'[^A-Za-z0-9]+', '_', selection)}"
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", run_id):
        raise pytest.UsageError(f"LORA_SUITE_RUN_ID must be a folder name (letters, digits, _ . -), got {run_id!r}")
    # the controlling process of workers imports no torch (4.1-4.6 s of a fresh runner): its report takes the first
    # worker's environment (harness/worker_records.py); every test process reads its own
    environment = package_environment() if drives_workers(config) else collect_environment()
    config.stash[REPORT_KEY] = report = RunReport(run_id=run_id, selection=selection, environment=environment)
    spec = config.getoption("lora_impl") or DEFAULT
    try:
        impl = resolve_implementation(spec)
        if not drives_workers(config):  # a process that runs tests
            start = time.perf_counter()
            impl.preload()
            state.preload_s = time.perf_counter() - start
    except Exception as exc:  # an ImplementationError, or what the user's preload raised: a usage error, one line
        why = exc if isinstance(exc, ImplementationError) else repr(exc)
        raise pytest.UsageError(f"--lora-impl {spec}: {why}") from None
    config.stash[IMPL_KEY] = impl
    report.implementation = implementation_record(impl, spec)
    if config.getoption("vram_limit"):
        report.notes.append(_vram_limit(config))
    if config.getoption("report_dir"):
        check_report_dir(config.getoption("report_dir"))
    if is_worker(config):  # an xdist worker: hands its records to the controller, which alone writes the report
        state.outbox = worker_records.Outbox()
    else:  # the controlling process
        _catch_sigterm(config, state)
        state.inbox = worker_records.Inbox()
    if not config.getini("log_cli") and not config.getoption("log_cli_level", None):
        handler = ProgressLines(config)
        logger = logging.getLogger("lora_suite")  # the trainer logs as lora_suite.engine.trainer
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        config.add_cleanup(lambda: logger.removeHandler(handler))


def _vram_limit(config: pytest.Config) -> str:
    """``--vram-limit``: checked, and applied where tests run on a GPU (``lora_suite.measure.vram_limit``); the note."""
    from lora_suite.measure import vram_limit as V

    try:
        gib = V.parse_limit(config.getoption("vram_limit"))
        if drives_workers(config):
            return f"--vram-limit {gib:g} GiB: each test process judged as on a {gib:g} GiB card"
        import torch

        if not torch.cuda.is_available():
            return f"--vram-limit {gib:g} GiB: no CUDA GPU here, nothing capped"
        return V.apply_limit(gib, torch.cuda.current_device())
    except V.VramLimitError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The GPU, the implementation under test, versions and commit."""
    env, impl = config.stash[REPORT_KEY].environment, config.stash[IMPL_KEY]
    return header_lines(env, impl.describe(), drives_workers=drives_workers(config))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Start the session's clock (the CUDA context on its own), and write report.json with status "running"."""
    config, state = session.config, session_state(session.config)
    state.session_start = time.time()
    state.workers = int(getattr(config.option, "numprocesses", 0) or 0) if drives_workers(config) else 0
    if not state.workers:  # a process that runs tests (the controlling process of workers imports no torch)
        import torch

        if torch.cuda.is_available():  # on its own, so the wall-time breakdown can name it
            start = time.perf_counter()
            torch.zeros(1, device="cuda")
            torch.cuda.synchronize()
            state.cuda_context_s = time.perf_counter() - start
    state.report = config.stash[REPORT_KEY]
    state.start = time.perf_counter()
    state.report_dir = None if is_worker(config) else config.getoption("report_dir")
    if state.report_dir:
        state.save(state.report.write_json, Path(state.report_dir))  # status "running" from the first second


def _report_tier_wall_time(session: pytest.Session, run: RunReport, start: float | None) -> None:
    """``-m <tier>`` GPU runs: the session's wall time (from ``start``, on ``time.perf_counter()``) against the
    tier's target (session_tables.tier_wall_time)."""
    tier = session.config.getoption("markexpr")
    if not tier or start is None or run.environment.gpu_name is None or not (session.testscollected or run.outcomes):
        return
    line = session_tables.tier_wall_time(run, tier, time.perf_counter() - start)
    if line:
        session.config.stash[SUMMARY_KEY].append(line)


def _drop_unfinished_benchmarks(config: pytest.Config, run: RunReport) -> None:
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
def pytest_sessionfinish(session: pytest.Session, exitstatus: int | pytest.ExitCode) -> Generator[None, None, None]:
    """Before pytest-benchmark saves (its own wrapper runs inside this one): unfinished benchmarks out; after it,
    whatever it did, the run report is written. An xdist worker hands its last records over before the others:
    xdist's own wrapper (inside this one) sends ``workeroutput`` to the controller when it ends."""
    _drop_unfinished_benchmarks(session.config, session.config.stash[REPORT_KEY])
    state = session_state(session.config)
    if state.outbox is not None:
        run = session.config.stash[REPORT_KEY]
        out = session_tables.worker_output(run, state, worker_id(session.config))
        session.config.workeroutput[worker_records.KEY] = out  # type: ignore[attr-defined]  # xdist's, in a worker
    try:
        return (yield)
    finally:
        _finish_report(session, session.exitstatus)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: WorkerController, error: object | None) -> None:
    """The controller: a worker ended; its last records, its RawKernel variants and kernel load times arrive."""
    out = getattr(node, "workeroutput", {}).get(worker_records.KEY)
    state = session_state(node.config)
    if out is None or state.inbox is None or state.report is None:
        return
    state.inbox.apply(state.report, out["worker"], out["changes"])
    state.worker_outputs.append(out)


def _finish_report(session: pytest.Session, exitstatus: int | pytest.ExitCode) -> None:
    report_dir = session.config.getoption("report_dir")
    run = session.config.stash[REPORT_KEY]
    state = session_state(session.config)
    if state.outbox is not None:  # an xdist worker: the controller writes the report (pytest_sessionfinish handed over)
        return
    session_tables.wall_time_breakdown(run, state)
    session_tables.kernel_variants(run, state.worker_outputs)
    if state.terminated:
        run.status = "terminated"
    elif exitstatus == pytest.ExitCode.INTERRUPTED:
        run.status = "interrupted"
    else:
        run.status = "complete"
    session.config.stash[SUMMARY_KEY] = []
    _report_tier_wall_time(session, run, state.start)
    if report_dir and (md := state.save(run.write, Path(report_dir))) is not None:
        session.config.stash[SUMMARY_KEY].append(f"report: {md}")
    if state.unsaved:  # the run's evidence is not on disk: the run fails, saying why (after pytest's own summary)
        line = f"lora-gpu-suite: FAILED: {state.unsaved}"
        session.config.stash[SUMMARY_KEY].append(line)
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        tr.write_line(line, red=True) if tr is not None else print(line, file=sys.stderr)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int | pytest.ExitCode, config: pytest.Config
) -> None:
    """The suite's section: checks passed and failed, a run that saw no GPU said so, the report's path."""
    run, tr = config.stash[REPORT_KEY], terminalreporter
    s = run.summary()
    tr.section("lora-gpu-suite")
    # a test process's own reading of the GPU (a controller of workers has one once a worker handed it over)
    state = session_state(config)
    own_reading = not state.workers or (state.inbox is not None and state.inbox.environment_from is not None)
    if own_reading and run.environment.gpu_name is None:
        skipped_gpu = sum(1 for o in run.outcomes if o.outcome == "skipped" and "CUDA GPU" in o.reason)
        nothing = not (s["checks_passed"] or s["checks_failed"] or s.get("passed"))
        tr.write_line(
            f"No CUDA GPU was found: {skipped_gpu} GPU test(s) skipped; {s.get('passed', 0)} passed and "
            f"{s.get('failed', 0)} failed on the CPU{': nothing was judged (no check ran)' if nothing else '.'}"
        )
    tr.write_line(f"checks: {s['checks_passed']} passed, {s['checks_failed']} failed")
    for line in config.stash.get(SUMMARY_KEY, []):
        tr.write_line(line, red=line.startswith("FAILED"))


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict[str, object]) -> None:
    """pytest-benchmark's JSON carries the GPU name, versions and git commit of the run."""
    machine_info["lora_gpu_suite"] = dataclasses.asdict(config.stash[REPORT_KEY].environment)
