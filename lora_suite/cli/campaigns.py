"""The subcommands that are not one pytest run: the scorecard campaign (each implementation through the tiers in
lanes, then the interleaved benchmark alone, then the scorecard), and the offline tools over run folders and the
ledger (render-scorecard, history, ledger)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from lora_suite.cli import preflight
from lora_suite.cli.targets import default_ledger, default_reports, ledger_sources, python
from lora_suite.cli.usage import UsageError
from lora_suite.results import history as history_tool
from lora_suite.results import ledger, store
from lora_suite.results import scorecard as scorecard_tool

SCORECARD_TIERS = ("quick", "convergence", "memory")


def _suite(*args: str) -> list[str]:
    return [python(), "-m", "lora_suite", *args]


def scorecard(args) -> int:
    """Every selected implementation through quick, convergence and memory (``--jobs N`` lanes at once, each its
    own process and log: the tiers judge no timing, each process measures its own peak), then the interleaved
    benchmark alone, then the scorecard from every run under the folder. A failing tier is a finding: the next runs.
    ``SCORECARD_DRY_RUN=1`` prints the commands instead."""
    impls = _scorecard_impls(args)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = Path(args.report_dir) if args.report_dir else default_reports() / f"{stamp}-scorecard"
    dry = os.environ.get("SCORECARD_DRY_RUN") == "1"
    out.mkdir(parents=True, exist_ok=True)
    record = ["--record", "--ledger", str(args.ledger or default_ledger())] if args.record else []

    def lane(impl: str) -> list[list[str]]:
        vram = ["--check-vram"] if args.check_vram else []
        # lanes side by side are the parallelism: each tier in one process (six quick workers per lane would
        # put 6 x jobs processes of ~4 GiB each on the GPU)
        workers = ["--workers", "1"] if args.jobs > 1 else []
        return [
            _suite(t, "--lora-impl", impl, "--report-dir", str(out), *vram, *workers, *record) for t in SCORECARD_TIERS
        ]

    def show(cmd):
        return "would run: lora-suite " + " ".join(cmd[3:])

    running: list[tuple[subprocess.Popen, IO[str]]] = []  # a lane's process and its log file
    for impl in impls.split(","):
        if args.jobs == 1:
            for cmd in lane(impl):
                print(show(cmd)) if dry else subprocess.run(cmd)
            continue
        while len([p for p, _ in running if p.poll() is None]) >= args.jobs:
            time.sleep(0.5)
        print(f"scorecard: {impl}'s tiers started (output: {out / f'lane-{impl}.log'})", flush=True)
        log = open(out / f"lane-{impl}.log", "w")  # noqa: SIM115  (closed when the lane ends)
        script = " && ".join(
            ("echo " + repr(show(c))) if dry else " ".join(map(_quote, c)) + " ; true" for c in lane(impl)
        )
        running.append((subprocess.Popen(["bash", "-c", script], stdout=log, stderr=subprocess.STDOUT), log))
    for p, lane_log in running:
        p.wait()
        lane_log.close()
    if not args.no_bench:
        cmd = _suite(
            "bench", "--report-dir", str(out), *record, "--", "-k", "speed_interleaved", "--bench-impls", impls
        )
        print(show(cmd)) if dry else subprocess.run(cmd)
    cmd = _suite("render-scorecard", str(out), str(out))
    if dry:
        print(show(cmd))
        return 0
    return subprocess.run(cmd).returncode


def _scorecard_impls(args) -> str:
    """The implementations ``scorecard`` runs, comma-separated (default: every one installed), each checked."""
    import re

    from lora_suite.implementations import installed_names

    preflight.check_ledger_option(args)
    if args.report_dir:
        preflight.check_report_dir(args.report_dir)
    impls = args.impls if args.impls is not None else ",".join(installed_names())
    if not re.fullmatch(r"[A-Za-z0-9_.:,-]+", impls or ""):
        raise UsageError(f"--lora-impl must be names separated by commas, got {impls!r}")
    for impl in impls.split(","):
        preflight.check_implementation(impl)
    return impls


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


def render_scorecard(args) -> int:
    preflight.check_existing("render-scorecard", args.dirs)
    preflight.check_output("render-scorecard", args.out, folder=True)
    if args.ledger:
        preflight.check_existing("render-scorecard --ledger", [args.ledger], kind="ledger file")
    try:
        rows = ledger.rows_of_runs([Path(d) for d in args.dirs]) if args.dirs else []
        if args.group or args.ledger:
            rows += ledger.select(read_sources(ledger_sources(args.ledger)), group=args.group)
        losses = scorecard_tool.loss_curves([Path(d) for d in args.dirs]) if args.dirs else {}
    except ledger.LedgerError as exc:
        print(f"scorecard: {exc}", file=sys.stderr)
        return 2
    card = scorecard_tool.build_rows(_dedupe(rows), losses)
    if not card.matrix:
        print(f"scorecard: no run found in {args.dirs or ''} {args.group or ''}".rstrip(), file=sys.stderr)
        return 2
    scorecard_tool.write(Path(args.out), card)
    print(f"scorecard: {len(card.matrix)} implementation(s); {Path(args.out) / 'scorecard.md'}")
    return 0


def read_sources(locations: list) -> list[dict]:
    """The rows of several ledgers and stores, each run once (the first location that holds it wins)."""
    rows, seen = [], set()
    for location in locations:
        new = [r for r in ledger.read(location) if ledger.run_key(r) not in seen]
        seen |= {ledger.run_key(r) for r in new}
        rows += new
    return rows


def _dedupe(rows: list[dict]) -> list[dict]:
    """A run both in the ledger and in a folder given: the folder's rows (read first) win. A run is its id on its GPU:
    the nightly's GPU types start together, and their runs (each type under its own group) may share a run id."""
    first: dict[tuple[str, str], tuple] = {}
    out = []
    for r in rows:
        key = first.setdefault((r["run_id"], r["gpu"]), (r["group"],))
        if key == (r["group"],):
            out.append(r)
    return out


