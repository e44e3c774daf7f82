"""The arithmetic behind the tiers' pass/fail criteria, as pure functions (tested on the CPU).

- loss_drop: (mean of the first window − mean of the last window) / mean of the first window.
- windowed_means: the mean of consecutive, non-overlapping windows (a smoothed loss curve).
- coefficient_of_variation: std / mean (population std); no tier judges it any more (one stall dominates it).
- robust_spread: 1.4826·MAD / median, the robust counterpart of the CV (equal to it for Gaussian noise; one
  stall among n steps moves the MAD by at most one rank, where it moves a plain CV by ~stall/(mean·√n)).
- median_drift: (median(first window) − median(last window)) / median(first window), with the standard
  error of that difference for the noise allowance: a median of w samples of a distribution with robust
  σ has standard error ≈ 1.2533·σ/√w (asymptotic efficiency of the median, 2/π, for Gaussian noise), so
  the difference of two independent window medians has SE ≈ 1.2533·σ·√(2/w). σ is pooled from within the
  two windows (1.4826·median of |v − its window's median|), so that the drift itself does not widen its
  own allowance. A drift criterion passes when drift ≤ drift_max + z·SE / median(first window).
- stall_fraction: the fraction of values above factor × their median. Host preemption and jitter move a
  step by tens of percent; a stall (a synchronising allocator retry, a collection, a periodic rebuild)
  multiplies it. A rare stall is noise; stalls on a fixed share of the steps are a defect.
- device_time_verdict / aged_vs_fresh_verdict: the long-run speed criteria that the host's speed cannot move
  (lora_suite/scenarios/long_run.py says which noise each one absorbs).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


def _check_window(values, window: int) -> None:
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    if len(values) < window:
        raise ValueError(f"need at least one window of {window} values, got {len(values)}")


def windowed_means(values, window: int) -> list[float]:
    _check_window(values, window)
    return [statistics.fmean(values[i : i + window]) for i in range(0, len(values) - window + 1, window)]


def loss_drop(losses, window: int) -> float:
    _check_window(losses, 2 * window if len(losses) >= 2 * window else window)
    first, last = statistics.fmean(losses[:window]), statistics.fmean(losses[-window:])
    return (first - last) / first


def coefficient_of_variation(values) -> float:
    if len(values) < 2:
        raise ValueError(f"need two or more values, got {len(values)}")
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean else math.inf


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


def widest_control(controls, reference) -> list[float]:
    """Per step t, the loss of the control run farthest from the reference, |c_t − ref_t| / ref_t largest (a NaN
    counts as farthest): ``loss_match``'s e(t) over it is the running max over every control run."""
    if not controls:
        raise ValueError("widest_control: expected one or more control runs, got none")
    if any(len(c) != len(reference) for c in controls):
        raise ValueError(f"control runs of {[len(c) for c in controls]} steps, reference of {len(reference)}")

    def gap(c, r):
        g = abs(c - r) / abs(r)
        return math.inf if math.isnan(g) else g

    return [max(cs, key=lambda c: gap(c, r)) for *cs, r in zip(*controls, reference)]


OPS = {  # the comparison of a value with its threshold, for verdicts here and checks in report.py
    "<=": lambda v, t: v <= t,
    "<": lambda v, t: v < t,
    ">=": lambda v, t: v >= t,
    ">": lambda v, t: v > t,
    "==": lambda v, t: v == t,
}
MAD_TO_SIGMA = 1.4826  # σ = 1.4826·MAD for Gaussian noise
MEDIAN_SE_FACTOR = 1.2533  # √(π/2): standard error of a median / (σ/√n) for Gaussian noise


def median_abs_deviation(values) -> float:
    if len(values) < 2:
        raise ValueError(f"need two or more values, got {len(values)}")
    med = statistics.median(values)
    return statistics.median(abs(v - med) for v in values)


def robust_spread(values) -> float:
    """1.4826·MAD / median: the spread of ``values`` relative to their median, insensitive to rare stalls."""
    med = statistics.median(values)
    return MAD_TO_SIGMA * median_abs_deviation(values) / med if med else math.inf


