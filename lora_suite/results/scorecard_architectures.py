"""The scorecard's implementation × architecture matrix (issue 55), from the quick tier's records of
``lora_suite/tiers/quick/test_architectures.py``: every check whose name starts with ``<architecture>: `` (an
``lora_suite.engine.architectures`` name) judges that cell, and every not-applicable record so named says why a cell,
or part of it, was not judged.

A cell is ``pass`` / ``fail`` with its count of checks (and the failed ones), ``n/a`` with the reasons when the run
judged nothing of that architecture but declared it not applicable, and absent ("not run") for a quick run older than
those tests. The newest quick run of each implementation gives its row (the ledger's run ids start with their stamp).
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import TypeVar

from lora_suite.engine.architectures import NAMES

CellT = TypeVar("CellT")  # the scorecard's Cell (passed in: this module is imported by the scorecard's)


def matrix(
    rows: list[dict],
    cell_type: Callable[[str, str, list[str], list[str], int], CellT],
    run_key: Callable[[dict], tuple[str, str, str]],
) -> dict[str, dict[str, CellT]]:
    """implementation -> architecture -> ``cell_type(verdict, run, failed, not_applicable, judged)`` from ledger
    rows (``run_key``: what identifies one run's rows)."""
    runs: dict[tuple, list[dict]] = {}
    for r in sorted(rows, key=lambda r: r["run_id"]):
        if r["tier"] == "quick":
            runs.setdefault(run_key(r), []).append(r)
    out: dict[str, dict[str, CellT]] = {}
    for (run, _, impl), rs in runs.items():  # newest last: it replaces the row
        cells: dict[str, CellT] = {}
        for arch in NAMES:
            mine = [r for r in rs if str(r["check"]).startswith(f"{arch}: ")]
            checks = [r for r in mine if r["kind"] == "check"]
            na = [f"{r['check']}: {r['detail']}" for r in mine if r["kind"] == "n/a"]
            failed = [r["check"] for r in checks if r["verdict"] == "fail"]
            if checks or na:
                verdict = ("fail" if failed else "pass") if checks else "n/a"
                cells[arch] = cell_type(verdict, run, failed, na, len(checks))
        if cells:
            out[impl] = cells
    return out


def cell_text(cell) -> str:
    if cell is None:
        return "not run"
    if cell.verdict == "n/a":
        return "n/a: " + "; ".join(n.split(": ", 1)[-1] for n in cell.not_applicable)[:160].replace("|", "\\|")
    text = f"{cell.verdict}, {cell.judged} checks"
    if cell.failed:
        text += f" ({len(cell.failed)} failed: {'; '.join(cell.failed)[:120]})"
    if cell.not_applicable:
        text += f" [{len(cell.not_applicable)} n/a: {'; '.join(cell.not_applicable)[:120]}]"
    return text.replace("|", "\\|")


def render_md(arch_matrix: dict) -> list[str]:
    """The Markdown table (no lines when no quick run judged an architecture)."""
    if not arch_matrix:
        return []
    lines = ["", "Architectures (quick tier, `test_architectures.py`): checks per family, or n/a with the reason", ""]
    lines += [f"| implementation | {' | '.join(NAMES)} |", "|---|" + "---|" * len(NAMES)]
    for impl, row in sorted(arch_matrix.items()):
        lines.append(f"| {impl} | {' | '.join(cell_text(row.get(a)) for a in NAMES)} |")
    return lines


def render_html(arch_matrix: dict, colour: dict) -> str:
    if not arch_matrix:
        return ""
    rows = []
    for impl, row in sorted(arch_matrix.items()):
        cells = []
        for a in NAMES:
            c = row.get(a)
            verdict = c.verdict if c else "not run"
            title = "; ".join(c.failed + c.not_applicable) if c else ""
            label = verdict + (f", {c.judged} checks" if c and c.judged else "")
            cells.append(
                f'<td style="background:{colour.get(verdict, "#fff3c4")}" title="{html.escape(title)}">'
                f"{html.escape(label)}</td>"
            )
        rows.append(f"<tr><th>{html.escape(impl)}</th>{''.join(cells)}</tr>")
    head = "".join(f"<th>{html.escape(a)}</th>" for a in NAMES)
    return f"<h2>Architectures (quick tier)</h2><table><tr><th>implementation</th>{head}</tr>{''.join(rows)}</table>"
