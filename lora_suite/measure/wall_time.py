"""Where a run's wall time goes (issue 20: the quick tier's edit-run loop), as a table for the report.

Phases, each measured, never inferred from a total:
- ``before pytest``: what ``gpu-test.sh`` did before it started pytest (choosing the interpreter, nvidia-smi),
  from ``GPU_TEST_T0`` (the script's start, epoch seconds) to the pytest process's start;
- ``interpreter and plugin imports``: the process's start (``/proc/self/stat``) to ``pytest_configure``;
- ``collection``: ``pytest_configure`` to the session's start (test modules imported, items selected);
- ``CUDA context``: creating it at the session's start, timed on its own;
- ``tests``: the call phase of every test, with the RawKernel first loads inside them (NVRTC compile, or CuPy's
  disk cache: ``lora_core.ops.cupy_interop.KERNEL_LOAD_SECONDS``) and the slowest tests named;
- ``setup and teardown``: the tests' fixtures (models built for a module, the cleanup after each test), the
  slowest named (``SessionClock``);
- ``report.json after each test``: the plugin's incremental writes (a killed run keeps what it did), timed;
- ``rest of the session``: the session's wall time less the three above (pytest's own work between tests).
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class SessionClock:
    """What the session's time went to besides the tests' calls: per test, its setup + teardown seconds, and the
    time spent writing report.json after each test."""

    setup_teardown: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    writes_s: float = 0.0
    first_test_at: float | None = None  # when the first test's setup began (epoch seconds)
    test_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # setup + call + teardown, in order

    def add_phase(self, nodeid: str, when: str, seconds: float) -> None:
        if self.first_test_at is None:
            self.first_test_at = time.time() - seconds
        self.test_s[nodeid] += seconds
        if when in ("setup", "teardown"):
            self.setup_teardown[nodeid] += seconds

    def timeline(self, worker: str, **known: float | None) -> dict:
        """This process's timeline as a worker hands it over (``worker_rows`` reads it): ``known`` adds the
        process's own epochs and seconds (process_start, configured, preload_s, cuda_context_s, end)."""
        first = next(iter(self.test_s), None)  # the first test this process ran
        return {
            "worker": worker,
            **known,
            "first_test": self.first_test_at,
            "first_test_name": first or "",
            "first_test_s": self.test_s[first] if first else None,
            "tests": len(self.test_s),
            "tests_s": sum(self.test_s.values()),
        }

    def timed(self, fn, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.writes_s += time.perf_counter() - start


def process_start_epoch(stat_path: str = "/proc/self/stat", uptime_path: str = "/proc/uptime") -> float | None:
    """When this process started, in epoch seconds (Linux), or None where /proc cannot tell."""
    try:
        fields = open(stat_path).read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat, counted after the ")" that ends the command name
        uptime = float(open(uptime_path).read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")


SETUP_ENV = "LORA_SUITE_BYTECODE_SETUP_S"  # the bytecode cache's set-up seconds (lora_suite.cli), for ``breakdown``


def breakdown(
    *,
    script_start: float | None,
    process_start: float | None,
    configured: float,
    session_start: float,
    cuda_context_s: float | None,
    test_seconds: list[tuple[str, float]],
    kernel_loads: dict[str, float],
    top: int = 5,
    clock: SessionClock | None = None,
    session_s: float | None = None,
    workers: int = 0,
    setup_s: float | None = None,
) -> list[tuple[str, float | None, str]]:
    """Rows (phase, seconds, detail); epoch seconds in, None where a phase could not be measured. ``workers``: the
    pytest-xdist workers this process drove (it then creates no CUDA context of its own). ``setup_s``: the bytecode
    cache's one-time set-up before pytest started (``lora_suite.cli.bytecode``), part of the first row."""
    rows = _start_up_rows(script_start, process_start, configured, session_start, setup_s)
    rows.append(("CUDA context", cuda_context_s, _cuda_context_detail(cuda_context_s, workers)))
    total = sum(s for _, s in test_seconds)
    rows.append((f"tests ({len(test_seconds)})", total, _slowest_tests(test_seconds, top)))
    if kernel_loads:
        rows.append(
            (
                f"  of which RawKernel first loads ({len(kernel_loads)})",
                sum(kernel_loads.values()),
                _slowest_loads(kernel_loads, top + 3),
            )
        )
    if clock is not None:
        rows += _around_tests_rows(clock, total, session_s, top)
    return rows


def _cuda_context_detail(cuda_context_s: float | None, workers: int) -> str:
    """Where the run's CUDA context came from: this process at the session's start, each xdist worker, or none."""
    if cuda_context_s is not None:
        return "created at the session's start"
    if workers:
        return f"none in this process: each of the {workers} workers creates its own"
    return "no GPU"


def _start_up_rows(
    script_start: float | None,
    process_start: float | None,
    configured: float,
    session_start: float,
    setup_s: float | None,
) -> list[tuple[str, float | None, str]]:
    """The rows before the first test: before pytest (with the bytecode cache's set-up where there was one), the
    interpreter and plugin imports, and collection, each the gap between two epochs (None where one is unknown)."""
    rows: list[tuple[str, float | None, str]] = [
        (
            "before pytest (gpu-test.sh: interpreter choice, nvidia-smi)",
            None if script_start is None or process_start is None else process_start - script_start,
            "GPU_TEST_T0 to the pytest process's start" if script_start else "not started by gpu-test.sh",
        ),
    ]
    if setup_s is not None:
        rows.append(
            (
                "  of which compiling the bytecode cache",
                setup_s,
                "once per interpreter and machine, over all CPU cores (lora_suite.cli.bytecode)",
            )
        )
    rows += [
        (
            "interpreter and plugin imports",
            None if process_start is None else configured - process_start,
            "process start to pytest_configure; " + bytecode_note(),
        ),
        ("collection", session_start - configured, "test modules imported, items selected"),
    ]
    return rows


def _around_tests_rows(
    clock: SessionClock, tests_s: float, session_s: float | None, top: int
) -> list[tuple[str, float | None, str]]:
    """The rows of the session's time besides the tests' calls: setup and teardown (the slowest named), the
    report.json writes, and the rest: session − tests − fixtures − writes (where the session's time is known)."""
    fixtures = sum(clock.setup_teardown.values())
    rows: list[tuple[str, float | None, str]] = [
        ("setup and teardown", fixtures, _slowest_tests(list(clock.setup_teardown.items()), top)),
        ("report.json after each test", clock.writes_s, "the plugin's incremental writes"),
    ]
    if session_s is not None:
        rest = session_s - tests_s - fixtures - clock.writes_s
        rows.append(("rest of the session", rest, f"session {session_s:.2f} s less the tests, fixtures, writes"))
    return rows


def _slowest_tests(seconds: list[tuple[str, float]], top: int) -> str:
    """The ``top`` slowest tests by their function's name (the node id's last part), slowest first."""
    slow = sorted(seconds, key=lambda t: -t[1])[:top]
    return "slowest: " + "; ".join(f"{name.split('::')[-1]} {s:.2f} s" for name, s in slow)


def _slowest_loads(loads: dict[str, float], top: int) -> str:
    """The ``top`` slowest first loads, and how many others there were."""
    ranked = sorted(loads.items(), key=lambda kv: -kv[1])
    text = "; ".join(f"{k} {v:.2f} s" for k, v in ranked[:top])
    return text + (f"; {len(ranked) - top} others" if len(ranked) > top else "")


def worker_rows(timelines: list[dict], session_start: float) -> list[tuple[str, float | None, str]]:
    """Rows of a run spread over pytest-xdist workers: where each worker's own time went before and around its
    tests, from the timelines the workers hand over (``SessionClock.timeline``; epoch seconds, one host's clock).

    - ``workers' start-up``: a worker's process start to its first test (interpreter, plugin and test-module
      imports, the implementation's preload, collection), the median and the slowest worker;
    - ``workers' first tests``: the first test each worker ran, which also pays that process's first use of CUDA,
      cuBLAS and the model code (the same test run later in a warm process takes less);
    - ``last worker to finish``: the critical path: its start after the session's, its start-up, its tests.
    """
    if not timelines:
        return []
    rows = [
        _start_up_row(timelines),
        _first_tests_row(timelines),
        _last_worker_row(timelines, session_start),
    ]
    return [row for row in rows if row is not None]


def _start_up_row(timelines: list[dict]) -> tuple[str, float | None, str] | None:
    """The workers' start-up (process start to first test): the median worker's seconds, and the slowest worker's
    split into imports, preload, CUDA context and collection; None where no worker knows both epochs."""
    ups = sorted(  # by seconds alone: two workers with the same start-up must not compare their dicts
        ((t["first_test"] - t["process_start"], t) for t in timelines if _known(t, "first_test", "process_start")),
        key=lambda st: st[0],
    )
    if not ups:
        return None
    median = ups[len(ups) // 2][0]
    slow_s, slow = ups[-1]
    after = _gap(slow, "configured", "first_test")
    own = (slow.get("preload_s") or 0.0) + (slow.get("cuda_context_s") or 0.0)
    parts = [
        ("imports", _gap(slow, "process_start", "configured")),
        ("implementation preload", slow.get("preload_s")),
        ("CUDA context", slow.get("cuda_context_s")),
        ("collection", None if after is None else after - own),
    ]
    return (
        f"workers' start-up ({len(timelines)})",
        median,
        f"median, process start to its first test; slowest {slow['worker']} {slow_s:.2f} s: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in parts if v is not None),
    )


def _first_tests_row(timelines: list[dict]) -> tuple[str, float | None, str] | None:
    """The workers' first tests: their summed seconds and the four slowest named; None where no worker ran one."""
    firsts = sorted(
        ((t["first_test_s"], t) for t in timelines if t.get("first_test_s") is not None), key=lambda x: -x[0]
    )
    if not firsts:
        return None
    return (
        "workers' first tests",
        sum(s for s, _ in firsts),
        "each pays its process's first use of CUDA, cuBLAS and the model code: "
        + "; ".join(f"{t['worker']} {t['first_test_name'].split('::')[-1]} {s:.2f} s" for s, t in firsts[:4])
        + (f"; {len(firsts) - 4} others" if len(firsts) > 4 else ""),
    )


def _last_worker_row(timelines: list[dict], session_start: float) -> tuple[str, float | None, str] | None:
    """The critical path: the worker that ended last, session start to its end, with its own start, start-up and
    tests; None where no worker recorded its end."""
    ended = [t for t in timelines if _known(t, "end")]
    if not ended:
        return None
    last = max(ended, key=lambda t: t["end"])
    start = _gap(last, "process_start", "first_test")
    return (
        "last worker to finish",
        last["end"] - session_start,
        f"{last['worker']}, session start to its end: "
        + (
            f"started {last['process_start'] - session_start:+.2f} s, start-up {start:.2f} s, "
            if start is not None
            else ""
        )
        + f"{last.get('tests', 0)} tests {last.get('tests_s', 0.0):.2f} s",
    )


def _known(t: dict, *keys: str) -> bool:
    return all(t.get(k) is not None for k in keys)


def _gap(t: dict, a: str, b: str) -> float | None:
    return t[b] - t[a] if _known(t, a, b) else None


def bytecode_note() -> str:
    """Where this process keeps the bytecode of what it imports: each process compiles from source when it writes none."""
    if sys.pycache_prefix:
        return f"bytecode cached in {sys.pycache_prefix}"
    if sys.flags.dont_write_bytecode:
        return "bytecode not written (PYTHONDONTWRITEBYTECODE): modules without a .pyc are compiled in every process"
    return "bytecode written beside the sources"
