"""The ledger and the results store hold the run's verdict by the rule of its report and summary
(``lora_suite.harness.verdict``), ``ledger record`` refuses what ``--record`` refuses, and a store path is checked as
``--report-dir`` is (issue 56, item 1)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lora_suite.cli import main
from lora_suite.harness.verdict import LEDGER_WORD, verdict_of_json
from lora_suite.results import ledger

RUNS = Path(__file__).resolve().parents[2] / "fixtures" / "runs"
GPU = {"gpu_name": "NVIDIA H100 80GB HBM3", "git_commit": "abc"}


def _report(outcomes, checks=(), not_applicable=(), status="complete", env=GPU) -> dict:
    return {
        "run_id": "20261127T000000Z-quick",
        "status": status,
        "environment": dict(env),
        "selection": "quick",
        "checks": list(checks),
        "outcomes": list(outcomes),
        "not_applicable": list(not_applicable),
    }


SKIPPED = {"test": "t.py::a", "outcome": "skipped", "reason": "Skipped: VRAM pre-check: 1.0 GiB free"}
PASSED = {"test": "t.py::b", "outcome": "passed"}
CHECK = {"test": "t.py::b", "name": "peak", "passed": True, "value": 1, "op": "<=", "threshold": 2}
BAD = dict(CHECK, passed=False, value=3)
NA = {"test": "t.py::b", "name": "x", "reason": "no NF4 base"}
CASES = [
    (_report([SKIPPED]), "not judged"),  # every test skipped: the ledger once stored this as pass
    (_report([PASSED], not_applicable=[NA]), "not judged"),  # a test that recorded only "not applicable"
    (_report([]), "not judged"),  # nothing selected
    (_report([PASSED], [CHECK]), "pass"),
    (_report([PASSED], [BAD]), "fail"),
    (_report([PASSED], [CHECK], status="terminated"), "terminated"),
    (_report([PASSED], [BAD], status="interrupted"), "interrupted"),
]


@pytest.mark.parametrize("report,word", CASES)
def test_the_ledger_row_holds_the_reports_verdict(report, word):
    (run,) = [r for r in ledger.rows_of_report(report, "r") if r["kind"] == "run"]
    assert run["verdict"] == word == LEDGER_WORD[verdict_of_json(report)[0]]


def test_the_recorded_fixture_runs_keep_their_verdicts():
    for path in sorted(RUNS.glob("*/report.json")):
        report = json.loads(path.read_text())
        (run,) = [r for r in ledger.rows_of_report(report, path.parent.name) if r["kind"] == "run"]
        assert run["verdict"] == LEDGER_WORD[verdict_of_json(report)[0]], path.parent.name


def test_ledger_record_refuses_a_run_that_saw_no_gpu_and_appends_nothing(tmp_path, capsys):
    shutil.copytree(RUNS / "20261122T061557Z-memory", tmp_path / "runs" / "20261122T061557Z-memory")
    cpu = tmp_path / "runs" / "20261127T000000Z-quick"
    cpu.mkdir()
    (cpu / "report.json").write_text(json.dumps(_report([SKIPPED], env={"gpu_name": None})))
    led = tmp_path / "ledger.jsonl"
    assert main(["ledger", "record", str(tmp_path / "runs"), "--ledger", str(led)]) == 2
    err = capsys.readouterr().err
    assert "20261127T000000Z-quick: it saw no GPU" in err and "nothing was appended" in err, err
    assert not led.exists()
    shutil.rmtree(cpu)
    assert main(["ledger", "record", str(tmp_path / "runs"), "--ledger", str(led)]) == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["ledger", "record", "RUN", "--ledger", "{tmp}/no/such/folder/results.sqlite"],
        ["ledger", "record", "RUN", "--ledger", "{tmp}/no/such/folder/ledger.jsonl"],
        ["quick", "--record", "--ledger", "{tmp}/no/such/folder/results.sqlite"],
    ],
    ids=["record-sqlite", "record-jsonl", "quick-record"],
)
def test_a_store_path_whose_folders_do_not_exist_is_refused(argv, tmp_path, capsys):
    run = RUNS / "20261122T061557Z-memory"
    argv = [a.replace("{tmp}", str(tmp_path)).replace("RUN", str(run)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}/no/such does not exist" in err, err  # the folder that may not be made (a new one inside it may)
    assert not (tmp_path / "no").exists()
