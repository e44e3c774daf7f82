"""The arithmetic behind the tiers' pass/fail criteria, as pure functions (tested on the CPU).

- loss_drop: (mean of the first window − mean of the last window) / mean of the first window.
- windowed_means: the mean of consecutive, non-overlapping windows (a smoothed loss curve).
- coefficient_of_variation: std / mean (population std), e.g. of step times after warm-up.
- throughput_drift: relative fall of the mean of the last window against the first: (first − last) / first.
"""

from __future__ import annotations

import math
import statistics


def _check_window(values, window: int) -> None:
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    if len(values) < window:
        raise ValueError(f"need at least one window of {window} values, got {len(values)}")


def windowed_means(values, window: int) -> list[float]:
    _check_window(values, window)
    return [statistics.fmean(values[i:i + window]) for i in range(0, len(values) - window + 1, window)]


def loss_drop(losses, window: int) -> float:
    _check_window(losses, 2 * window if len(losses) >= 2 * window else window)
    first, last = statistics.fmean(losses[:window]), statistics.fmean(losses[-window:])
    return (first - last) / first


def coefficient_of_variation(values) -> float:
    if len(values) < 2:
        raise ValueError(f"need two or more values, got {len(values)}")
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean else math.inf


def throughput_drift(values, window: int) -> float:
    _check_window(values, window)
    first, last = statistics.fmean(values[:window]), statistics.fmean(values[-window:])
    return (first - last) / first


def is_non_increasing(values, slack: float = 0.0) -> bool:
    """Each value ≤ the previous one + slack (slack as a fraction of the previous value)."""
    return all(b <= a * (1 + slack) for a, b in zip(values, values[1:]))


def loss_match(ours, reference, control, factor: float, floor: float) -> tuple[list[tuple], list[int]]:
    """Per-step loss match of ``ours`` against ``reference``, with a band set by a ``control`` run.

    gap(t) = |ours_t − ref_t| / ref_t;  e(t) = max_{s ≤ t} |control_s − ref_s| / ref_s;
    tolerance(t) = max(factor · e(t), floor). Returns rows (step, ref, ours, gap, e(t), tolerance) and the
    steps where gap > tolerance.
    """
    if not (len(ours) == len(reference) == len(control)):
        raise ValueError(f"runs differ in length: ours {len(ours)}, reference {len(reference)}, control {len(control)}")
    rows, beyond, envelope = [], [], 0.0
    for step, (lo, lr, lc) in enumerate(zip(ours, reference, control)):
        envelope = max(envelope, abs(lc - lr) / abs(lr))
        tol = max(factor * envelope, floor)
        gap = abs(lo - lr) / abs(lr)
        if not gap <= tol:  # NaN is beyond
            beyond.append(step)
        rows.append((step, lr, lo, gap, envelope, tol))
    return rows, beyond
