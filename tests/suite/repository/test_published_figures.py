"""Every published figure is a ledger row (issue 43, item 3), in ``README.md``, ``docs/*.md`` and ``reports/README.md``:

- every run a page cites is in ``reports/ledger.jsonl.gz`` (the published ledger);
- every measured figure written with its unit (``ms``, ``s``, ``min``, ``GiB``, ``MiB``, ``GB``, ``tokens/s``; each end
  of a range ``a-b unit``) is, at its printed precision, the value, threshold or spread of a ledger row of a run or
  ledger group cited in the same section (from one heading to the next), in a unit of the same kind (a row's unit is
  its ``unit`` field, else the last unit its check's name gives). Code (spans and fenced blocks) holds settings,
  commands and sample output, not figures;
- a check count printed beside a run ("judged by N checks ... (run R") is that run's count of passed checks;
- a mutation score ("score S (K killed, V survived, E equivalent of T mutants) in W s") is the figures of a mutation
  run of the ledger group its paragraph names; the second score printed after it ("(score S2 with the equivalents
  counted as survivors)") is K / (K + V + E) of those counts, at its printed precision.

A figure edited to a value the ledger does not hold fails here."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RUN = re.compile(r"\b(\d{8}T\d{6}Z-[A-Za-z0-9_.-]*[A-Za-z0-9_])")
CHECKS = re.compile(r"judged by (\d+) checks[^()]*\(run (\d{8}T\d{6}Z-[A-Za-z0-9_.-]*[A-Za-z0-9_])")
SCORE = re.compile(
    r"score (\d\.\d+) \((\d+) killed, (\d+) survived,\s+(\d+) equivalent of (\d+)(?: mutants?)?\) in (\d+) s", re.S
)
SECOND_SCORE = re.compile(
    r"\((\d+) killed, (\d+) survived,\s+(\d+) equivalent of \d+(?: mutants?)?\) in \d+ s\s+"
    r"\(score (\d\.\d+) with\s+the\s+equivalents\s+counted\s+as\s+survivors\)"
)
GROUP = re.compile(r"ledger group `([^`]+)`")
UNITS = {"ms": ("time", 1e-3), "s": ("time", 1.0), "min": ("time", 60.0), "seconds": ("time", 1.0)}
UNITS |= {"MiB": ("memory", 1 / 1024), "GiB": ("memory", 1.0), "GB": ("memory", 1e9 / 2**30)}
UNITS |= {"tokens/s": ("rate", 1.0)}
_UNIT = r"(tokens/s|ms|min|GiB|MiB|GB|s)(?![\w/])"
FIGURE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?:\s?[-–]\s?(\d+(?:\.\d+)?))?\s?" + _UNIT)
CHECK_UNIT = re.compile(r"(?<![\w'/-])(tokens/s|ms|min|GiB|MiB|GB|s|seconds)(?![\w'/-])")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
PAGES = [
    "README.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
    "reports/README.md",
]


def _rows() -> list[dict]:
    from lora_suite.results import ledger

    return ledger.read(ROOT / "reports" / "ledger.jsonl.gz")


class Ledger:
    """The published ledger's rows, indexed once: by run and by group, each row's figures (``_row_values``), the
    figures of the rows each cited set and table cell describe, and each section's verdicts by its text. Every judge
    of a page judges it section by section from the section's text and the rows alone, so a page edited in one place
    (a figure made 1% larger) is judged anew in the section it changed only, and its other sections' verdicts are
    the ones their unchanged text got."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows
        self.by_run, self.by_group = _indexed(rows)
        self._figures: dict[int, list[tuple[str, float]]] = {}  # id(row) -> _row_values(row)
        self._described: dict[tuple, list[tuple[str, float]]] = {}  # (cited, column, labels) -> their figures
        self._verdicts: dict[tuple[str, str], list[str]] = {}  # (judge, section) -> its verdicts

    def row_values(self, row: dict) -> list[tuple[str, float]]:
        if (found := self._figures.get(id(row))) is None:
            found = self._figures[id(row)] = _row_values(row)
        return found

    def cited(self, section: str) -> tuple[frozenset[str], frozenset[str]]:
        """The runs and the names in backticks (ledger groups) ``section`` cites."""
        return frozenset(RUN.findall(section)), frozenset(re.findall(r"`([^`\n]+)`", section))

    def rows_of(self, cited: tuple[frozenset[str], frozenset[str]]) -> list[dict]:
        runs, groups = cited
        return [r for run in runs for r in self.by_run.get(run, [])] + [
            r for g in groups for r in self.by_group.get(g, [])
        ]

    def figures(self, cited: tuple, column: str | None = None, labels: tuple[str, ...] = ()) -> list[tuple[str, float]]:
        """The figures of the cited rows (``column`` None) or of those a table cell describes (``_described``)."""
        key = (cited, column, labels)
        if (found := self._described.get(key)) is None:
            rows = self.rows_of(cited)
            rows = rows if column is None else _described(rows, column, list(labels))
            found = self._described[key] = [v for r in rows for v in self.row_values(r)]
        return found

    def judged(self, judge: Callable[[str, Ledger], list[str]], section: str) -> list[str]:
        """``judge(section, self)``, once per section text."""
        key = (judge.__name__, section)
        if (found := self._verdicts.get(key)) is None:
            found = self._verdicts[key] = judge(section, self)
        return found


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def _row_unit(row: dict) -> tuple[str, float] | None:
    unit = (row.get("unit") or "").strip()
    if not unit:
        found = CHECK_UNIT.findall(row["check"])  # the last unit its name gives: "step ms, round 1", "peak (GiB)"
        unit = found[-1] if found else ""
    return UNITS.get(unit)


