"""Each test function's seconds become a ledger figure (the cost docs/lora-spec.md prints beside each check reads
them): every parametrisation and phase summed, a non-finite or missing duration left out."""

from __future__ import annotations

import functools

from lora_suite.results.ledger_rows import TEST_TIME, ledger_row, seconds_rows

HEAD = {"run_id": "r", "time": "", "group": "g", "commit": "c", "gpu": "G", "driver": None, "cuda": None}
HEAD |= {"torch": None, "implementation": "cupy", "tier": "quick"}


def test_a_test_functions_parametrisations_and_phases_are_summed():
    outcomes = [
        {"test": "tiers/quick/test_a.py::test_grid[bf16]", "outcome": "passed", "duration_s": 1.25},
        {"test": "tiers/quick/test_a.py::test_grid[fp32]", "outcome": "passed", "duration_s": 0.5},
        {"test": "tiers/quick/test_a.py::test_one", "outcome": "passed", "duration_s": 2.0},
        {"test": "tiers/quick/test_a.py::test_one", "outcome": "passed", "duration_s": float("nan")},
        {"test": "tiers/quick/test_a.py::test_none", "outcome": "skipped"},
    ]
    rows = seconds_rows({"outcomes": outcomes}, functools.partial(ledger_row, HEAD))
    got = {r["check"]: (r["value"], r["unit"], r["kind"]) for r in rows}
    assert got == {
        f"{TEST_TIME}tiers/quick/test_a.py::test_grid": (1.75, "s", "figure"),
        f"{TEST_TIME}tiers/quick/test_a.py::test_one": (2.0, "s", "figure"),
    }
