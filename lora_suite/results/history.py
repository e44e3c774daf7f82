"""History: every judged figure and benchmark row of many runs, over time, as a page you can explore (issues 20, 45).

``lora-suite history [DIR…] [--ledger STORE] [--html OUT]`` reads the results store (and the published ledger), plus
every ``report.json`` under the directories, and writes ``OUT_HTML`` (``history_page``: one self-contained page, its
charting script inlined, that works offline) and ``history.md`` beside it, atomically:

- runs are grouped by GPU model, LoRA implementation and tier: figures of different GPUs or implementations are never
  drawn on one line;
- a **figure** is a check with a numeric value and a numeric threshold under ``<=``, ``<``, ``>=`` or ``>`` (its
  name's run-specific tail, "(first: …)", left out so that nights line up), a tier's headline figure, or a benchmark
  row's ``÷ PEFT eager`` / ``step ms`` / ``peak GiB`` / ``ratio (median)`` cell, named "<table>: <row>";
- the page draws the figure a reader picks for every group the GPU, implementation and tier filters keep, with value,
  threshold, run id and commit on hover; failed checks and runs the compare gate
  (``lora_suite.results.compare.compare_runs``) finds regressed against the group's previous run are marked;
- the Markdown lists, per group, each figure's latest value, its threshold, its range over the runs and how many
  runs it has.
Nothing is written half: a directory without any report is an error naming it (exit 2).
"""

from __future__ import annotations

import datetime as dt
import math
import re
import sys
from pathlib import Path

from lora_suite.harness.report import atomic_write_text
from lora_suite.results import ledger
from lora_suite.results.history_data import Group, Point  # noqa: F401  (history.Group, history.Point)
from lora_suite.results.ledger import RUN_TAIL

_ORDERED = {"<=", "<", ">=", ">"}
_STAMP = re.compile(r"(\d{4})(\d{2})(\d{2})T(\d{2})(\d{2})(\d{2})Z")


def run_time(report: dict, run_dir: Path) -> dt.datetime:
    """The run's time: its run id's leading UTC stamp (``20261124T055553Z-…``), else the environment's."""
    env = report.get("environment") or {}
    return row_time(
        {"run_id": report.get("run_id", "") or run_dir.name, "time": env.get("timestamp_utc") or ""}, run_dir.name
    )


def row_time(row: dict, fallback: str = "") -> dt.datetime:
    for text in (row.get("run_id", ""), fallback):
        m = _STAMP.match(text)
        if m:  # by hand: strptime costs a tenth of a second per thousand runs
            year, month, day, hour, minute, second = (int(g) for g in m.groups())  # _STAMP's six groups
            return dt.datetime(year, month, day, hour, minute, second, tzinfo=dt.timezone.utc)
    if row.get("time"):
        return dt.datetime.fromisoformat(row["time"].replace("Z", "+00:00"))
    raise ValueError(
        f"{fallback or row.get('run_id')}: no run time (its run_id, its directory name and environment.timestamp_utc "
        "carry none)"
    )


