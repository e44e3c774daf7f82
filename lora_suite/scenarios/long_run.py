"""The extended tier's verdicts on a long run, computed from what the run recorded.

The tier (tiers/extended), the planted-defect self-test (tiers/selftest_gpu) and the CPU replay tests
(tests/suite/scenarios/test_long_run.py, on recorded GPU series) all judge a run with ``extended_verdicts``.

What is judged, and the noise each criterion absorbs (after ``fit_after_step`` warm-up steps):
- leaks: least-squares slope of torch's allocated and reserved memory, this process's own GPU memory
  (``process_gpu_mib``: NVML's per-process accounting, or this process's allocators, lora_suite.measure.nvml) and
  the process's C heap in use (host memory, memory.host_heap_bytes), MiB per step, each against its bar, judged
  as a trend (leak_fit.TrendFit: the least of the whole fit's slope and twice the slower half's, so a one-off rise does not
  count as a per-step leak). NVML's device-wide used memory and the resident set size are fitted as diagnostics
  only: the device-wide figure counts every process on the GPU (issue 28: a second job on the same H200 failed
  4 of 6 runs on it while torch's memory stayed flat), and the RSS keeps pages freed memory served.
- loss: 50-step window means non-increasing within a slack, last below first (sampling noise ~1%).
- stalls: the share of steps whose CUDA-event span exceeds factor × the median span. A loaded host stretches
  steps by tens of percent (worst seen 2.05×); a stall multiplies them. Profiled steps are left out (the
  profiler adds host time to them).
- device time: the step's GPU work, early vs late window (lora_suite/measure/device_time.py). The host's speed does not
  enter the durations of launches; a GPU neighbour's time slices are clipped away.
- aged vs fresh: the host side's cost of the run's own state, in alternating pairs (lora_suite/scenarios/aged_vs_fresh.py).
  The host's speed moves both sides of a pair alike.
Diagnostics, never judged: the process-CPU-time drift (the criterion until issue 18, which judged the host),
and where the step's time goes (device busy time / event span per window: below ~0.5 the step is host-bound).
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field

from lora_suite.engine.step_record import StepRecord
from lora_suite.measure.criteria import (
    Verdict,
    aged_vs_fresh_allowance,
    aged_vs_fresh_verdict,
    device_time_verdict,
    host_time_drift,
    is_non_increasing,
    stall_verdict,
    windowed_means,
)
from lora_suite.measure.device_time import DeviceWindow
from lora_suite.measure.leak_fit import fit_slope, fit_trend
from lora_suite.scenarios.aged_vs_fresh import Pair
from lora_suite.settings.config import TierConfig

NOISE_MODELS = (  # (criterion, measured on, noise it absorbs, what moves it): the report's table of the timed verdicts
    (
        "stalls",
        "CUDA-event span of each unprofiled step after warm-up",
        "host preemption and jitter (tens of percent; worst seen 2.05x the median)",
        "a step taking 2.5x the median or more",
    ),
    (
        "device time drift",
        "summed GPU launch durations (CUPTI) of 5 profiled steps early and late, outlying launches at "
        "their window median",
        "the host's speed (it does not enter launch durations); a GPU neighbour's time slices "
        "(clipped); kernel jitter (3 SE of the window medians); clock changes (5%)",
        "more GPU work per step as the run goes on",
    ),
    (
        "aged vs fresh",
        "process CPU time of alternating steps of this run and a fresh one, per-pair ratio",
        "the host's speed, which moves both steps of a pair alike; step jitter (3 SE of the median ratio, pairs added "
        "until that resolves 9%); what two models in one process may differ in (3%)",
        "host work that grows with the run's own state (model, optimizer, trainer)",
    ),
    (
        "leak slopes",
        "torch allocated and reserved, this process's GPU memory (NVML per-process, or its allocators), C heap in "
        "use, per step after warm-up; the least of the whole fit's slope and twice the slower half's",
        "allocator caching; one-off allocations (they move one half only); other processes on the GPU (not in "
        "this process's figures; the device-wide reading is context only)",
        "memory kept per step",
    ),
)
LEAK_SERIES = ("allocated_mib", "reserved_mib", "process_gpu_mib", "host_heap_mib")
# Fitted and shown, never judged: the whole GPU's used memory (every process's) and the RSS (memory.host_heap_bytes)
DIAGNOSTIC_SLOPES = ("nvml_used_mib", "host_rss_mib")
_NO_READINGS = {
    "process_gpu_mib": "no reading of this process's GPU memory (neither NVML per-process nor the allocators)",
    "host_heap_mib": "no glibc mallinfo2",
}


@dataclass
class LongRunVerdicts:
    verdicts: list[Verdict] = field(default_factory=list)
    fits: list[tuple] = field(default_factory=list)  # (series, slope, intercept, r2, min, max)
    missing: list[str] = field(default_factory=list)  # criteria the config asks for but the run gave no data for
    diagnostics: list[str] = field(default_factory=list)

    def by_name(self) -> dict[str, Verdict]:
        """The verdicts by their criterion's short name: the name up to ' after', ' slope' or ','."""
        return {v.name.split(" after")[0].split(" slope")[0].split(",")[0]: v for v in self.verdicts}


