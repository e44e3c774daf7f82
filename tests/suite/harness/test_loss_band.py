"""The loss band as a tier reports it (``lora_suite.harness.loss_band``): one series and one check, the check counting
the steps whose gap leaves max(factor · e(t), floor)."""

from __future__ import annotations

from lora_suite.harness.loss_band import LossBand, judge_loss_band


class _Tier:
    nodeid = "t::x"

    def __init__(self) -> None:
        self.checks: list[tuple] = []
        self.series: list = []
        self.report = self
        self.check = lambda *a, **kw: self.checks.append((*a, kw))

    def add_series(self, s) -> None:
        self.series.append(s)


BAND = LossBand("title", "one GPU", "2 GPUs", "steps beyond", "src")


def test_a_run_inside_the_band_passes_and_one_step_outside_is_named():
    ref, ctl = [2.0, 1.8, 1.6, 1.5], [2.002, 1.802, 1.601, 1.5]  # e(t) = 1e-3 from step 0
    tier = _Tier()
    assert judge_loss_band(tier, BAND, [2.0, 1.801, 1.6, 1.5], ref, ctl, 4, 2**-10) == []
    assert tier.checks[0][:4] == ("steps beyond (first: [])", 0, "==", 0) and tier.checks[0][4]["source"] == "src"
    series = tier.series[0]
    assert series.columns[:3] == ("step", "one GPU", "2 GPUs") and len(series.rows) == 4
    tier = _Tier()
    assert judge_loss_band(tier, BAND, [2.0, 1.8, 1.7, 1.5], ref, ctl, 4, 2**-10) == [2]  # 6% at step 2
    assert tier.checks[0][:2] == ("steps beyond (first: [2])", 1)