def _row_values(row: dict) -> list[tuple[str, float]]:
    """The row's numbers in base units of its kind: value, threshold and each number of its detail (its spread)."""
    unit = _row_unit(row)
    if unit is None:
        return []
    kind, scale = unit
    nums = [row.get("value"), row.get("threshold")]
    nums += [float(x) for x in re.findall(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w.])", row.get("detail") or "")]
    return [(kind, float(x) * scale) for x in nums if isinstance(x, (int, float)) and not isinstance(x, bool)]


def _sections(text: str) -> list[str]:
    """From one heading to the next; a ``#`` line inside a fenced block is not a heading."""
    sections, fenced = [[]], False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        if not fenced and re.match(r"#{1,6} ", line):
            sections.append([])
        sections[-1].append(line)
    return ["\n".join(lines) for lines in sections if lines]


def _cell_context(prose: str, groups: dict[str, list[str]]) -> dict:
    """For each table row of ``prose`` (by the offset its line starts at): a function of an offset in that line to
    (the column's header, the row's labels), as ``table_cells`` reads them; ``groups``: the names in backticks of
    each line before they were taken out (a row that names a ledger group)."""
    out, header, shape, start = {}, None, None, 0
    for line in prose.splitlines(keepends=True):
        if not line.startswith("|"):
            header, start = None, start + len(line)
            continue
        cells = line.rstrip("\n").split("|")[1:]
        if header is None:
            header = [c.strip().lower() for c in cells]
        else:
            words = [
                c.strip().lower()
                for c in cells
                if c.strip() and not NUMBER.fullmatch(c.strip()) and not FIGURE.search(c)
            ]
            shape = SHAPE.search(cells[0]) if cells[0].strip() else shape
            labels = ([words[-1]] if words else []) + ([shape.group(0).replace("×", "x")] if shape else [])
            labels += sorted(_runs_of(line)) + [f"group:{g}" for g in groups.get(line.rstrip("\n"), [])]  # its runs
            bounds = [start + 1 + sum(len(c) + 1 for c in cells[:i]) for i in range(len(cells) + 1)]

            def where(at, bounds=bounds, header=header, labels=labels):
                i = max(j for j, b in enumerate(bounds) if b <= at)
                return (header[i] if i < len(header) else ""), labels

            out[start] = where
        start += len(line)
    return out


