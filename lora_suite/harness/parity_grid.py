"""A parity grid in the run report (quick's fused-path and fused-loss grids against float64): one series with a row
per case (``engine.parity.GRID_COLUMNS``: the tensor worst against its tolerance, the case's verdict) and one check,
the tensors beyond tolerance, which must be none of the grid's."""

from __future__ import annotations

from lora_suite.harness.report_records import Series
from lora_suite.judges.parity import GRID_COLUMNS, grid_row


def report_grid(run_report, check, cases, grid: tuple[str, str, str], source: str, title: str = "", x: str = "x"):
    """``cases``: (label, [TensorError]) per case; ``grid``: (what, dtype config, layout). Adds the series "cupy fused
    ``title`` (default ``what``) vs float64, config, ``x`` layout" of the test "fused ``what`` parity config layout"
    and the check "fused ``what`` config layout: tensors beyond tolerance (of N)" == 0, N the tensors compared, the
    first four failures in its detail."""
    what, config, layout = grid
    test, name = (
        f"fused {what} parity {config} {layout}",
        f"cupy fused {title or what} vs float64, {config}, {x} {layout}",
    )
    rows, failures, compared = [], [], 0
    for label, errs in cases:
        row, failed = grid_row(label, errs)
        rows.append(row)
        failures += failed
        compared += len(errs)
    run_report.add_series(Series(test=test, name=name, columns=GRID_COLUMNS, rows=tuple(rows)))
    check(
        f"fused {what} {config} {layout}: tensors beyond tolerance (of {compared})",
        len(failures),
        "==",
        0,
        source=source,
        detail="; ".join(failures[:4]),
    )
