"""The results store (issue 45): the embedded SQLite default and a real PostgreSQL server run the same tests.

The server is started here from the PostgreSQL the OS packages (``initdb``/``pg_ctl``; as the ``postgres`` user when
the tests run as root), with a password, on a free port. Without those binaries the PostgreSQL cases skip, saying so,
unless ``LORA_SUITE_REQUIRE_POSTGRES=1`` (what ``.ci/run`` sets), which makes a missing server a failure."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from lora_suite.results import ledger, store
from tests.suite.results.recorded_run import run_copies

WRITERS = 8
PASSWORD = "s3cret-Pa55word-for-the-test"


def _pg_bin() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return versions[-1].parent if versions else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def postgres_url():
    """A PostgreSQL server of its own, password-protected; its URL (with the password)."""
    bin_dir = _pg_bin()
    if bin_dir is None:
        if os.environ.get("LORA_SUITE_REQUIRE_POSTGRES") == "1":
            pytest.fail("LORA_SUITE_REQUIRE_POSTGRES=1 and no PostgreSQL server (initdb) is installed")
        pytest.skip("no PostgreSQL server installed (initdb not found): the store's PostgreSQL cases are not run")
    root = Path(tempfile.mkdtemp(prefix="lora-suite-pg-"))  # not under pytest's 0700 folder: postgres must enter
    data, pwfile = root / "data", root / "pw"
    pwfile.write_text(PASSWORD + "\n")
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    if as_user:
        shutil.chown(root, "postgres")
        shutil.chown(pwfile, "postgres")
    port = _free_port()
    run = lambda *cmd: subprocess.run([*as_user, *cmd], check=True, capture_output=True, text=True)  # noqa: E731
    run(str(bin_dir / "initdb"), "-D", str(data), "-U", "suite", "-A", "scram-sha-256", f"--pwfile={pwfile}")
    opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c max_connections=50"
    run(str(bin_dir / "pg_ctl"), "-D", str(data), "-o", opts, "-l", str(root / "log"), "-w", "start")
    try:
        yield f"postgresql://suite:{PASSWORD}@127.0.0.1:{port}/postgres"
    finally:
        run(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgres"])
def location(request, tmp_path):
    """A fresh, empty store of each kind."""
    if request.param == "sqlite":
        return str(tmp_path / "results.sqlite")
    url = request.getfixturevalue("postgres_url")
    from sqlalchemy import create_engine, text

    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    with engine.begin() as conn:  # every test starts from an empty store
        conn.execute(text("DROP TABLE IF EXISTS rows, runs, meta"))
    engine.dispose()
    store._OPEN.clear()
    return url


def test_rows_read_back_exactly_as_written_and_a_run_is_kept_once(location, tmp_path):
    rows = ledger.rows_of_runs(run_copies(tmp_path, 2), group="g")
    assert ledger.append(location, rows) == len(rows)
    assert ledger.read(location) == rows  # numbers, strings, booleans and nulls alike, in their order
    assert ledger.append(location, rows) == 0  # the same runs again: nothing added


def test_the_published_ledger_imports_whole(location):
    rows = ledger.read(Path(__file__).resolve().parents[3] / "reports" / "ledger.jsonl")[:3000]
    assert ledger.append(location, rows) == len(rows)
    assert ledger.read(location) == rows


def _writer(location: str, runs: list[str], barrier) -> None:
    store._OPEN.clear()  # a forked writer opens its own connection
    barrier.wait()
    from lora_suite.cli import main

    raise SystemExit(main(["ledger", "record", *runs, "--ledger", location, "--group", "g"]))


@pytest.mark.skipif(sys.platform == "win32", reason="forks the writers")
def test_eight_ledger_record_processes_at_once_keep_every_row_in_ten_trials(location, tmp_path):
    """Eight `lora-suite ledger record` processes, started together at a barrier, each recording three runs of eight
    (every run by three writers at once): in each of ten trials every run is stored once, with all its rows."""
    runs = run_copies(tmp_path, WRITERS)
    per_run = len(ledger.rows_of_runs([runs[0]], group="g"))
    ctx = multiprocessing.get_context("fork")
    for trial in range(10):
        where = location if "://" in location else str(tmp_path / f"results-{trial}.sqlite")
        if "://" in where and trial:
            _empty(where)
        barrier = ctx.Barrier(WRITERS)
        mine = [[str(runs[(w + k) % WRITERS]) for k in range(3)] for w in range(WRITERS)]
        procs = [ctx.Process(target=_writer, args=(where, m, barrier)) for m in mine]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
        assert [p.exitcode for p in procs] == [0] * WRITERS, f"trial {trial}"
        store._OPEN.clear()
        got = ledger.read(where)
        assert sorted(r["run_id"] for r in got if r["kind"] == "run") == sorted(r.name for r in runs), f"trial {trial}"
        assert len(got) == WRITERS * per_run, f"trial {trial}"


def _empty(url: str) -> None:
    from sqlalchemy import create_engine, text

    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM rows; DELETE FROM runs"))
    engine.dispose()


def test_a_store_url_with_a_password_leaves_no_trace_of_it(postgres_url, tmp_path):
    """The password is in the URL the runner is given; no message, log line, report or ledger row may show it."""
    (run,) = run_copies(tmp_path, 1)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3]), "LORA_SUITE_STORE": postgres_url}
    cli = [sys.executable, "-m", "lora_suite", "ledger"]
    outs = [
        subprocess.run([*cli, "record", str(run)], capture_output=True, text=True, env=env, timeout=120),
        subprocess.run([*cli, "show", "--run", run.name], capture_output=True, text=True, env=env, timeout=120),
        subprocess.run([*cli, "show", "--run", "none"], capture_output=True, text=True, env=env, timeout=120),
    ]
    bad_url = postgres_url.replace("@127.0.0.1", "@127.0.0.1:1")  # a port nobody listens on: the error path
    outs.append(subprocess.run([*cli, "record", str(run), "--ledger", bad_url], capture_output=True, text=True))
    wrong = postgres_url.replace(PASSWORD, PASSWORD + "x")  # refused by the server: the driver's message path
    outs.append(subprocess.run([*cli, "record", str(run), "--ledger", wrong], capture_output=True, text=True))
    assert [o.returncode for o in outs] == [0, 0, 0, 2, 2], [o.stderr[-400:] for o in outs]
    assert "appended to postgresql://suite:***@" in outs[0].stdout
    for o in outs:
        assert PASSWORD not in o.stdout + o.stderr
    stored = json.dumps(ledger.read(postgres_url))
    assert PASSWORD not in stored and PASSWORD not in (run / "report.json").read_text()
    assert PASSWORD not in store.redacted(postgres_url) and "***" in store.redacted(postgres_url)


def test_a_store_of_a_newer_schema_is_refused_by_name(tmp_path):
    path = tmp_path / "results.sqlite"
    store.open_store(path)
    import sqlite3

    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    store._OPEN.clear()
    with pytest.raises(ledger.LedgerError, match="schema_version 99; this suite reads 1 to 1"):
        ledger.read(path)


def test_what_names_a_store_and_what_names_a_ledger_file():
    assert store.is_store("postgresql://u:p@h/db") and store.is_store("x/results.sqlite") and store.is_store("a.db")
    assert not store.is_store("reports/ledger.jsonl")
    assert store.redacted("postgresql://u:pw@h:5/db") == "postgresql://u:***@h:5/db"
    assert store.redacted("reports/results.sqlite") == "reports/results.sqlite"


def test_the_wal_switch_waits_for_a_writer_that_holds_the_file():
    """SQLite answers a journal-mode change "database is locked" at once (no busy timeout) while writers open a new
    file together: the switch is retried, and any other error is raised."""
    import sqlite3

    class Conn:
        def __init__(self, errors):
            self.errors, self.calls = list(errors), 0

        def execute(self, sql):
            self.calls += 1
            if self.errors:
                raise sqlite3.OperationalError(self.errors.pop(0))

    conn = Conn(["database is locked", "database is locked"])
    store._wal(conn)
    assert conn.calls == 3
    with pytest.raises(sqlite3.OperationalError, match="disk I/O error"):
        store._wal(Conn(["disk I/O error"]))
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        store._wal(Conn(["database is locked"] * 1000), wait_s=0.0)
