"""The extended tier's own behaviour on a ``Tier`` (``lora_suite.harness.tier``): what a long run records beside its
steps, and its verdicts as checks. The planted-defect self-tests of that tier (``lora_suite/tiers/selftest_gpu/``)
run the same steps.

- ``aged_vs_fresh``: after the run, a fresh run from the same config and seed takes turns with it
  (``lora_suite.scenarios.aged_vs_fresh``); the pairs, with their ratio of process CPU time, go into a series.
- ``device_windows``: the device time of the steps a ``DeviceTimer`` profiled, per window
  (``lora_suite.measure.device_time``), and where a step's time goes (device busy share of its event span).
- ``record_verdicts``: the long run's verdicts (``lora_suite.scenarios.long_run.extended_verdicts``) as checks."""

from __future__ import annotations

from lora_suite.engine.step_record import StepRecord
from lora_suite.engine.trainer import TrainingRun, TrainResult
from lora_suite.harness.report import Series
from lora_suite.harness.tier import Tier
from lora_suite.measure.device_time import DeviceTimer, DeviceWindow
from lora_suite.measure.device_time import window as device_window
from lora_suite.scenarios.aged_vs_fresh import Pair, run_pairs
from lora_suite.scenarios.long_run import LongRunVerdicts, aged_vs_fresh_resolved, time_budget_rows
from lora_suite.settings.config import TierConfig

PAIR_COLUMNS = (
    "pair",
    "aged step",
    "fresh step",
    "aged first",
    "aged CPU ms",
    "fresh CPU ms",
    "ratio",
    "aged span ms",
    "fresh span ms",
)


def _ms(seconds: float | None) -> float | None:
    """Seconds as milliseconds rounded to 3 decimals; None stays None."""
    return None if seconds is None else round(seconds * 1e3, 3)


def pair_row(p: Pair) -> tuple:
    """One aged-vs-fresh pair as a row of ``PAIR_COLUMNS``."""
    return (
        p.index,
        p.aged_step,
        p.fresh_step,
        p.aged_first,
        _ms(p.aged_cpu_s),
        _ms(p.fresh_cpu_s),
        round(p.ratio, 4),
        _ms(p.aged_span_s),
        _ms(p.fresh_span_s),
    )


class ExtendedTier:
    """The extended tier's long-run records and verdicts, on the session's ``tier``: ``ExtendedTier(tier)``."""

    def __init__(self, tier: Tier):
        self.tier = tier

    def aged_vs_fresh(self, cfg: TierConfig, aged: TrainResult, **kw) -> list[Pair]:
        """After a run: a fresh run from the same config and seed takes turns with it (lora_suite.scenarios.aged_vs_fresh);
        ``kw`` (a step_hook) goes to the fresh run as it went to the aged one. The pairs are recorded as a series."""
        if aged.run is None:
            raise ValueError(
                "aged vs fresh needs the aged run's state: TrainResult.run is None, expected its TrainingRun"
            )
        crit = cfg.criteria
        fresh = self.tier.prepare(cfg)
        fresh_run = TrainingRun(fresh.model, fresh.batches, cfg.train, adapters=fresh.adapters, **kw)
        pairs = run_pairs(
            aged.run,
            fresh_run,
            aged_start=cfg.train.steps,
            pairs=crit.aged_vs_fresh_pairs,
            warmup=crit.aged_vs_fresh_warmup,
            max_pairs=crit.aged_vs_fresh_pairs_max,
            resolved=lambda done: aged_vs_fresh_resolved(done, crit),
            repeats=crit.aged_vs_fresh_repeats,
        )
        self.tier.report.add_series(
            Series(
                self.tier.nodeid,
                "aged vs fresh: alternating pairs (process CPU ms, event span ms)",
                PAIR_COLUMNS,
                tuple(pair_row(p) for p in pairs),
                plot_x="pair",
                plot_y=("ratio",),
            )
        )
        del fresh, fresh_run
        return pairs

    def device_windows(
        self, cfg: TierConfig, timer: DeviceTimer, records: list[StepRecord]
    ) -> dict[str, DeviceWindow] | None:
        """The device times of the timer's windows, recorded per step (None, and a note, when nothing was profiled)."""
        tier = self.tier
        try:
            windows = {
                name: device_window(name, steps, timer.launches, cfg.criteria.device_clip)
                for name, steps in timer.plan.items()
            }
        except ValueError as exc:
            tier.report.notes.append(f"{tier.nodeid}: device time not measured: {exc}")
            return None
        spans = {r.step: r.gpu_time_s for r in records}
        rows = tuple(
            (w.name, step, round(summed * 1e3, 3), round(clipped * 1e3, 3), n, _ms(spans.get(step)))
            for w in windows.values()
            for step, summed, clipped, n in zip(w.steps, w.summed_s, w.clipped_s, w.launches)
        )
        tier.report.add_series(
            Series(
                tier.nodeid,
                "device time of the profiled steps (lora_suite/device_time.py)",
                ("window", "step", "summed launch ms", "clipped launch ms", "launches", "event span ms"),
                rows,
            )
        )
        tier.report.add_series(
            Series(
                tier.nodeid,
                "where a step's time goes: device busy share of the event span",
                (
                    "window",
                    "steps",
                    "event span ms",
                    "summed launch ms",
                    "clipped launch ms",
                    "launches",
                    "device busy share",
                ),
                tuple(time_budget_rows(records, windows)),
            )
        )
        return windows

    def record_verdicts(self, judged: LongRunVerdicts) -> None:
        """A long run's verdicts as checks; a criterion without data fails (it is not silently passed)."""
        tier = self.tier
        tier.report.add_series(
            Series(
                tier.nodeid,
                "leak fit: y = slope*step + intercept",
                ("series", "slope MiB/step", "intercept MiB", "r2", "min MiB", "max MiB"),
                tuple(judged.fits),
            )
        )
        tier.report.notes.extend(f"{tier.nodeid}: {d}" for d in judged.diagnostics)
        for m in judged.missing:
            tier.check(f"measured: {m}", False, "==", True, source="the tier's config judges it; the run gave no data")
        for v in judged.verdicts:
            tier.check(v.name, v.value, v.op, v.threshold, source=v.source, detail=v.detail)
