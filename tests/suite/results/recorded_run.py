"""One recorded run (``tests/fixtures/runs``) copied as many times as a test needs runs: the ledger's and the results
store's tests of concurrent writers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

RUN = Path(__file__).resolve().parents[2] / "fixtures" / "runs" / "20261122T061557Z-memory"


def run_copies(tmp_path: Path, n: int) -> list[Path]:
    """``n`` copies of ``RUN``, each with its own run id (and folder of that name), under ``tmp_path / "runs"``."""
    out = []
    for i in range(n):
        d = tmp_path / "runs" / f"20261122T0616{i:02d}Z-memory"
        shutil.copytree(RUN, d)
        report = json.loads((d / "report.json").read_text())
        report["run_id"] = d.name
        (d / "report.json").write_text(json.dumps(report))
        out.append(d)
    return out
