"""A parity grid in the run report (lora_suite.harness.parity_grid) on the CPU: a row per case, one check counting
every tensor compared and failing with the first failures named."""

from __future__ import annotations

from lora_suite.harness.parity_grid import report_grid
from lora_suite.harness.report import RunReport
from lora_suite.judges.parity import GRID_COLUMNS, TensorError


class _Checks:
    def __init__(self):
        self.calls = []

    def __call__(self, name, value, op, threshold, **kw):
        self.calls.append((name, value, op, threshold, kw))


def _err(name, scaled, tol):
    return TensorError(name, scaled, 1.0, scaled, tol, int(scaled > tol), (0,))


def test_the_grid_is_a_series_and_one_check_over_every_tensor(tmp_path):
    from lora_suite.settings.environment import collect_environment

    report = RunReport("r", "quick", collect_environment())
    checks = _Checks()
    cases = [("a", [_err("y", 1e-4, 1e-3), _err("dA", 1e-4, 1e-3)]), ("b", [_err("y", 5e-3, 1e-3)])]
    report_grid(report, checks, cases, ("MLP", "bf16", "2d"), "tol rule")
    (series,) = report.series
    assert series.columns == GRID_COLUMNS and [r[0] for r in series.rows] == ["a", "b"]
    assert [r[-1] for r in series.rows] == ["ok", "FAIL"]
    ((name, value, op, threshold, kw),) = checks.calls
    assert series.test == "fused MLP parity bf16 2d" and series.name == "cupy fused MLP vs float64, bf16, x 2d"
    assert name == "fused MLP bf16 2d: tensors beyond tolerance (of 3)" and (value, op, threshold) == (1, "==", 0)
    assert kw["source"] == "tol rule" and kw["detail"].startswith("b: y: max err")
