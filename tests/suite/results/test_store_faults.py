"""A results store that fails the way servers and disks do (issue 72): a PostgreSQL server that accepts the connection
and never answers is named within 15 s by every command that opens the store, in one line, with no traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("psycopg")


@pytest.fixture
def silent_server():
    """A TCP port that accepts connections and never sends a byte (a hung server, a proxy to nowhere)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    for c in held:
        c.close()
    server.close()


RUN = Path(__file__).resolve().parents[2] / "fixtures" / "runs" / "20261122T055507Z-quick"  # a recorded run


@pytest.mark.parametrize(
    "command",
    [["ledger", "show"], ["ledger", "record", "--group", "g", str(RUN)], ["history", "--html", "page.html"]],
    ids=["show", "record", "history"],
)
def test_a_server_that_never_answers_is_named_within_15_s(silent_server, command, tmp_path):
    url = f"postgresql://suite@127.0.0.1:{silent_server}/results"
    args = [sys.executable, "-m", "lora_suite", *command, "--ledger", url]
    start = time.monotonic()
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    took = time.monotonic() - start
    out = done.stdout + done.stderr
    assert took < 15, f"{command}: {took:.1f} s before an answer"
    assert done.returncode == 2 and "Traceback" not in out, out
    assert "timeout" in out and "connect_timeout=5 s" in out, out
    assert not (tmp_path / "page.html").exists()