def history(args) -> int:
    html = Path(args.html) if args.html else default_reports() / "history" / "history.html"
    preflight.check_existing("history", args.dirs)
    if args.ledger:
        preflight.check_existing("history --ledger", [args.ledger], kind="ledger file")
    if html.suffix != ".html":
        raise UsageError(f"--html needs a path ending in .html, got {args.html!r}")
    if args.html:
        preflight.check_output("history --html", args.html)
    try:
        dirs = ledger.run_folders([Path(d) for d in args.dirs]) if args.dirs else []
        rows = ledger.rows_of_runs(dirs) if dirs else []
        if not args.no_ledger:
            rows += read_sources(ledger_sources(args.ledger))
        if not rows:
            raise ledger.LedgerError("nothing to draw: the ledger is empty and no run folder was given")
        groups = history_tool.collect_rows(_dedupe(rows), {d.name: d for d in dirs})
    except (ledger.LedgerError, ValueError) as exc:
        print(f"history: {exc}", file=sys.stderr)
        return 2
    try:
        md = history_tool.write(html, groups)
    except OSError as exc:  # issue 28: a folder that cannot be created ended in a traceback
        print(f"history: cannot write {html} ({exc.strerror or exc})", file=sys.stderr)
        return 2
    print(f"history: {sum(len(g.runs) for g in groups)} runs in {len(groups)} groups; {html} and {md}")
    return 0


def ledger_command(args) -> int:
    path = args.ledger or default_ledger()
    if args.action == "import":  # FILE into the store
        preflight.check_existing("ledger import", [args.file], kind="ledger file or store")
    if args.action == "export":  # the store's rows into FILE
        preflight.check_existing("ledger export --ledger", [path], kind="ledger file or store")
        preflight.check_output("ledger export", args.file)
    if args.action == "show" and args.ledger:
        preflight.check_existing("ledger show --ledger", [args.ledger], kind="ledger file")
    if args.action == "record":
        preflight.check_existing("ledger record", args.runs)
    if args.action in ("record", "import") and args.ledger:
        preflight.check_store_path(args.ledger)
    name = store.redacted(path)
    try:
        if args.action == "record":
            added = ledger.record(path, [Path(r) for r in args.runs], args.group)
            print(f"ledger: {added} row(s) appended to {name}" + ("" if added else " (those runs are in it already)"))
            return 0
        if args.action in ("import", "export"):
            src, dst = (args.file, path) if args.action == "import" else (path, args.file)
            rows = ledger.select(ledger.read(src), run=args.run, group=args.group)
            added = ledger.append(dst, rows)
            print(f"ledger: {added} of {len(rows)} row(s) copied from {store.redacted(src)} to {store.redacted(dst)}")
            return 0
        rows = ledger.select(read_sources(ledger_sources(args.ledger)), run=args.run, check=args.check)
    except ledger.LedgerError as exc:
        print(f"ledger: {exc}", file=sys.stderr)
        return 2
    print(ledger.format_rows(rows) if rows else f"ledger: no row of {name} matches")
    return 0
