"""The results ledger: the project's GPU evidence kept as data, one JSON object a line (``reports/ledger.jsonl``).

Run folders are outputs, ignored by git and archived as CI artifacts; what stays is one row per judged figure per
run, appended by ``lora-suite ledger record RUN...`` (or ``--record`` on a run). Each row carries:

    run_id, time (UTC), group (the folder that held the run: a campaign, a baseline set), commit, gpu, driver,
    cuda, torch, implementation, tier, kind, check, value, op, threshold, unit, verdict, source, detail

``kind`` is one of
- ``run``: one per run; ``value`` the run's status, ``verdict`` pass | fail | n/a | its status (error,
  interrupted, terminated), ``detail`` the base the memory tier stored ("NF4 base" / "16-bit base");
- ``check``: every check the run recorded, ``verdict`` pass | fail;
- ``n/a``: a check the implementation declared not applicable, ``detail`` the reason;
- ``bench``: a measured figure (a table cell of ``ledger_rows.BENCH_COLUMNS``: a benchmark's, or a mutation run's
  killed, survived and equivalent mutants and wall time), ``verdict`` measured; ``check`` is "<table>: <row>:
  <column>";
- ``stopped``: a benchmark run that stopped, ``value`` what stopped it, ``verdict`` fail;
- ``figure``: a tier's headline figure (report.json ``figures``: its YAML's ``suite.figures``), ``verdict``
  measured, ``detail`` its p20/p80, samples, clock and direction; and each test function's seconds ("test time:
  <file>::<function>", every parametrisation and phase summed).
Commits are kept to 12 hex digits. A run already in the ledger is not appended twice (its run id, group and
implementation identify it). The ledger is written atomically (a temporary file beside it, then renamed): an
interruption leaves the old one whole. Appends are serialised by an OS file lock on ``<ledger>.lock`` held across the
read, the de-duplication and the rename, so writers that overlap (scorecard lanes recording as their tiers end, two
GPU runners on one checkout) lose nothing and append a run once.
"""

from __future__ import annotations

import datetime as dt
import functools
import gzip
import json
import os
import re
import zlib
from pathlib import Path

from filelock import FileLock, Timeout

from lora_suite.harness.report import atomic_write_text
from lora_suite.results.ledger_rows import (  # noqa: F401  (the row format, read from here too)
    FIELDS,
    KEY_FIELDS,
    KINDS,
    LedgerError,
    check_rows,
    figure_rows,
    ledger_row,
    not_applicable_rows,
    run_key,
    seconds_rows,
    series_rows,
)

LOCK_TIMEOUT_S = 300.0  # a writer holds the lock for one read and one rename; five minutes means a stuck holder

NF4_NOTE = "stored as NF4"  # Prepared.describe's words in a run's notes when the base was quantised


