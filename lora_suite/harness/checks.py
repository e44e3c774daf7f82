"""Checks: ``check(name, value, op, threshold, *, unit, source, detail)`` records a criterion in the run report;
a failed check is remembered with the test line that made it and fails the test when it ends (``CheckFailed``)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType

from lora_suite.harness.report import Check, RunReport


class CheckFailed(AssertionError):
    """Raised at the end of a test whose checks failed; ``where`` is the test line of the first one."""

    def __init__(self, message: str, where: str):
        super().__init__(message)
        self.where = where


class Checker:
    """``check(name, value, op, threshold, *, unit, source, detail)``: the one way a test records a criterion.

    The check goes into the run report; a failed one is remembered with the line that made it (the first
    caller frame outside helpers marked ``__tracebackhide__``) and fails the test when it ends.
    """

    def __init__(self, report: RunReport, nodeid: str, failed: list):
        self.report, self.nodeid, self.failed = report, nodeid, failed

    def __call__(self, name, value, op, threshold, *, unit="", source="", detail="") -> Check:
        __tracebackhide__ = True
        c = self.report.check(self.nodeid, name, value, op, threshold, unit=unit, source=source, detail=detail)
        if not c.passed:
            self.failed.append((c, _caller_line()))
        return c

    def not_applicable(self, name: str, reason: str):
        """Record that check ``name`` does not apply to the implementation under test, and why."""
        return self.report.mark_not_applicable(self.nodeid, name, reason)


def _caller_line() -> str:
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and (frame.f_locals.get("__tracebackhide__") or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = Path(frame.f_code.co_filename)
    try:
        path = path.relative_to(Path.cwd())
    except ValueError:
        pass
    return f"{path}:{frame.f_lineno}"


def failure_text(report) -> tuple[str, str]:
    """The whole failure message (an assertion's full text, not only its type) and where it was raised
    (for failed checks: the test line of the first one)."""
    where = dict(report.user_properties).get("first_failed_check")
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and where:
        return crash.message, where
    if crash is not None:
        return crash.message, f"{crash.path}:{crash.lineno}"
    text = report.longreprtext.strip()
    return text[-4000:], ""
