"""The leak-slope fit (lora_suite.measure.leak_fit): a least-squares line, and the two-window trend test that tells
a per-step leak from a one-off rise, a sawtooth and a rate that differs between the halves."""

from __future__ import annotations

import pytest

from lora_suite.measure.leak_fit import fit_slope, fit_trend


def test_fit_slope_recovers_a_line_and_flags_bad_input():
    fit = fit_slope(range(50, 100), [3.0 + 0.25 * x for x in range(50, 100)])
    assert fit.slope == pytest.approx(0.25) and fit.intercept == pytest.approx(3.0) and fit.r2 == pytest.approx(1.0)
    flat = fit_slope([1, 2, 3, 4], [5.0, 5.0, 5.0, 5.0])
    assert flat.slope == 0.0 and flat.r2 == 1.0
    with pytest.raises(ValueError, match="two or more"):
        fit_slope([1], [1.0])
    with pytest.raises(ValueError, match="all x are equal"):
        fit_slope([2, 2], [1.0, 3.0])


def test_fit_trend_judges_the_least_slope_of_the_whole_run_and_each_half():
    steps = list(range(50, 500))
    leak = fit_trend(steps, [100.0 + 0.3 * s for s in steps])
    assert leak.sustained == pytest.approx(0.3) and leak.first.n == leak.second.n == 225
    # a one-off rise of 60 MiB: the whole fit's slope is 0.2 (about 1.5 x 60 / 450), each half's 0
    jump = fit_trend(steps, [100.0 + (60.0 if s >= 275 else 0.0) for s in steps])
    assert jump.whole.slope == pytest.approx(0.2, abs=0.001) and jump.sustained == pytest.approx(0.0)
    # a sawtooth (memory taken for 45 steps, then freed, ten times): the whole run does not rise
    saw = fit_trend(steps, [100.0 + 0.5 * ((s - 50) % 45) for s in steps])
    assert saw.sustained == saw.whole.slope and abs(saw.whole.slope) < 0.01
    # granular growth (20 MiB segments every 10 steps = 2 MiB/step) is still a trend in both halves
    stairs = fit_trend(steps, [100.0 + 20 * ((s - 50) // 10) for s in steps])
    assert stairs.sustained == pytest.approx(2.0, rel=0.02)
    assert "2 x the slower half" in stairs.describe()
    # a leak whose rate differs between the halves (a planted 1 MiB/step host leak: 0.25 and 1.08 MiB/step)
    bent = fit_trend(steps, [100.0 + (0.25 * (s - 50) if s < 275 else 56.25 + 1.08 * (s - 275)) for s in steps])
    assert bent.sustained == pytest.approx(0.5, rel=0.01) and bent.whole.slope > 0.6
    with pytest.raises(ValueError, match="four or more"):
        fit_trend([1, 2, 3], [1.0, 2.0, 3.0])