def newer_schema(report: dict) -> str | None:
    """Why a report cannot be read: its schema is newer than this suite's (None when it can be)."""
    from lora_suite.harness.report import SCHEMA_VERSION

    version = report.get("schema_version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= SCHEMA_VERSION:
        return (
            f"report.json has schema_version {version!r}; this suite reads 1 to {SCHEMA_VERSION} (a newer suite "
            "wrote it: upgrade lora-gpu-suite)"
        )
    return None


def _run_verdict(report: dict) -> str:
    """The run's verdict by the rule of its report and summary (``harness.verdict``), in the ledger's words."""
    from lora_suite.harness.verdict import LEDGER_WORD, verdict_of_json

    result = verdict_of_json(report)[0]
    return LEDGER_WORD.get(result, result.lower())


def rows_of_report(report: dict, run: str, group: str = "") -> list[dict]:
    """Every judged figure of one run's report.json as ledger rows (the module docstring)."""
    if not isinstance(report, dict):
        raise LedgerError(f"{run}: report.json holds {type(report).__name__}, expected a JSON object")
    newer = newer_schema(report)
    if newer:
        raise LedgerError(f"{run}: {newer}")
    row = functools.partial(ledger_row, _run_head(report, run, group))
    base = "NF4 base" if any(NF4_NOTE in n for n in report.get("notes", [])) else "16-bit base"
    out = [row("run", "run", report.get("status"), _run_verdict(report), detail=base)]
    out += check_rows(report, row)
    out += not_applicable_rows(report, row)
    out += figure_rows(report, row)
    out += series_rows(report, row)
    out += seconds_rows(report, row)
    return out


def _run_head(report: dict, run: str, group: str) -> dict:
    """The fields every row of one run shares: its id, time, group, commit (12 hex digits), GPU, driver, CUDA,
    torch, implementation and tier."""
    env = report.get("environment") or {}
    commit = str(env.get("git_commit") or "unknown").split()[0][:12]  # 12 hex digits name a commit
    return {
        "run_id": report.get("run_id") or run,
        "time": env.get("timestamp_utc") or "",
        "group": group,
        "commit": commit,
        "gpu": env.get("gpu_name") or "no GPU",
        "driver": env.get("driver"),
        "cuda": env.get("cuda"),
        "torch": env.get("torch"),
        "implementation": (report.get("implementation") or {}).get("name") or "cupy",
        "tier": str(report.get("selection") or "all"),
    }


def run_folders(paths: list[Path]) -> list[Path]:
    """Each path that holds a report.json, or every run folder under it (sorted)."""
    out = []
    for p in map(Path, paths):
        if not p.is_dir():
            raise LedgerError(f"report directory {p} does not exist")
        found = [p] if (p / "report.json").is_file() else sorted(q.parent for q in p.rglob("report.json"))
        if not found:
            raise LedgerError(f"no report.json under {p}")
        out += found
    return out


def _reports(paths: list[Path]) -> list[tuple[Path, dict]]:
    """(run folder, its report.json) of each run under ``paths``; an unreadable one is an error naming it."""
    out = []
    for d in run_folders(paths):
        try:
            out.append((d, json.loads((d / "report.json").read_text())))
        except (OSError, json.JSONDecodeError) as exc:
            raise LedgerError(f"{d / 'report.json'}: not a readable report.json ({exc})") from None
    return out


def _rows(reports: list[tuple[Path, dict]], group: str | None) -> list[dict]:
    return [r for d, rep in reports for r in rows_of_report(rep, d.name, d.parent.name if group is None else group)]


def rows_of_runs(paths: list[Path], group: str | None = None) -> list[dict]:
    return _rows(_reports(paths), group)


RUN_FIELDS = ("time", "commit", "gpu", "driver", "cuda", "torch", "tier")  # the same on every row of one run

DEFAULTS = {"op": "", "threshold": None, "unit": "", "source": "", "detail": "", "value": None}
_ALL, _KEYS, _NEEDED = frozenset(FIELDS), frozenset(KEY_FIELDS), frozenset(("kind", "check", "verdict"))
_SHORT = _ALL - frozenset(RUN_FIELDS)  # the keys a short row may have


def read(path: str | Path) -> list[dict]:
    """Every row of the ledger, whole; a line that is not a row is an error naming the file and the line.

    A line is a whole row (every key of ``FIELDS``), or, after its run's ``run`` row, a short one: the run's key
    (``KEY_FIELDS``), its own fields, and none of ``RUN_FIELDS`` (taken from the run row) nor the empty defaults
    (``DEFAULTS``). ``append`` writes the short form; the file stays one JSON object a line.
    """
    if "://" not in str(path) and not Path(path).exists():
        return []  # nothing recorded yet: reading creates no store
    if (found := _store(path)) is not None:
        return found.read()
    path = Path(path)
    rows, decode = [], json.JSONDecoder().decode
    heads: dict[tuple[object, ...], dict] = {}  # run_key -> that run's run row
    for n, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = decode(line)
        except json.JSONDecodeError as exc:
            raise LedgerError(f"{path}:{n}: not JSON ({exc})") from None
        if isinstance(r, dict) and r.keys() != _ALL and r.get("kind") != "run":
            head = heads.get(tuple(r.get(k) for k in KEY_FIELDS)) if _KEYS <= r.keys() else None
            if head is not None and r.keys() <= _SHORT and _NEEDED <= r.keys():
                r = {**head, **DEFAULTS, **r}  # the run row's fields, the defaults, then the row's own
        if not isinstance(r, dict) or r.keys() != _ALL or r["kind"] not in KINDS:
            raise LedgerError(
                f"{path}:{n}: not a ledger row (expected the keys {list(FIELDS)}, or a short row after its run's "
                f"run row; kind one of {KINDS})"
            )
        if r["kind"] == "run":
            heads[run_key(r)] = r
        rows.append(r)
    return rows


def encode(rows: list[dict], heads: dict | None = None) -> str:
    """The lines of ``rows``: a run row whole, the rows after it short (``read`` says how)."""
    heads = {} if heads is None else heads
    lines = []
    for r in rows:
        head = heads.get(run_key(r))
        if r["kind"] == "run" or head is None or any(head[k] != r[k] for k in RUN_FIELDS):
            out = {k: r[k] for k in FIELDS}
            if r["kind"] == "run":
                heads[run_key(r)] = r
        else:
            out = {k: r[k] for k in FIELDS if k not in RUN_FIELDS and not (k in DEFAULTS and r[k] == DEFAULTS[k])}
        lines.append(json.dumps(out, ensure_ascii=False, separators=(",", ":")) + "\n")
    return "".join(lines)


def append(path: str | Path, rows: list[dict]) -> int:
    """Append the rows of runs not yet in the ledger (by run id, group and implementation: the lanes of a scorecard
    start together and their runs can share a run id); returns how many rows were added."""
    if (found := _store(path)) is not None:
        return found.append(rows)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S)
    try:
        with lock:
            old = read(path)
            have = {run_key(r) for r in old}
            new = [r for r in rows if run_key(r) not in have]
            if not new:
                return 0
            text = read_text(path) if path.exists() else ""
            if text and not text.endswith("\n"):
                text += "\n"
            text += encode(new, {run_key(r): r for r in old if r["kind"] == "run"})
            write_text(path, text)
            return len(new)
    except Timeout:
        raise LedgerError(
            f"{path}: another writer has held {lock.lock_file} for over {LOCK_TIMEOUT_S:.0f} s; nothing was appended"
        ) from None


