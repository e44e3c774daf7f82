"""The scorecard: LoRA implementations side by side, judged by the same tiers (issue 19).

``python -m lora_suite.results.scorecard OUT_DIR REPORT_DIR [REPORT_DIR ...]`` reads every ``report.json`` under the
report directories (``gpu-test.sh scorecard`` lays out one run directory per implementation and tier) and writes
``OUT_DIR/scorecard.md``, a self-contained ``OUT_DIR/scorecard.html`` (its plots embedded as PNG) and
``OUT_DIR/scorecard.json``, atomically:

- the matrix implementation × tier: pass, fail (with the failed checks), not applicable (every check of the tier
  declared not applicable, with the reasons), the run's own end (error, interrupted) or "not run"; a pass that
  had checks declared not applicable says how many, with their reasons in a footnote (and on hover in HTML);
- the depth of each cell: how many checks judged the implementation in that tier's run and how many records
  declared something not applicable (a pass on 7 checks is not a pass on 250);
- the convergence tier's loss curves, overlaid per implementation;
- the memory tier's peak allocated VRAM per implementation, as bars;
- the implementation × architecture matrix from the quick tier's checks of each family
  (``lora_suite.results.scorecard_architectures``): pass or fail with its checks, or n/a with the reason;
- the benchmark column, per implementation that took turns in a bench run's interleaved training benchmark
  (``--bench-impls``): measured, fail (a run that stopped: the row saying what stopped it) or n/a (every mode
  declared not applicable); its tokens/s relative to PEFT eager, each taken from the first bench run that
  measured it (one run's turns, never two runs mixed), as a table and a bar plot.
A failing implementation is a finding, not an error: the scorecard is written whatever the verdicts (exit 0);
exit 2 when no report is found or the arguments are wrong.
"""

from __future__ import annotations

import base64
import html
import io
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lora_suite.harness.report import atomic_write_text
from lora_suite.results import ledger
from lora_suite.results import scorecard_architectures as arch_card

TIERS = ("quick", "convergence", "memory", "benchmark")
PEAK_CHECK = "peak allocated VRAM"


@dataclass
class Cell:
    verdict: str  # "pass", "fail", "n/a", "not judged", "not run" or the run's status ("error", "interrupted", ...)
    run: str = ""  # the run directory's name
    failed: list[str] = field(default_factory=list)
    not_applicable: list[str] = field(default_factory=list)  # "test: reason"
    judged: int = 0  # checks judged in the run (passed or failed)


@dataclass
class Scorecard:
    matrix: dict[str, dict[str, Cell]]  # implementation -> tier -> cell (the newest run of each pair)
    losses: dict[str, tuple[list[float], list[float]]]  # implementation -> (steps, losses), convergence tier
    peaks_gib: dict[str, float]  # implementation -> peak allocated VRAM, memory tier
    speed_vs_peft_eager: dict[str, float]  # "<case> <run>" -> tokens/s ÷ PEFT eager's, from a bench run
    peak_base: dict[str, str] = field(default_factory=dict)  # implementation -> "NF4" or "16-bit", memory tier
    speed_source: dict[str, str] = field(default_factory=dict)  # "<case> <run>" -> the bench run it is from
    architectures: dict[str, dict[str, Cell]] = field(default_factory=dict)  # implementation -> family -> cell


