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


def test_breakdown_rows_name_each_phase_and_the_slowest_tests():
    rows = wall_time.breakdown(
        script_start=100.0,
        process_start=103.5,
        configured=106.0,
        session_start=109.0,
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
