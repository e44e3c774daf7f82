"""GPU timing with CUDA events: warm up, then time each repetition, report median with p20/p80.

Device work is asynchronous, so a host clock alone measures launch time; CUDA events bracket the
work on the stream. Compilation and handle creation stay out of the numbers (warm-up runs first).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lora_suite.measure.criteria import median_se


@dataclass(frozen=True)
class TimingStats:
    median_ms: float
    p20_ms: float
    p80_ms: float
    mean_ms: float
    reps: int

    @classmethod
    def from_samples(cls, samples_ms: list[float]) -> TimingStats:
        if not samples_ms:
            raise ValueError("no timing samples")
        ordered = sorted(samples_ms)
        return cls(
            median_ms=statistics.median(ordered),
            p20_ms=_quantile(ordered, 0.2),
            p80_ms=_quantile(ordered, 0.8),
            mean_ms=statistics.fmean(ordered),
            reps=len(ordered),
        )


def _quantile(ordered: list[float], q: float) -> float:
    """Linear-interpolated quantile of sorted samples."""
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def cuda_time(
    fn: Callable[[], object], *, warmup: int = 10, reps: int = 50, device: torch.device | None = None
) -> TimingStats:
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


def interleaved_rounds(
    fns: dict[str, Callable[[], object]], *, rounds: int = 7, reps: int = 15, warmup: int = 5
) -> dict[str, list[float]]:
    """Median CUDA-event ms of each callable per round, the callables taking turns within every round.

    Interleaving puts slow drifts of the machine (clocks, a second job, thermals) on every candidate alike;
    the per-round medians give the round-to-round spread a noise allowance is computed from.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            out[name].append(cuda_time(fn, warmup=1, reps=reps).median_ms)
    return out


@dataclass(frozen=True)
class PairedEstimate:
    """Median of per-round values and its standard error (1.2533·1.4826·MAD/√n, see criteria.py)."""

    median: float
    se: float
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: list[float]) -> PairedEstimate:
        med, se = median_se(values)
        return cls(med, se, tuple(values))


@dataclass(frozen=True)
class BarAttempt:
    estimate: PairedEstimate
    passed: bool


def measure_until_pass(
    measure: Callable[[], PairedEstimate], passes: Callable[[PairedEstimate], bool], *, attempts: int = 3
) -> list[BarAttempt]:
    """Measure; on a failure measure again, up to ``attempts`` times. The bar fails only if every attempt does.

    A real regression fails every attempt; a transient (another job's burst) rarely does three times in a row.
    Every attempt is returned so that the report shows the re-measurements, not only the last one.
    """
    out = []
    for _ in range(attempts):
        est = measure()
        out.append(BarAttempt(est, bool(passes(est))))
        if out[-1].passed:
            break
    return out