def build_rows(rows: list[dict], losses: dict | None = None) -> Scorecard:
    """The scorecard from ledger rows (``lora_suite.results.ledger``); ``losses`` (implementation -> (steps, loss)) come
    from run folders where they are at hand (the ledger keeps judged figures, not curves)."""
    matrix: dict[str, dict[str, Cell]] = {}
    peaks, ratios, bases, sources = {}, {}, {}, {}
    bench_cells: dict[str, Cell] = {}  # implementation -> its cell of the interleaved benchmark
    runs: dict[tuple, list[dict]] = {}
    for r in sorted(rows, key=lambda r: r["run_id"]):  # run ids start with their UTC stamp: newest last, it wins
        runs.setdefault(ledger.run_key(r), []).append(r)  # lanes started in the same second share a run id
    for (run, _, _), rs in runs.items():
        head = next((r for r in rs if r["kind"] == "run"), rs[0])
        impl, tier = head["implementation"], head["tier"]
        failed = [r["check"] for r in rs if r["kind"] == "check" and r["verdict"] == "fail"]
        na = [f"{r['check']}: {r['detail']}".strip(": ") for r in rs if r["kind"] == "n/a"]
        if tier != "benchmark":  # a bench run judges the implementations that took turns, each in its own cell
            verdict = head["verdict"] if head["kind"] == "run" else ("fail" if failed else "pass")
            if verdict == "fail" and not failed:
                failed = ["a test failed"]
            judged = sum(r["kind"] == "check" for r in rs)
            matrix.setdefault(impl, {})[tier] = Cell(verdict, run, failed, na, judged)
        for r in rs:
            if tier == "memory" and r["kind"] == "check" and r["check"] == PEAK_CHECK and isinstance(r["value"], float):
                peaks[impl] = r["value"]
                bases[impl] = "NF4" if head["detail"] == "NF4 base" else "16-bit"
            if tier != "benchmark":
                continue
            if r["kind"] == "bench" and r["check"].endswith(": ÷ PEFT eager"):
                label = r["check"].split(": ")[-2]  # "<case> <run>"
                if label not in ratios:  # the first bench run that measured a (case, run) gives its ratio
                    ratios[label], sources[label] = r["value"], run
                bench_cells.setdefault(_impl_of_run(label.split(" ")[-1]), Cell("measured", run))
            if r["kind"] == "stopped":
                label = r["check"].split(": ")[-1]
                cell = bench_cells.setdefault(_impl_of_run(label.split(" ")[-1]), Cell("fail", run))
                cell.verdict = "fail"
                cell.failed.append(f"{label}: {r['value']}")
        if tier == "benchmark":
            for item in na:  # "<case> <impl> <mode>: why" or "<case> <impl>: what: why"
                parts = item.split(" ", 2)
                if len(parts) == 3:
                    impl_of = parts[1].rstrip(":")
                    bench_cells.setdefault(impl_of, Cell("n/a", run)).not_applicable.append(item)
    for impl, cell in bench_cells.items():  # measured, fail (a run that stopped) or n/a (every mode declared)
        matrix.setdefault(impl, {})["benchmark"] = cell
    return Scorecard(matrix, losses or {}, peaks, ratios, bases, sources, arch_card.matrix(rows, Cell, ledger.run_key))


def loss_curves(dirs: list[Path]) -> dict[str, tuple[list, list]]:
    """implementation -> (steps, losses) of the newest convergence run under the folders."""
    out = {}
    for d in ledger.run_folders(dirs):
        report = json.loads((d / "report.json").read_text())
        impl = (report.get("implementation") or {}).get("name") or "unknown"
        for s in report.get("series", []) if report.get("selection") == "convergence" else []:
            cols = s.get("columns", [])
            if s["name"] == f"convergence ({impl}): loss" and "loss" in cols:
                i, j = cols.index("step"), cols.index("loss")
                out[impl] = ([r[i] for r in s["rows"]], [r[j] for r in s["rows"]])
    return out


def build(dirs: list[Path]) -> Scorecard:
    """The scorecard of every run under the folders (their rows, as the ledger would hold them, and loss curves)."""
    for d in dirs:
        if not d.is_dir():
            raise FileNotFoundError(f"report directory {d} does not exist")
    try:
        return build_rows(ledger.rows_of_runs(dirs), loss_curves(dirs))
    except ledger.LedgerError as exc:
        raise FileNotFoundError(str(exc)) from None


