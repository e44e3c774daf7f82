"""GPU timing with CUDA events: warm up, then time each repetition, report median with p20/p80.

Device work is asynchronous, so a host clock alone measures launch time; CUDA events bracket the
work on the stream. Compilation and handle creation stay out of the numbers (warm-up runs first).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class TimingStats:
    median_ms: float
    p20_ms: float
    p80_ms: float
    mean_ms: float
    reps: int

    @classmethod
    def from_samples(cls, samples_ms: list[float]) -> "TimingStats":
        if not samples_ms:
            raise ValueError("no timing samples")
        ordered = sorted(samples_ms)
        return cls(median_ms=statistics.median(ordered), p20_ms=_quantile(ordered, 0.2),
                   p80_ms=_quantile(ordered, 0.8), mean_ms=statistics.fmean(ordered), reps=len(ordered))


def _quantile(ordered: list[float], q: float) -> float:
    """Linear-interpolated quantile of sorted samples."""
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def cuda_time(fn: Callable[[], object], *, warmup: int = 10, reps: int = 50,
              device: torch.device | None = None) -> TimingStats:
    """Time ``fn`` on the current CUDA stream: ``warmup`` untimed calls, then ``reps`` timed ones."""
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_time needs a CUDA GPU, but torch.cuda.is_available() is False")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return TimingStats.from_samples([s.elapsed_time(e) for s, e in zip(starts, ends)])
