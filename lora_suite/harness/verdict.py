"""What a run judged, as one verdict: PASS, PASS (RETRIED), FAIL, NOT JUDGED, INTERRUPTED, TERMINATED or RUNNING, and
why. PASS (RETRIED): everything passed, but some test only after ``--oom-retry`` halved its micro-batch.

A run that judged nothing is NOT JUDGED, never PASS: no check recorded, and no test passed but ones that recorded
only "not applicable" (every test skipped by the VRAM pre-check or for want of a GPU, every test not applicable,
nothing selected). The reason names the commonest skip or not-applicable reason, with its count. The run report
writes the verdict into report.json and report.md's first line; the command line's summary and exit code follow it
(``lora_suite/cli/verdicts.py``).
"""

from __future__ import annotations

from types import SimpleNamespace

from lora_suite.measure.card import OOM_CHECK, RETRIED_CHECK

# The verdict as the ledger and the results store hold it (a run row's ``verdict``): lower case
LEDGER_WORD = {
    "PASS": "pass",
    "PASS (RETRIED)": "pass (retried)",
    "FAIL": "fail",
    "NOT JUDGED": "not judged",
    "INTERRUPTED": "interrupted",
    "TERMINATED": "terminated",
    "RUNNING": "running",
}


def run_verdict(report) -> tuple[str, str]:
    """(result, why) of a ``RunReport``, or of anything with its ``status``, ``checks`` (``name``, ``passed``,
    ``test``), ``outcomes`` (``test``, ``outcome``, ``reason``) and ``not_applicable`` (``test``, ``reason``):
    ``verdict_of_json`` reads a report.json that way."""
    stopped = {"interrupted": "INTERRUPTED", "terminated": "TERMINATED"}.get(report.status)
    failed = [o.test for o in report.outcomes if o.outcome in ("failed", "error")]
    failed_checks = [c.name for c in report.checks if not c.passed]
    if failed or failed_checks:
        what = f"{len(failed_checks)} check(s) failed" if failed_checks else f"{len(failed)} test(s) failed"
        if only_out_of_memory(failed_checks):
            what += " (out of memory)"
        return stopped or "FAIL", what + (f" before the run was {report.status}" if stopped else "")
    if stopped:
        return stopped, f"the run was {report.status} before it finished"
    only_not_applicable = {n.test for n in report.not_applicable} - {c.test for c in report.checks}
    judged = len(report.checks) + sum(
        o.outcome == "passed" and o.test not in only_not_applicable for o in report.outcomes
    )  # a test that passed recording only "not applicable" judged nothing
    if report.status == "running":  # a report written while the run goes on: its verdict is not in yet
        return "RUNNING", f"{judged} judgement(s) so far"
    if judged == 0:
        return "NOT JUDGED", _why_nothing_judged(report.outcomes, report.not_applicable)
    why = f"{len(report.checks)} check(s) and {sum(o.outcome == 'passed' for o in report.outcomes)} test(s) passed"
    retried = sorted({c.test for c in report.checks if c.name == RETRIED_CHECK})
    if retried:  # --oom-retry ran them with a smaller micro-batch than asked for: never an ordinary PASS
        return "PASS (RETRIED)", f"{why}; {len(retried)} test(s) passed only with the micro-batch halved (--oom-retry)"
    return "PASS", why


def only_out_of_memory(failed_checks: list[str]) -> bool:
    """Whether the failed checks named are all out-of-memory checks (``lora_suite.harness.oom_verdict``), one at
    least: a capacity verdict, after which the GPU was released."""
    return bool(failed_checks) and all(name.startswith(OOM_CHECK) for name in failed_checks)


def _why_nothing_judged(outcomes: list, not_applicable: list) -> str:
    """The commonest reason (with its count) why the tests of a run judged nothing: skipped, or not applicable
    (``Outcome`` and ``NotApplicable`` records of the run report)."""
    if not outcomes:
        return "no test ran (none selected)"
    na = {n.test: n.reason for n in not_applicable}
    reasons: dict[str, int] = {}
    for o in outcomes:
        if o.outcome == "skipped":
            first = ((o.reason or "").splitlines() or ["(no reason given)"])[0]
            key = "skipped: " + first.removeprefix("Skipped: ")[:200]  # pytest's own prefix, once is enough
        else:
            key = "not applicable: " + na.get(o.test, o.outcome)[:200]
        reasons[key] = reasons.get(key, 0) + 1
    reason, count = max(reasons.items(), key=lambda kv: kv[1])
    return f"{count} of {len(outcomes)} test(s) {reason}"


def verdict_of_json(report: dict) -> tuple[str, str]:
    """``run_verdict`` of a report.json's content: the one rule the summary, the report, the ledger and the results
    store share (a report written before the verdict field existed is judged the same way)."""

    def records(key: str) -> list:
        return [
            SimpleNamespace(**{"test": "", "reason": "", **r}) for r in report.get(key) or [] if isinstance(r, dict)
        ]

    return run_verdict(
        SimpleNamespace(
            status=str(report.get("status")),
            checks=records("checks"),
            outcomes=records("outcomes"),
            not_applicable=records("not_applicable"),
        )
    )