def _impl_of_run(run: str) -> str:
    """'peft-bnb-captured' -> 'peft-bnb': an interleaved run is named <implementation>-<mode>."""
    return run.rsplit("-", 1)[0]


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def plots(card: Scorecard) -> dict[str, bytes]:
    """PNG bytes of the loss overlay and the peak bars (only those with data)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}
    if card.losses:
        fig, ax = plt.subplots(figsize=(7, 4))
        for impl, (steps, loss) in sorted(card.losses.items()):
            ax.plot(steps, loss, label=impl)
        ax.set(xlabel="step", ylabel="loss", title="convergence tier: loss per step")
        ax.legend()
        out["scorecard-loss.png"] = _png(fig)
        plt.close(fig)
    if card.peaks_gib:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        names = sorted(card.peaks_gib)
        ax.bar([f"{n}\n({card.peak_base.get(n, '?')} base)" for n in names], [card.peaks_gib[n] for n in names])
        ax.set(ylabel="GiB", title="memory tier: peak allocated VRAM")
        out["scorecard-peak.png"] = _png(fig)
        plt.close(fig)
    if card.speed_vs_peft_eager:
        keys = sorted(card.speed_vs_peft_eager)
        fig, ax = plt.subplots(figsize=(8, 0.28 * len(keys) + 1.2))
        ax.barh(keys, [card.speed_vs_peft_eager[k] for k in keys])
        ax.axvline(1.0, color="k", lw=0.8)
        ax.invert_yaxis()
        ax.set(xlabel="tokens/s ÷ PEFT eager (runs taking turns)", title="training benchmark: speed vs PEFT eager")
        out["scorecard-speed.png"] = _png(fig)
        plt.close(fig)
    return out


def summarise(items: list[str]) -> list[str]:
    """Each distinct item once, in first-seen order, with "(×n)" where it occurs n > 1 times (51 skipped tests
    of one declared reason are one note)."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return [f"{item} (×{n})" if n > 1 else item for item, n in counts.items()]


def _cell_text(cell: Cell | None, notes: list[str]) -> str:
    if cell is None:
        return "not run"
    text = cell.verdict
    if cell.judged:
        text += f", {cell.judged} checks"
    if cell.failed:
        text += f" ({len(cell.failed)}: {'; '.join(cell.failed)[:120]})"
    if cell.not_applicable:
        notes.append("; ".join(summarise(cell.not_applicable)))
        text += f" [{len(cell.not_applicable)} n/a, note {len(notes)}]"
    return text


def render_md(card: Scorecard, images: dict[str, bytes]) -> str:
    tiers = [t for t in TIERS if any(t in row for row in card.matrix.values())] or list(TIERS)
    notes: list[str] = []
    lines = [
        "# LoRA implementations scorecard",
        "",
        f"| implementation | {' | '.join(tiers)} |",
        "|---|" + "---|" * len(tiers),
    ]
    for impl, row in sorted(card.matrix.items()):
        lines.append(f"| {impl} | {' | '.join(_cell_text(row.get(t), notes) for t in tiers)} |")
    judged_tiers = [t for t in tiers if t != "benchmark"]
    lines += [
        "",
        "Depth: checks judged / records declared not applicable, per tier",
        "",
        f"| implementation | {' | '.join(judged_tiers)} | total judged |",
        "|---|" + "---|" * (len(judged_tiers) + 1),
    ]
    for impl, row in sorted(card.matrix.items()):
        cells = [row.get(t) for t in judged_tiers]
        depth = [f"{c.judged} / {len(c.not_applicable)}" if c else "-" for c in cells]
        lines.append(f"| {impl} | {' | '.join(depth)} | {sum(c.judged for c in cells if c)} |")
    if notes:
        lines += ["", "Not applicable, as each implementation declared it:", ""]
        lines += [f"{i}. {n}" for i, n in enumerate(notes, 1)]
    lines += arch_card.render_md(card.architectures)
    if card.peaks_gib:
        lines += ["", "| implementation | base | peak allocated VRAM (GiB), memory tier |", "|---|---|---|"]
        lines += [f"| {k} | {card.peak_base.get(k, '?')} | {v} |" for k, v in sorted(card.peaks_gib.items())]
    if card.speed_vs_peft_eager:
        lines += [
            "",
            "| benchmark case and run | tokens/s ÷ PEFT eager (runs taking turns) | bench run |",
            "|---|---|---|",
        ]
        lines += [
            f"| {k} | {v:.3f} | {card.speed_source.get(k, '')} |" for k, v in sorted(card.speed_vs_peft_eager.items())
        ]
    lines += [""] + [f"![{name}]({name})" for name in images]
    return "\n".join(lines) + "\n"