def unledgered_figures(text: str, ledger: Ledger) -> list[str]:
    """Each measured figure of ``text`` that no row of the runs and groups cited in its section holds."""
    return [bad for section in _sections(text) for bad in ledger.judged(_unledgered_in, section)]


def _unledgered_in(section: str, ledger: Ledger) -> list[str]:
    """``unledgered_figures`` of one section."""
    bad, cited = [], ledger.cited(section)
    prose = CODE.sub("", section)
    groups = {CODE.sub("", line): re.findall(r"`([^`\n]+)`", line) for line in section.splitlines()}
    cells = _cell_context(prose, groups)
    for m in FIGURE.finditer(prose):
        kind, scale = UNITS[m.group(3)]
        if (where := cells.get(prose.rfind("\n", 0, m.start()) + 1)) is not None:  # a table row: its cell's rows
            column, labels = where(m.start())
            values = ledger.figures(cited, column, tuple(labels))
        else:
            values = ledger.figures(cited)
        for printed in filter(None, m.group(1, 2)):
            half = 0.5 * 10.0 ** -len(printed.partition(".")[2]) * (1 + 1e-9)  # its printed precision
            if not any(k == kind and abs(v / scale - float(printed)) <= half for k, v in values):
                heading = section.splitlines()[0][:60]
                bad.append(f"{printed} {m.group(3)} in '{heading}' ({prose[max(0, m.start() - 40) : m.end()]!r})")
    return bad


def cited_runs_missing(text: str, ledger: Ledger) -> list[str]:
    known = set(ledger.by_run) | set(ledger.by_group)  # a scorecard's group is named like a run
    return sorted({run for run in RUN.findall(text) if run not in known})


def wrong_check_counts(text: str, ledger: Ledger) -> list[str]:
    passed: dict[str, int] = {}
    for r in ledger.rows:
        if r["kind"] == "check" and r["verdict"] == "pass":
            passed[r["run_id"]] = passed.get(r["run_id"], 0) + 1
    return [
        f"{n} checks for {run}: the ledger has {passed.get(run, 0)}"
        for n, run in CHECKS.findall(text)
        if passed.get(run) != int(n)
    ]


SHORT_RUN = re.compile(r"…(\d{6}Z-[A-Za-z0-9_.-]*[A-Za-z0-9_])")  # "…011821Z-memory": the date of the run before it
COUNT = re.compile(r"(?<![\w.])(\d+) checks?\b")


def _runs_of(line: str) -> set[str]:
    """The run ids a line names, an abbreviated one ("…HHMMSSZ-name") completed with the date of the first."""
    full = RUN.findall(line)
    return set(full) | ({full[0][:9] + short for short in SHORT_RUN.findall(line)} if full else set())


def wrong_run_check_counts(text: str, ledger: Ledger) -> list[str]:
    """Each "N checks" printed in a table row, or a paragraph, that names runs: N is the count of checks (all, or
    those that passed) of one of those runs in the ledger (0 for a run that recorded none)."""
    counts: dict[str, set[int]] = {}
    for run in ledger.by_run:
        counts[run] = {0}
    tallies: dict[str, list[int]] = {}
    for r in ledger.rows:
        if r["kind"] == "check":
            t = tallies.setdefault(r["run_id"], [0, 0])
            t[0] += 1
            t[1] += r["verdict"] == "pass"
    counts |= {run: set(t) for run, t in tallies.items()}
    bad = []
    for para in _paragraphs(CODE.sub("", text)):
        for line in para.splitlines() if para.lstrip().startswith("|") else [para]:
            runs = _runs_of(line)
            for m in COUNT.finditer(line) if runs else ():
                if not any(int(m.group(1)) in counts.get(run, set()) for run in runs):
                    bad.append(f"{m.group(0)} beside {sorted(runs)}: the ledger has {[counts.get(r) for r in runs]}")
    return bad


