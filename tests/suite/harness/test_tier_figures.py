"""A tier's headline figures (issue 43): declared in its YAML (``suite.figures``), recorded in report.json, kept by
``ledger record``, and gated by ``compare``: a device-clocked figure that moved the worse way beyond its noise
threshold is a regression, a host-clocked one is listed and never fails."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lora_suite.results import compare, ledger
from lora_suite.settings.config import CONFIG_DIR, ConfigError, FigureSpec
from lora_suite.settings.loader import load_tier_config
from lora_suite.settings.registry import registry


def _figure(name="captured step device time", value=50.0, p20=None, p80=None, clock="device", better="lower"):
    return {
        "test": "t",
        "name": name,
        "value": value,
        "unit": "ms",
        "clock": clock,
        "better": better,
        "p20": p20,
        "p80": p80,
        "samples": 1000,
    }


def test_the_tiers_declare_their_headline_figures():
    figures = {name: [f.name for f in t.entry.figures] for name, t in registry().items()}
    assert figures["full"] == [
        "captured step device time",
        "tokens per second (captured step device time)",
        "peak GPU memory",
        "eager step span",
    ]
    assert figures["profile"][:2] == ["profiled step span", "kernel time in the profiled step"]
    assert figures["memory"] == ["peak GPU memory"] and figures["convergence"] == ["loss drop"]
    assert figures["quick"] == ["tier wall time"] and figures["extended"] == ["device time per step"]
    full = load_tier_config(CONFIG_DIR / "full.yaml").suite.figures[0]
    assert full == FigureSpec("captured step device time", "ms", "device", "lower")


@pytest.mark.parametrize(
    "line, message",
    [
        (
            "    - {name: x, unit: ms, clock: wall, better: lower}\n",
            "figures\\[0\\].clock: 'wall'; expected device or host",
        ),
        (
            "    - {name: x, unit: ms, clock: host, better: less}\n",
            "figures\\[0\\].better: 'less'; expected lower or higher",
        ),
        ("    - {name: x, unit: ms, clock: host}\n", "missing required key\\(s\\) \\['better'\\]"),
        (
            "    - {name: x, unit: ms, clock: host, better: lower}\n" * 2,
            "figures: \\['x', 'x'\\]; expected figure names",
        ),
    ],
)
def test_a_bad_figure_declaration_is_refused_at_load_time(tmp_path, line, message):
    text = (CONFIG_DIR / "memory.yaml").read_text()
    start = text.index("  figures:")
    end = text.index("\n", text.index("    - ", start)) + 1
    (tmp_path / "models").symlink_to(CONFIG_DIR / "models")
    (tmp_path / "memory.yaml").write_text(text[:start] + "  figures:\n" + line + text[end:])
    with pytest.raises(ConfigError, match=message):
        load_tier_config(tmp_path / "memory.yaml")


def test_a_figure_the_tier_does_not_declare_is_refused():
    from lora_suite.harness.figures import record_figure
    from lora_suite.harness.report import Figure, RunReport
    from lora_suite.settings.environment import collect_environment

    report = RunReport("r", "full", collect_environment())
    with pytest.raises(ValueError, match="declares no 'step time'"):
        record_figure(report, "t", "full", "step time", 1.0)
    assert record_figure(report, "t", "quick", "peak GPU memory", 1.0, missing_ok=True) is None  # quick has none
    record_figure(report, "t", "full", "captured step device time", 50.0, p20=49.0, p80=51.0, samples=1000)
    assert report.figures == [Figure("t", "captured step device time", 50.0, "ms", "device", "lower", 49.0, 51.0, 1000)]
    with pytest.raises(ValueError, match="already recorded"):
        record_figure(report, "t", "full", "captured step device time", 50.0)
    with pytest.raises(ValueError, match="not a finite number"):
        record_figure(report, "t", "full", "peak GPU memory", float("nan"))


def test_the_extended_tier_figure_is_the_median_device_time_past_the_warm_up():
    from types import SimpleNamespace

    from lora_suite.harness.report import RunReport
    from lora_suite.measure.device_time import DeviceWindow
    from lora_suite.settings.environment import collect_environment
    from lora_suite.tiers.extended.test_extended_tier import step_device_time_figure

    tier = SimpleNamespace(report=RunReport("r", "extended", collect_environment()), nodeid="t")
    step_device_time_figure(tier, None)
    assert tier.report.figures == [] and "no profiled step" in tier.report.notes[0]
    ms = (0.5, 0.02, 0.021, 0.022, 0.019, 0.020)  # warm-up's CUPTI set-up must not count
    windows = {
        "warm-up": DeviceWindow("warm-up", (45,), (ms[0],), (ms[0],), (300,)),
        "early": DeviceWindow("early", (50, 51), (9.0, 9.0), ms[1:3], (300, 300)),
        "late": DeviceWindow("late", (98, 99, 100), (9.0,) * 3, ms[3:], (300,) * 3),
    }
    step_device_time_figure(tier, windows)
    (fig,) = tier.report.figures
    assert (fig.name, fig.unit, fig.clock, fig.samples) == ("device time per step", "ms", "device", 5)
    assert fig.value == pytest.approx(20.0) and fig.p20 < fig.value < fig.p80 < 22.0


@pytest.mark.parametrize(
    "before, after, regression",
    [
        (_figure(value=50.0, p20=49.7, p80=50.3), _figure(value=60.0, p20=59.6, p80=60.4), True),  # +20%: caught
        (_figure(value=50.0, p20=49.7, p80=50.3), _figure(value=52.0, p20=51.7, p80=52.3), None),  # +4%: noise
        (_figure(value=50.0, p20=49.7, p80=50.3), _figure(value=40.0, p20=39.7, p80=40.3), False),  # faster
        (_figure(value=50.0, p20=40.0, p80=60.0), _figure(value=60.0, p20=50.0, p80=70.0), "unresolved"),  # wide
        (_figure(value=900.0, better="higher"), _figure(value=700.0, better="higher"), True),  # tokens/s fell
        (_figure(value=900.0, better="higher"), _figure(value=1100.0, better="higher"), False),
        (_figure(value=50.0, clock="host"), _figure(value=70.0, clock="host"), False),  # host: listed only
    ],
)
def test_compare_judges_device_figures_with_the_noise_rule(before, after, regression):
    changes = compare.compare_figures({"figures": [before]}, {"figures": [after]})
    if regression is None:
        assert changes == []
    elif regression == "unresolved":  # its spread hides a 10% change: listed, never a regression
        (c,) = changes
        assert c.unresolved and not c.regression
    else:
        (c,) = changes
        assert c.kind == "figure" and c.name == before["name"] and c.regression is regression
        assert ("host-clocked" in c.note) == (before["clock"] == "host")


def test_a_device_figure_the_run_lost_is_a_regression_and_a_host_one_is_not():
    base = {"figures": [_figure(), _figure(name="wall time", clock="host")]}
    changes = {c.name: c for c in compare.compare_figures(base, {"figures": []})}
    assert changes["captured step device time"].regression and not changes["wall time"].regression


def test_compare_of_two_run_folders_fails_on_a_slower_figure(tmp_path, capsys):
    report = json.loads(next((Path(__file__).parents[2] / "fixtures" / "runs").rglob("report.json")).read_text())
    report.update(schema_version=4, figures=[_figure(value=50.0, p20=49.8, p80=50.2)])
    for name, value in (("base", 50.0), ("same", 50.5), ("slow", 60.0)):
        (tmp_path / name).mkdir()
        r = dict(report, figures=[_figure(value=value, p20=value - 0.2, p80=value + 0.2)])
        (tmp_path / name / "report.json").write_text(json.dumps(r))
    assert compare.main([str(tmp_path / "base"), str(tmp_path / "same")]) == 0
    assert compare.main([str(tmp_path / "base"), str(tmp_path / "slow")]) == 1
    assert "REGRESSION" in capsys.readouterr().out


def test_the_ledger_keeps_each_figure_with_its_spread_and_clock():
    report = {
        "schema_version": 4,
        "run_id": "r",
        "status": "complete",
        "environment": {},
        "figures": [_figure(p20=49.0, p80=51.0)],
    }
    (row,) = [r for r in ledger.rows_of_report(report, "r") if r["kind"] == "figure"]
    assert (row["check"], row["value"], row["unit"], row["verdict"]) == (
        "captured step device time",
        50.0,
        "ms",
        "measured",
    )
    assert row["detail"] == "p20 49, p80 51, 1000 sample(s), device clock, lower is better"


def test_the_planted_slowdown_reports_itself_as_the_implementation_it_slows():
    from lora_suite.scenarios.full_tier_step_slowdown import SPIN_MS, cupy_slowed

    impl = cupy_slowed()
    assert impl.name == "cupy" and f"{SPIN_MS} ms of GPU spin before each adapted layer" in impl.describe()
    assert dataclasses.is_dataclass(FigureSpec)


def test_the_profile_tier_declares_a_figure_for_every_kernel_family():
    from lora_suite.measure.kernel_profile import FAMILY_ORDER

    declared = {f.name for f in registry()["profile"].entry.figures}
    assert {f"{family} ms per step" for family in FAMILY_ORDER} <= declared
