"""One run of a stack's checks, classified (``lora_suite.mutation.mutate`` runs the source and each mutant through
it), from the ``report.json`` the run leaves, its exit code and its output:

    killed by   the first failed check; else the first crashed test and its exception, where the run judged
                something (a check recorded or a test passed) or the crash's traceback runs through the mutated
                file (the code under test raised); else a non-zero exit of a run that judged something; or "timeout"
    error       the run judged nothing: no report.json (the harness did not start: an import error, a usage error),
                no test reached a check (a collection error, every test skipped), or only crashes outside the code
                under test (an environment error before any check ran). An error is never a kill
    passed      none of the above
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lora_suite.mutation.forked_runs import run_subprocess


@dataclass(frozen=True)
class Attempt:
    """One run of the checks: passed, or what killed it (a check, a crashed test, "timeout"), or why it judged
    nothing (``error``: then it is neither passed nor killed)."""

    passed: bool
    killed_by: str
    seconds: float
    judged: int = 0  # tests that passed: 0 means the run judged nothing
    error: str = ""  # the run judged nothing: why (no report.json, no test ran, a crash outside the code under test)


def killed_by(report: dict | None, returncode: int, output: str, mutated: str = "") -> tuple[str, int]:
    """What killed a run (empty where it passed or judged nothing: ``nothing_judged`` tells those apart) and how many
    tests passed, from its report.json, exit code and output; ``mutated``: the mutated file's path, whose presence in
    a crash's traceback (the output) makes a crash of a run that judged nothing else a kill."""
    report = report or {}
    failed = [c for c in report.get("checks", []) if not c.get("passed")]
    outcomes = report.get("outcomes", [])
    passed = sum(o.get("outcome") == "passed" for o in outcomes)
    judged = _judged(report)
    if failed:
        c = failed[0]
        return f"check {c.get('name')!r} ({_short(c.get('test', ''))})", passed
    crashed = [o for o in outcomes if o.get("outcome") in ("failed", "error")]
    inside = bool(mutated) and (mutated in output or any(mutated in str(o.get("location", "")) for o in crashed))
    if crashed and (judged or inside):
        o = crashed[0]
        return f"{_short(o.get('test', ''))}: {_first_line(o.get('reason', '')) or 'failed'}", passed
    if returncode != 0 and judged:
        return f"exit {returncode}: {last_line(output)[:300] or 'no output'}", passed
    return "", passed


def _judged(report: dict) -> bool:
    """Whether a run judged something: a check recorded, or a test passed."""
    return bool(report.get("checks")) or any(o.get("outcome") == "passed" for o in report.get("outcomes", []))


def nothing_judged(report: dict | None, returncode: int, output: str) -> str:
    """Why a run that no check failed and no crash of the code under test killed judged nothing; empty where it
    judged something (a check recorded, a test passed) and exited 0."""
    end = f"exit {returncode}: {last_line(output)[:300] or 'no output'}"
    if report is None:
        return f"no report.json: the harness did not run ({end})"
    outcomes = report.get("outcomes", [])
    if _judged(report):
        return ""
    crashed = [o for o in outcomes if o.get("outcome") in ("failed", "error")]
    if crashed:
        o = crashed[0]
        why = _first_line(o.get("reason", "")) or "failed"
        return f"no check ran: {_short(o.get('test', ''))} crashed outside the code under test ({why})"
    if outcomes:
        return f"no check ran: all {len(outcomes)} test(s) skipped ({end})"
    return f"no test ran: nothing collected or a collection error ({end})"


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
    command: list[str],
    env: dict[str, str],
    report_dir: Path,
    timeout: float,
    runner=run_subprocess,
    mutated: Path | None = None,
) -> Attempt:
    """Run ``command`` (through ``runner``) and classify it by the ``report.json`` it leaves in ``report_dir``;
    ``mutated``: the mutant's file, where the run judges one (a crash whose traceback runs through it is a kill)."""
    done = runner(command, env, timeout)
    if done.returncode is None:
        return Attempt(False, f"timeout (over {timeout:.0f} s)", done.seconds)
    path = report_dir / "report.json"
    try:
        report = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, json.JSONDecodeError):
        report = None
    why, passed = killed_by(report, done.returncode, done.output, str(mutated) if mutated else "")
    if why:
        return Attempt(False, why, done.seconds, passed)
    error = nothing_judged(report, done.returncode, done.output)
    if error:
        return Attempt(False, "", done.seconds, passed, error)
    return Attempt(True, "", done.seconds, passed)
