"""The spread of a figure over rounds and the beyond-the-spread rule (lora_suite.measure.round_spread): a ratio is
called beyond the spread only when every round of one stack beats every round of the other."""

from __future__ import annotations

import statistics

import pytest

from lora_suite.measure import round_spread as RS


def test_a_spread_is_the_median_and_the_least_and_greatest_round():
    assert RS.Spread.of([130.0, 100.0, 120.0]) == RS.Spread(120.0, 100.0, 130.0, 3)
    assert RS.Spread.of([100.0, 110.0]) == RS.Spread(105.0, 100.0, 110.0, 2)
    assert RS.Spread.of([]) is None


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_round_figure_that_is_not_a_positive_number_is_an_error(bad):
    with pytest.raises(ValueError, match="positive finite"):
        RS.Spread.of([100.0, bad])


@pytest.mark.parametrize(
    ("base", "compared", "verdict", "low", "high"),
    [
        # compared's slowest round (150) beats base's fastest (180): faster beyond the spread
        ([180.0, 200.0, 190.0], [140.0, 150.0, 145.0], RS.FASTER, 180 / 150, 200 / 140),
        # base's slowest round (150) beats compared's fastest (160): slower beyond the spread
        ([140.0, 150.0, 145.0], [160.0, 170.0, 200.0], RS.SLOWER, 140 / 200, 150 / 160),
        # a third faster by the medians, but one round of each overlaps: within the spread
        ([150.0, 200.0, 210.0], [140.0, 150.0, 160.0], RS.WITHIN, 150 / 160, 210 / 140),
        # a tie of the slowest and the fastest round is not beyond
        ([150.0, 160.0, 170.0], [130.0, 140.0, 150.0], RS.WITHIN, 1.0, 170 / 130),
        # two rounds a side are a spread
        ([200.0, 210.0], [150.0, 160.0], RS.FASTER, 200 / 160, 210 / 150),
    ],
)
def test_a_speedup_is_judged_against_the_spread_of_both_stacks(base, compared, verdict, low, high):
    s = RS.speedup(base, compared)
    assert s.verdict == verdict
    assert s.low == pytest.approx(low) and s.high == pytest.approx(high)
    assert s.ratio == pytest.approx(statistics.median(base) / statistics.median(compared))
    assert s.low <= s.ratio <= s.high
    assert (s.verdict == RS.FASTER) == (s.low > 1) and (s.verdict == RS.SLOWER) == (s.high < 1)


@pytest.mark.parametrize(
    ("base", "compared"), [([200.0], [100.0]), ([200.0, 210.0, 220.0], [100.0]), ([200.0], [1.0, 2.0])]
)
def test_a_single_round_on_either_side_is_not_judged(base, compared):
    s = RS.speedup(base, compared)
    assert s.verdict == RS.ONE_ROUND == "one round: not judged"
    assert s.ratio is not None and s.low is None and s.high is None
    assert RS.target_verdict(s, 1.2, [10.0], [9.0]) == RS.ONE_ROUND


def test_a_stack_without_rounds_gives_no_ratio_and_no_verdict():
    s = RS.speedup([], [100.0, 110.0])
    assert s == RS.RatioSpread(None, None, None, None)
    assert RS.speedup([100.0, 110.0], []) == s
    assert RS.target_verdict(s, 1.2, [], [9.0]) is None


@pytest.mark.parametrize(
    ("base", "compared", "base_peaks", "peaks", "verdict"),
    [
        # unsloth 240-260 ms, fused 190-200: slowest fused round 200 -> 240 / 200 = 1.2: met, peak lower
        ([240.0, 250.0, 260.0], [190.0, 195.0, 200.0], [21.0, 21.0, 21.0], [18.8, 18.8, 18.9], RS.MET),
        # 1.25x by the medians, but the slowest fused round against the fastest unsloth round is 1.09x
        ([240.0, 250.0, 260.0], [190.0, 200.0, 220.0], [21.0] * 3, [18.8] * 3, "not met: slowest against fastest"),
        # fast enough, but one round's peak above Unsloth's least
        ([240.0, 250.0, 260.0], [190.0, 195.0, 200.0], [21.0, 20.9, 21.0], [18.8, 20.95, 18.8], "not met: peak up to"),
    ],
)
def test_the_speed_target_is_met_only_beyond_the_spread_with_the_peak_no_higher(
    base, compared, base_peaks, peaks, verdict
):
    got = RS.target_verdict(RS.speedup(base, compared), 1.2, base_peaks, peaks)
    assert got.startswith(verdict), got