def wrong_scores(text: str, ledger: Ledger) -> list[str]:
    """Each printed mutation score against the mutation runs of the ledger group its paragraph names."""
    runs: dict[str, dict[str, float]] = {}
    for r in ledger.rows:
        if r["run_id"].split("-", 1)[-1].startswith("mutate"):
            fig = runs.setdefault(r["run_id"], {"group": r["group"]})
            if r["kind"] == "check" and r["check"].startswith("mutation score"):
                fig["score"] = r["value"]
            elif r["kind"] == "bench":
                fig[r["check"].rsplit(": ", 1)[-1]] = r["value"]
    bad = []
    for para in _paragraphs(text):
        groups = set(GROUP.findall(para))
        for score, killed, survived, equivalent, total, wall in SCORE.findall(para):
            want = (float(score), int(killed), int(survived), int(equivalent), int(total), int(wall))
            found = [
                f
                for f in runs.values()
                if f["group"] in groups
                and (
                    round(f.get("score", -1), len(score) - 2),
                    f.get("mutants killed"),
                    f.get("mutants survived"),
                    f.get("mutants equivalent"),
                    sum(f.get(k, 0) for k in ("mutants killed", "mutants survived", "mutants equivalent")),
                    round(f.get("wall s", -1)),
                )
                == want
            ]
            if not found:
                bad.append(
                    f"score {score} ({killed}/{survived}/{equivalent} of {total}, {wall} s) in no run of {groups}"
                )
    return bad


def wrong_second_scores(text: str) -> list[str]:
    """Each score printed "with the equivalents counted as survivors" against K / (K + V + E) of the counts printed
    before it (which ``wrong_scores`` holds to the ledger)."""
    bad = []
    for killed, survived, equivalent, printed in SECOND_SCORE.findall(text):
        k, n = int(killed), int(killed) + int(survived) + int(equivalent)
        if round(k / n, len(printed) - 2) != float(printed):
            bad.append(f"score {printed} with the equivalents counted as survivors: {k} / {n} is {k / n:.4f}")
    return bad


# a measured ratio has decimals ("5.03×"); a whole one ("2×", "16×") is a rule's constant or a target. Not a shape
# ("8×256") nor a count of GPUs ("2×H200")
RATIO = re.compile(r"(?<![\w.×])(\d+\.\d+)\s?×(?!\w)")
# its derivation, written right after it: <!-- = RUN "part of a check" / RUN "part of another" --> (or one row)
DERIVED = re.compile(r'\**\)?\s?<!-- = (\S+) "([^"]+)"(?: / (\S+) "([^"]+)")? -->')
TARGET = re.compile(r"target|≥|asks for|would|bar\b", re.I)  # a ratio asked for, not measured
RATIO_CHECK = re.compile(r"÷|ratio|speed-?up|×|faster|slower| / |relative|vs\b", re.I)  # a check that is a ratio
SHAPE = re.compile(r"\d+×\d+")  # a case's batch and sequence ("32×1024")
QUOTIENT = re.compile(r"(\d+(?:\.\d+)?) vs (\d+(?:\.\d+)?) \($")
NUMBER = re.compile(r"(?<![\w.×])-?\d+(?:\.\d+)?(?![\w.×])")


def _indexed(rows: list[dict]) -> tuple[dict, dict]:
    by_run: dict[str, list[dict]] = {}
    by_group: dict[str, list[dict]] = {}
    for r in rows:
        by_run.setdefault(r["run_id"], []).append(r)
        by_group.setdefault(r["group"], []).append(r)
    return by_run, by_group


def _within(printed: str, value: float) -> bool:
    return abs(value - float(printed)) <= 0.5 * 10.0 ** -len(printed.partition(".")[2]) * (1 + 1e-9)


def ratio_backed(printed: str, cited: list[dict]) -> bool:
    """A printed ratio is a figure of a row of the runs its section cites whose check is a ratio (its value,
    threshold or a number of its detail). A quotient of any two cited figures is no derivation: with the dozens of
    rows a section cites, a ratio edited by 1% still matched some pair for 103 of the 134 ratios the pages printed."""
    for r in cited:
        if not RATIO_CHECK.search(r["check"]):
            continue
        numbers = [r.get("value"), r.get("threshold"), *(float(x) for x in NUMBER.findall(r.get("detail") or ""))]
        if any(isinstance(x, (int, float)) and not isinstance(x, bool) and _within(printed, x) for x in numbers):
            return True
    return False


