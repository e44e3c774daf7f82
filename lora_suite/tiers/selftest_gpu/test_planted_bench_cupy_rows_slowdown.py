"""selftest-gpu: the regression gate on the layer benchmark's rows. The Llama-7B rows of the layer benchmark
(``lora_suite/benchmarks/test_bench_lora_linear.py``, ``test_forward_backward``: base, torch, PEFT, cupy and
cupy-nf4 at three shapes) run three times, as a user runs them (``python -m lora_suite bench``, its own process and
run folder): clean, with the planted slowdown of the cupy rows (the pytest plugin
``lora_suite.scenarios.bench_cupy_rows_slowdown``, loaded by module name with ``-p``: each cupy and cupy-nf4 step
gets 20% of its own median device time more), and clean again. ``compare`` of the planted run against the first
clean one must exit 1 naming cupy rows, and no other row; of the two clean runs, it must pass. Each row's medians go
into this run's report, both comparisons into its notes; the three bench runs' folders are kept inside this run's
folder (``bench-runs/``) so that ``ledger record`` can keep them too.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from lora_suite.harness.report import Series
from lora_suite.scenarios import gate_runs as G

pytestmark = [pytest.mark.gpu, pytest.mark.selftest_gpu]
PLANT = "lora_suite.scenarios.bench_cupy_rows_slowdown"
ROWS = "test_forward_backward and llama7b"  # the 7B rows: their spread on a quiet machine is 1-7%, below 20%
CUPY_ROW = re.compile(r"-cupy(-nf4)?\]")


def _bench(out: Path, *extra: str) -> Path:
    return G.run_target(out, "bench", "--", "-k", ROWS, *extra, result="benchmark.json")


def _medians(run: Path) -> dict[str, float]:
    """Each row's CUDA-event median (ms), by the row's name in its test (``test_forward_backward[<shape>-<impl>]``)."""
    rows = json.loads((run / "benchmark.json").read_text()).get("benchmarks", [])
    return {r["name"]: r["extra_info"]["cuda_median_ms"] for r in rows}


def _regressions(compared: subprocess.CompletedProcess) -> list[str]:
    """The benchmark rows ``compare`` calls a regression (the last field of each such line: the row's name)."""
    lines = compared.stdout.splitlines()
    return [ln.split()[-1] for ln in lines if ln.startswith("benchmark") and " REGRESSION " in ln]


def test_slower_cupy_rows_fail_the_gate_and_a_clean_rerun_passes_it(tier, tmp_path, request):
    report_dir = request.config.getoption("report_dir")
    runs = Path(report_dir) / "bench-runs" if report_dir else tmp_path
    folders, (slow, same) = G.clean_planted_again(runs, _bench, ("-p", PLANT))
    medians = [_medians(r) for r in folders]
    rows = tuple((name, *(f"{m.get(name, float('nan')):.4f}" for m in medians)) for name in sorted(medians[0]))
    columns = ("row", "clean ms", "planted ms", "clean again ms")
    tier.report.add_series(Series(tier.nodeid, "layer benchmark, 7B rows: CUDA-event median (ms)", columns, rows))
    G.note_comparisons(tier.report.notes, slow, same)
    flagged = _regressions(slow)
    cupy = [row for row in flagged if CUPY_ROW.search(row)]
    detail = slow.stdout[-800:] or slow.stderr[-800:]
    tier.check("planted 20% slower cupy rows: compare's exit code", slow.returncode, "==", 1, detail=detail)
    tier.check("planted 20% slower cupy rows: cupy rows compare calls a regression", len(cupy), ">=", 1, detail=detail)
    others = [row for row in flagged if row not in cupy]
    tier.check("planted: other rows compare calls a regression", len(others), "==", 0, detail=" | ".join(others))
    tier.check("two clean bench runs: compare passes", same.returncode, "==", 0, detail=same.stdout[-800:])
