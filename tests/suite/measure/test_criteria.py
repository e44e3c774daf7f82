"""The arithmetic of the tiers' pass/fail criteria."""

from __future__ import annotations

import math

import pytest

from lora_suite.harness.modules import load_test_module
from lora_suite.measure.criteria import (
    coefficient_of_variation,
    is_non_increasing,
    loss_drop,
    loss_match,
    windowed_means,
)


def test_loss_drop_uses_window_means():
    losses = [10.0] * 10 + [8.0] * 80 + [6.0] * 10
    assert loss_drop(losses, 10) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="need at least one window"):
        loss_drop([1.0, 2.0], 10)


def test_windowed_means_and_monotonicity():
    means = windowed_means([5, 5, 4, 4, 3, 3, 9], 2)  # the incomplete tail window is dropped
    assert means == [5, 4, 3]
    assert (
        is_non_increasing(means) and not is_non_increasing([3.0, 3.05]) and is_non_increasing([3.0, 3.05], slack=0.02)
    )


def test_cv_and_drift():
    assert coefficient_of_variation([1.0, 1.0, 1.0]) == 0.0
    assert coefficient_of_variation([1.0, 3.0]) == pytest.approx(0.5)


def test_loss_match_band_follows_the_control():
    ref = [10.0, 9.0, 8.0, 7.0]
    control = [10.0, 9.0, 8.08, 7.0]  # 1% gap at step 2 -> e = 0.01 from then on
    rows, beyond = loss_match([10.0, 9.02, 8.2, 7.2], ref, control, factor=4, floor=1e-3)
    assert [r[5] for r in rows] == pytest.approx([1e-3, 1e-3, 0.04, 0.04])
    assert beyond == [1]  # 0.22% > the 0.1% floor at step 1; 2.5% < 4% at step 2; 2.9% < 4% at step 3
    _, nan_beyond = loss_match([math.nan], [1.0], [1.0], 4, 1e-3)
    assert nan_beyond == [0]


def test_one_stall_dominates_a_plain_cv_but_not_the_robust_spread():
    """The extended tier's false alarm (issue 8): steady 100 ms steps with one 300 ms stall."""
    from lora_suite.measure.criteria import robust_spread

    times = [100.0 + (i % 5) * 0.5 for i in range(450)]
    times[200] = 300.0
    assert coefficient_of_variation(times) > 0.04  # the plain CV grows with one sample
    assert robust_spread(times) < 0.02


def test_robust_spread_catches_a_slowed_path_on_half_the_steps():
    """A planted defect: every other step takes 30% longer (e.g. a sync plus extra work every other step)."""
    from lora_suite.measure.criteria import robust_spread

    times = [100.0 if i % 2 else 130.0 for i in range(450)]
    assert robust_spread(times) > 0.10


def test_median_drift_and_its_noise_allowance():
    import random

    from lora_suite.measure.criteria import median_drift

    rng = random.Random(0)
    steady = [1000.0 * (1 + rng.gauss(0, 0.05)) for _ in range(450)]
    d = median_drift(steady, 50)
    assert abs(d.drift) < d.allowed(0.0, 3.0)  # steady noise stays inside 3 standard errors
    assert 0.005 < d.noise_se < 0.02  # 1.2533·0.05·√(2/50) ≈ 0.0125
    slowing = [v * (1 - 0.25 * i / 450) for i, v in enumerate(steady)]  # a planted progressive slowdown
    d = median_drift(slowing, 50)
    assert d.drift > d.allowed(0.05, 3.0)


def test_stalls_are_counted_beyond_a_factor_of_the_median_only():
    from lora_suite.measure.criteria import stall_fraction

    jitter = [100.0 * (1 + 0.5 * ((i * 7919) % 13) / 13) for i in range(400)]  # host jitter up to +50%
    assert stall_fraction(jitter, 2.5) == 0.0
    one = jitter.copy()
    one[100] = 300.0 * 3
    assert stall_fraction(one, 2.5) == 1 / 400  # one stall: noise, within a 5% allowance
    quarter = [v * (3.0 if i % 4 == 0 else 1.0) for i, v in enumerate(jitter)]
    assert stall_fraction(quarter, 2.5) > 0.15  # a stall on every 4th step: a defect, far above 5%


def test_stall_verdict_judges_multiples_of_the_step_not_a_host_regime():
    from lora_suite.measure.criteria import stall_verdict

    steps = list(range(50, 500))
    wall = [0.17 if s < 300 else 0.33 for s in steps]  # the loaded host switching regime: 2x, not a stall
    assert stall_verdict(wall, factor=2.5, stall_max=0.05, source="x.yaml").passed
    stalled = [0.17 * (3.0 if s % 4 == 0 else 1.0) for s in steps]
    assert not stall_verdict(stalled, factor=2.5, stall_max=0.05, source="x.yaml").passed