def derived(printed: str, derivation: re.Match, by_run: dict) -> str | None:
    """Why the written derivation does not give ``printed`` (None: it does): each part names one row of its run."""
    values = []
    for run, part in ((derivation.group(1), derivation.group(2)), (derivation.group(3), derivation.group(4))):
        if run is None:
            continue
        found = [r["value"] for r in by_run.get(run, []) if part in r["check"] and isinstance(r["value"], (int, float))]
        if len(found) != 1:
            return f"{run} has {len(found)} rows whose check holds {part!r}: expected one"
        values.append(float(found[0]))
    value = values[0] / values[1] if len(values) == 2 else values[0]
    return None if _within(printed, value) else f"the derivation gives {value:.6g}"


def unbacked_ratios(text: str, ledger: Ledger) -> list[str]:
    """Each measured ratio ("1.182×") of ``text`` that its written derivation (``DERIVED``, ``derived``), else the
    ratio rows cited in its section (``ratio_backed``), do not give; a ratio asked for (a target, a bar) is not a
    measurement."""
    return [bad for section in _sections(text) for bad in ledger.judged(_unbacked_ratios_in, section)]


def _unbacked_ratios_in(section: str, ledger: Ledger) -> list[str]:
    """``unbacked_ratios`` of one section."""
    bad, cited, prose = [], ledger.rows_of(ledger.cited(section)), CODE.sub("", section)
    for m in RATIO.finditer(prose):
        if derivation := DERIVED.match(prose, m.end()):
            if why := derived(m.group(1), derivation, ledger.by_run):
                bad.append(f"{m.group(1)}× ({prose[max(0, m.start() - 50) : m.end()]!r}): {why}")
            continue
        around = prose[max(0, m.start() - 30) : m.start()] + prose[m.end() : m.end() + 14]
        quotient = QUOTIENT.search(prose[max(0, m.start() - 40) : m.start()])
        if quotient and _within(m.group(1), float(quotient.group(1)) / float(quotient.group(2))):
            continue  # "0.71 vs 0.25 (2.8×)": the quotient of the two figures printed before it
        if not TARGET.search(around) and not ratio_backed(m.group(1), cited):
            bad.append(
                f"{m.group(1)}× in '{section.splitlines()[0][:60]}' ({prose[max(0, m.start() - 50) : m.end()]!r})"
            )
    return bad


def table_cells(section: str) -> list[tuple[str, str, str, int, str, str]]:
    """(number, unit, row, the number's offset in the row, its column's name, the row's label) of each table cell
    whose unit is its column's header ("step ms", "peak (GiB)"); a ratio column ("÷", "ratio") has no unit. The
    label is the row's last cell that is not a number ("cupy+liger")."""
    out, header, shape = [], None, None
    for line in CODE.sub("", section).splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = line.split("|")[1:-1] if line.rstrip().endswith("|") else line.split("|")[1:]
        if header is None:
            header = [c.strip().lower() for c in cells]
            continue
        words = [
            c.strip().lower() for c in cells if c.strip() and not NUMBER.fullmatch(c.strip()) and not FIGURE.search(c)
        ]
        shape = SHAPE.search(cells[0]) if cells and cells[0].strip() else shape if header else None
        offset = 1
        for cell, name in zip(cells, header):
            unit = None if re.search(r"÷|ratio", name) else (CHECK_UNIT.findall(name) or [None])[-1]
            number = NUMBER.search(cell) if unit and not FIGURE.search(cell) and not set(cell) <= set("-: ") else None
            if number and not cell.strip().startswith(("≤", "≥", "<", ">")):
                labels = [words[-1]] if words else []
                labels += [shape.group(0).replace("×", "x")] if shape else []  # "32×1024" is "32x1024" in a check
                labels += sorted(_runs_of(line))  # a row that names its runs
                out.append((number.group(0), unit, line, offset + number.start(), name, labels))
            offset += len(cell) + 1
    return out