def _number(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def figure_of(row: dict) -> tuple[str, float, float | None, str, bool] | None:
    """A ledger row as a figure (the module docstring), or None: (name, value, threshold, op, passed)."""
    value = _number(row["value"])
    if value is None:
        return None
    if row["kind"] in ("bench", "figure"):
        return row["check"], value, None, "", True
    threshold = _number(row["threshold"])
    if row["kind"] != "check" or threshold is None or row["op"] not in _ORDERED:
        return None
    return RUN_TAIL.sub("", row["check"]), value, threshold, row["op"], row["verdict"] == "pass"


def figures_of(report: dict) -> dict[str, tuple[float, float | None, str, bool]]:
    """name -> (value, threshold, op, passed) for every figure of one report (see the module docstring)."""
    figs = (figure_of(r) for r in ledger.rows_of_report(report, str(report.get("run_id", ""))))
    return {f[0]: f[1:] for f in figs if f}


def collect_rows(rows: list[dict], run_dirs: dict[str, Path] | None = None) -> list[Group]:
    """Groups of figures from ledger rows; ``run_dirs`` (run id -> folder) lets the compare gate judge pairs of
    runs whose folders are at hand (benchmark timings included), the others by their checks' verdicts."""
    groups: dict[tuple[str, str, str], Group] = {}
    seen: dict[tuple, set] = {}
    times: dict[str, dt.datetime] = {}  # a run's time, parsed once (10,000 runs have ten times as many rows)
    for r in rows:
        key = (r["gpu"], r["implementation"], r["tier"])
        group = groups.setdefault(key, Group(*key))
        when = times.get(r["run_id"]) or times.setdefault(r["run_id"], row_time(r, r["run_id"]))
        if r["run_id"] not in seen.setdefault(key, set()):
            seen[key].add(r["run_id"])
            group.runs.append((when, r["run_id"]))
            group.commits[r["run_id"]] = str(r["commit"])[:7]
            group.verdicts[r["run_id"]] = {}
        if r["kind"] == "check":
            group.verdicts[r["run_id"]][RUN_TAIL.sub("", r["check"])] = r["verdict"] == "pass"
        f = figure_of(r)
        if f:
            group.figures.setdefault(f[0], []).append(Point(when, r["run_id"], str(r["commit"])[:7], *f[1:]))
    for group in groups.values():
        group.runs.sort()
        for pts in group.figures.values():
            pts.sort(key=lambda p: p.when)
        _flag_regressions(group, run_dirs or {})
    return sorted(groups.values(), key=lambda g: (g.gpu, g.implementation, g.tier))


def collect(dirs: list[Path]) -> list[Group]:
    """Groups of figures from every report.json under the run folders."""
    for d in dirs:
        if not d.is_dir():
            raise FileNotFoundError(f"report directory {d} does not exist")
    try:
        folders = ledger.run_folders(dirs)
        rows = ledger.rows_of_runs(folders)
    except ledger.LedgerError as exc:
        raise ValueError(str(exc)) from None
    return collect_rows(rows, {d.name: d for d in folders})


def _flag_regressions(group: Group, run_dirs: dict[str, Path]) -> None:
    """Each run against the group's previous run: by the compare gate where both folders are at hand, else by the
    gate's rule for checks (one that passed and now fails, or is gone, is a regression)."""
    from lora_suite.results.compare import compare_runs

    for (_, before), (_, after) in zip(group.runs, group.runs[1:]):
        if before in run_dirs and after in run_dirs:
            try:
                changes = compare_runs(run_dirs[before], run_dirs[after])
            except (ValueError, FileNotFoundError, KeyError):
                continue  # runs the gate cannot pair (different shapes of report): no verdict, none drawn
            found = [f"{c.kind} {c.name}: {c.before} -> {c.after}" for c in changes if c.regression]
        else:
            old, new = group.verdicts[before], group.verdicts[after]
            found = [
                f"check {n}: passed -> {'failed' if n in new else 'missing'}"
                for n, ok in old.items()
                if ok and not new.get(n, False)
            ]
        if found:
            group.regressions[after] = found


def margin(points: list[Point]) -> float:
    """How close the latest point is to its threshold (0 at it, larger is safer); inf without a threshold."""
    p = points[-1]
    if p.threshold is None:
        return math.inf
    scale = abs(p.threshold) or 1.0
    return (p.threshold - p.value) / scale if p.op in ("<=", "<") else (p.value - p.threshold) / scale


def _rank(points: list[Point]) -> tuple:
    """Plot order: figures that ever failed, then those that moved between runs, closest to their threshold
    first; a figure that never moved (a count that must equal its bound) says little drawn over time."""
    moved = len({p.value for p in points}) > 1
    return (all(p.passed for p in points), not moved, margin(points))


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60]


def _fmt(v: float | None) -> str:
    return "" if v is None else f"{v:.4g}"


def render_md(groups: list[Group]) -> str:
    runs = sum(len(g.runs) for g in groups)
    lines = [
        "# LoRA GPU suite history",
        "",
        f"{runs} runs in {len(groups)} groups (GPU · implementation · tier). Each figure's latest value, its "
        "threshold and its range; regressions are runs the compare gate found regressed against the group's "
        "previous run. The HTML page beside this one draws every figure over time.",
        "",
    ]
    for g in groups:
        lines += [f"## {g.title}", "", f"{len(g.runs)} runs, {g.runs[0][0]:%Y-%m-%d} to {g.runs[-1][0]:%Y-%m-%d}.", ""]
        for run, found in sorted(g.regressions.items()):
            lines.append(f"- **regression** in `{run}`: {'; '.join(found)[:400]}")
        if g.regressions:
            lines.append("")
        if g.figures:
            lines += [
                "| figure | latest | threshold | range over the runs | runs | latest commit |",
                "|---|---|---|---|---|---|",
            ]
            for name in sorted(g.figures, key=lambda n: (margin(g.figures[n]), n)):
                pts = g.figures[name]
                last = pts[-1]
                values = [p.value for p in pts]
                verdict = "" if last.passed else " **FAIL**"
                lines.append(
                    f"| {name.replace('|', '/')} | {_fmt(last.value)}{verdict} | "
                    f"{last.op} {_fmt(last.threshold)} | {_fmt(min(values))} – {_fmt(max(values))} | "
                    f"{len(pts)} | {last.commit} |"
                )
            lines.append("")
    return "\n".join(lines) + "\n"


def write(out_html: Path, groups: list[Group]) -> Path:
    """The interactive page (``history_page``) and ``history.md`` beside it, each written atomically."""
    from lora_suite.results import history_page

    out_html.parent.mkdir(parents=True, exist_ok=True)
    md = render_md(groups)
    atomic_write_text(out_html.parent / "history.md", md)
    atomic_write_text(out_html, history_page.render(groups))
    return out_html.parent / "history.md"


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m lora_suite.results.history OUT_HTML REPORT_DIR [REPORT_DIR ...]", file=sys.stderr)
        return 2
    out = Path(argv[0])
    if out.suffix != ".html":
        print(f"history: the output must be an .html file, got {argv[0]!r}", file=sys.stderr)
        return 2
    try:
        groups = collect([Path(a) for a in argv[1:]])
    except (FileNotFoundError, ValueError) as exc:
        print(f"history: {exc}", file=sys.stderr)
        return 2
    try:
        md = write(out, groups)
    except OSError as exc:  # issue 28: a folder that cannot be created ended in a traceback
        print(f"history: cannot write {out} ({exc.strerror or exc})", file=sys.stderr)
        return 2
    print(f"history: {sum(len(g.runs) for g in groups)} runs in {len(groups)} groups; {out} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
