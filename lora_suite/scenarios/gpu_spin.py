"""The GPU spin the slowdown plants add (``full_tier_step_slowdown``, ``bench_cupy_rows_slowdown``): a
``torch.cuda._sleep`` kernel of a number of clock cycles, converted from milliseconds once per process by timing
10⁷ cycles between two CUDA events (cycles per ms = 10⁷ / elapsed ms)."""

from __future__ import annotations

import torch

TIMED_CYCLES = 10_000_000


def cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of ``torch.cuda._sleep``, timed with CUDA events."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(TIMED_CYCLES // 10)  # warm
    a.record()
    torch.cuda._sleep(TIMED_CYCLES)
    b.record()
    b.synchronize()
    return TIMED_CYCLES / a.elapsed_time(b)


def spin(cycles: int) -> None:
    """Keep the current stream busy for ``cycles`` GPU clock cycles (a kernel: a CUDA graph records it)."""
    torch.cuda._sleep(cycles)
