"""lora_suite.results.history on the CPU: from committed GPU reports and from fixture reports written here."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from lora_suite.results.history import collect, figures_of, main, run_time

ROOT = Path(__file__).resolve().parents[3]
REPORTS = Path(__file__).resolve().parents[2] / "fixtures" / "runs"  # recorded run excerpts (README there)
RUNS = [
    "20261122T134049Z-memory",
    "20261121T055114Z-memory",
    "20261122T134017Z-quick",
    "20261122T104642Z-quick",
    "20261124T055553Z-scorecard/20261124T055814Z-memory-cupy",
]


def _report(root: Path, name: str, checks, *, gpu="NVIDIA H200", impl="cupy", selection="memory", commit="abc1234"):
    d = root / name
    d.mkdir(parents=True)
    (d / "report.json").write_text(
        json.dumps(
            {
                "schema_version": 3,
                "run_id": name,
                "selection": selection,
                "status": "complete",
                "environment": {"gpu_name": gpu, "git_commit": commit},
                "implementation": {"name": impl},
                "summary": {},
                "outcomes": [],
                "not_applicable": [],
                "series": [],
                "notes": [],
                "checks": [
                    {"test": "t::a", "name": n, "value": v, "op": op, "threshold": t, "passed": ok}
                    for n, v, op, t, ok in checks
                ],
            }
        )
    )
    return d


def test_committed_runs_group_by_gpu_implementation_and_tier_and_draw_their_figures(tmp_path):
    for run in RUNS:
        shutil.copytree(REPORTS / run, tmp_path / "r" / Path(run).name)
    groups = {g.title: g for g in collect([tmp_path / "r"])}
    memory = groups["NVIDIA H200 · cupy · memory"]
    assert len(memory.runs) == 3
    peak = memory.figures["peak allocated VRAM"]
    assert len(peak) == 3 and all(0 < p.value <= 1.5 for p in peak)
    assert {p.threshold for p in peak} == {1.5} and all(p.op == "<=" for p in peak)
    assert [p.when for p in peak] == sorted(p.when for p in peak)
    assert "NVIDIA H200 · cupy · quick" in groups
    assert main([str(tmp_path / "out" / "h.html"), str(tmp_path / "r")]) == 0
    md = (tmp_path / "out" / "history.md").read_text()
    assert "## NVIDIA H200 · cupy · memory" in md and "| peak allocated VRAM |" in md
    page = (tmp_path / "out" / "h.html").read_text()
    data = json.loads(page.split("<script id='data' type='application/json'>")[1].split("</script>")[0])
    assert len(data["groups"]) == len(groups) and "Plotly" in page and "<script src=" not in page  # offline
    titles = {" · ".join(data["s"][g[k]] for k in ("gpu", "impl", "tier")) for g in data["groups"]}
    assert titles == set(groups)


def test_a_failed_figure_and_a_gate_regression_are_marked(tmp_path):
    root = tmp_path / "r"
    _report(root, "20261120T000000Z-memory", [("peak allocated VRAM", 1.2, "<=", 1.5, True)])
    _report(root, "20261121T000000Z-memory", [("peak allocated VRAM", 1.7, "<=", 1.5, False)], commit="def5678")
    (g,) = collect([root])
    assert [p.passed for p in g.figures["peak allocated VRAM"]] == [True, False]
    assert list(g.regressions) == ["20261121T000000Z-memory"]  # passed, then failed: the gate's regression
    main([str(tmp_path / "h.html"), str(root)])
    md = (tmp_path / "history.md").read_text()
    assert "**regression** in `20261121T000000Z-memory`" in md and "1.7 **FAIL** | <= 1.5" in md


def test_gpus_and_implementations_are_never_drawn_on_one_line(tmp_path):
    root = tmp_path / "r"
    _report(root, "20261120T000000Z-memory", [("peak", 1.2, "<=", 1.5, True)])
    _report(root, "20261120T010000Z-memory", [("peak", 1.3, "<=", 1.5, True)], gpu="NVIDIA H100 80GB HBM3")
    _report(root, "20261120T020000Z-memory", [("peak", 2.4, "<=", 3.0, True)], impl="peft")
    assert sorted(g.title for g in collect([root])) == [
        "NVIDIA H100 80GB HBM3 · cupy · memory",
        "NVIDIA H200 · cupy · memory",
        "NVIDIA H200 · peft · memory",
    ]


def test_figures_are_numeric_checks_with_ordered_thresholds_and_bench_rows():
    report = {
        "checks": [
            {"name": "steps beyond the band (first: [3, 4])", "value": 2, "op": "==", "threshold": 0, "passed": False},
            {"name": "loss drop", "value": 0.38, "op": ">=", "threshold": 0.3, "passed": True},
            {"name": "path", "value": "cupy", "op": "==", "threshold": "cupy", "passed": True},
            {"name": "slope (first: x)", "value": 0.01, "op": "<=", "threshold": 0.1, "passed": True},
        ],
        "series": [
            {
                "name": "tokens/s ÷ PEFT's",
                "columns": ["case", "run", "÷ PEFT eager"],
                "rows": [["c", "cupy-eager", 1.1], ["c", "peft-eager", None]],
            }
        ],
    }
    got = figures_of(report)
    assert set(got) == {"loss drop", "slope", "tokens/s ÷ PEFT's: c cupy-eager: ÷ PEFT eager"}
    assert got["slope"] == (0.01, 0.1, "<=", True)


def test_a_run_time_comes_from_the_run_id_else_the_environment(tmp_path):
    assert run_time({"run_id": "20261124T055553Z-quick"}, tmp_path).hour == 5
    assert run_time({"environment": {"timestamp_utc": "2026-11-24T01:02:03+00:00"}}, tmp_path / "x").minute == 2
    with pytest.raises(ValueError, match="no run time"):
        run_time({}, tmp_path / "x")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["out.html"], "usage"),
        (["out.txt", "reports"], "must be an .html file, got 'out.txt'"),
        (["out.html", "/nonexistent/dir"], "report directory /nonexistent/dir does not exist"),
    ],
)
def test_bad_arguments_are_refused_naming_them(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_directory_without_reports_and_a_broken_report_are_named(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "h.html"), str(tmp_path / "empty")]) == 2
    assert f"no report.json under {tmp_path / 'empty'}" in capsys.readouterr().err
    bad = tmp_path / "bad" / "20261120T000000Z-quick"
    bad.mkdir(parents=True)
    (bad / "report.json").write_text("{not json")
    assert main([str(tmp_path / "h.html"), str(tmp_path / "bad")]) == 2
    assert "not a readable report.json" in capsys.readouterr().err
    assert not (tmp_path / "h.html").exists(), "nothing written half"


def test_gpu_test_history_writes_the_page_and_refuses_a_bad_option(tmp_path):
    root = tmp_path / "r"
    _report(root, "20261120T000000Z-memory", [("peak", 1.2, "<=", 1.5, True)])
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-test.sh"), "history", str(root), "--html", str(tmp_path / "o" / "h.html")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "o" / "h.html").is_file() and (tmp_path / "o" / "history.md").is_file()
    bad = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-test.sh"), "history", "--html", "x.md"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--html needs a path ending in .html, got 'x.md'" in bad.stderr
