"""Damaged ledger files (issue 72): every command that reads a JSON-lines ledger, given one that is not gzip, cut
short, not UTF-8, a folder or unreadable, ends in one clear line naming the file and what is wrong, exit 2, no
traceback, the file unchanged."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest

GOOD = b'{"run_id":"r","group":"g","implementation":"i","kind":"run"}\n' * 50


def _damaged(kind: str, folder: Path) -> Path:
    path = folder / "ledger.jsonl.gz"
    if kind == "not gzip":
        path.write_bytes(GOOD)
    elif kind == "cut short":
        path.write_bytes(gzip.compress(GOOD * 20)[:-40])
    elif kind == "not utf-8":
        path.write_bytes(gzip.compress(b"\xff\xfe" + GOOD))
    elif kind == "a folder":
        path.mkdir()
    elif kind == "unreadable":
        path.write_bytes(gzip.compress(GOOD))
        path.chmod(0)
    return path


KINDS = ["not gzip", "cut short", "not utf-8", "a folder", "unreadable"]
RUN = Path(__file__).resolve().parents[2] / "fixtures" / "runs" / "20261122T055507Z-quick"  # a recorded GPU run


def _good(folder: Path) -> Path:
    """A small sound ledger: the recorded run's rows."""
    from lora_suite.results import ledger

    path = folder / "good.jsonl"
    ledger.append(path, ledger.rows_of_runs([RUN], "g"))
    return path


COMMANDS = {
    "ledger show": lambda p: ["ledger", "show", "--ledger", str(p)],
    "ledger record": lambda p: ["ledger", "record", "--ledger", str(p), "--group", "g", str(RUN)],
    "ledger import": lambda p: ["ledger", "import", "--ledger", str(p.parent / "s.sqlite"), str(p)],
    "ledger export": lambda p: ["ledger", "export", "--ledger", str(_good(p.parent)), str(p)],
    "history": lambda p: ["history", "--ledger", str(p), "--html", str(p.parent / "h.html")],
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_damaged_ledger_is_one_clear_line(command, kind, tmp_path):
    if kind == "unreadable" and os.geteuid() == 0:
        pytest.skip("root reads a file whatever its mode: 'unreadable' cannot be made here")
    path = _damaged(kind, tmp_path)
    before = path.read_bytes() if path.is_file() and kind != "unreadable" else None
    done = subprocess.run(
        [sys.executable, "-m", "lora_suite", *COMMANDS[command](path)], capture_output=True, text=True, timeout=120
    )
    out = done.stdout + done.stderr
    assert done.returncode == 2, (command, kind, done.returncode, out[-2000:])
    assert "Traceback" not in out and "INTERNALERROR" not in out, out[-2000:]
    assert str(path) in out, out
    if before is not None:
        assert path.read_bytes() == before
