"""Run reports: typed records -> ``report.json`` + ``report.md`` (+ PNG plots), written atomically.

A run holds its environment, the outcome of every test, every *check* (a measured value against a
threshold, with where the threshold came from) and *series* (tables such as per-step loss and memory).
The Markdown and the plots are rendered from these records, never written by hand.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lora_suite.core.environment import Environment
from lora_suite.harness.verdict import run_verdict
from lora_suite.measure.criteria import OPS as _OPS


@dataclass(frozen=True)
class Check:
    test: str  # pytest node id
    name: str
    value: Any
    op: str  # one of _OPS
    threshold: Any
    passed: bool
    unit: str = ""
    source: str = ""  # where the threshold came from (config key, derivation)
    detail: str = ""  # diagnosis when it fails (what is beyond, where)


@dataclass(frozen=True)
class Figure:
    """A tier's headline figure (its YAML's ``suite.figures``): a value with its unit, the clock that measured it and,
    where it is a median of samples, their 20th and 80th percentiles (``compare`` reads the spread from them)."""

    test: str
    name: str
    value: float
    unit: str
    clock: str  # device | host
    better: str  # lower | higher
    p20: float | None = None
    p80: float | None = None
    samples: int = 1


@dataclass(frozen=True)
class NotApplicable:
    """A check the implementation under test cannot take by design, with its reason: shown, never dropped."""

    test: str
    name: str  # the check that was not run
    reason: str  # the implementation's own words (LoRAImplementation.not_applicable) or the config's


@dataclass(frozen=True)
class Series:
    test: str
    name: str
    columns: tuple[str, ...]
    rows: tuple[tuple, ...]
    plot_x: str | None = None  # column to plot the others against; None: table only
    plot_y: tuple[str, ...] = ()


@dataclass(frozen=True)
class Outcome:
    test: str
    outcome: str  # passed | failed | skipped | error
    duration_s: float
    reason: str = ""  # the whole skip reason or failure message (an assertion's full text)
    location: str = ""  # file:line of a failure


# 1: reports before the field existed (reports/schema/report-v1.schema.json); 2: status, before issue 9;
# 3: the implementation under test and the not-applicable checks; 4: the verdict
SCHEMA_VERSION = 4
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
        kernel tests is one thing an implementation does not have, however many cases it holds."""
        prefix = "every check of the "
        suffix = f" test(s) of this module ({feature})"
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
            "not_applicable": [asdict(n) for n in self.not_applicable],
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
        counts["checks_not_applicable"] = len(self.not_applicable)
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


COMPACT_ROWS = 40  # a longer series shows its first and last rows and every k-th between them in report.md


def plottable(s: Series) -> Series | None:
    """The series to draw: its own plot axes, or, for one with a ``step`` column and none set, its first three
    numeric columns against the step (a per-step series read as a curve); None for one with nothing to draw."""
    if not s.rows:
        return None
    if s.plot_x:
        return s
    if "step" not in s.columns or len(s.rows) < 3:
        return None
    ys = tuple(
        c
        for j, c in enumerate(s.columns)
        if c != "step" and all(isinstance(r[j], (int, float)) and not isinstance(r[j], bool) for r in s.rows)
    )[:3]
    return dataclasses.replace(s, plot_x="step", plot_y=ys) if ys else None