def test_device_time_verdict_passes_jitter_and_fails_a_10_percent_slower_device_step():
    from lora_suite.measure.criteria import device_time_verdict

    early = [0.0370 * (1 + 0.002 * k) for k in (-2, -1, 0, 1, 2)]  # quiet kernels: well under 1% apart
    kw = dict(drift_max=0.05, z=3.0, source="x.yaml")
    assert device_time_verdict(early, [t * 1.01 for t in early], **kw).passed
    v = device_time_verdict(early, [t * 1.10 for t in early], **kw)
    assert not v.passed and v.value == pytest.approx(1 - 1 / 1.1, abs=1e-3), v


def test_aged_vs_fresh_verdict_passes_equal_sides_and_fails_a_10_percent_costlier_aged_side():
    from lora_suite.measure.criteria import aged_vs_fresh_verdict

    jitter = [1 + 0.02 * ((i * 7) % 5 - 2) for i in range(40)]  # deterministic ±4% pair-to-pair noise
    kw = dict(slowdown_max=0.05, z=3.0, source="x.yaml")
    assert aged_vs_fresh_verdict(jitter, **kw).passed
    assert not aged_vs_fresh_verdict([1.10 * j for j in jitter], **kw).passed
    with pytest.raises(ValueError, match="need two or more values, got 1"):
        aged_vs_fresh_verdict([1.0], **kw)


def test_aged_vs_fresh_allowance_does_not_grow_with_the_slowdown_it_judges():
    """On the ratios themselves a spread that scales with the level widened a fourfold slowdown's own allowance
    past fourfold (CI at d7a8575); on their logs the allowance is the same at every level."""
    from lora_suite.measure.criteria import aged_vs_fresh_allowance, aged_vs_fresh_verdict

    noise = [1 + 0.3 * ((i * 7) % 5 - 2) for i in range(24)]  # ±60% pair-to-pair, multiplicative
    kw = dict(slowdown_max=0.05, z=3.0)
    _, quiet, _ = aged_vs_fresh_allowance(noise, **kw)
    _, fourfold, _ = aged_vs_fresh_allowance([4 * r for r in noise], **kw)
    assert quiet == pytest.approx(fourfold)
    assert not aged_vs_fresh_verdict([4 * r for r in noise], source="x", **kw).passed
    with pytest.raises(ValueError, match="ratios must be positive, got \\[0.0"):
        aged_vs_fresh_allowance([0.0, 1.0], **kw)


def test_host_normalised_drift_tells_a_slower_host_from_more_work():
    """A host slowing 30% over the run scales step and probe alike (the normalised drift stays ~0, the raw one
    does not); a step doing 30% more work on a steady host moves only the step (both drifts see it)."""
    from lora_suite.measure.criteria import host_normalised_drift, median_drift

    n, w = 200, 50
    ramp = [1 + 0.3 * i / (n - 1) for i in range(n)]
    jitter = [1 + 0.01 * ((i * 7) % 5 - 2) for i in range(n)]  # deterministic ±2% noise
    probe = [0.0003 * r * j for r, j in zip(ramp, jitter)]
    slower_host = [0.15 * r for r in ramp]
    raw = median_drift([2048 / c for c in slower_host], w)
    assert raw.drift > 0.15
    assert abs(host_normalised_drift(slower_host, probe, 2048, w).drift) < 0.03
    steady_probe = [0.0003 * j for j in jitter]
    more_work = [0.15 * r for r in ramp]
    assert host_normalised_drift(more_work, steady_probe, 2048, w).drift > 0.15
    with pytest.raises(ValueError, match="200 step times but 199 probe times"):
        host_normalised_drift(more_work, steady_probe[:-1], 2048, w)


def test_the_extended_tier_records_host_speed_per_window(tiny_cfg):
    """The extended tier's diagnostic table and note, from step records (the tier itself needs a GPU)."""
    import dataclasses
    from pathlib import Path
    from types import SimpleNamespace

    from lora_suite.engine.step_record import StepRecord
    from lora_suite.harness.report import RunReport
    from lora_suite.settings.environment import collect_environment

    path = Path(__file__).resolve().parents[3] / "tiers" / "extended" / "test_extended_tier.py"
    ext = load_test_module(path, "extended_tier_for_test")
    cfg = dataclasses.replace(
        tiny_cfg, criteria=dataclasses.replace(tiny_cfg.criteria, fit_after_step=2, smooth_window=4)
    )
    records = [
        StepRecord(i, 1.0, 1.0, 1e-3, 1.0, 0.1, 0, 0, 0, None, 0.1, 0.1 * (1 + i / 20), 1e-3 * (1 + i / 20))
        for i in range(14)
    ]
    tier = SimpleNamespace(nodeid="t", report=RunReport("r", "extended", collect_environment()))
    ext.record_host_speed(tier, cfg, records)
    (table,) = tier.report.series
    assert [row[0] for row in table.rows] == [2, 6, 10] and all(row[3] == 100.0 for row in table.rows)
    assert "drift of tokens per unit of host work (diagnostic, not judged): 0.0000" in tier.report.notes[0]
