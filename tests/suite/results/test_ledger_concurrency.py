"""lora_suite.results.ledger under concurrent writers (issue 33): appends that overlap lose nothing and add a run once.

Eight writers were seen to leave 2-5 runs of 8 when each read the file, added its rows and renamed a new file over
it: the last rename won. The forked writers below meet at a barrier, so every trial overlaps them on purpose."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest

from lora_suite.results import ledger
from tests.suite.results.recorded_run import run_copies

WRITERS = 8


def _writer(path: str, run: str, barrier) -> None:
    barrier.wait()
    ledger.record(Path(path), [Path(run)], group="g")


def _together(path: Path, runs: list[Path]) -> list[int]:
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(len(runs))
    procs = [ctx.Process(target=_writer, args=(str(path), str(r), barrier)) for r in runs]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    return [p.exitcode for p in procs]


def _runs_in(path: Path) -> list[str]:
    return [r["run_id"] for r in ledger.read(path) if r["kind"] == "run"]


@pytest.mark.skipif(sys.platform == "win32", reason="forks the writers")
def test_eight_writers_of_eight_runs_at_once_leave_every_run_once_in_ten_trials(tmp_path):
    runs = run_copies(tmp_path, WRITERS)
    per_run = len(ledger.rows_of_runs([runs[0]], group="g"))
    for trial in range(10):
        path = tmp_path / f"ledger-{trial}.jsonl"
        assert _together(path, runs) == [0] * WRITERS
        assert sorted(_runs_in(path)) == sorted(r.name for r in runs), f"trial {trial}"
        assert len(ledger.read(path)) == WRITERS * per_run, f"trial {trial}"


@pytest.mark.skipif(sys.platform == "win32", reason="forks the writers")
def test_one_run_recorded_by_eight_writers_at_once_is_in_the_ledger_once(tmp_path):
    (run,) = run_copies(tmp_path, 1)
    for trial in range(5):
        path = tmp_path / f"ledger-{trial}.jsonl"
        assert _together(path, [run] * WRITERS) == [0] * WRITERS
        assert _runs_in(path) == [run.name], f"trial {trial}"


def test_eight_cli_processes_started_together_leave_eight_runs(tmp_path):
    """The command people run, as eight processes: `lora-suite ledger record RUN --ledger L`."""
    runs = run_copies(tmp_path, WRITERS)
    path = tmp_path / "ledger.jsonl"
    cmd = [sys.executable, "-m", "lora_suite", "ledger", "record"]
    procs = [subprocess.Popen([*cmd, str(r), "--ledger", str(path)], stdout=subprocess.PIPE, text=True) for r in runs]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * WRITERS, outs
    assert sorted(_runs_in(path)) == sorted(r.name for r in runs)


def test_a_stuck_lock_holder_is_named_and_nothing_is_appended(tmp_path, monkeypatch):
    from filelock import FileLock

    (run,) = run_copies(tmp_path, 1)
    path = tmp_path / "ledger.jsonl"
    monkeypatch.setattr(ledger, "LOCK_TIMEOUT_S", 0.2)
    holder = FileLock(str(path) + ".lock", thread_local=False)
    with holder:
        ctx = multiprocessing.get_context("fork")
        child = ctx.Process(target=_expect_timeout, args=(str(path), str(run)))
        child.start()
        child.join(60)
    assert child.exitcode == 0 and not path.exists()


def _expect_timeout(path: str, run: str) -> None:
    try:
        ledger.record(Path(path), [Path(run)])
    except ledger.LedgerError as exc:
        assert "another writer has held" in str(exc) and "nothing was appended" in str(exc)
        return
    raise SystemExit(1)


def test_a_run_folder_finds_its_rows_though_pytest_stamped_its_run_id_seconds_later():
    """Runs recorded before the run id was the folder's name: folder 20261124T214330Z-quick, run 214332Z-quick."""
    row = {"run_id": "20261124T214332Z-quick", "tier": "quick", "implementation": "cupy", "check": "x", "group": "g"}
    peft = dict(row, implementation="peft")
    assert ledger.select([row], run="20261124T214330Z-quick") == [row]
    assert ledger.select([peft], run="20261124T214330Z-quick-peft") == [peft]
    assert ledger.select([row], run="20261124T214330Z-memory") == []
    assert ledger.select([row], run="20261124T214440Z-quick") == []  # after the run id: another run
