"""``report.md`` and the plots of a run report (``lora_suite.harness.report.RunReport``), rendered from its records:
the verdict, environment, tests, checks, figures, not-applicable checks and series as Markdown tables, and one PNG
per plottable series. Never written by hand."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import asdict
from pathlib import Path

from lora_suite.harness.report_records import Check, ReportView, Series, folded_not_applicable

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


def render_plots(report: ReportView, directory: Path) -> dict[int, str]:
    """One PNG per plottable series; returns {series index: file name}."""
    wanted = [(i, p) for i, s in enumerate(report.series) if (p := plottable(s)) is not None]
    if not wanted:
        return {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = {}
    for i, s in wanted:
        assert s.plot_x is not None  # plottable gives a series its x axis, or None
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


def render_markdown(report: ReportView, plots: dict[int, str] | None = None) -> str:
    """report.md: the verdict and run line, the environment, notes, tests and failures, checks by test, figures,
    what was not applicable, and each series as a table (with its plot where ``plots`` has one, by series index)."""
    lines = _md_head(report)
    lines += ["## Environment", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in asdict(report.environment).items()]
    if report.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in report.notes]
    lines += _md_tests(report)
    lines += _md_checks(report)
    lines += _md_figures(report)
    lines += _md_not_applicable(report)
    for i, ser in enumerate(report.series):
        lines += _md_series(ser, plots[i] if plots and i in plots else None)
    return "\n".join(lines) + "\n"


def _md_head(report: ReportView) -> list[str]:
    """The title, the verdict, the run's id, status and summary counts, a warning when it did not finish, and the
    implementation under test."""
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
    return lines


def _md_tests(report: ReportView) -> list[str]:
    """Every test's outcome, seconds and reason, then each failed or erroring test's full reason."""
    lines = ["", "## Tests", "", "| test | outcome | seconds | reason |", "|---|---|---|---|"]
    lines += [
        f"| `{_short(o.test)}` | {o.outcome} | {o.duration_s:.2f} | {_cell(o.reason, 300)} |" for o in report.outcomes
    ]
    failures = [o for o in report.outcomes if o.outcome in ("failed", "error")]
    if failures:
        lines += ["", "## Failures", ""]
        for o in failures:
            lines += [f"### `{_short(o.test)}` ({o.location})", "", "```", o.reason, "```", ""]
    return lines


def _md_checks(report: ReportView) -> list[str]:
    """The checks, a table per test in the order the tests recorded them: value, criterion, verdict (a failure's
    detail with it) and the threshold's source."""
    by_test: dict[str, list[Check]] = {}
    for c in report.checks:
        by_test.setdefault(c.test, []).append(c)
    lines = ["", "## Checks", ""] if by_test else []
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
    return lines


def _md_figures(report: ReportView) -> list[str]:
    """The headline figures: value, p20-p80 spread over the samples (where measured), clock, which way is better."""
    if not report.figures:
        return []
    lines = ["", "## Figures", "", "| figure | value | p20-p80 | clock | better |", "|---|---|---|---|---|"]
    lines += [
        f"| {f.name} | {f.value:.4g} {f.unit} | "
        + (f"{f.p20:.4g}-{f.p80:.4g} ({f.samples} samples)" if f.p20 is not None and f.p80 is not None else "-")
        + f" | {f.clock} | {f.better} |"
        for f in report.figures
    ]
    return lines


def _md_not_applicable(report: ReportView) -> list[str]:
    """The checks not applicable to the implementation under test, with its reasons."""
    records = folded_not_applicable(report.not_applicable)
    if not records:
        return []
    lines = ["", "## Not applicable to this implementation", "", "| test | check | reason |", "|---|---|---|"]
    lines += [f"| `{_short(n.test)}` | {n.name} | {_cell(n.reason, 500)} |" for n in records]
    lines.append("")
    return lines


def _md_series(ser: Series, plot: str | None) -> list[str]:
    """One series: its heading, its plot (``plot``: the image's path, if any), and its rows as a table, compacted
    (``compact_rows``) with a note saying how."""
    lines = ["", f"## {ser.name} (`{_short(ser.test)}`)", ""]
    if plot is not None:
        lines += [f"![{ser.name}]({plot})", ""]
    rows, note = compact_rows(ser.rows)
    if note:
        lines += [f"_{note}_", ""]
    lines += ["| " + " | ".join(ser.columns) + " |", "|" + "---|" * len(ser.columns)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return lines


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.4g}" if (v == 0 or 1e-3 <= abs(v) < 1e5) else f"{v:.3e}"
    return str(v)


def _short(nodeid: str) -> str:
    return nodeid.split("::", 1)[-1] if "::" in nodeid else nodeid


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in text.lower()).strip("_")[:40]


def _cell(text: str, limit: int = 300) -> str:
    text = str(text).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + " …"
