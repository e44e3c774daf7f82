"""Every committed report.json validates against the JSON Schema of its schema_version; new reports are v5."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

jsonschema = pytest.importorskip(
    "jsonschema",
    reason="jsonschema is not installed: pip install -e .[test] (the test extra) to validate the committed reports",
)

from lora_suite.harness.report import SCHEMA_VERSION, RunReport  # noqa: E402
from lora_suite.settings.environment import collect_environment  # noqa: E402  (after the importorskip above)

REPORTS = Path(__file__).resolve().parents[3] / "reports"
RUNS = Path(__file__).resolve().parents[2] / "fixtures" / "runs"  # recorded run excerpts (README there)
COMMITTED = sorted(RUNS.rglob("report.json"))


def schema_for(version: int) -> dict:
    return json.loads((REPORTS / "schema" / f"report-v{version}.schema.json").read_text())


def test_there_are_committed_reports_to_validate():
    assert len(COMMITTED) >= 10


@pytest.mark.parametrize("path", COMMITTED, ids=[str(p.relative_to(RUNS)) for p in COMMITTED])
def test_committed_report_validates(path):
    data = json.loads(path.read_text())
    jsonschema.validate(data, schema_for(data.get("schema_version", 1)))


def test_a_new_report_is_the_current_schema_with_implementation_not_applicable_checks_and_verdict(tmp_path):
    r = RunReport("r", "quick", collect_environment())
    r.implementation = {"name": "peft", "spec": "peft", "description": "PEFT", "not_applicable": {"nf4_base": "why"}}
    r.check("t", "x", 1.0, "<=", 2.0)
    r.mark_not_applicable("t", "QLoRA peak < 16-bit peak", "peft has no NF4 base")
    r.status = "complete"
    data = json.loads(r.write_json(tmp_path).read_text())
    assert data["schema_version"] == SCHEMA_VERSION == 5
    jsonschema.validate(data, schema_for(SCHEMA_VERSION))
    assert data["summary"]["checks_not_applicable"] == 1
    assert data["verdict"] == {"result": "PASS", "why": "1 check(s) and 0 test(s) passed"}
    md = r.write(tmp_path).read_text()
    assert "LoRA implementation under test: **peft**" in md
    assert "| `t` | QLoRA peak < 16-bit peak | peft has no NF4 base |" in md


def test_a_not_applicable_record_needs_its_reason():
    with pytest.raises(ValueError, match="needs its reason"):
        RunReport("r", "quick", collect_environment()).mark_not_applicable("t", "x", "")


def test_schema_rejects_a_report_without_status():
    data = RunReport("r", "quick", collect_environment()).to_dict()
    del data["status"]
    with pytest.raises(jsonschema.ValidationError, match="'status' is a required property"):
        jsonschema.validate(data, schema_for(2))


def _outcome(test, outcome, reason=""):
    from lora_suite.harness.report import Outcome

    return Outcome(test, outcome, 0.1, reason)


@pytest.mark.parametrize(
    "outcomes, checks, status, want",
    [
        (
            [
                ("a", "skipped", "NOT enough free VRAM: 1.0 GiB < 3.2"),
                ("b", "skipped", "NOT enough free VRAM: 1.0 GiB < 3.2"),
            ],
            0,
            "complete",
            ("NOT JUDGED", "2 of 2 test(s) skipped: NOT enough free VRAM: 1.0 GiB < 3.2"),
        ),
        (
            [("a", "skipped", "needs a CUDA GPU: none found")],
            0,
            "complete",
            ("NOT JUDGED", "1 of 1 test(s) skipped: needs a CUDA GPU: none found"),
        ),
        ([], 0, "complete", ("NOT JUDGED", "no test ran (none selected)")),
        ([("a", "passed"), ("b", "skipped", "x")], 0, "complete", ("PASS", "0 check(s) and 1 test(s) passed")),
        ([("a", "skipped", "x")], 1, "complete", ("PASS", "1 check(s) and 0 test(s) passed")),
        ([("a", "failed", "boom")], 0, "complete", ("FAIL", "1 test(s) failed")),
        ([("a", "skipped", "x")], 0, "terminated", ("TERMINATED", "the run was terminated before it finished")),
        ([("a", "passed")], 0, "running", ("RUNNING", "1 judgement(s) so far")),
        ([], 0, "running", ("RUNNING", "0 judgement(s) so far")),  # not NOT JUDGED before its first test ends
    ],
)
def test_a_run_that_judged_nothing_is_not_judged_never_a_pass(outcomes, checks, status, want, tmp_path):
    r = RunReport("r", "memory", collect_environment())
    r.implementation = {"name": "cupy", "spec": "cupy", "description": "lora_core", "not_applicable": {}}
    r.outcomes = [_outcome(*o) for o in outcomes]
    for i in range(checks):
        r.check("t", f"c{i}", 1.0, "<=", 2.0)
    r.status = status
    assert r.verdict() == want
    data = json.loads(r.write_json(tmp_path).read_text())
    jsonschema.validate(data, schema_for(SCHEMA_VERSION))
    assert data["verdict"] == dict(zip(("result", "why"), want))
    assert r.write(tmp_path).read_text().splitlines()[2] == f"**{want[0]}**: {want[1]}"  # report.md's first lines


def test_a_test_that_passed_recording_only_not_applicable_judged_nothing():
    r = RunReport("r", "memory", collect_environment())
    r.outcomes = [_outcome("t", "passed")]
    r.mark_not_applicable("t", "QLoRA peak < 16-bit peak", "no NF4 base")
    r.status = "complete"
    assert r.verdict() == ("NOT JUDGED", "1 of 1 test(s) not applicable: no NF4 base")
