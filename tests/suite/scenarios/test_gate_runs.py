"""``scenarios.gate_runs``: a target run as a user runs it leaves its one run folder; three runs go to clean,
planted and again, the planted one with the plant's arguments, and both comparisons are made against the first."""

from __future__ import annotations

import json

from lora_suite.scenarios import gate_runs as G


def test_a_target_run_returns_its_run_folder(tmp_path):
    run = G.run_target(tmp_path / "out", "quick", "--", "-k", "test_quick_tier")
    assert run.parent == tmp_path / "out" and json.loads((run / "report.json").read_text())["selection"] == "quick"


def test_clean_planted_again_runs_and_compares_against_the_first(tmp_path, monkeypatch):
    calls, compared = [], []

    def run(folder, *extra):
        calls.append((folder.name, extra))
        return folder

    monkeypatch.setattr(G, "compare", lambda base, other: compared.append((base.name, other.name)) or other.name)
    folders, results = G.clean_planted_again(tmp_path / "runs", run, ("-p", "plant"))
    assert calls == [("clean", ()), ("planted", ("-p", "plant")), ("again", ())]
    assert [f.name for f in folders] == ["clean", "planted", "again"] and (tmp_path / "runs").is_dir()
    assert compared == [("clean", "planted"), ("clean", "again")] and results == ["planted", "again"]
