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
import time
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class SessionClock:
    """What the session's time went to besides the tests' calls: per test, its setup + teardown seconds, and the
    time spent writing report.json after each test."""

    setup_teardown: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    writes_s: float = 0.0

    def add_phase(self, nodeid: str, when: str, seconds: float) -> None:
        if when in ("setup", "teardown"):
            self.setup_teardown[nodeid] += seconds

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
) -> list[tuple[str, float | None, str]]:
    """Rows (phase, seconds, detail); epoch seconds in, None where a phase could not be measured. ``workers``: the
    pytest-xdist workers this process drove (it then creates no CUDA context of its own)."""
    if cuda_context_s is not None:
        context = "created at the session's start"
    elif workers:
        context = f"none in this process: each of the {workers} workers creates its own"
    else:
        context = "no GPU"
    rows = [
        (
            "before pytest (gpu-test.sh: interpreter choice, nvidia-smi)",
            None if script_start is None or process_start is None else process_start - script_start,
            "GPU_TEST_T0 to the pytest process's start" if script_start else "not started by gpu-test.sh",
        ),
        (
            "interpreter and plugin imports",
            None if process_start is None else configured - process_start,
            "process start to pytest_configure",
        ),
        ("collection", session_start - configured, "test modules imported, items selected"),
        ("CUDA context", cuda_context_s, context),
    ]
    total = sum(s for _, s in test_seconds)
    slow = sorted(test_seconds, key=lambda t: -t[1])[:top]
    rows.append(
        (
            f"tests ({len(test_seconds)})",
            total,
            "slowest: " + "; ".join(f"{name.split('::')[-1]} {s:.2f} s" for name, s in slow),
        )
    )
    if kernel_loads:
        rows.append(
            (
                f"  of which RawKernel first loads ({len(kernel_loads)})",
                sum(kernel_loads.values()),
                _slowest_loads(kernel_loads, top + 3),
            )
        )
    if clock is not None:
        fixtures = sum(clock.setup_teardown.values())
        slow = sorted(clock.setup_teardown.items(), key=lambda t: -t[1])[:top]
        rows.append(
            (
                "setup and teardown",
                fixtures,
                "slowest: " + "; ".join(f"{name.split('::')[-1]} {s:.2f} s" for name, s in slow),
            )
        )
        rows.append(("report.json after each test", clock.writes_s, "the plugin's incremental writes"))
        if session_s is not None:
            rest = session_s - total - fixtures - clock.writes_s
            rows.append(("rest of the session", rest, f"session {session_s:.2f} s less the tests, fixtures, writes"))
    return rows


def _slowest_loads(loads: dict[str, float], top: int) -> str:
    """The ``top`` slowest first loads, and how many others there were."""
    ranked = sorted(loads.items(), key=lambda kv: -kv[1])
    text = "; ".join(f"{k} {v:.2f} s" for k, v in ranked[:top])
    return text + (f"; {len(ranked) - top} others" if len(ranked) > top else "")