def read_text(path: Path) -> str:
    """A ledger file's text; ``.gz``: gzip-compressed (the published ledger, ``reports/ledger.jsonl.gz``). A file that
    cannot be read, is not gzip, is cut short or is not UTF-8 is a ``LedgerError`` naming it and what is wrong."""
    try:
        data = path.read_bytes()
        return (gzip.decompress(data) if path.suffix == ".gz" else data).decode()
    except (gzip.BadGzipFile, zlib.error) as exc:
        raise LedgerError(
            f"{path}: not a gzip-compressed ledger ({exc}); a .gz ledger is written by this suite"
        ) from None
    except EOFError:
        raise LedgerError(f"{path}: the gzip stream is cut short (a truncated copy?); restore the file") from None
    except UnicodeDecodeError as exc:
        raise LedgerError(f"{path}: not UTF-8 text at byte {exc.start}; a ledger is JSON lines") from None
    except OSError as exc:
        raise LedgerError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def write_text(path: Path, text: str) -> None:
    """Atomically; ``.gz`` compressed with no timestamp, so the same rows give the same bytes."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if path.suffix != ".gz":
            return atomic_write_text(path, text)
        tmp.write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise LedgerError(f"{path}: not written ({exc.strerror or exc}); the ledger is as it was") from None


def _store(location):
    """The results store ``location`` names (``lora_suite.results.store``), or None for a JSON-lines ledger."""
    from lora_suite.results import store

    return store.open_store(location) if store.is_store(location) else None


def refusal(report: dict) -> str | None:
    """Why a run is not recorded, or None: the one rule of ``--record`` and ``ledger record``. A run that saw no GPU
    judged nothing on one (its GPU tests skipped): its rows would read as a GPU's verdict."""
    if not (report.get("environment") or {}).get("gpu_name"):
        return "it saw no GPU (its GPU tests skipped; nothing was judged on one)"
    return None


def record(path: str | Path, runs: list[Path], group: str | None = None) -> int:
    """Append the rows of the run folders ``runs`` (each, or every run under it); nothing is appended when one of
    them is refused (``refusal``), and the error names each."""
    reports = _reports(runs)
    refused = [f"{d.name}: {why}" for d, rep in reports if isinstance(rep, dict) and (why := refusal(rep))]
    if refused:
        raise LedgerError("not recorded (nothing was appended): " + "; ".join(refused))
    return append(path, _rows(reports, group))


def select(rows: list[dict], run: str | None = None, check: str | None = None, group: str | None = None) -> list[dict]:
    return [
        r
        for r in rows
        if (not run or r["run_id"].startswith(run) or _folder_of(run, r))
        and (not check or check in r["check"])
        and (not group or r["group"] == group)
    ]


def folder_token(text: str) -> str:
    """``text`` as a part of a folder name: every character but letters and digits becomes "_"."""
    return "".join(c if c.isalnum() else "_" for c in text)


def _folder_of(name: str, r: dict) -> bool:
    """Whether ``name`` is the folder of ``r``'s run, for runs recorded before the run id was the folder's name: the
    CLI named the folder <stamp>-<tier>[-<implementation>] up to a few seconds before pytest stamped its run id
    (the implementation as --lora-impl spelled it: a module:factory spec is not found by its folder)."""
    m = re.fullmatch(r"(\d{8}T\d{6}Z)-(.+)", name)
    rid = re.fullmatch(r"(\d{8}T\d{6}Z)-(.+)", r["run_id"])
    if not m or not rid or r["tier"] is None:
        return False
    impl = folder_token(r["implementation"])
    tier = r["tier"].replace("_", "-")
    if m.group(2) not in (tier, f"{tier}-{impl}") and not m.group(2).startswith(f"{tier}-{impl}-"):
        return False
    folder_t = dt.datetime.strptime(m.group(1), "%Y%m%dT%H%M%SZ")
    run_t = dt.datetime.strptime(rid.group(1), "%Y%m%dT%H%M%SZ")
    return 0 <= (run_t - folder_t).total_seconds() <= 60


def format_rows(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        t = "" if r["threshold"] is None else f" {r['op']} {r['threshold']}"
        lines.append(
            f"{r['run_id']}  {r['gpu']}  {r['implementation']}  {r['tier']}  {r['kind']}  "
            f"{r['check']}: {r['value']}{t}  [{r['verdict']}]  {r['commit'][:7]}"
        )
    return "\n".join(lines)


RUN_TAIL = re.compile(r"\s*\((first|of \d+|max at)[^)]*\)\s*$")  # a check name's run-specific tail
