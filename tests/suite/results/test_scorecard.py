"""lora_suite.results.scorecard on the CPU, from committed GPU reports of cupy and PEFT (H100, 22ff8ab) and a bench run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from lora_suite.results.scorecard import build, cell_of, main
from tests.conftest import SCORECARD_RUNS

REPORTS = Path(__file__).resolve().parents[2] / "fixtures" / "runs"  # recorded run excerpts (README there)


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "reports"
    for run in SCORECARD_RUNS:
        shutil.copytree(REPORTS / run, root / run)
    return root


def _report(root, run):
    return json.loads((root / run / "report.json").read_text())


def test_the_matrix_curves_peaks_and_speeds_from_real_reports(tmp_path, capsys):
    root = _copy(tmp_path)
    card = build([root])
    assert sorted(card.matrix) == ["cupy", "peft", "torch"]  # torch took turns in the bench run only
    assert {t: c.verdict for t, c in card.matrix["peft"].items()} == {
        "quick": "pass",
        "convergence": "pass",
        "memory": "pass",
        "benchmark": "measured",
    }
    assert {t: c.verdict for t, c in card.matrix["torch"].items()} == {"benchmark": "measured"}
    assert "PEFT builds a 4-bit base only through bitsandbytes" in " ".join(
        card.matrix["peft"]["memory"].not_applicable
    )
    assert card.matrix["cupy"]["memory"].not_applicable == []
    assert set(card.losses) == {"cupy", "peft"} and len(card.losses["peft"][0]) == len(card.losses["peft"][1]) > 10
    assert card.peaks_gib["peft"] > card.peaks_gib["cupy"]  # PEFT on the bf16 base, cupy on NF4
    assert card.peak_base == {"peft": "16-bit", "cupy": "NF4"}
    assert card.speed_vs_peft_eager["smollm2-qv-r8-8x256 peft-captured"] == 4.214
    assert main([str(tmp_path / "out"), str(root)]) == 0
    md = (tmp_path / "out" / "scorecard.md").read_text()
    assert "| peft | pass, " in md and "Not applicable, as each implementation declared it:" in md
    peft_quick = card.matrix["peft"]["quick"]
    assert peft_quick.judged == len(_report(root, "20261122T055613Z-quick-peft")["checks"]) > 0, "the run's checks"
    assert f"| peft | pass, {peft_quick.judged} checks [" in md
    depth = [line for line in md.splitlines() if line.startswith("| peft | ") and " / " in line]
    assert depth == [
        "| peft | "
        + " | ".join(
            f"{card.matrix['peft'][t].judged} / {len(card.matrix['peft'][t].not_applicable)}"
            for t in ("quick", "convergence", "memory")
        )
        + f" | {sum(card.matrix['peft'][t].judged for t in ('quick', 'convergence', 'memory'))} |"
    ]
    assert "![scorecard-loss.png](scorecard-loss.png)" in md and (tmp_path / "out" / "scorecard-peak.png").is_file()
    page = (tmp_path / "out" / "scorecard.html").read_text()
    assert page.count("data:image/png;base64,") == 3 and 'title="' in page
    assert json.loads((tmp_path / "out" / "scorecard.json").read_text())["peaks_gib"]["cupy"] == card.peaks_gib["cupy"]
    assert "3 implementation(s)" in capsys.readouterr().out


def test_a_failing_or_broken_run_is_a_finding_not_an_error(tmp_path):
    root = _copy(tmp_path)
    report = json.loads((root / SCORECARD_RUNS[0] / "report.json").read_text())
    report["checks"][0]["passed"] = False
    (root / SCORECARD_RUNS[0] / "report.json").write_text(json.dumps(report))
    cell = cell_of(report, SCORECARD_RUNS[0])
    assert cell.verdict == "fail" and cell.failed == [report["checks"][0]["name"]]
    assert cell_of(dict(report, status="interrupted"), "r").verdict == "interrupted"
    assert (
        cell_of(
            {"status": "complete", "checks": [], "summary": {}, "not_applicable": [{"name": "x", "reason": "no NF4"}]},
            "r",
        ).verdict
        == "not judged"  # only "not applicable" recorded: it judged nothing (issue 56: the report's own verdict)
    )
    assert main([str(tmp_path / "out"), str(root)]) == 0
    assert cell.judged == len(report["checks"])
    assert f"| peft | fail, {cell.judged} checks (1: " in (tmp_path / "out" / "scorecard.md").read_text()


def test_bad_arguments_are_named(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert main([str(tmp_path / "out"), str(tmp_path / "missing")]) == 2
    assert "missing does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "out"), str(tmp_path / "empty")]) == 2
    assert "no report.json under" in capsys.readouterr().err


def test_a_peer_that_stopped_in_the_benchmark_is_a_finding_in_its_own_cell(tmp_path):
    run = tmp_path / "r" / "20261124T000000Z-bench"
    run.mkdir(parents=True)
    table = {
        "name": "tokens/s ÷ PEFT's",
        "columns": ["case", "run", "median step ms (host)", "÷ PEFT eager"],
        "rows": [["c", "peft-eager", 10.0, None], ["c", "loralib-eager", 9.0, 1.1]],
    }
    stopped = {
        "name": "interleaved runs that stopped (findings about the implementation)",
        "columns": ["case", "run", "what stopped it"],
        "rows": [["c", "peft-bnb-captured", "round 1: RuntimeError: capture"]],
    }
    report = {
        "status": "complete",
        "selection": "benchmark",
        "implementation": {"name": "cupy"},
        "checks": [],
        "series": [table, stopped],
        "summary": {},
        "not_applicable": [
            {"name": "c torchtune captured", "reason": "no capture"},
            {"name": "c peft-bnb: bfloat16 base; the tier runs on an NF4 base", "reason": "QLoRA"},
        ],
    }
    (run / "report.json").write_text(json.dumps(report))
    card = build([tmp_path / "r"])
    assert card.matrix["loralib"]["benchmark"].verdict == "measured"
    assert card.matrix["peft-bnb"]["benchmark"].verdict == "fail"
    assert card.matrix["peft-bnb"]["benchmark"].failed == ["c peft-bnb-captured: round 1: RuntimeError: capture"]
    assert card.matrix["peft-bnb"]["benchmark"].not_applicable == [
        "c peft-bnb: bfloat16 base; the tier runs on an NF4 base: QLoRA"
    ]
    assert card.matrix["torchtune"]["benchmark"].verdict == "n/a"
    assert "cupy" not in card.matrix  # the bench run's own --lora-impl is not a row of its own


def test_repeated_reasons_are_one_note_with_their_count():
    from lora_suite.results.scorecard import summarise

    assert summarise(["a: x", "b: y", "a: x", "a: x"]) == ["a: x (×3)", "b: y"]


def test_two_bench_runs_are_never_mixed_the_first_that_measured_a_run_gives_its_ratio(tmp_path):
    def bench(name, rows):
        run = tmp_path / "r" / name
        run.mkdir(parents=True)
        table = {"name": "t", "columns": ["case", "run", "÷ PEFT eager"], "rows": rows}
        (run / "report.json").write_text(
            json.dumps(
                {
                    "status": "complete",
                    "selection": "benchmark",
                    "checks": [],
                    "implementation": {"name": "cupy"},
                    "series": [table],
                }
            )
        )

    bench("20261124T000000Z-bench", [["c", "peft-eager", None], ["c", "torch-eager", 1.2]])
    bench(
        "20261124T010000Z-bench", [["c", "peft-eager", None], ["c", "torch-eager", 0.9], ["c", "torchtune-eager", 1.1]]
    )
    card = build([tmp_path / "r"])
    assert card.speed_vs_peft_eager == {"c torch-eager": 1.2, "c torchtune-eager": 1.1}
    assert card.speed_source == {
        "c torch-eager": "20261124T000000Z-bench",
        "c torchtune-eager": "20261124T010000Z-bench",
    }


def test_lanes_that_started_in_the_same_second_keep_their_own_cells(tmp_path):
    """A scorecard's lanes start together: two implementations' quick runs with one run id (seen on an H100 at
    88062a8, cupy-fused and peft-liger) are two cells, and the ledger keeps both runs."""
    from lora_suite.results import ledger

    root = tmp_path / "reports"
    for name, impl, passed in (("r-quick-a", "impl-a", False), ("r-quick-b", "impl-b", True)):
        report = json.loads((REPORTS / SCORECARD_RUNS[0] / "report.json").read_text())
        report["run_id"] = "20261124T174353Z-quick"
        report["implementation"] = dict(report.get("implementation") or {}, name=impl)
        report["checks"][0]["passed"] = passed
        (root / name).mkdir(parents=True)
        (root / name / "report.json").write_text(json.dumps(report))
    card = build([root])
    assert card.matrix["impl-a"]["quick"].verdict == "fail" and card.matrix["impl-b"]["quick"].verdict == "pass"
    path = tmp_path / "ledger.jsonl"
    added = ledger.record(path, [root / "r-quick-a"], group="sc")
    assert added > 0 and ledger.record(path, [root / "r-quick-b"], group="sc") == added  # not taken for a, twice
    assert ledger.record(path, [root / "r-quick-b"], group="sc") == 0
