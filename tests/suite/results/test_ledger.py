"""lora_suite.results.ledger: run folders become rows; the history page and the scorecard render from rows alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lora_suite.cli import main
from lora_suite.results import ledger
from tests.conftest import SCORECARD_RUNS

RUNS = Path(__file__).resolve().parents[2] / "fixtures" / "runs"  # recorded run excerpts (README there)


def test_rows_carry_every_judged_figure_with_its_provenance():
    report = json.loads((RUNS / "20261122T061557Z-memory" / "report.json").read_text())
    rows = ledger.rows_of_report(report, "20261122T061557Z-memory", "reports")
    assert all(set(r) == set(ledger.FIELDS) for r in rows)
    run = [r for r in rows if r["kind"] == "run"]
    assert len(run) == 1 and run[0]["verdict"] == "pass" and run[0]["gpu"] == report["environment"]["gpu_name"]
    checks = [r for r in rows if r["kind"] == "check"]
    assert len(checks) == len(report["checks"])
    peak = next(r for r in checks if r["check"] == "peak allocated VRAM")
    assert peak["op"] == "<=" and isinstance(peak["threshold"], float) and peak["source"]


def test_record_appends_once_and_history_and_scorecard_render_from_the_ledger(tmp_path, capsys):
    runs = tmp_path / "campaign"
    for name in SCORECARD_RUNS:
        shutil.copytree(RUNS / name, runs / name)
    led = tmp_path / "ledger.jsonl"
    assert main(["ledger", "record", str(runs), "--ledger", str(led)]) == 0
    n = len(ledger.read(led))
    assert n > 100 and main(["ledger", "record", str(runs), "--ledger", str(led)]) == 0
    assert len(ledger.read(led)) == n, "a run already in the ledger is not appended twice"
    shutil.rmtree(runs)  # from here on only the ledger is at hand
    assert main(["render-scorecard", str(tmp_path / "card"), "--ledger", str(led), "--group", "campaign"]) == 0
    md = (tmp_path / "card" / "scorecard.md").read_text()
    assert "| peft | pass, " in md and "| cupy | pass" in md and "peft-captured" in md
    assert "Depth: checks judged / records declared not applicable, per tier" in md
    assert main(["history", "--ledger", str(led), "--html", str(tmp_path / "h" / "history.html")]) == 0
    page = (tmp_path / "h" / "history.md").read_text()
    assert "## NVIDIA H100 80GB HBM3 · cupy · memory" in page and "| peak allocated VRAM |" in page
    assert main(["ledger", "show", "--ledger", str(led), "--check", "peak allocated VRAM"]) == 0
    assert "peak allocated VRAM" in capsys.readouterr().out


def test_a_broken_ledger_line_is_named(tmp_path, capsys):
    led = tmp_path / "ledger.jsonl"
    led.write_text('{"run_id": "x"}\n')
    with pytest.raises(ledger.LedgerError, match=r"ledger.jsonl:1: not a ledger row"):
        ledger.read(led)
    assert main(["history", "--ledger", str(led), "--html", str(tmp_path / "h.html")]) == 2
    assert "not a ledger row" in capsys.readouterr().err


def test_the_committed_ledger_is_whole_and_holds_the_readme_runs():
    rows = ledger.read(Path(__file__).resolve().parents[3] / "reports" / "ledger.jsonl.gz")
    runs = {r["run_id"] for r in rows}
    assert {"20261124T162716Z-quick", "20261124T163037Z-memory"} <= runs  # cited in README.md


def test_rows_after_their_run_row_are_written_short_and_read_whole(tmp_path):
    """The ledger's short rows (the run's fields once, on its run row): a round trip gives every row whole, and a
    short row with no run row before it is an error naming the line."""
    runs = tmp_path / "campaign"
    shutil.copytree(RUNS / SCORECARD_RUNS[0], runs / SCORECARD_RUNS[0])
    rows = ledger.rows_of_runs([runs])
    led = tmp_path / "ledger.jsonl"
    ledger.append(led, rows)
    lines = led.read_text().splitlines()
    assert len(lines) == len(rows) and '"gpu"' in lines[0] and all('"gpu"' not in line for line in lines[1:])
    assert sum(map(len, lines)) < 0.7 * sum(len(json.dumps(r)) for r in rows)
    assert ledger.read(led) == [{k: r[k] for k in ledger.FIELDS} for r in rows]
    led.write_text("\n".join(lines[1:]) + "\n")
    with pytest.raises(ledger.LedgerError, match=r"ledger.jsonl:1: not a ledger row .*after its run's run row"):
        ledger.read(led)


def test_the_fused_tables_rounds_and_kernel_kinds_are_recorded_figures():
    report = {
        "status": "complete",
        "series": [
            {
                "name": "fused table, eager (GPU-bound batches): median ms per step part, peak GiB",
                "columns": ["case", "round", "stack", "fwd ms, round", "bwd ms, round", "step ms, round"],
                "rows": [["7b", 1, "cupy+liger", 90.0, 70.0, 171.9]],
            },
            {
                "name": "fused table: kernel time by kind",
                "columns": ["case", "stack", "kernel kind", "ms per step", "share"],
                "rows": [["7b", "cupy+liger", "GEMM (cuBLAS)", 87.22, 0.784]],
            },
        ],
    }
    got = {r["check"]: r["value"] for r in ledger.rows_of_report(report, "run", "g") if r["kind"] == "bench"}
    assert got["fused table, eager (GPU-bound batches): median ms per step p: 7b 1 cupy+liger: step ms, round"] == 171.9
    assert got["fused table: kernel time by kind: 7b cupy+liger GEMM (cuBLAS): ms per step"] == 87.22