def render_html(card: Scorecard, images: dict[str, bytes]) -> str:
    tiers = [t for t in TIERS if any(t in row for row in card.matrix.values())] or list(TIERS)
    colour = {"pass": "#d4f4d4", "measured": "#d4f4d4", "fail": "#f8d0d0", "n/a": "#e8e8e8"}
    rows = []
    for impl, row in sorted(card.matrix.items()):
        cells = []
        for t in tiers:
            c = row.get(t)
            verdict = c.verdict if c else "not run"
            title = "; ".join(summarise(c.failed + c.not_applicable) if c else [])
            label = verdict + (f", {c.judged} checks" if c and c.judged else "")
            label += f" ({len(c.not_applicable)} n/a)" if c and c.not_applicable else ""
            cells.append(
                f'<td style="background:{colour.get(verdict, "#fff3c4")}" title="{html.escape(title)}">'
                f"{html.escape(label)}</td>"
            )
        rows.append(f"<tr><th>{html.escape(impl)}</th>{''.join(cells)}</tr>")
    imgs = "".join(
        f'<p><img alt="{n}" src="data:image/png;base64,{base64.b64encode(b).decode()}"></p>' for n, b in images.items()
    )
    return (
        "<!doctype html><meta charset=utf-8><title>LoRA implementations scorecard</title>"
        "<style>td,th{border:1px solid #999;padding:4px 8px}table{border-collapse:collapse}</style>"
        "<h1>LoRA implementations scorecard</h1><p>Hover a cell for the failed checks and the reasons of what "
        "was not applicable.</p>"
        f"<table><tr><th>implementation</th>{''.join(f'<th>{t}</th>' for t in tiers)}</tr>{''.join(rows)}"
        f"</table>{arch_card.render_html(card.architectures, colour)}{imgs}\n"
    )


def write(out_dir: Path, card: Scorecard) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    images = plots(card)
    for name, data in images.items():
        tmp = out_dir / f".{name}.tmp"
        tmp.write_bytes(data)
        tmp.replace(out_dir / name)
    atomic_write_text(
        out_dir / "scorecard.json",
        json.dumps(
            {
                "matrix": {i: {t: asdict(c) for t, c in row.items()} for i, row in card.matrix.items()},
                "losses": card.losses,
                "peaks_gib": card.peaks_gib,
                "peak_base": card.peak_base,
                "speed_vs_peft_eager": card.speed_vs_peft_eager,
                "speed_source": card.speed_source,
                "architectures": {i: {a: asdict(c) for a, c in row.items()} for i, row in card.architectures.items()},
            },
            indent=1,
        ),
    )
    atomic_write_text(out_dir / "scorecard.md", render_md(card, images))
    atomic_write_text(out_dir / "scorecard.html", render_html(card, images))


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m lora_suite.results.scorecard OUT_DIR REPORT_DIR [REPORT_DIR ...]", file=sys.stderr)
        return 2
    try:
        card = build([Path(a) for a in argv[1:]])
    except FileNotFoundError as exc:
        print(f"scorecard: {exc}", file=sys.stderr)
        return 2
    if not card.matrix:
        print(f"scorecard: no report.json under {argv[1:]}", file=sys.stderr)
        return 2
    write(Path(argv[0]), card)
    print(f"scorecard: {len(card.matrix)} implementation(s); {Path(argv[0]) / 'scorecard.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def cell_of(report: dict, run: str) -> Cell:
    """One run's cell of the matrix (pass, fail with the failed checks, n/a, or the run's own end)."""
    card = build_rows(ledger.rows_of_report(report, run))
    return next(iter(next(iter(card.matrix.values())).values()))
