"""lora_suite.results.acceptance and scripts/load-acceptance.sh on the CPU: the summary of runs by condition, and bad input."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from lora_suite.results.acceptance import collect, figure_ranges, main, plant_tallies, run_counts

ROOT = Path(__file__).resolve().parents[3]


def _run(root: Path, condition: str, run: str, value: float, threshold: float = 0.05, status: str = "complete"):
    d = root / condition / run
    d.mkdir(parents=True)
    passed = value <= threshold
    report = {
        "run_id": run,
        "selection": "extended",
        "status": status,
        "summary": {"passed": int(passed), "failed": int(not passed)},
        "environment": {"gpu_name": "NVIDIA H200", "git_commit": "abc1234"},
        "checks": [
            {
                "test": "t::x",
                "name": "device time per step drift (clipped kernel durations), early vs late",
                "value": value,
                "op": "<=",
                "threshold": threshold,
                "passed": passed,
            }
        ],
    }
    (d / "report.json").write_text(json.dumps(report))


def test_runs_by_condition_with_figure_ranges(tmp_path, capsys):
    _run(tmp_path, "quiet", "r1", 0.001)
    _run(tmp_path, "loaded", "r2", 0.003, threshold=0.06)
    assert main([str(tmp_path)]) == 0
    runs = collect(tmp_path)
    assert [(r["condition"], r["passed"]) for r in runs] == [("loaded", True), ("quiet", True)]
    (row,) = figure_ranges(runs)
    assert row[:6] == ("extended", "device time per step drift", 2, 0, 0.001, 0.003) and row[7:] == (0.05, 0.06)
    md = (tmp_path / "acceptance.md").read_text()
    assert md.startswith("# Load acceptance: 2 runs, 0 failed") and "| quiet | r1 | extended | PASS |" in md
    assert json.loads((tmp_path / "acceptance.json").read_text())["runs"][0]["run"] == "r2"
    assert "2 runs, 0 failed" in capsys.readouterr().out


def _plants(root: Path, condition: str, run: str, caught: list[bool]):
    d = root / condition / run
    d.mkdir(parents=True)
    checks = [
        {
            "test": f"tiers/selftest_gpu/test_x.py::test_leak_is_caught[round{i + 1}]",
            "name": "planted leak fails",
            "value": not c,
            "op": "==",
            "threshold": False,
            "passed": c,
        }
        for i, c in enumerate(caught)
    ]
    report = {
        "run_id": run,
        "selection": "selftest_gpu",
        "status": "complete",
        "summary": {"checks_passed": sum(caught), "checks_failed": len(caught) - sum(caught)},
        "environment": {
            "gpu_name": "NVIDIA H200",
            "git_commit": "def5678 (from $LORA_SUITE_GIT_COMMIT)",
            "host_gpus": 2,
        },
        "checks": checks,
    }
    (d / "report.json").write_text(json.dumps(report))


def test_plant_rounds_are_tallied_per_condition_and_machines_named_per_run(tmp_path):
    _plants(tmp_path, "quiet", "p1", [True, True])
    _plants(tmp_path, "loaded", "p2", [True, False, True])
    _run(tmp_path, "quiet", "r1", 0.001)
    runs = collect(tmp_path)
    assert plant_tallies(runs) == {"test_leak_is_caught @ def5678": {"loaded": [2, 3], "quiet": [2, 2]}}
    assert run_counts(runs) == {"selftest_gpu": {"loaded": [1, 1], "quiet": [1, 0]}, "extended": {"quiet": [1, 0]}}
    assert main([str(tmp_path)]) == 1  # the round that missed its plant fails the acceptance
    md = (tmp_path / "acceptance.md").read_text()
    assert "| test_leak_is_caught @ def5678 | 2/3 | 2/2 | 4/5 |" in md
    assert "| selftest_gpu | 1 (1) | 1 (0) | 2 (1) |" in md and "| extended | - | 1 (0) | 1 (0) |" in md
    assert "| loaded | p2 | selftest_gpu | FAIL | 2 / 1 | NVIDIA H200 | 2 | def5678 |" in md
    assert "commits abc1234, def5678 (from $LORA_SUITE_GIT_COMMIT)" in md


def test_a_failed_or_interrupted_run_fails_the_acceptance(tmp_path, capsys):
    _run(tmp_path, "quiet", "r1", 0.2)
    _run(tmp_path, "paired", "r2", 0.0, status="terminated")
    assert main([str(tmp_path)]) == 1
    assert "2 failed: paired/r2, quiet/r1" in capsys.readouterr().out


def test_an_empty_directory_and_bad_usage_are_named(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no <condition>/<run>/report.json under it" in capsys.readouterr().err
    assert main([]) == 2


def test_load_acceptance_script_refuses_bad_conditions_and_counts(tmp_path):
    script = ROOT / "scripts" / "load-acceptance.sh"
    bad = subprocess.run(["bash", str(script), str(tmp_path), "noisy"], capture_output=True, text=True)
    assert bad.returncode == 2 and "CONDITION must be quiet, paired or loaded, got 'noisy'" in bad.stderr
    bad = subprocess.run(["bash", str(script), str(tmp_path), "quiet", "two"], capture_output=True, text=True)
    assert bad.returncode == 2 and "run counts must be whole numbers >= 0, got 'two'" in bad.stderr
    assert not (tmp_path / "quiet").exists()  # nothing written before the arguments are checked


def test_a_run_that_judged_nothing_is_not_judged_not_passed(tmp_path, capsys):
    """The acceptance reads each run's verdict by the one rule (harness.verdict): a complete run whose tests all
    skipped judged nothing, and fails the acceptance as NOT JUDGED (it once counted as passed)."""
    _run(tmp_path, "quiet", "r1", 0.001)
    d = tmp_path / "quiet" / "r2"
    d.mkdir(parents=True)
    skipped = {"test": "t::x", "outcome": "skipped", "reason": "Skipped: no CUDA GPU"}
    report = {"run_id": "r2", "selection": "extended", "status": "complete", "checks": [], "outcomes": [skipped]}
    (d / "report.json").write_text(json.dumps(report))
    runs = {r["run"]: r for r in collect(tmp_path)}
    assert runs["r2"]["verdict"] == "NOT JUDGED" and not runs["r2"]["passed"]
    assert runs["r1"]["verdict"] == "PASS" and runs["r1"]["passed"]
    assert main([str(tmp_path)]) == 1
    assert "| quiet | r2 | extended | NOT JUDGED |" in (tmp_path / "acceptance.md").read_text()
