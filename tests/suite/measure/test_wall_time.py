"""lora_suite.measure.wall_time on the CPU: the phases of a run's wall time, each measured."""

from __future__ import annotations

import os
import time

from lora_suite.measure import wall_time


def test_the_process_start_is_read_from_proc_and_lies_before_now():
    start = wall_time.process_start_epoch()
    assert start is not None and time.time() - 3600 * 24 < start <= time.time()


def test_without_proc_the_start_is_unknown_not_invented(tmp_path):
    assert wall_time.process_start_epoch(str(tmp_path / "missing"), str(tmp_path / "missing")) is None


def test_a_fake_stat_gives_its_start(tmp_path):
    ticks = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    stat.write_text("123 (py (weird) name) S " + " ".join(["0"] * 18) + f" {50 * ticks} 0 0\n")
    uptime = tmp_path / "uptime"
    uptime.write_text("100.0 5.0\n")
    before = time.time()
    got = wall_time.process_start_epoch(str(stat), str(uptime))
    assert before - 50 - 1 < got < time.time() - 50 + 1  # started 50 s after boot, booted 100 s ago


def _started_breakdown(process_start: float, configured: float, session_start: float, **kw):
    """A run gpu-test.sh started at 100 s (epoch seconds); by default with no CUDA context, no tests and no kernel
    loads."""
    kw = {"cuda_context_s": None, "test_seconds": [], "kernel_loads": {}, **kw}
    return wall_time.breakdown(
        script_start=100.0, process_start=process_start, configured=configured, session_start=session_start, **kw
    )


def test_breakdown_rows_name_each_phase_and_the_slowest_tests():
    rows = _started_breakdown(
        103.5,
        106.0,
        109.0,
        cuda_context_s=0.8,
        test_seconds=[("t.py::a", 1.0), ("t.py::b", 7.5), ("t.py::c", 0.2)],
        kernel_loads={"nf4.cu:dequant": 0.6, "cast.cu:cast": 0.3},
        top=2,
    )
    got = {phase: (secs, detail) for phase, secs, detail in rows}
    assert got["before pytest (gpu-test.sh: interpreter choice, nvidia-smi)"][0] == 3.5
    assert got["interpreter and plugin imports"][0] == 2.5
    assert got["collection"][0] == 3.0 and got["CUDA context"][0] == 0.8
    assert got["tests (3)"] == (8.7, "slowest: b 7.50 s; a 1.00 s")
    assert abs(got["  of which RawKernel first loads (2)"][0] - 0.9) < 1e-9


def _unstarted_breakdown(**kw):
    """A run not started by gpu-test.sh, configured at 1 s and started at 2 s, with no CUDA context of its own."""
    return wall_time.breakdown(
        script_start=None, process_start=None, configured=1.0, session_start=2.0, cuda_context_s=None, **kw
    )


def test_a_phase_that_was_not_measured_is_none_and_says_why():
    rows = _unstarted_breakdown(
        test_seconds=[],
        kernel_loads={},
    )
    assert rows[0][1] is None and rows[0][2] == "not started by gpu-test.sh"
    assert rows[1][1] is None and rows[3] == ("CUDA context", None, "no GPU")


def test_the_session_clock_names_fixtures_writes_and_the_rest():
    clock = wall_time.SessionClock()
    for nodeid, when, secs in [("t.py::a", "setup", 2.0), ("t.py::a", "call", 9.0), ("t.py::a", "teardown", 0.5)]:
        clock.add_phase(nodeid, when, secs)
    clock.add_phase("t.py::b", "teardown", 0.25)
    assert clock.timed(lambda x: x + 1, 1) == 2 and clock.writes_s >= 0.0
    clock.writes_s = 0.75
    rows = _unstarted_breakdown(
        test_seconds=[("t.py::a", 9.0), ("t.py::b", 1.0)],
        kernel_loads={},
        clock=clock,
        session_s=14.0,
    )
    got = {phase: (secs, detail) for phase, secs, detail in rows}
    assert got["setup and teardown"] == (2.75, "slowest: a 2.50 s; b 0.25 s")
    assert got["report.json after each test"][0] == 0.75
    assert got["rest of the session"][0] == 14.0 - 10.0 - 2.75 - 0.75