def extended_verdicts(
    cfg: TierConfig,
    records: list[StepRecord],
    windows: dict[str, DeviceWindow] | None = None,
    pairs: list[Pair] | None = None,
) -> LongRunVerdicts:
    """The extended tier's verdicts on a run: leak slopes, the smoothed loss, stalls, device-time drift and aged vs
    fresh, each judged only where the config sets its bar; the fits, the criteria that lacked data and the
    diagnostics with them."""
    crit, source = cfg.criteria, f"configs/{cfg.tier}.yaml"
    out = LongRunVerdicts()
    after = [r for r in records if r.step >= crit.fit_after_step]
    steps = [r.step for r in after]
    _judge_leaks(out, crit, source, after, steps)
    _fit_diagnostic_slopes(out, after, steps)
    if crit.smooth_slack is not None:
        _judge_loss(out, crit, source, records)
    unprofiled = [r for r in after if not r.profiled]
    _judge_timing(out, crit, source, unprofiled, windows, pairs)
    _host_time_diagnostic(out, cfg, unprofiled)
    return out


def _leak_bar(crit, name: str) -> tuple[float | None, str]:
    """The slope bar of one leak series and the criterion's key: the host heap has its own bar, the GPU series
    share one."""
    if name == "host_heap_mib":
        return crit.host_leak_slope_max_mib_per_step, "host_leak_slope_max_mib_per_step"
    return crit.leak_slope_max_mib_per_step, "leak_slope_max_mib_per_step"


def _judge_leaks(out: LongRunVerdicts, crit, source: str, after: list[StepRecord], steps: list[int]) -> None:
    """One verdict per leak series that has a bar: the sustained slope (leak_fit.TrendFit: the least of the whole
    fit's slope and twice the slower half's, MiB per step) at most the bar; a series without readings is missing."""
    for name in LEAK_SERIES:
        bar, key = _leak_bar(crit, name)
        if bar is None:
            continue
        values = [getattr(r, name) for r in after]
        if any(v is None for v in values):
            out.missing.append(f"{name} slope: no readings ({_NO_READINGS.get(name, 'none recorded')})")
            continue
        trend = fit_trend(steps, values)
        fit = trend.whole
        out.fits.append((name, fit.slope, fit.intercept, fit.r2, min(values), max(values)))
        out.verdicts.append(
            Verdict(
                f"{name} slope after step {crit.fit_after_step}, sustained in both halves",
                round(trend.sustained, 5),
                "<=",
                bar,
                f"{source} {key}",
                f"from {values[0]:.1f} to {values[-1]:.1f} MiB; {trend.describe()}",
            )
        )


