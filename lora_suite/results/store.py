"""The results store: every ledger row of every run, kept past a CI artifact's life, in a database that several
runners may write at once.

Where: ``--ledger`` (or ``$LORA_SUITE_STORE``) names it. ``sqlite:///PATH`` or a file ending ``.sqlite``/``.db`` is the
embedded default (one file, no server; ``reports/results.sqlite``); ``postgresql://USER@HOST/DB`` is a team's shared
server (the ``[postgres]`` extra: SQLAlchemy's psycopg 3 driver); a file ending ``.jsonl`` is the JSON-lines ledger,
kept as the import and export format (``lora_suite.results.ledger``). The password of a URL comes from the URL or from
``$PGPASSWORD`` and is never printed: every message names the store by ``redacted(url)``.

Schema (``SCHEMA_VERSION``; ``meta.schema_version`` says which a store holds, ``migrate`` brings an older one up):

- ``runs``: one row per run key (run id, group, implementation), unique. A writer inserts the run's key and its rows
  in one transaction, the key with ``ON CONFLICT DO NOTHING``: of two writers recording the same run, one inserts
  it and the other adds nothing, on SQLite (a file lock, WAL) and on PostgreSQL (the unique index) alike;
- ``rows``: each row as JSON text (``data``; a check's value may be a number, a string, a boolean or null, and reads
  back as it was), beside its run key, ``seq`` (its order within the run), kind and check, which queries filter on.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from lora_suite.results.ledger_rows import FIELDS, LedgerError, run_key

SCHEMA_VERSION = 1
STORE_ENV = "LORA_SUITE_STORE"
_PASSWORD = re.compile(r"(://[^:/@\s]*:)([^@\s]*)@")  # scheme://user:PASSWORD@host
MIGRATION_LOCK = 4_245_045  # PostgreSQL's advisory lock of the schema's creation and migration (any constant)
# A PostgreSQL server that accepts the connection and never answers is named within 15 s: libpq's connect_timeout
# holds per address it tries (localhost: ::1, then 127.0.0.1), so 5 s each; a statement the server has not finished
# in 2 minutes is ended by the server (a store's writes are one run's rows: seconds). A URL's own ?connect_timeout=N or
# ?options=... wins over these defaults.
PG_CONNECT_TIMEOUT_S = 5
PG_STATEMENT_TIMEOUT_MS = 120_000
_URL = re.compile(r"[a-z][a-z0-9+]*://")  # scheme://: a server's URL, or sqlite:///PATH


def is_store(location: str | Path) -> bool:
    """A database rather than a JSON-lines ledger: a URL, or a file ending .sqlite or .db."""
    text = str(location)
    return bool(_URL.match(text)) or Path(text).suffix in (".sqlite", ".db")


def url_of(location: str | Path) -> str:
    text = str(location)
    return text if _URL.match(text) else f"sqlite:///{Path(text).resolve()}"


def redacted(location: str | Path) -> str:
    """The store's URL with any password replaced by ``***``: what messages, logs and reports may show."""
    return _PASSWORD.sub(r"\1***@", str(location))


def _scrub(message: str, location: str | Path) -> str:
    """``message`` with the URL's password (and ``$PGPASSWORD``) taken out, wherever a driver may have echoed it."""
    found = _PASSWORD.search(str(location))
    for secret in (found.group(2) if found else None, os.environ.get("PGPASSWORD")):
        if secret:
            message = message.replace(secret, "***")
    return redacted(message)


def _engine(location: str | Path):
    from sqlalchemy import create_engine, event
    from sqlalchemy.engine import make_url

    url = make_url(url_of(location))
    if url.drivername == "postgresql":  # SQLAlchemy's default driver is psycopg2; the extra installs psycopg 3
        url = url.set(drivername="postgresql+psycopg")
    if url.drivername.startswith("sqlite"):
        if url.database is None:  # sqlite:// alone is a store in memory, gone when the command ends
            raise ValueError(f"{redacted(location)!r} names no database file (expected sqlite:///PATH)")
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 300})

        @event.listens_for(engine, "connect")
        def _pragmas(conn, _):  # WAL: readers do not block the writer; the file lock orders the writers
            _wal(conn)
            conn.isolation_level = None  # transactions are begun below, IMMEDIATE: the writer takes the lock first

        @event.listens_for(engine, "begin")
        def _begin(conn):
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    defaults = {"connect_timeout": PG_CONNECT_TIMEOUT_S, "options": f"-c statement_timeout={PG_STATEMENT_TIMEOUT_MS}"}
    connect_args = {k: v for k, v in defaults.items() if k not in url.query}
    return create_engine(url, pool_pre_ping=True, connect_args=connect_args)


def _failure(exc: Exception, location: str | Path) -> str:
    """The first line of a driver's error, the password taken out, and what to do where it is a timeout."""
    line = _scrub(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, location)
    if "timeout" in line.lower() and str(location).startswith("postgres"):
        line += (
            f" (no answer from the server within connect_timeout={PG_CONNECT_TIMEOUT_S} s per address, or a statement "
            f"beyond statement_timeout={PG_STATEMENT_TIMEOUT_MS} ms: check that the server is up and reachable; give "
            "?connect_timeout=N in the URL for a slower one)"
        )
    return line


