"""The bad-input battery (issue 20), run folders: ``compare`` (``lora_suite.results.compare``, through
``scripts/gpu-test.sh compare``) and ``history`` (``lora_suite.results.history``) given folders that are missing, empty,
or hold a report.json that is not JSON, not an object, of another implementation, judged nothing or is of a newer
schema: each refused with a message that says which, and nothing written half."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "gpu-test.sh"
OK = {
    "schema_version": 3,
    "status": "complete",
    "checks": [],
    "outcomes": [{"test": "t::x", "outcome": "passed"}],
    "implementation": {"name": "cupy"},
}
REPORTS = {  # kind -> the report.json a run folder holds (text as written; None: no report.json)
    "ok": OK,
    "peft": {**OK, "implementation": {"name": "peft"}},
    "broken": "{not json",
    "empty": None,
    "nothing": {**OK, "outcomes": []},
    "list": [OK],
    "future": {**OK, "schema_version": 99},
}


def _run_dir(root: Path, name: str, report: dict | list | str | None) -> Path:
    d = root / name
    d.mkdir(parents=True)
    if report is not None:
        (d / "report.json").write_text(report if isinstance(report, str) else json.dumps(report))
    return d


COMPARE_CASES = [  # (what, the baseline's kind, the run's kind, what the output must hold); "missing": no folder
    ("compare: baseline missing", "missing", "ok", "absent-base does not exist (a run folder)"),  # issue 44
    ("compare: run missing", "ok", "missing", "absent-run does not exist (a run folder)"),
    ("compare: both empty", "empty", "empty", "nothing to compare"),
    ("compare: report not JSON", "broken", "ok", "report.json"),
    ("compare: two implementations", "peft", "ok", "only compares with runs of the same one"),
    # issue 28's battery: these passed with exit 0
    ("compare: baseline judged nothing", "nothing", "ok", "judged nothing (its report.json has no checks"),
    ("compare: baseline not an object", "list", "ok", "holds a JSON list, expected an object"),
    ("compare: baseline from a newer suite", "future", "ok", "schema_version 99; this suite reads 1 to 5"),
]


@pytest.mark.parametrize("what, base, run, expected", COMPARE_CASES, ids=[c[0] for c in COMPARE_CASES])
def test_report_dirs_for_compare(what, base, run, expected, tmp_path):
    def make(kind, name):
        return tmp_path / f"absent-{name}" if kind == "missing" else _run_dir(tmp_path, name, REPORTS[kind])

    b, r = make(base, "base"), make(run, "run")
    out = subprocess.run(["bash", str(SCRIPT), "compare", str(b), str(r)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert expected in out.stdout + out.stderr, (out.stdout[-800:], out.stderr[-800:])


HISTORY_CASES = {  # what -> (the run folder's name and report.json, or None: none; what stderr must hold)
    "a directory without reports": (None, "no report.json under"),
    "a report that is not JSON": (("20261120T000000Z-quick", "{not json"), "not a readable report.json"),
    "a report without a run time": (("run", {"checks": []}), "no run time"),
    "a report that is not an object": (("20261120T000000Z-quick", [1, 2]), "holds list, expected a JSON object"),
    "a report from a newer suite": (
        ("20261120T000000Z-quick", {"schema_version": 7, "checks": []}),
        "schema_version 7; this suite reads 1 to 5",
    ),
}


@pytest.mark.parametrize("what", HISTORY_CASES)
def test_report_dirs_for_history(what, tmp_path, capsys):
    from lora_suite.results.history import main

    folder, expected = HISTORY_CASES[what]
    root = tmp_path / "reports"
    root.mkdir()
    if folder is not None:
        _run_dir(root, *folder)
    assert main([str(tmp_path / "out" / "h.html"), str(root)]) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "out").exists(), "nothing written half"