def _fit_diagnostic_slopes(out: LongRunVerdicts, after: list[StepRecord], steps: list[int]) -> None:
    """Least-squares fits of the series shown and never judged (the device-wide used memory, the RSS), where
    every step after warm-up has a reading and there are at least two."""
    for name in DIAGNOSTIC_SLOPES:
        values = [getattr(r, name) for r in after]
        if len(values) >= 2 and all(v is not None for v in values):
            fit = fit_slope(steps, values)
            what = "device-wide, every process: context" if name == "nvml_used_mib" else "diagnostic"
            out.fits.append((f"{name} ({what})", fit.slope, fit.intercept, fit.r2, min(values), max(values)))


def _judge_loss(out: LongRunVerdicts, crit, source: str, records: list[StepRecord]) -> None:
    """The loss verdicts on the window means m_1..m_k of ``smooth_window`` steps: m_{i+1} <= m_i (1 + slack) for
    every i, and m_k < m_1."""
    means = windowed_means([r.loss for r in records], crit.smooth_window)
    out.verdicts.append(
        Verdict(
            f"smoothed loss keeps falling (each window <= previous x (1 + {crit.smooth_slack}))",
            float(is_non_increasing(means, crit.smooth_slack)),
            ">=",
            1.0,
            f"{source} smooth_slack",
            f"window means {[round(m, 4) for m in means]}",
        )
    )
    out.verdicts.append(
        Verdict("last window mean loss < first window mean", round(means[-1], 4), "<", round(means[0], 4))
    )


def _judge_timing(
    out: LongRunVerdicts,
    crit,
    source: str,
    unprofiled: list[StepRecord],
    windows: dict[str, DeviceWindow] | None,
    pairs: list[Pair] | None,
) -> None:
    """The timed verdicts whose bars the config sets, in this order: stalls, device-time drift, aged vs fresh. Each
    judge gives a verdict, or the line of a criterion the run gave no data for (missing), or nothing."""
    judges = (
        (crit.stall_fraction_max, lambda: _stalls(crit, source, unprofiled)),
        (crit.device_time_drift_max, lambda: _device_time(crit, source, windows)),
        (crit.aged_vs_fresh_slowdown_max, lambda: _aged_vs_fresh(crit, source, pairs)),
    )
    for bar, judge in judges:
        if bar is None:
            continue
        found = judge()
        if isinstance(found, Verdict):
            out.verdicts.append(found)
        elif isinstance(found, str):
            out.missing.append(found)


def _stalls(crit, source: str, unprofiled: list[StepRecord]) -> Verdict | None:
    """The stall verdict on the unprofiled steps' event spans; nothing where there are none (a run without CUDA
    events)."""
    if not unprofiled or unprofiled[0].gpu_time_s is None:
        return None
    spans = [r.gpu_time_s for r in unprofiled]
    return stall_verdict(spans, factor=crit.stall_factor, stall_max=crit.stall_fraction_max, source=source)


def _device_time(crit, source: str, windows: dict[str, DeviceWindow] | None) -> Verdict | str:
    """The device-time drift verdict on the early and late profiled windows' clipped device times; missing
    without both windows."""
    if not windows or "early" not in windows or "late" not in windows:
        return "device time drift: no early and late profiled windows (CUPTI through torch.profiler)"
    early, late = windows["early"].clipped_s, windows["late"].clipped_s
    return device_time_verdict(early, late, drift_max=crit.device_time_drift_max, z=crit.drift_noise_z, source=source)


def _aged_vs_fresh(crit, source: str, pairs: list[Pair] | None) -> Verdict | str:
    """The aged-vs-fresh verdict on the pairs' ratios; missing when no pairs were run."""
    if not pairs:
        return "aged vs fresh: no alternating pairs were run"
    ratios = [p.ratio for p in pairs]
    return aged_vs_fresh_verdict(
        ratios, slowdown_max=crit.aged_vs_fresh_slowdown_max, z=crit.drift_noise_z, source=source
    )