@dataclass(frozen=True)
class Drift:
    first_median: float
    last_median: float
    drift: float  # (first − last) / first: positive when the value fell
    noise_se: float  # standard error of ``drift`` from the samples' own robust spread

    def allowed(self, drift_max: float, z: float) -> float:
        """The bar with its noise allowance: drift_max + z·SE."""
        return drift_max + z * self.noise_se


def median_drift(values, window: int) -> Drift:
    """Relative fall of the median of the last ``window`` values against the first ``window`` (docstring above)."""
    _check_window(values, 2 * window)
    return window_drift(list(values[:window]), list(values[-window:]))


def window_drift(head: list[float], tail: list[float]) -> Drift:
    """Relative fall of median(tail) against median(head), with the SE of that difference (docstring above)."""
    if len(head) < 2 or len(tail) < 2:
        raise ValueError(f"need two or more values per window, got {len(head)} and {len(tail)}")
    first, last = statistics.median(head), statistics.median(tail)
    sigma = MAD_TO_SIGMA * statistics.median([abs(v - first) for v in head] + [abs(v - last) for v in tail])
    se = MEDIAN_SE_FACTOR * sigma * math.sqrt(1 / len(head) + 1 / len(tail)) / first if first else math.inf
    return Drift(first, last, (first - last) / first if first else math.inf, se)


def host_normalised_drift(cpu_times_s, probe_times_s, tokens_per_step: float, window: int) -> Drift:
    """Drift of tokens per unit of *host work*, the step's CPU time measured in host-probe times.

    v_i = tokens · p_i / c_i, with c_i the step's process CPU time and p_i the fixed probe's (step_record.host_probe)
    right after it. A host that becomes slower (clock, a neighbour on shared cores) scales c_i and p_i alike and
    leaves v_i; a step that does more work (a slower path, longer GPU waits spun on the CPU) scales c_i only.
    Recorded by the extended tier as a diagnostic beside the asserted CPU-time drift (issue 9 follow-up: a quiet
    H100 showed a 30% host slowdown within one run, reports/20261122T063748Z-extended).
    """
    if len(cpu_times_s) != len(probe_times_s):
        raise ValueError(f"{len(cpu_times_s)} step times but {len(probe_times_s)} probe times")
    return median_drift([tokens_per_step * p / c for c, p in zip(cpu_times_s, probe_times_s)], window)


@dataclass(frozen=True)
class Verdict:
    """A criterion evaluated on measurements; tiers record it as a check, self-tests assert it fails."""

    name: str
    value: float
    op: str
    threshold: float
    source: str = ""
    detail: str = ""

    @property
    def passed(self) -> bool:
        return bool(OPS[self.op](self.value, self.threshold))  # NaN never passes: every comparison is False


def stall_fraction(values, factor: float) -> float:
    """Share of ``values`` above ``factor`` × their median."""
    med = statistics.median(values)
    return sum(v > factor * med for v in values) / len(values)


def median_se(values) -> tuple[float, float]:
    """The median of ``values`` and its standard error, 1.2533·1.4826·MAD/√n (Gaussian efficiency of a median)."""
    if len(values) < 2:
        raise ValueError(f"need two or more values, got {len(values)}")
    return statistics.median(values), MEDIAN_SE_FACTOR * MAD_TO_SIGMA * median_abs_deviation(values) / math.sqrt(
        len(values)
    )


def stall_verdict(step_times_s, *, factor: float, stall_max: float, source: str) -> Verdict:
    """Share of steps slower than ``factor`` × the median step (CUDA-event spans): a stall multiplies a step, where
    host preemption and jitter move it by tens of percent."""
    ordered = sorted(step_times_s)
    return Verdict(
        f"share of steps slower than {factor} x the median step (stalls) after warm-up",
        round(stall_fraction(step_times_s, factor), 4),
        "<=",
        stall_max,
        f"{source} stall_factor, stall_fraction_max",
        f"median {statistics.median(ordered) * 1e3:.1f} ms, min {ordered[0] * 1e3:.1f}, max "
        f"{ordered[-1] * 1e3:.1f}, robust spread {robust_spread(step_times_s):.3f}",
    )


