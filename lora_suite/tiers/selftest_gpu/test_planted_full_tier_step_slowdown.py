"""selftest-gpu: the nightly gate on the full tier's headline figures. The full tier runs three times, as a user runs
it (``python -m lora_suite full``, its own process and run report): clean, with the planted slowdown of its training
step (``lora_suite.scenarios.full_tier_step_slowdown:cupy_slowed``: about 20% more device time per captured step),
and clean again. ``compare`` of the planted run against the first clean one must fail naming the captured step's
device time; of the two clean runs, it must pass. The figures and both comparisons go into this run's report; the
three full runs' folders are kept inside this run's folder (``full-runs/``) so that ``ledger record`` can keep them
too. (Until issue 58 this file was test_planted_step_slowdown.py: the ledger's rows of that time carry that name.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lora_suite.harness.report import Series
from lora_suite.scenarios import gate_runs as G

pytestmark = [pytest.mark.gpu, pytest.mark.selftest_gpu]
FIGURE = "captured step device time"
PLANT = "lora_suite.scenarios.full_tier_step_slowdown:cupy_slowed"


def _full(out: Path, *extra: str) -> Path:
    return G.run_target(out, "full", *extra)


def _figure(run: Path) -> float:
    figures = json.loads((run / "report.json").read_text()).get("figures", [])
    return next(f["value"] for f in figures if f["name"] == FIGURE)


def test_a_slower_captured_step_fails_the_gate_and_a_clean_rerun_passes_it(tier, tmp_path, request):
    report_dir = request.config.getoption("report_dir")
    runs = Path(report_dir) / "full-runs" if report_dir else tmp_path
    folders, (slow, same) = G.clean_planted_again(runs, _full, ("--lora-impl", PLANT))
    rows = [(name, f"{_figure(r):.3f}", str(r.name)) for name, r in zip(("clean", "planted", "clean again"), folders)]
    tier.report.add_series(
        Series(
            tier.nodeid, "full tier: captured step device time (ms)", ("run", "median ms", "run folder"), tuple(rows)
        )
    )
    G.note_comparisons(tier.report.notes, slow, same)
    caught = slow.returncode == 1 and any(FIGURE in ln and "REGRESSION" in ln for ln in slow.stdout.splitlines())
    tier.check("planted ~20% slower captured step: compare fails naming its device time", caught, "==", True)
    tier.check("two clean full runs: compare passes", same.returncode, "==", 0, detail=same.stdout[-500:])
