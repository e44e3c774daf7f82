"""What a command would take and ignore is refused, naming it (issue 56, item 3): ``selftest`` with an option of the
GPU targets, and ``compare`` of a baseline of another tier or implementation than the run's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lora_suite.cli import main

RUNS = Path(__file__).resolve().parents[2] / "fixtures" / "runs"


@pytest.mark.parametrize(
    "extra",
    [
        ["--lora-impl", "peft"],
        ["--fused-ops", "liger"],
        ["--baseline", "auto"],
        ["--record"],
        ["--record", "--ledger", "x.jsonl"],
        ["--require-gpu"],
    ],
    ids=lambda e: " ".join(e),
)
def test_selftest_refuses_the_options_of_the_gpu_targets(extra, capsys):
    assert main(["selftest", *extra]) == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert extra[0] in first and "selftest runs the framework's own CPU tests" in first, first


def _run(tmp_path: Path, fixture: str, name: str, **changes) -> Path:
    folder = tmp_path / name
    shutil.copytree(RUNS / fixture, folder)
    report = json.loads((folder / "report.json").read_text())
    report.update(changes)
    (folder / "report.json").write_text(json.dumps(report))
    return folder


def test_compare_refuses_a_baseline_of_another_tier_naming_both(tmp_path, capsys):
    base = _run(tmp_path, "20261122T061702Z-convergence", "base")
    run = _run(tmp_path, "20261122T104642Z-quick", "run")
    assert main(["compare", str(base), str(run)]) == 2
    err = capsys.readouterr().err
    assert "tier 'convergence'" in err and "'quick'" in err and "same tier" in err, err


def test_compare_refuses_a_baseline_of_another_implementation_naming_both(tmp_path, capsys):
    base = _run(tmp_path, "20261122T104642Z-quick", "base")
    run = _run(tmp_path, "20261122T104642Z-quick", "run", implementation={"name": "peft"})
    assert main(["compare", str(base), str(run)]) == 2
    err = capsys.readouterr().err
    assert "'cupy'" in err and "'peft'" in err, err


def test_compare_of_the_same_tier_and_implementation_still_compares(tmp_path, capsys):
    base = _run(tmp_path, "20261122T104642Z-quick", "base")
    run = _run(tmp_path, "20261122T104642Z-quick", "run")
    assert main(["compare", str(base), str(run)]) == 0
    assert "no regression" in capsys.readouterr().out