def _described(rows: list[dict], column: str, labels: list[str]) -> list[dict]:
    """The rows a table cell describes: of the runs and groups its row names (else of its section), those whose
    check ends with its column ("fwd ms") and, among them, each of its row's labels ("cupy+liger", as a word) that
    some of them name; where no check ends with the column (a table of its own), all of them, narrowed by the
    case's shape ("32x1024") only. A spread (min, max) is its own column's figure, never another column's."""
    named = {run.lower() for text in (column, *labels) for run in RUN.findall(text.upper())}
    named |= {label.removeprefix("group:") for label in labels if label.startswith("group:")}
    rows = [r for r in rows if r["run_id"].lower() in named or r["group"] in named] or rows  # a row naming its runs
    ends = re.compile(rf"(^|: ){re.escape(column)}$") if column else None  # a benchmark row's "<table>: <column>"
    chosen = [r for r in rows if ends and ends.search(r["check"].lower())]
    bench = bool(chosen)  # the table follows a benchmark's columns: its row labels name the stack too
    chosen = chosen or rows
    if column and not re.search(r"\b(min|max|range)\b", column):  # a spread is its own column's figure
        chosen = [r for r in chosen if not re.search(r"\b(min|max)$", r["check"])] or chosen
    for label in (label for label in labels if re.search(r"[a-z0-9]{2}", label)):  # a word, not "-"
        shape = SHAPE.fullmatch(label.replace("x", "×"))
        if not (shape or bench):
            continue
        edge = r"\d" if shape else r"[\w+-]"  # "…-r16-32x1024": a shape
        word = re.compile(rf"(?<!{edge}){re.escape(label)}(?!{edge})")
        chosen = [r for r in chosen if word.search(r["check"].lower())] or chosen
    return chosen


def unbacked_cells(text: str, ledger: Ledger) -> list[str]:
    """Each table cell whose unit is in its header (``table_cells``) that the rows it describes (``_described``,
    among those cited in its section) do not hold."""
    return [bad for section in _sections(text) for bad in ledger.judged(_unbacked_cells_in, section)]


def _unbacked_cells_in(section: str, ledger: Ledger) -> list[str]:
    """``unbacked_cells`` of one section."""
    bad, cited = [], ledger.cited(section)
    for printed, unit, line, _, column, labels in table_cells(section):
        kind, scale = UNITS.get(unit, (unit, 1.0))
        if not any(k == kind and _within(printed, v / scale) for k, v in ledger.figures(cited, column, tuple(labels))):
            bad.append(f"{printed} {unit} in '{section.splitlines()[0][:60]}' ({line[:90]!r})")
    return bad


def prose_figures(text: str) -> list[re.Match]:
    """The figures ``unledgered_figures`` judges, as matches in ``text`` itself (outside code)."""
    code = [m.span() for m in CODE.finditer(text)]
    return [m for m in FIGURE.finditer(text) if not any(a <= m.start() < b for a, b in code)]


@pytest.fixture(scope="module")
def ledger() -> Ledger:
    return Ledger(_rows())


@pytest.mark.parametrize("page", PAGES)
def test_each_page_cites_runs_in_the_ledger_and_prints_only_their_figures(page, ledger):
    text = (ROOT / page).read_text()
    assert cited_runs_missing(text, ledger) == []
    assert unledgered_figures(text, ledger) == []
    assert wrong_check_counts(text, ledger) == [] and wrong_scores(text, ledger) == []
    assert wrong_run_check_counts(text, ledger) == []
    assert wrong_second_scores(text) == []


def test_the_readme_prints_check_counts_and_mutation_scores_from_the_ledger(ledger):
    text = (ROOT / "README.md").read_text()
    assert CHECKS.findall(text) and len(SCORE.findall(text)) >= 2 and len(SECOND_SCORE.findall(text)) >= 2


