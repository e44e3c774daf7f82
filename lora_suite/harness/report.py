"""Run reports: typed records -> ``report.json`` + ``report.md`` (+ PNG plots), written atomically.

A run holds its environment, the outcome of every test, every *check* (a measured value against a
threshold, with where the threshold came from) and *series* (tables such as per-step loss and memory).
The Markdown and the plots are rendered from these records, never written by hand (``report_render``; its
``render_markdown``, ``render_plots``, ``plottable`` and ``compact_rows`` are importable from here too).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lora_suite.harness.report_records import (  # noqa: F401
    MODULE_PREFIX,
    MODULE_SUFFIX,
    Check,
    Figure,
    NotApplicable,
    Outcome,
    Series,
    folded_not_applicable,
)
from lora_suite.harness.report_render import compact_rows, plottable, render_markdown, render_plots  # noqa: F401
from lora_suite.harness.verdict import run_verdict
from lora_suite.measure.criteria import OPS as _OPS
from lora_suite.settings.environment import Environment

# 1: reports before the field existed (reports/schema/report-v1.schema.json); 2: status, before issue 9;
# 3: the implementation under test and the not-applicable checks; 4: the verdict; 5: the verdict PASS (RETRIED)
SCHEMA_VERSION = 5
REWOUND = ("notes", "checks", "series", "not_applicable", "figures")  # what one test attempt adds to a run report
STATUSES = ("running", "complete", "interrupted", "terminated")


@dataclass
class RunReport:
    run_id: str
    selection: str  # what was run (marker expression / tier)
    environment: Environment
    # running (written while a run is under way), complete, interrupted (Ctrl-C), terminated (SIGTERM)
    status: str = "running"
    # the LoRA implementation under test: {"name", "spec", "description", "not_applicable": {feature: reason}}
    implementation: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    series: list[Series] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    not_applicable: list[NotApplicable] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)

    def figure(self, record: Figure) -> Figure:
        """Record a headline figure (one per name: a second of the same name is an error)."""
        if any(f.name == record.name for f in self.figures):
            raise ValueError(f"figure {record.name!r} is already recorded in this run")
        if not (isinstance(record.value, (int, float)) and math.isfinite(record.value)):
            raise ValueError(f"figure {record.name!r}: value {record.value!r} is not a finite number")
        self.figures.append(record)
        return record

    def mark(self) -> dict[str, int]:
        """How many records each list holds now: ``rewind`` takes later ones back out (a test run again)."""
        return {f: len(getattr(self, f)) for f in REWOUND}

    def rewind(self, mark: dict[str, int]) -> None:
        for f, n in mark.items():
            del getattr(self, f)[n:]

    def check(
        self, test: str, name: str, value, op: str, threshold, *, unit: str = "", source: str = "", detail: str = ""
    ) -> Check:
        """Record ``value op threshold`` and return the record (its ``passed`` says the verdict).

        NaN never passes. The caller asserts on ``passed`` so that pytest fails with the same message.
        """
        if op not in _OPS:
            raise ValueError(f"op={op!r} is not one of {sorted(_OPS)}")
        passed = not _is_nan(value) and bool(_OPS[op](value, threshold))
        record = Check(test, name, _plain(value), op, _plain(threshold), passed, unit, source, "" if passed else detail)
        self.checks.append(record)
        return record

    def mark_not_applicable(self, test: str, name: str, reason: str) -> NotApplicable:
        if not reason:
            raise ValueError(f"not-applicable check {name!r} needs its reason")
        record = NotApplicable(test, name, reason)
        self.not_applicable.append(record)
        return record

    def mark_module_not_applicable(self, module: str, feature: str, reason: str) -> None:
        """One record per test module and feature, naming how many of its tests it covers: a module of lora_core's
        kernel tests is one thing an implementation does not have, however many cases it holds (the report folds the
        modules of one feature and reason into one record: ``folded_not_applicable``)."""
        prefix, suffix = MODULE_PREFIX, MODULE_SUFFIX.format(feature=feature)
        for i, r in enumerate(self.not_applicable):
            if r.test == module and r.name.startswith(prefix) and r.name.endswith(suffix):
                count = int(r.name[len(prefix) : -len(suffix)]) + 1
                self.not_applicable[i] = NotApplicable(module, f"{prefix}{count}{suffix}", r.reason)
                return
        self.mark_not_applicable(module, f"{prefix}1{suffix}", reason)

    def add_series(self, series: Series) -> None:
        self.series.append(series)

    def add_row(self, test: str, name: str, columns: tuple[str, ...], row: tuple) -> None:
        """Append one row to the table ``name`` (created on first use), e.g. one benchmark result."""
        for i, ser in enumerate(self.series):
            if ser.name == name:
                if ser.columns != tuple(columns):
                    raise ValueError(f"table {name!r} has columns {ser.columns}, got a row for {tuple(columns)}")
                self.series[i] = Series(ser.test, name, ser.columns, ser.rows + (tuple(row),))
                return
        self.series.append(Series(test, name, tuple(columns), (tuple(row),)))

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "run_id": self.run_id,
            "selection": self.selection,
            "status": self.status,
            "environment": asdict(self.environment),
            "implementation": self.implementation,
            "notes": self.notes,
            "verdict": dict(zip(("result", "why"), self.verdict())),
            "summary": self.summary(),
            "outcomes": [asdict(o) for o in self.outcomes],
            "checks": [asdict(c) for c in self.checks],
            "not_applicable": [asdict(n) for n in folded_not_applicable(self.not_applicable)],
            "figures": [asdict(f) for f in self.figures],
            "series": [asdict(s) for s in self.series],
        }

    def verdict(self) -> tuple[str, str]:
        """(result, why): PASS, FAIL, NOT JUDGED, INTERRUPTED, TERMINATED or RUNNING (``harness/verdict.py``)."""
        return run_verdict(self)

    def summary(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for o in self.outcomes:
            counts[o.outcome] = counts.get(o.outcome, 0) + 1
        counts["checks_passed"] = sum(c.passed for c in self.checks)
        counts["checks_failed"] = sum(not c.passed for c in self.checks)
        counts["checks_not_applicable"] = len(folded_not_applicable(self.not_applicable))
        return counts

    def write_json(self, directory: str | Path) -> Path:
        """Only report.json (cheap: written after every test, so that a killed run leaves its evidence)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_text(directory / "report.json", json.dumps(self.to_dict(), indent=1, default=str) + "\n")
        return directory / "report.json"

    def write(self, directory: str | Path) -> Path:
        """Write report.json, the plots and report.md into ``directory``; return the Markdown path."""
        directory = Path(directory)
        self.write_json(directory)
        plots = render_plots(self, directory)
        md = directory / "report.md"
        atomic_write_text(md, render_markdown(self, plots))
        return md


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary file beside ``path``, fsync, then rename over it: readers never see half a file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.chmod(f.fileno(), 0o666 & ~_umask())  # mkstemp makes 0600; a report is for everyone to read
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _plain(v):
    """Make numpy/torch scalars JSON-plain."""
    if hasattr(v, "item") and callable(v.item):
        return v.item()
    return v


def _is_nan(v) -> bool:
    try:
        return math.isnan(float(_plain(v)))
    except (TypeError, ValueError):
        return False
