"""The ledger rows of one run's report.json, section by section (``lora_suite.results.ledger`` puts them together
in ``rows_of_report``; its docstring says what each kind of row holds): a row per check, per not-applicable check,
per headline figure, and per benchmark cell or stopped benchmark of the series. Each section's rows are built with
``row``: ``ledger_row`` with the run's shared fields bound."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

TEST_TIME = "test time: "  # the check of a test function's seconds (seconds_rows)
# A ledger row's fields, in order (lora_suite.results.ledger's docstring says what each holds)
FIELDS = (
    "run_id",
    "time",
    "group",
    "commit",
    "gpu",
    "driver",
    "cuda",
    "torch",
    "implementation",
    "tier",
    "kind",
    "check",
    "value",
    "op",
    "threshold",
    "unit",
    "verdict",
    "source",
    "detail",
)
KINDS = ("run", "check", "n/a", "bench", "stopped", "figure")
KEY_FIELDS = ("run_id", "group", "implementation")


class LedgerError(ValueError):
    """A ledger line or a report that cannot become rows; the message names the file and line."""


def run_key(r: dict) -> tuple[str, str, str]:
    """What identifies one run's rows: run id, group, implementation."""
    return r["run_id"], r["group"], r["implementation"]


BENCH_COLUMNS = (
    "÷ PEFT eager",
    "step ms",
    "peak GiB",
    "ratio (median)",
    "fwd ms",
    "bwd ms",
    "speed-up",
    "peak ratio",
    # the fused table's rounds and its kernel profiles (issue 34: a one-round figure is read beside its repeats)
    "fwd ms, round",
    "bwd ms, round",
    "step ms, round",
    "peak GiB, round",
    "ms per step",
    # the spread of the fused table's rounds and of its ratios (issue 47: a ratio is read against that spread)
    "step ms min",
    "step ms max",
    "speed-up min",
    "speed-up max",
    # the mixed-input NF4 GEMM against dequantise + cuBLAS (issue 47, benchmarks/test_bench_nf4_matmul.py)
    "ms per call",
    "ms min",
    "ms max",
    "ratio to dequantise + cuBLAS",
    # NF4 dequantisation beside a decoder layer's other work (issue 47, benchmarks/test_bench_nf4_dequant.py)
    "ms per sequence",
    "ratio to serial",
    # a stack's kernel time against its eager step (issue 47: Unsloth's profile beside cupy-fused+liger's)
    "kernel ms per step",
    "eager step ms",
    "host-bound gap share",
    "eager step ms, profiled",
    "host ms per step (self)",
    "kernel-time speed-up",
    "eager step speed-up",
    "gap share, stack",
    "gap share, against",
    # a captured step beside its own eager step (issue 57, benchmarks/test_bench_captured_profile.py)
    "eager kernel ms",
    "captured step ms",
    "captured kernel ms",
    "eager peak GiB",
    "captured warm-up peak GiB",
    "captured capture peak GiB",
    "allocated at capture GiB",
    "graph pool GiB",
    "graph pool allocated GiB",
    "eager ms",
    "captured ms",
    "difference ms",
    "eager",  # its first run's columns (run 20261128T013054Z-bench): kept so that the run records as it did
    "captured",
    "difference",
    # a mutation run's figures (lora-suite mutate: mutation/mutation_report.py); its score is a check
    "mutants killed",
    "mutants survived",
    "mutants equivalent",
    "mutants error",
    "score, equivalents as survivors (killed / (killed + survived + equivalent))",
    "wall s",
)
LABEL_COLUMNS = (
    "case",
    "run",
    "round",
    "implementation",
    "mode",
    "shape",
    "stack",
    "fused stack",
    "against",
    "part",
    "kernel kind",
    "kind",
    "kernel",
    "candidate",
    "CUDA call",
)