# the pages whose ratios and table cells are held to the ledger too (issue 56, item 4: README.md and docs/);
# reports/README.md, the record of every run since the first, is held for its figures with units and its counts
BACKED = [p for p in PAGES if p != "reports/README.md"]


@pytest.mark.parametrize("page", BACKED)
def test_each_ratio_and_table_cell_is_a_ledger_figure_or_derived_from_two(page, ledger):
    text = (ROOT / page).read_text()
    assert unbacked_ratios(text, ledger) == []
    assert unbacked_cells(text, ledger) == []


def _edited_by_one_percent(text: str, start: int, end: int) -> str | None:
    printed = text[start:end]
    new = f"{float(printed) * 1.01:.{len(printed.partition('.')[2])}f}"
    return None if new == printed else text[:start] + new + text[end:]


@pytest.mark.parametrize("page", BACKED)
def test_every_ratio_and_table_cell_edited_by_one_percent_fails(page, ledger):
    """Each measured ratio and each table cell with its unit in the header, in turn made 1% larger (printed to the
    same precision: where that changes the text), is a value its ledger or its derivation do not give."""
    text = (ROOT / page).read_text()
    code = [m.span() for m in CODE.finditer(text)]
    spans = []
    for m in RATIO.finditer(text):
        around = text[max(0, m.start() - 30) : m.start()] + text[m.end() : m.end() + 14]
        if not any(a <= m.start() < b for a, b in code) and not TARGET.search(around):  # a target is no figure
            spans.append(m.span(1))
    for section in _sections(text):
        for number, _, line, offset, _, _ in table_cells(section):
            for at in re.finditer(re.escape(line), text):
                spans.append((at.start() + offset, at.start() + offset + len(number)))
    before = set(unbacked_ratios(text, ledger)) | set(unbacked_cells(text, ledger))
    escaped = []
    for start, end in spans:
        edited = _edited_by_one_percent(text, start, end)
        after = set(unbacked_ratios(edited, ledger)) | set(unbacked_cells(edited, ledger)) if edited else before
        if edited and not after - before:
            escaped.append(text[max(0, start - 50) : end + 2])
    assert escaped == []


@pytest.mark.parametrize("page", PAGES)
def test_every_figure_of_a_page_edited_by_one_percent_fails(page, ledger):
    """Each figure in turn made 1% larger (printed to the same precision: where that changes the text) is a value
    the ledger it describes do not hold (a table cell: its column's and its row's; prose: its section's runs)."""
    text = (ROOT / page).read_text()
    escaped = []
    for m in prose_figures(text):
        edited = _edited_by_one_percent(text, *m.span(1))
        if edited and not unledgered_figures(edited, ledger):
            escaped.append(text[max(0, m.start() - 40) : m.end()])
    assert escaped == []


def test_a_check_count_beside_its_runs_edited_by_one_fails(ledger):
    text = (ROOT / "reports/README.md").read_text()
    for old in ("82 passed, 173 checks", "127 / 132 checks", "(7 and 4 checks;"):
        assert old in text and not wrong_run_check_counts(text, ledger)
        n = re.search(r"(\d+) checks", old).group(1)
        edited = text.replace(old, old.replace(f"{n} checks", f"{int(n) + 1} checks"))
        assert wrong_run_check_counts(edited, ledger), old


@pytest.mark.parametrize(
    "old, new",
    [
        ("judged by 210 checks", "judged by 211 checks"),
        ("score 0.931 (121 killed", "score 0.941 (121 killed"),
        ("24 equivalent of 151) in 323 s", "24 equivalent of 151) in 300 s"),
        ("(score 0.776 with the equivalents", "(score 0.786 with the equivalents"),
        ("20261127T111738Z-quick-plain_lora_make", "20261127T111739Z-quick-plain_lora_make"),
        ("22.3 s on a warm H100", "23.3 s on a warm H100"),
        ("score 0.964 (27 killed", "score 0.954 (27 killed"),
        ("captured step 72.4 ms", "captured step 71.4 ms"),
    ],
)
def test_a_figure_edited_to_a_value_the_ledger_does_not_hold_fails(old, new, ledger):
    text = (ROOT / "README.md").read_text()
    assert old in text
    edited = text.replace(old, new)
    assert (
        cited_runs_missing(edited, ledger)
        or wrong_check_counts(edited, ledger)
        or wrong_scores(edited, ledger)
        or wrong_second_scores(edited)
        or unledgered_figures(edited, ledger)
    )


