"""Each test's outcome: a test whose recorded checks failed fails when it ends, a CUDA error stops the session, a
CUDA out-of-memory is a failed check saying why (``lora_suite.harness.oom_verdict``), and
every phase's outcome and duration goes into the run report (an xdist worker hands its new records over with each
phase's report; the controlling process applies them). ``pytest_runtest_logreport`` gets no config: it is a method
of ``PhaseRecords``, a plugin object registered with the session's state when pytest is configured."""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path

import pytest

from lora_suite.harness import worker_records
from lora_suite.harness.checks import CheckFailed, failure_text
from lora_suite.harness.cuda_errors import is_cuda_error, is_oom
from lora_suite.harness.oom_verdict import record_oom
from lora_suite.harness.plugin.state import FAILED_KEY, REPORT_KEY, SessionState, session_state, worker_id
from lora_suite.harness.report import Outcome


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """Fail a test whose recorded checks failed, after it ran to its end (every check is in the report)."""
    __tracebackhide__ = True
    result = yield
    failed = item.stash.get(FAILED_KEY, [])
    if failed:
        lines = [
            f"{where}: {c.name}: {c.value}{c.unit} is not {c.op} {c.threshold}{c.unit}"
            + (f" ({c.detail})" if c.detail else "")
            for c, where in failed
        ]
        raise CheckFailed(f"{len(failed)} check(s) failed:\n" + "\n".join(lines), failed[0][1])
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Name a failed test's first failed check, stop the session at a CUDA error, hand a worker's records over."""
    report = yield
    if call.excinfo is not None and call.when == "call" and is_oom(call.excinfo.value):
        record_oom(item, call.excinfo, item.config.stash[REPORT_KEY])  # a verdict that says why; the GPU released
    if call.excinfo is not None and isinstance(call.excinfo.value, CheckFailed):
        report.user_properties.append(("first_failed_check", call.excinfo.value.where))
    if call.excinfo is not None and is_cuda_error(call.excinfo.value):
        item.session.shouldstop = (
            f"CUDA error in {item.nodeid}: {call.excinfo.typename}: {str(call.excinfo.value)[:300]} -- the CUDA "
            "context is no longer trustworthy, so the session stops here instead of cascading"
        )
    outbox = session_state(item.config).outbox
    if outbox is not None:  # an xdist worker: this phase's new and changed records travel with its report
        changes = outbox.changes(item.config.stash[REPORT_KEY])
        if changes:
            report.user_properties.append((worker_records.KEY, {"worker": worker_id(item.config), "changes": changes}))
    return report


def pytest_configure(config: pytest.Config) -> None:
    """Register the plugin object that records each phase, holding this session's state."""
    config.pluginmanager.register(PhaseRecords(session_state(config)), PhaseRecords.NAME)


class PhaseRecords:
    """The plugin object whose hook records each test phase in the run report: ``pytest_runtest_logreport`` gets
    no config, so the object holds the session's state."""

    NAME = "lora-suite-phase-records"

    def __init__(self, state: SessionState) -> None:
        self.state = state

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Record the phase's outcome (and its time on the session clock) in the run report."""
        state, run = self.state, self.state.report
        if run is None:  # before the session started
            return
        if state.inbox is not None:  # the controller: records a worker handed off with this report
            for key, value in getattr(report, "user_properties", ()):
                if key == worker_records.KEY:
                    state.inbox.apply(run, value["worker"], value["changes"])
        state.clock.add_phase(report.nodeid, report.when, report.duration)
        if report.when == "call" or (report.when != "call" and report.outcome != "passed"):
            outcome = report.outcome if report.when == "call" else ("skipped" if report.skipped else "error")
            reason, location = "", ""
            if report.skipped and isinstance(report.longrepr, tuple):
                reason = report.longrepr[2]
            elif report.failed:
                reason, location = failure_text(report)
            run.outcomes.append(Outcome(report.nodeid, outcome, round(report.duration, 3), reason, location))
            if state.report_dir:  # report.json after every test: a killed run still leaves what it did
                state.clock.timed(state.save, run.write_json, Path(state.report_dir))