def device_time_verdict(early_s, late_s, *, drift_max: float, z: float, source: str) -> Verdict:
    """Drift of the step's device time (lora_suite/measure/device_time.py: clipped launch durations), early vs late window.

    v_j = 1 / T_j (steps per device-second); drift = (median v_early − median v_late) / median v_early with the SE
    of window_drift; passes when drift ≤ drift_max + z·SE. The host's speed does not enter T_j.
    """
    d = window_drift([1 / t for t in early_s], [1 / t for t in late_s])
    return Verdict(
        "device time per step drift (clipped kernel durations), early vs late window",
        round(d.drift, 4),
        "<=",
        round(d.allowed(drift_max, z), 4),
        f"{source} device_time_drift_max {drift_max} + drift_noise_z {z} x SE {d.noise_se:.4f}",
        f"median {1e3 / d.first_median:.2f} ms early, {1e3 / d.last_median:.2f} ms "
        f"late ({len(early_s)} and {len(late_s)} profiled steps)",
    )


def aged_vs_fresh_allowance(ratios, *, slowdown_max: float, z: float) -> tuple[float, float, float]:
    """The aged-vs-fresh slowdown and its allowance, on the log scale of the per-pair ratios ρ_i.

    The noise is multiplicative: a preempted step (on a virtual machine, preemption shows in process CPU time)
    multiplies one side of its pair, and a steady slowdown multiplies every aged step. On ℓ_i = ln ρ_i both are
    additive, so the spread, and with it the allowance, does not grow with the slowdown being judged (on ρ_i
    itself a fourfold slowdown widened its own allowance to past fourfold: CI at d7a8575). With
    m = median(ℓ) and SE = 1.2533·1.4826·MAD(ℓ)/√n (median_se):

        slowdown = e^m − 1,   allowance = e^(ln(1 + slowdown_max) + z·SE) − 1,

    and the verdict passes when slowdown ≤ allowance. Near ρ = 1, ln ρ ≈ ρ − 1, so a quiet run reads as it did on ρ.
    Returns (slowdown, allowance, SE on the log scale)."""
    if any(not (r > 0) for r in ratios):
        raise ValueError(f"aged vs fresh ratios must be positive, got {sorted(ratios)[:3]}")
    med, se = median_se([math.log(r) for r in ratios])
    return math.exp(med) - 1, math.exp(math.log1p(slowdown_max) + z * se) - 1, se


def aged_vs_fresh_verdict(ratios, *, slowdown_max: float, z: float, source: str) -> Verdict:
    """Per-pair ratio ρ_i = CPU time of the aged run's step / the fresh run's (lora_suite/scenarios/aged_vs_fresh.py);
    judged on ln ρ_i (aged_vs_fresh_allowance)."""
    slowdown, allowance, se = aged_vs_fresh_allowance(ratios, slowdown_max=slowdown_max, z=z)
    return Verdict(
        "aged run's step / fresh run's step, process CPU time, median over alternating pairs, minus 1",
        round(slowdown, 4),
        "<=",
        round(allowance, 4),
        f"{source} aged_vs_fresh_slowdown_max {slowdown_max} + drift_noise_z {z} x SE {se:.4f} of the log ratio",
        f"{len(ratios)} pairs: median ratio {statistics.median(ratios):.4f}, min {min(ratios):.3f}, "
        f"max {max(ratios):.3f}",
    )


def host_time_drift(cpu_times_s, tokens_per_step: float, window: int) -> Drift:
    """Diagnostic only (judged until issue 18): drift of tokens per process CPU-second, first vs last window after
    warm-up. On a host-bound step it follows the host's speed: 84-154 ms per step within one run on a shared H200
    (tests/fixtures/extended_replay/h200-2026-11-23-run*: 4 false alarms in 9 runs at a 5% + 3 SE bar)."""
    return median_drift([tokens_per_step / t for t in cpu_times_s], window)
