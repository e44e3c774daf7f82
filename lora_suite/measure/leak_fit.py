"""The leak fit: a least-squares line through a memory series (``fit_slope``: MiB against step), and the two-window
trend test a leak verdict judges (``fit_trend``: the least of the whole run's slope and twice the slower half's, so
that a one-off rise is not read as a leak; ``TrendFit`` says why). The extended tier fits its leak series with them
(``lora_suite.scenarios.long_run``): torch's allocated and reserved memory, the process's GPU memory and its C heap."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlopeFit:
    """Least-squares line y = slope·x + intercept, with r² and the number of points."""

    slope: float
    intercept: float
    r2: float
    n: int


def fit_slope(xs, ys) -> SlopeFit:
    xs, ys = [float(x) for x in xs], [float(y) for y in ys]
    n = len(xs)
    if n != len(ys) or n < 2:
        raise ValueError(f"fit_slope needs two or more (x, y) pairs, got {n} x and {len(ys)} y")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("fit_slope: all x are equal")
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys))
    return SlopeFit(slope, intercept, 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0, n)


@dataclass(frozen=True)
class TrendFit:
    """A leak fit that also asks whether the series is a trend (a two-window test).

    The fitted points are split into halves, each fitted on its own; the judged figure is

        sustained = min(slope(all), 2 · min(slope(first half), slope(second half)))

    A per-step leak grows memory in both halves. Its rate need not be the same in both: glibc's allocator moved a
    planted 1 MiB/step host leak between its mmap and heap accounting, so one round's halves grew 0.25 and 1.08
    MiB/step (whole 0.71; selftest-gpu at 243680f, H100); the factor 2 lets the slower half grow at half the
    whole run's rate and still count as the same leak. A one-off rise of J MiB (a cache that fills once, a buffer
    allocated mid-run, a neighbour's plateau in a device-wide reading) lands in one half (or between them): the
    other half's slope is ≈ 0, while the whole fit's slope is up to 1.5·J/n. Memory that rises and is freed again
    (a sawtooth) has a small whole-run slope. A leak that starts in the second half only is judged by its first
    half, so it shows only in ``whole`` (reported beside the verdict). Allocator granularity (torch reserves 2 MiB
    and 20 MiB segments) makes a half's slope coarse for leaks near the bar; a leaked activation of the suite's
    models is 2 MiB or more per step, many times any bar here.
    """

    whole: SlopeFit
    first: SlopeFit
    second: SlopeFit

    SLOWER_HALF_FACTOR = 2.0

    @property
    def sustained(self) -> float:
        return min(self.whole.slope, self.SLOWER_HALF_FACTOR * min(self.first.slope, self.second.slope))

    def describe(self) -> str:
        return (
            f"whole {self.whole.slope:.4f} (r2 {self.whole.r2:.3f}), first half {self.first.slope:.4f}, "
            f"second half {self.second.slope:.4f} MiB/step; judged: the least of the whole and 2 x the slower half "
            "(a leak grows in both halves)"
        )


def fit_trend(xs, ys) -> TrendFit:
    xs, ys = list(xs), list(ys)
    if len(xs) < 4:
        raise ValueError(f"fit_trend needs four or more (x, y) pairs (two per half), got {len(xs)}")
    h = len(xs) // 2
    return TrendFit(fit_slope(xs, ys), fit_slope(xs[:h], ys[:h]), fit_slope(xs[h:], ys[h:]))