def _scalar(v):
    """A row's value or threshold as a JSON scalar: a non-finite float as its text, anything else not a scalar as
    its JSON (cut to 200 characters)."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return json.dumps(v)[:200]


def ledger_row(head: dict, kind, check, value, verdict, op="", threshold=None, unit="", source="", detail="") -> dict:
    """One ledger row: the run's ``head`` and one figure, its value and threshold as scalars, the detail cut to
    300 characters."""
    return {
        **head,
        "kind": kind,
        "check": check,
        "value": _scalar(value),
        "op": op,
        "threshold": _scalar(threshold),
        "unit": unit,
        "verdict": verdict,
        "source": source,
        "detail": str(detail)[:300],
    }


def check_rows(report: dict, row: Callable[..., dict]) -> list[dict]:
    """A row per check: its value against its threshold, pass or fail."""
    return [
        row(
            "check",
            c["name"],
            c.get("value"),
            "pass" if c.get("passed") else "fail",
            c.get("op", ""),
            c.get("threshold"),
            c.get("unit", ""),
            c.get("source", ""),
            c.get("detail", ""),
        )
        for c in report.get("checks", [])
    ]


def not_applicable_rows(report: dict, row: Callable[..., dict]) -> list[dict]:
    """A row per check the implementation declared not applicable, with its reason."""
    out = []
    for item in report.get("not_applicable") or []:
        name = item.get("name") or item.get("test", "") if isinstance(item, dict) else str(item)
        reason = item.get("reason", "") if isinstance(item, dict) else ""
        out.append(row("n/a", name, None, "n/a", detail=reason))
    return out


def figure_rows(report: dict, row: Callable[..., dict]) -> list[dict]:
    """A row per headline figure of the tier, measured; its spread (p20, p80), samples and clock in the detail."""
    out = []
    for f in report.get("figures") or []:  # a tier's headline figures: the spread and clock ride in the detail
        spread = f"p20 {f['p20']:.6g}, p80 {f['p80']:.6g}, " if f.get("p20") is not None else ""
        detail = f"{spread}{f.get('samples', 1)} sample(s), {f['clock']} clock, {f['better']} is better"
        out.append(row("figure", f["name"], f["value"], "measured", unit=f.get("unit", ""), detail=detail))
    return out


def seconds_rows(report: dict, row: Callable[..., dict]) -> list[dict]:
    """A figure per test function: its seconds in the run, every parametrisation and phase summed (the cost
    docs/lora-spec.md prints beside each check is one of these)."""
    totals: dict[str, list[float]] = {}
    for o in report.get("outcomes") or []:
        seconds = o.get("duration_s") if isinstance(o, dict) else None
        if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds):
            t = totals.setdefault(str(o.get("test", "")).split("[", 1)[0], [0.0, 0])
            t[0], t[1] = t[0] + seconds, t[1] + 1
    return [
        row("figure", f"{TEST_TIME}{test}", round(seconds, 2), "measured", unit="s", detail=f"{n} phase record(s)")
        for test, (seconds, n) in sorted(totals.items())
    ]


def series_rows(report: dict, row: Callable[..., dict]) -> list[dict]:
    """From each series' rows, labelled by their label columns (else the first cell): a failed row per 'what
    stopped it' cell, and a measured row per finite number in a benchmark column."""
    out = []
    for s in report.get("series", []):
        cols = list(s.get("columns", []))
        keys = [i for i, c in enumerate(cols) if c in LABEL_COLUMNS]
        for r in s.get("rows", []):
            label = " ".join(str(r[i]) for i in keys) or str(r[0])
            if "what stopped it" in cols:
                out.append(row("stopped", f"{s['name'][:60]}: {label}", r[cols.index("what stopped it")], "fail"))
            for c in (c for c in BENCH_COLUMNS if c in cols):
                v = r[cols.index(c)]
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    out.append(row("bench", f"{s['name'][:60]}: {label}: {c}", v, "measured"))
    return out
