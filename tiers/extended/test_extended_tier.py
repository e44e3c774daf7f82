"""extended tier: TinyLlama-1.1B architecture, 500 steps: no leak, loss keeps falling, steady throughput."""

from __future__ import annotations

import pytest

from lora_core.criteria import coefficient_of_variation, is_non_increasing, throughput_drift, windowed_means
from lora_core.memory import fit_slope
from lora_core.report import Series
from lora_core.trainer import train

pytestmark = [pytest.mark.gpu, pytest.mark.extended]


def test_long_run_no_leak_loss_falls_steady_speed(tier):
    cfg = tier.config("extended")
    crit = cfg.criteria
    prepared = tier.prepare(cfg)
    result = train(prepared.model, prepared.batches, cfg.train)
    tier.record_steps("extended", result.records)
    tier.check_backend(prepared.model, cfg.backend)
    after = [r for r in result.records if r.step >= crit.fit_after_step]
    steps = [r.step for r in after]
    fits = []
    for name in ("allocated_mib", "reserved_mib", "nvml_used_mib"):
        values = [getattr(r, name) for r in after]
        if any(v is None for v in values):
            tier.report.notes.append(f"{tier.nodeid}: no NVML readings; {name} slope not fitted")
            continue
        fit = fit_slope(steps, values)
        fits.append((name, fit.slope, fit.intercept, fit.r2, min(values), max(values)))
        tier.check(f"{name} slope after step {crit.fit_after_step}", round(fit.slope, 5), "<=",
                   crit.leak_slope_max_mib_per_step, unit=" MiB/step", source="configs/extended.yaml")
    tier.report.add_series(Series(tier.nodeid, "leak fit: y = slope*step + intercept",
                                  ("series", "slope MiB/step", "intercept MiB", "r2", "min MiB", "max MiB"), tuple(fits)))
    means = windowed_means(result.losses, crit.smooth_window)
    tier.report.add_series(Series(tier.nodeid, f"smoothed loss ({crit.smooth_window}-step window means)",
                                  ("window", "mean loss"), tuple(enumerate(means))))
    tier.check(f"smoothed loss keeps falling (each window <= previous x (1 + {crit.smooth_slack}))",
               is_non_increasing(means, crit.smooth_slack), "==", True, source="configs/extended.yaml smooth_slack",
               detail=f"window means {[round(m, 4) for m in means]}")
    tier.check("last window mean < first window mean", round(means[-1], 4), "<", round(means[0], 4))
    times = [r.step_time_s for r in after]
    tier.check("step time CV after warm-up", round(coefficient_of_variation(times), 4), "<=", crit.step_time_cv_max,
               source="configs/extended.yaml")
    drift = throughput_drift([r.tokens_per_s for r in after], crit.smooth_window)
    tier.check("throughput drift (first vs last window after warm-up)", round(drift, 4), "<=",
               crit.throughput_drift_max, source="configs/extended.yaml")