def _wal(conn, wait_s: float = 300.0) -> None:
    """``PRAGMA journal_mode=WAL`` on a new sqlite3 connection, retried while another writer holds the file: SQLite
    answers a journal-mode change "database is locked" at once, without its busy timeout, when writers open a new file
    together (seen as 3 of 8 writers failing in one trial of ten)."""
    import sqlite3
    import time

    deadline = time.monotonic() + wait_s
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _tables():
    from sqlalchemy import Column, Integer, MetaData, String, Table, Text, UniqueConstraint

    md = MetaData()
    meta = Table("meta", md, Column("key", String(64), primary_key=True), Column("value", Text))
    runs = Table(
        "runs",
        md,
        Column("run_id", String(255), nullable=False),
        Column("grp", String(255), nullable=False),
        Column("implementation", String(255), nullable=False),
        UniqueConstraint("run_id", "grp", "implementation", name="runs_key"),
    )
    rows = Table(
        "rows",
        md,
        Column("run_id", String(255), nullable=False, index=True),
        Column("grp", String(255), nullable=False, index=True),
        Column("implementation", String(255), nullable=False),
        Column("seq", Integer, nullable=False),
        Column("kind", String(32), nullable=False),
        Column("check_name", Text, nullable=False),
        Column("data", Text, nullable=False),  # the whole row as JSON: it reads back exactly as it was written
    )
    return md, meta, runs, rows


class Store:
    """One results store (``open_store``). ``append(rows)`` and ``read()`` mirror ``ledger.append`` and ``read``."""

    def __init__(self, location: str | Path):
        self.location = location
        self.name = redacted(location)
        try:
            self.engine = _engine(location)
            self.md, self.meta, self.runs, self.rows = _tables()
            self.migrate()
        except ImportError as exc:
            extra = "the [postgres] extra" if "psycopg" in str(exc.name) else f"pip install {exc.name}"
            missing = f"{exc.name} is not installed ({extra})"
            raise LedgerError(f"store {self.name}: {missing}") from None
        except Exception as exc:
            raise LedgerError(f"store {self.name}: {_failure(exc, location)}") from None

    def migrate(self) -> None:
        """Create the tables, or bring a store of an older schema up to ``SCHEMA_VERSION``; refuse a newer one."""
        from sqlalchemy import select

        with self.engine.begin() as conn:
            if self.engine.dialect.name == "postgresql":  # writers starting together: one creates, the rest wait
                conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
            self.md.create_all(conn)
            have = conn.execute(select(self.meta.c.value).where(self.meta.c.key == "schema_version")).scalar()
            if have is None:
                conn.execute(self.meta.insert().values(key="schema_version", value=str(SCHEMA_VERSION)))
            elif int(have) > SCHEMA_VERSION:
                raise LedgerError(f"schema_version {have}; this suite reads 1 to {SCHEMA_VERSION}: update the suite")

    def append(self, rows: list[dict]) -> int:
        """Add the rows of runs the store does not hold yet (by run key); returns how many rows were added."""
        by_run: dict[tuple, list[dict]] = {}
        for r in rows:
            by_run.setdefault(run_key(r), []).append(r)
        added = 0
        try:
            for key, run_rows in by_run.items():
                added += self._append_run(key, run_rows)
        except LedgerError:
            raise
        except Exception as exc:
            raise LedgerError(f"store {self.name}: {_failure(exc, self.location)}") from None
        return added

    def _append_run(self, key: tuple, run_rows: list[dict]) -> int:
        insert = _insert_ignoring_conflicts(self.engine.dialect.name, self.runs)
        with self.engine.begin() as conn:
            values = insert.values(run_id=key[0], grp=key[1], implementation=key[2])
            if conn.execute(values.returning(self.runs.c.run_id)).first() is None:
                return 0  # another writer (or an earlier record) has this run
            conn.execute(self.rows.insert(), [_to_db(r, i) for i, r in enumerate(run_rows)])
        return len(run_rows)

    def read(self) -> list[dict]:
        """Every row, runs in the order they were recorded, each run's rows in their order."""
        from sqlalchemy import select

        try:
            with self.engine.connect() as conn:
                order = {
                    tuple(k): i
                    for i, k in enumerate(
                        conn.execute(select(self.runs.c.run_id, self.runs.c.grp, self.runs.c.implementation))
                    )
                }
                decode = json.JSONDecoder().decode
                cursor = conn.connection.dbapi_connection.cursor()  # the driver's own rows: 10,000 runs read fast
                cursor.execute("SELECT run_id, grp, implementation, seq, data FROM rows")
                found = cursor.fetchall()
                found = [((k, g, i), seq, decode(data)) for k, g, i, seq, data in found]
        except Exception as exc:
            raise LedgerError(f"store {self.name}: {_failure(exc, self.location)}") from None
        found.sort(key=lambda f: (order.get(f[0], 0), f[1]))
        return [r for _, _, r in found]


def _insert_ignoring_conflicts(dialect: str, table):
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as postgresql_insert

        return postgresql_insert(table).on_conflict_do_nothing()
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    return sqlite_insert(table).on_conflict_do_nothing()


def _to_db(r: dict, seq: int) -> dict:
    row = {f: r.get(f) for f in FIELDS}
    return {
        "run_id": r["run_id"],
        "grp": r["group"],
        "implementation": r["implementation"],
        "seq": seq,
        "kind": r["kind"],
        "check_name": str(r["check"]),
        "data": json.dumps(row, ensure_ascii=False, separators=(",", ":")),
    }


_OPEN: dict[str, Store] = {}


def open_store(location: str | Path) -> Store:
    """The store at ``location``, opened (and migrated) once per process."""
    key = url_of(location)
    if key not in _OPEN:
        _OPEN[key] = Store(location)
    return _OPEN[key]
