"""Where a run's wall time goes (issue 20: the quick tier's edit-run loop), as a table for the report.

Phases, each measured, never inferred from a total:
- ``before pytest``: what ``gpu-test.sh`` did before it started pytest (choosing the interpreter, nvidia-smi),
  from ``GPU_TEST_T0`` (the script's start, epoch seconds) to the pytest process's start;
- ``interpreter and plugin imports``: the process's start (``/proc/self/stat``) to ``pytest_configure``;
- ``collection``: ``pytest_configure`` to the session's start (test modules imported, items selected);
- ``CUDA context``: creating it at the session's start, timed on its own;
- ``tests``: setup + call + teardown of every test, with the RawKernel first loads inside them (NVRTC compile,
  or CuPy's disk cache: ``lora_core.ops.cupy_interop.KERNEL_LOAD_SECONDS``) and the slowest tests named.
"""

from __future__ import annotations

import os
import time


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
) -> list[tuple[str, float | None, str]]:
    """Rows (phase, seconds, detail); epoch seconds in, None where a phase could not be measured."""
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
        ("CUDA context", cuda_context_s, "created at the session's start" if cuda_context_s is not None else "no GPU"),
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
                "; ".join(f"{k} {v:.2f} s" for k, v in sorted(kernel_loads.items(), key=lambda kv: -kv[1])),
            )
        )
    return rows