def compact_rows(rows: tuple, limit: int = COMPACT_ROWS) -> tuple[list, str]:
    """At most about ``limit`` rows of a long series for report.md (first and last 10, every k-th between), and
    the note that says so ("" when all are shown)."""
    if len(rows) <= limit:
        return list(rows), ""
    head, tail = 10, 10
    k = max(1, (len(rows) - head - tail) // (limit - head - tail))
    middle = list(rows[head : len(rows) - tail : k])
    shown = list(rows[:head]) + middle + list(rows[-tail:])
    return shown, (
        f"{len(rows)} rows: the first and last {head} and every {k}th between ({len(shown)} shown); "
        "every row is in report.json"
    )


def render_plots(report: RunReport, directory: Path) -> dict[int, str]:
    """One PNG per plottable series; returns {series index: file name}."""
    wanted = [(i, plottable(s)) for i, s in enumerate(report.series) if plottable(s) is not None]
    if not wanted:
        return {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = {}
    for i, s in wanted:
        xi = s.columns.index(s.plot_x)
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for col in s.plot_y:
            yi = s.columns.index(col)
            ax.plot([r[xi] for r in s.rows], [r[yi] for r in s.rows], label=col)
        ax.set_xlabel(s.plot_x)
        ax.set_title(f"{_short(s.test)}: {s.name}", fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        name = f"plot_{i:02d}_{_slug(s.name)}.png"
        tmp = directory / f".{name}.tmp.png"
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
        plt.close(fig)
        os.replace(tmp, directory / name)
        files[i] = name
    return files


def render_markdown(report: RunReport, plots: dict[int, str] | None = None) -> str:
    env = report.environment
    s = report.summary()
    lines = [
        f"# LoRA GPU suite report: {report.selection}",
        "",
        "**{}**: {}".format(*report.verdict()),
        "",
        f"Run `{report.run_id}` ({report.status}): " + ", ".join(f"{k} {v}" for k, v in s.items()),
        "",
    ]
    if report.status != "complete":
        lines += [f"**This run did not finish: status `{report.status}`.** What it did before it stopped is below.", ""]
    impl = report.implementation
    if impl:
        lines += [f"LoRA implementation under test: **{impl.get('name')}** ({impl.get('description', '')})", ""]
    lines += ["## Environment", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in asdict(env).items()]
    if report.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in report.notes]
    lines += ["", "## Tests", "", "| test | outcome | seconds | reason |", "|---|---|---|---|"]
    lines += [
        f"| `{_short(o.test)}` | {o.outcome} | {o.duration_s:.2f} | {_cell(o.reason, 300)} |" for o in report.outcomes
    ]
    failures = [o for o in report.outcomes if o.outcome in ("failed", "error")]
    if failures:
        lines += ["", "## Failures", ""]
        for o in failures:
            lines += [f"### `{_short(o.test)}` ({o.location})", "", "```", o.reason, "```", ""]
    by_test: dict[str, list[Check]] = {}
    for c in report.checks:
        by_test.setdefault(c.test, []).append(c)
    if by_test:
        lines += ["", "## Checks", ""]
    for test, checks in by_test.items():
        lines += [
            f"### `{_short(test)}`",
            "",
            "| check | value | criterion | verdict | threshold source |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {c.name} | {_fmt(c.value)}{(' ' + c.unit) if c.unit else ''} | {c.op} {_fmt(c.threshold)} | "
            f"{'PASS' if c.passed else '**FAIL**: ' + _cell(c.detail, 2000)} | {_cell(c.source)} |"
            for c in checks
        ]
        lines.append("")
    if report.figures:
        lines += ["", "## Figures", "", "| figure | value | p20-p80 | clock | better |", "|---|---|---|---|---|"]
        lines += [
            f"| {f.name} | {f.value:.4g} {f.unit} | "
            + (f"{f.p20:.4g}-{f.p80:.4g} ({f.samples} samples)" if f.p20 is not None and f.p80 is not None else "-")
            + f" | {f.clock} | {f.better} |"
            for f in report.figures
        ]
    if report.not_applicable:
        lines += ["", "## Not applicable to this implementation", "", "| test | check | reason |", "|---|---|---|"]
        lines += [f"| `{_short(n.test)}` | {n.name} | {_cell(n.reason, 500)} |" for n in report.not_applicable]
        lines.append("")
    for i, ser in enumerate(report.series):
        lines += ["", f"## {ser.name} (`{_short(ser.test)}`)", ""]
        if plots and i in plots:
            lines += [f"![{ser.name}]({plots[i]})", ""]
        rows, note = compact_rows(ser.rows)
        if note:
            lines += [f"_{note}_", ""]
        lines += ["| " + " | ".join(ser.columns) + " |", "|" + "---|" * len(ser.columns)]
        lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.4g}" if (v == 0 or 1e-3 <= abs(v) < 1e5) else f"{v:.3e}"
    return str(v)


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


def _short(nodeid: str) -> str:
    return nodeid.split("::", 1)[-1] if "::" in nodeid else nodeid


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in text.lower()).strip("_")[:40]


def _cell(text: str, limit: int = 300) -> str:
    text = str(text).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + " …"
