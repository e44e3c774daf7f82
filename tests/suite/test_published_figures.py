"""The README's published figures are ledger rows (issue 43, item 3; README.md first, the docs to follow): every run it
cites is in ``reports/ledger.jsonl``; a check count it prints beside a run ("judged by N checks ... (run R") is that
run's count of passed checks there; a mutation score it prints ("score S (K killed, V survived, E equivalent of T
mutants) in W s") is the figures of a mutation run of the ledger group it names. A figure edited to a value the
ledger does not hold fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = re.compile(r"\b(\d{8}T\d{6}Z-[A-Za-z0-9_.-]*[A-Za-z0-9_])")
CHECKS = re.compile(r"judged by (\d+) checks[^()]*\(run (\d{8}T\d{6}Z-[A-Za-z0-9_.-]*[A-Za-z0-9_])")
SCORE = re.compile(
    r"score (\d\.\d+) \((\d+) killed, (\d+) survived,\s+(\d+) equivalent of (\d+)(?: mutants?)?\) in (\d+) s", re.S
)
GROUP = re.compile(r"ledger group `([^`]+)`")


def _rows() -> list[dict]:
    return [json.loads(line) for line in (ROOT / "reports" / "ledger.jsonl").read_text().splitlines() if line.strip()]


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def cited_runs_missing(text: str, rows: list[dict]) -> list[str]:
    known = {r["run_id"] for r in rows}
    return sorted({run for run in RUN.findall(text) if run not in known})


def wrong_check_counts(text: str, rows: list[dict]) -> list[str]:
    passed: dict[str, int] = {}
    for r in rows:
        if r["kind"] == "check" and r["verdict"] == "pass":
            passed[r["run_id"]] = passed.get(r["run_id"], 0) + 1
    return [
        f"{n} checks for {run}: the ledger has {passed.get(run, 0)}"
        for n, run in CHECKS.findall(text)
        if passed.get(run) != int(n)
    ]


def wrong_scores(text: str, rows: list[dict]) -> list[str]:
    """Each printed mutation score against the mutation runs of the ledger group its paragraph names."""
    runs: dict[str, dict[str, float]] = {}
    for r in rows:
        if r["run_id"].split("-", 1)[-1].startswith("mutate"):
            fig = runs.setdefault(r["run_id"], {"group": r["group"]})
            if r["kind"] == "check" and r["check"].startswith("mutation score"):
                fig["score"] = r["value"]
            elif r["kind"] == "bench":
                fig[r["check"].rsplit(": ", 1)[-1]] = r["value"]
    bad = []
    for para in _paragraphs(text):
        groups = set(GROUP.findall(para))
        for score, killed, survived, equivalent, total, wall in SCORE.findall(para):
            want = (float(score), int(killed), int(survived), int(equivalent), int(total), int(wall))
            found = [
                f
                for f in runs.values()
                if f["group"] in groups
                and (
                    round(f.get("score", -1), len(score) - 2),
                    f.get("mutants killed"),
                    f.get("mutants survived"),
                    f.get("mutants equivalent"),
                    sum(f.get(k, 0) for k in ("mutants killed", "mutants survived", "mutants equivalent")),
                    round(f.get("wall s", -1)),
                )
                == want
            ]
            if not found:
                bad.append(
                    f"score {score} ({killed}/{survived}/{equivalent} of {total}, {wall} s) in no run of {groups}"
                )
    return bad


def test_the_readme_cites_only_runs_in_the_ledger_and_prints_their_figures():
    text, rows = (ROOT / "README.md").read_text(), _rows()
    assert cited_runs_missing(text, rows) == []
    assert CHECKS.findall(text) and wrong_check_counts(text, rows) == []
    assert len(SCORE.findall(text)) >= 2 and wrong_scores(text, rows) == []


@pytest.mark.parametrize(
    "old, new",
    [
        ("judged by 161 checks", "judged by 162 checks"),
        ("score 0.931 (121 killed", "score 0.941 (121 killed"),
        ("24 equivalent of 151) in 323 s", "24 equivalent of 151) in 300 s"),
        ("20261126T054731Z-quick-plain_lora_make", "20261126T054732Z-quick-plain_lora_make"),
    ],
)
def test_a_figure_edited_to_a_value_the_ledger_does_not_hold_fails(old, new):
    text, rows = (ROOT / "README.md").read_text(), _rows()
    assert old in text
    edited = text.replace(old, new)
    assert cited_runs_missing(edited, rows) or wrong_check_counts(edited, rows) or wrong_scores(edited, rows)
