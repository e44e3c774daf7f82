"""The tiers' own steps on a ``Tier`` (``lora_suite/harness/memory_tier.py``, ``lora_suite/harness/extended_tier.py``),
on the CPU with a stand-in for the session's tier: which checks, notes and series they record."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from lora_suite.harness.extended_tier import ExtendedTier, pair_row
from lora_suite.harness.memory_tier import MemoryTier
from lora_suite.measure.criteria import Verdict
from lora_suite.measure.device_time import DeviceTimer
from lora_suite.measure.memory import GIB
from lora_suite.scenarios.aged_vs_fresh import Pair
from lora_suite.scenarios.long_run import LongRunVerdicts
from lora_suite.settings.config import CONFIG_DIR
from lora_suite.settings.loader import load_tier_config


class Checks:
    """A stand-in for the ``check`` fixture: what was checked, and what was marked not applicable."""

    def __init__(self):
        self.made: list[tuple] = []
        self.not_applicable_: list[tuple[str, str]] = []

    def __call__(self, name, value, op, threshold, **kw):
        self.made.append((name, value, op, threshold))

    def not_applicable(self, name: str, reason: str):
        self.not_applicable_.append((name, reason))


def stand_in(configured_quantize=None, not_applicable=None):
    report = SimpleNamespace(notes=[], series=[], figures=[])
    report.add_series, report.figure = report.series.append, report.figures.append
    impl = SimpleNamespace(reason_not_applicable=lambda feature: (not_applicable or {}).get(feature))
    return SimpleNamespace(
        report=report, check=Checks(), nodeid="t", impl=impl, configured_quantize=configured_quantize
    )


def test_the_peak_is_judged_against_the_budget_of_the_base_the_run_used():
    cfg = load_tier_config(CONFIG_DIR / "memory.yaml")
    crit = cfg.criteria
    tier = stand_in(configured_quantize="nf4")
    MemoryTier(tier).check_memory(cfg, 1 * GIB, (2 * GIB, {}))
    assert tier.check.made == [
        ("peak allocated VRAM", 1.0, "<=", crit.vram_budget_gib),
        (f"QLoRA peak < 16-bit-base peak (same configuration, {cfg.train.steps} steps)", 1.0, "<", 2.0),
    ]
    assert [f.name for f in tier.report.figures] == ["peak GPU memory"]
    on_16bit = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, quantize=None))
    tier = stand_in(configured_quantize="nf4", not_applicable={"nf4_base": "no NF4 here"})
    MemoryTier(tier).check_memory(on_16bit, 1 * GIB, None)
    assert tier.check.made == [("peak allocated VRAM", 1.0, "<=", crit.vram_budget_16bit_base_gib)]
    assert tier.check.not_applicable_ == [("QLoRA peak < 16-bit-base peak (same configuration)", "no NF4 here")]


def test_the_estimate_is_judged_on_both_sides():
    cfg = load_tier_config(CONFIG_DIR / "memory.yaml")
    bar = cfg.criteria.memory_estimate_error_max
    assert bar is not None  # configs/memory.yaml sets it
    tier = stand_in()
    tier.estimate = SimpleNamespace(allocated_peak=2 * GIB, gib=lambda: {"allocated_peak": 2.0})
    MemoryTier(tier).check_peak_vs_estimate(cfg, int(1.6 * GIB))
    assert [c[1:] for c in tier.check.made] == [(0.25, "<=", bar), (0.25, ">=", -bar)]


def test_a_16bit_base_comparison_the_implementation_cannot_run_is_not_applicable():
    cfg = load_tier_config(CONFIG_DIR / "memory.yaml")
    tier = stand_in(not_applicable={"bf16_base": "always NF4"})
    assert MemoryTier(tier).bf16_baseline(cfg) is None
    assert tier.check.not_applicable_ == [("QLoRA peak < 16-bit-base peak (same configuration)", "always NF4")]
    no_nf4 = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, quantize=None))
    assert MemoryTier(stand_in()).bf16_baseline(no_nf4) is None


def test_a_long_run_criterion_without_data_fails_and_each_verdict_is_a_check():
    tier = stand_in()
    judged = LongRunVerdicts(
        verdicts=[Verdict("loss drop", 0.5, ">=", 0.1, source="yaml")],
        fits=[("allocated", 0.0, 1.0, 0.5, 1.0, 1.0)],
        missing=["device time drift"],
        diagnostics=["a diagnostic"],
    )
    ExtendedTier(tier).record_verdicts(judged)
    assert tier.check.made == [("measured: device time drift", False, "==", True), ("loss drop", 0.5, ">=", 0.1)]
    assert tier.report.notes == ["t: a diagnostic"]
    assert [s.name for s in tier.report.series] == ["leak fit: y = slope*step + intercept"]


def test_no_profiled_step_is_a_note_not_a_window():
    cfg = load_tier_config(CONFIG_DIR / "extended.yaml")
    tier = stand_in()
    assert ExtendedTier(tier).device_windows(cfg, DeviceTimer.for_windows(10, 100, 5), []) is None
    assert len(tier.report.notes) == 1 and "device time not measured" in tier.report.notes[0]


def test_an_aged_vs_fresh_pair_row_in_milliseconds():
    pair = Pair(0, 500, 20, True, 0.012, 0.010, None, 0.0105)
    assert pair_row(pair) == (0, 500, 20, True, 12.0, 10.0, 1.2, None, 10.5)