def _row(run: str, check: str, value: float, unit: str = "", detail: str = "", group: str = "g") -> dict:
    row = {"run_id": run, "group": group, "kind": "bench", "check": check, "value": value, "threshold": None}
    return row | {"unit": unit, "detail": detail, "verdict": "None"}


def _scanned(text: str, rows: list[dict]) -> list[str]:
    """The prose figures of ``text`` (no tables) that no row cited in their section holds, by a scan of every row of
    the ledger for every figure: what ``unledgered_figures`` finds through its index."""
    bad = []
    for section in _sections(text):
        runs, names = set(RUN.findall(section)), set(re.findall(r"`([^`\n]+)`", section))
        cited = [r for r in rows if r["run_id"] in runs or r["group"] in names]
        for m in FIGURE.finditer(CODE.sub("", section)):
            kind, scale = UNITS[m.group(3)]
            for printed in filter(None, m.group(1, 2)):
                if not any(k == kind and _within(printed, v / scale) for r in cited for k, v in _row_values(r)):
                    bad.append(f"{printed} {m.group(3)}")
    return bad


def test_the_indexed_ledger_finds_the_figures_a_scan_of_every_row_finds():
    a, b = "20260101T000000Z-bench", "20260101T000001Z-memory"
    rows = [_row(a, "fwd: step ms", 12.34, detail="min 11.9 max 12.8"), _row(a, "wall s", 95.0, unit="s")]
    rows += [_row(b, "peak (GiB)", 40.21, group="issue9"), _row(b, "reserved", 512.0, unit="MiB", group="issue9")]
    page = (
        f"# Speed\n\nRun {a}: a step of 12.3 ms (11.9-12.8 ms), 1.6 min in all.\n\n"
        f"# Memory\n\nIn `issue9`: 40.2 GiB at peak, 0.5 GiB reserved, 43.2 GB.\n\n# Nothing cited\n\nA 12.3 ms step.\n"
    )
    ledger = Ledger(rows)
    variants = [page, page.replace(a, b), page.replace("`issue9`", f"`g` {a}")]
    variants += [edited for m in prose_figures(page) if (edited := _edited_by_one_percent(page, *m.span(1)))]
    for text in variants:  # one index for all of them, as the 1%-edit cases use it, and a fresh one for each
        found = [bad.split(" in ")[0] for bad in unledgered_figures(text, ledger)]
        assert found == _scanned(text, rows) == [bad.split(" in ")[0] for bad in unledgered_figures(text, Ledger(rows))]
    assert _scanned(page, rows) == ["12.3 ms"] and len(variants) == 8
    assert all(_scanned(text, rows) != ["12.3 ms"] for text in variants[1:])


@pytest.mark.parametrize("page", ["docs/fused.md", "reports/README.md"])
def test_an_edited_page_gets_from_the_indexed_ledger_the_verdicts_a_fresh_index_gives(page, ledger):
    """The verdicts kept for a page's unchanged sections are those its sections get afresh."""
    text = (ROOT / page).read_text()
    edits = [edited for m in prose_figures(text) if (edited := _edited_by_one_percent(text, *m.span(1)))]
    for edited in (edits[len(edits) // 3], edits[-1]):
        fresh = Ledger(ledger.rows)
        for judge in (unledgered_figures, unbacked_ratios, unbacked_cells) if page in BACKED else (unledgered_figures,):
            assert judge(edited, ledger) == judge(edited, fresh), judge.__name__
        assert unledgered_figures(edited, ledger)
