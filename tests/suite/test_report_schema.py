"""Every committed report.json validates against the JSON Schema of its schema_version; new reports are v3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

jsonschema = pytest.importorskip(
    "jsonschema",
    reason="jsonschema is not installed: pip install -e .[test] (the test extra) to validate the committed reports",
)

from lora_suite.core.environment import collect_environment  # noqa: E402  (after the importorskip above)
from lora_suite.harness.report import SCHEMA_VERSION, RunReport  # noqa: E402

REPORTS = Path(__file__).resolve().parents[2] / "reports"
RUNS = Path(__file__).resolve().parents[1] / "fixtures" / "runs"  # recorded run excerpts (README there)
COMMITTED = sorted(RUNS.rglob("report.json"))


def schema_for(version: int) -> dict:
    return json.loads((REPORTS / "schema" / f"report-v{version}.schema.json").read_text())


def test_there_are_committed_reports_to_validate():
    assert len(COMMITTED) >= 10


@pytest.mark.parametrize("path", COMMITTED, ids=[str(p.relative_to(RUNS)) for p in COMMITTED])
def test_committed_report_validates(path):
    data = json.loads(path.read_text())
    jsonschema.validate(data, schema_for(data.get("schema_version", 1)))


def test_a_new_report_is_schema_v3_with_implementation_and_not_applicable_checks(tmp_path):
    r = RunReport("r", "quick", collect_environment())
    r.implementation = {"name": "peft", "spec": "peft", "description": "PEFT", "not_applicable": {"nf4_base": "why"}}
    r.check("t", "x", 1.0, "<=", 2.0)
    r.mark_not_applicable("t", "QLoRA peak < 16-bit peak", "peft has no NF4 base")
    r.status = "complete"
    data = json.loads(r.write_json(tmp_path).read_text())
    assert data["schema_version"] == SCHEMA_VERSION == 3
    jsonschema.validate(data, schema_for(3))
    assert data["summary"]["checks_not_applicable"] == 1
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