def test_a_controller_of_workers_says_where_the_contexts_are_and_trims_the_load_list():
    loads = {f"gw0 k{i}": i / 100 for i in range(20)}
    rows = _unstarted_breakdown(
        test_seconds=[("t", 1.0)],
        kernel_loads=loads,
        workers=6,
    )
    assert rows[3] == ("CUDA context", None, "none in this process: each of the 6 workers creates its own")
    detail = dict((r[0], r[2]) for r in rows)["  of which RawKernel first loads (20)"]
    assert detail.startswith("gw0 k19 0.19 s;") and detail.endswith("; 12 others")


def test_a_worker_clock_knows_its_first_test_and_hands_over_its_timeline():
    clock = wall_time.SessionClock()
    before = time.time()
    clock.add_phase("t.py::a", "setup", 2.0)
    clock.add_phase("t.py::a", "call", 5.0)
    clock.add_phase("t.py::b", "call", 1.0)
    t = clock.timeline("gw3", process_start=1.0, end=2.0)
    assert t["worker"] == "gw3" and t["process_start"] == 1.0 and t["end"] == 2.0
    assert t["first_test_name"] == "t.py::a" and t["first_test_s"] == 7.0
    assert before - 2.0 - 1 < t["first_test"] <= time.time() - 2.0 + 1e-3  # its setup began 2 s before it was told
    assert (t["tests"], t["tests_s"]) == (2, 8.0)


def _timeline(worker, process_start, first_test, end, first_s, **kw):
    return {
        "worker": worker,
        "process_start": process_start,
        "configured": None if process_start is None else process_start + 3.0,
        "preload_s": 0.5,
        "cuda_context_s": 1.0,
        "first_test": first_test,
        "first_test_name": f"t.py::first_{worker}",
        "first_test_s": first_s,
        "tests": 4,
        "tests_s": 12.0,
        "end": end,
        **kw,
    }


def test_worker_rows_give_the_start_up_the_first_tests_and_the_critical_path():
    rows = wall_time.worker_rows(
        [
            _timeline("gw0", 100.0, 106.0, 120.0, 9.0),
            _timeline("gw1", 100.5, 110.5, 131.0, 4.0),
            _timeline("gw2", 101.0, 108.0, 125.0, 6.0),
        ],
        session_start=99.0,
    )
    got = {phase: (secs, detail) for phase, secs, detail in rows}
    secs, detail = got["workers' start-up (3)"]
    assert secs == 7.0  # the median of 6, 7, 10
    # the slowest: 10 s = imports 3 + preload 0.5 + CUDA context 1 + collection 5.5
    assert (
        "slowest gw1 10.00 s: imports 3.00 s, implementation preload 0.50 s, CUDA context 1.00 s, collection 5.50 s"
        in detail
    )
    secs, detail = got["workers' first tests"]
    assert secs == 19.0 and detail.endswith("gw0 first_gw0 9.00 s; gw2 first_gw2 6.00 s; gw1 first_gw1 4.00 s")
    secs, detail = got["last worker to finish"]
    assert (
        secs == 32.0 and detail == "gw1, session start to its end: started +1.50 s, start-up 10.00 s, 4 tests 12.00 s"
    )


def test_worker_rows_of_no_worker_or_unknown_starts_invent_nothing():
    assert wall_time.worker_rows([], 0.0) == []
    rows = wall_time.worker_rows([_timeline("gw0", None, None, 10.0, None)], session_start=0.0)
    assert rows == [("last worker to finish", 10.0, "gw0, session start to its end: 4 tests 12.00 s")]


def test_the_bytecode_note_says_where_this_process_keeps_it(monkeypatch):
    monkeypatch.setattr(wall_time.sys, "pycache_prefix", "/cache/here")
    assert wall_time.bytecode_note() == "bytecode cached in /cache/here"
    monkeypatch.setattr(wall_time.sys, "pycache_prefix", None)
    assert wall_time.bytecode_note() in (
        "bytecode written beside the sources",
        "bytecode not written (PYTHONDONTWRITEBYTECODE): modules without a .pyc are compiled in every process",
    )


def test_the_bytecode_set_up_is_named_inside_the_time_before_pytest():
    rows = _started_breakdown(112.0, 115.0, 116.0, setup_s=10.5)
    assert rows[0][1] == 12.0 and rows[1][:2] == ("  of which compiling the bytecode cache", 10.5)
    assert rows[2][0] == "interpreter and plugin imports"


def test_workers_with_the_same_start_up_are_ranked_without_comparing_their_timelines():
    rows = wall_time.worker_rows(
        [_timeline("gw0", 100.0, 106.0, 120.0, 9.0), _timeline("gw1", 100.0, 106.0, 121.0, 9.0)], session_start=99.0
    )
    assert rows[0][:2] == ("workers' start-up (2)", 6.0)
