"""The tier's wall time (``plugin.run_report._report_tier_wall_time``) is a reported figure against its target,
never a failed check: a loaded host or another job on the GPU moves it as much as the code does."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest

from lora_suite.harness.plugin import run_report as P
from lora_suite.harness.plugin.state import SUMMARY_KEY
from lora_suite.harness.report import RunReport
from lora_suite.settings.config import RENAMED
from lora_suite.settings.environment import collect_environment


def _session(tier: str):
    stash = {SUMMARY_KEY: []}
    config = SimpleNamespace(getoption=lambda name: tier, stash=stash)
    return SimpleNamespace(config=config, testscollected=3, exitstatus=0)


def _on_a_gpu():
    return dataclasses.replace(collect_environment(), gpu_name="a GPU")


@pytest.mark.parametrize(("elapsed", "met"), [(5.0, "yes"), (500.0, "no")])
def test_wall_time_is_a_series_and_a_summary_line_never_a_check(elapsed, met):
    session, run = _session("quick"), RunReport("r", "quick", _on_a_gpu())
    start = time.perf_counter() - elapsed
    P._report_tier_wall_time(session, run, start)
    assert run.checks == [] and session.exitstatus == 0
    (series,) = run.series
    ((figure, seconds, target, got_met, source),) = series.rows
    assert target == 30 and got_met == met and abs(seconds - elapsed) < 1 and source == "quick.yaml criteria"
    (line,) = session.config.stash[SUMMARY_KEY]
    assert ("MISSED" in line) == (met == "no") and "not a check" in line
    (fig,) = run.figures  # quick's headline figure: host-clocked, so compare lists it and never fails it
    assert (fig.name, fig.unit, fig.clock, fig.value) == ("tier wall time", "s", "host", seconds)
    P._report_tier_wall_time(session, run, start)  # once per run, however often the hook runs
    assert len(run.figures) == 1


def test_a_tier_without_a_target_reports_nothing():
    session, run = _session("convergence"), RunReport("r", "convergence", _on_a_gpu())
    P._report_tier_wall_time(session, run, time.perf_counter())
    assert run.series == [] and run.checks == []


def test_the_former_budget_key_is_named_in_the_error():
    assert RENAMED["tier_seconds_max"] == "tier_seconds_target"


def test_a_run_that_saw_no_gpu_reports_no_wall_time_figure():
    session = _session("quick")
    run = RunReport("r", "quick", dataclasses.replace(collect_environment(), gpu_name=None))
    P._report_tier_wall_time(session, run, time.perf_counter() - 5.0)
    assert run.series == [] and session.config.stash[SUMMARY_KEY] == []
