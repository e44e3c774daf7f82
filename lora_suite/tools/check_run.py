"""One run of a stack's checks, classified (``lora_suite.tools.mutate`` runs the source and each mutant through
it): passed, or what killed it, read from the ``report.json`` the run leaves: the first failed check, else the first
crashed test and its exception, else a non-zero exit with the output's last line, or "timeout"."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lora_suite.tools.forked_runs import run_subprocess


@dataclass(frozen=True)
class Attempt:
    """One run of the checks: passed, or what killed it (a check, a crashed test, "timeout")."""

    passed: bool
    killed_by: str
    seconds: float
    judged: int = 0  # tests that passed: 0 means the run judged nothing


def killed_by(report: dict | None, returncode: int, output: str) -> tuple[str, int]:
    """What killed a run (empty where it passed) and how many tests passed, from its report.json and exit code."""
    report = report or {}
    failed = [c for c in report.get("checks", []) if not c.get("passed")]
    outcomes = report.get("outcomes", [])
    passed = sum(o.get("outcome") == "passed" for o in outcomes)
    if failed:
        c = failed[0]
        return f"check {c.get('name')!r} ({_short(c.get('test', ''))})", passed
    crashed = [o for o in outcomes if o.get("outcome") in ("failed", "error")]
    if crashed:
        o = crashed[0]
        return f"{_short(o.get('test', ''))}: {_first_line(o.get('reason', '')) or 'failed'}", passed
    if returncode != 0:
        return f"exit {returncode}: {last_line(output)[:300] or 'no output'}", passed
    return "", passed


def _short(nodeid: str) -> str:
    """A test's node id without its directories."""
    return nodeid.rsplit("/", 1)[-1]


def _first_line(text: str) -> str:
    """The first non-blank line of ``text``, stripped, at most 300 characters."""
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()[:300]
    return ""


def last_line(text: str) -> str:
    """The last non-blank line of ``text`` (a run's output: usually what stopped it)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def run_checks(
    command: list[str], env: dict[str, str], report_dir: Path, timeout: float, runner=run_subprocess
) -> Attempt:
    """Run ``command`` (through ``runner``) and classify it by the ``report.json`` it leaves in ``report_dir``."""
    done = runner(command, env, timeout)
    if done.returncode is None:
        return Attempt(False, f"timeout (over {timeout:.0f} s)", done.seconds)
    path = report_dir / "report.json"
    try:
        report = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, json.JSONDecodeError):
        report = None
    why, passed = killed_by(report, done.returncode, done.output)
    return Attempt(not why, why, done.seconds, passed)