def _host_time_diagnostic(out: LongRunVerdicts, cfg: TierConfig, unprofiled: list[StepRecord]) -> None:
    """The drift of tokens per process CPU-second over the unprofiled steps (tokens per step = batch size ×
    sequence length × gradient accumulation), as a diagnostic: it follows the host's speed, so it is never judged.
    Needs CPU times for at least two smoothing windows."""
    crit = cfg.criteria
    tokens = cfg.data.batch_size * cfg.data.seq_len * cfg.train.grad_accum
    cpu = [r.cpu_time_s for r in unprofiled]
    if cpu and cpu[0] is not None and len(cpu) >= 2 * crit.smooth_window:
        d = host_time_drift(cpu, tokens, crit.smooth_window)
        out.diagnostics.append(
            f"tokens per process CPU-second drift (diagnostic, not judged: it follows the host's "
            f"speed): {d.drift:.4f} (SE {d.noise_se:.4f}), first {d.first_median:.0f}, last "
            f"{d.last_median:.0f}"
        )


def aged_vs_fresh_resolved(pairs: list[Pair], crit) -> bool:
    """Whether the pairs so far resolve a slowdown of ``aged_vs_fresh_resolution``: the verdict's allowance
    (criteria.aged_vs_fresh_allowance) at most that (always true without a resolution target)."""
    if crit.aged_vs_fresh_resolution is None or crit.aged_vs_fresh_slowdown_max is None:
        return True
    _, allowance, _ = aged_vs_fresh_allowance(
        [p.ratio for p in pairs], slowdown_max=crit.aged_vs_fresh_slowdown_max, z=crit.drift_noise_z
    )
    return allowance <= crit.aged_vs_fresh_resolution


def time_budget_rows(records: list[StepRecord], windows: dict[str, DeviceWindow]) -> list[tuple]:
    """Per profiled window: median event span, median summed and clipped device time, and device busy share
    (clipped device time / span): where a step's time goes, and whether it was host-bound."""
    spans = {r.step: r.gpu_time_s for r in records if r.gpu_time_s is not None}
    rows = []
    for name, w in windows.items():
        span = statistics.median(spans[s] for s in w.steps if s in spans)
        clipped = statistics.median(w.clipped_s)
        rows.append(
            (
                name,
                f"{w.steps[0]}-{w.steps[-1]}",
                round(span * 1e3, 2),
                round(statistics.median(w.summed_s) * 1e3, 2),
                round(clipped * 1e3, 2),
                round(statistics.median(w.launches)),
                round(clipped / span, 3),
            )
        )
    return rows


def replay_report(report: dict) -> tuple[list[StepRecord], dict[str, DeviceWindow] | None, list[Pair] | None]:
    """What ``extended_verdicts`` needs, rebuilt from an extended-tier report.json (its recorded series), so that
    any run's verdicts, a false alarm's included, can be replayed on a CPU. Series a report lacks (reports made
    before issue 18 have no device windows or pairs) come back as None."""
    series = {s["name"]: s for s in report["series"]}
    if "extended: loss" not in series:
        raise ValueError(f"report {report.get('run_id')!r} has no 'extended: loss' series (not an extended-tier run?)")
    steps = series["extended: loss"]
    fields = {f.name for f in dataclasses.fields(StepRecord)}
    records = [StepRecord(**{c: v for c, v in zip(steps["columns"], row) if c in fields}) for row in steps["rows"]]
    windows = None
    dev = series.get("device time of the profiled steps (lora_suite/device_time.py)")
    if dev is not None:
        by_name: dict[str, list] = {}
        for name, step, summed, clipped, n, _span in dev["rows"]:
            by_name.setdefault(name, []).append((step, summed / 1e3, clipped / 1e3, n))
        windows = {
            name: DeviceWindow(
                name,
                tuple(r[0] for r in rows),
                tuple(r[1] for r in rows),
                tuple(r[2] for r in rows),
                tuple(r[3] for r in rows),
            )
            for name, rows in by_name.items()
        }
    pairs = None
    ab = series.get("aged vs fresh: alternating pairs (process CPU ms, event span ms)")
    if ab is not None:
        pairs = [
            Pair(
                i,
                a,
                f,
                first,
                ac / 1e3,
                fc / 1e3,
                None if asp is None else asp / 1e3,
                None if fsp is None else fsp / 1e3,
            )
            for i, a, f, first, ac, fc, _ratio, asp, fsp in ab["rows"]
        ]
    return records, windows, pairs
