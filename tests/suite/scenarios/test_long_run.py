"""Replays of recorded extended-tier runs through lora_suite.scenarios.long_run.extended_verdicts, on the CPU.

Fixtures (tests/fixtures/extended_replay/, trimmed report.json files; README there says where each came from):
- h200-2026-11-23-*: unchanged code (86cb0ab) on shared 2xH200 hosts, before issue 18. Four of the seven failed
  the process-CPU-time drift then; that figure is a diagnostic now, and every criterion these runs carry the
  data for must pass. They have no device windows, no aged-vs-fresh pairs and no RSS readings.
- the runs of the issue-18 load acceptance (if present): every criterion must pass.
Every fixture before issue 28 lacks this process's own GPU memory (``process_gpu_mib``): its leak verdict is reported
as missing (a failure in a live run), and the device-wide NVML reading they carry is fitted as context only.
Each fixture is then planted with a 10% drift (or a leak, or stalls) per criterion: that criterion must fail.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import pytest

from lora_suite.measure.criteria import host_time_drift
from lora_suite.scenarios.long_run import extended_verdicts, replay_report
from lora_suite.settings.config import CONFIG_DIR
from lora_suite.settings.loader import load_tier_config

FIXTURES = sorted((Path(__file__).resolve().parents[2] / "fixtures" / "extended_replay").glob("*.json.gz"))
BEFORE_ISSUE_18 = [f for f in FIXTURES if f.name.startswith("h200-2026-11-23-")]
WITH_NEW_SERIES = [f for f in FIXTURES if not f.name.startswith("h200-2026-11-23-")]
SHARED = [f for f in FIXTURES if "-shared-" in f.name]  # issue 28: two suite jobs on one GPU
CFG = load_tier_config(CONFIG_DIR / "extended.yaml")


def _load(path: Path):
    return replay_report(json.loads(gzip.decompress(path.read_bytes())))


def test_the_fixtures_are_there():
    assert len(BEFORE_ISSUE_18) == 7, [f.name for f in FIXTURES]


@pytest.mark.parametrize("path", BEFORE_ISSUE_18, ids=lambda p: p.name.removesuffix(".json.gz"))
def test_runs_before_issue_18_pass_what_they_carry_and_their_old_false_alarm_was_the_host(path):
    records, windows, pairs = _load(path)
    assert windows is None and pairs is None
    judged = extended_verdicts(CFG, records, windows, pairs)
    failed = [(v.name, v.value, v.threshold) for v in judged.verdicts if not v.passed]
    assert not failed, failed
    assert sorted(m.split(":")[0] for m in judged.missing) == [
        "aged vs fresh",
        "device time drift",
        "host_heap_mib slope",
        "process_gpu_mib slope",
    ]
    # The old criterion, replayed: it failed exactly the runs the evidence says it failed (5% + 3 SE bar).
    tokens = CFG.data.batch_size * CFG.data.seq_len
    after = [r.cpu_time_s for r in records if r.step >= CFG.criteria.fit_after_step]
    d = host_time_drift(after, tokens, CFG.criteria.smooth_window)
    assert (d.drift > d.allowed(0.05, 3.0)) == ("-fail" in path.stem), (d.drift, d.allowed(0.05, 3.0))


def _plant(records, field: str, fn):
    return [dataclasses.replace(r, **{field: fn(r.step, getattr(r, field))}) for r in records]


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.name.removesuffix(".json.gz"))
def test_planted_leaks_and_stalls_fail_on_every_fixture(path):
    records, windows, pairs = _load(path)
    leak = _plant(records, "allocated_mib", lambda step, v: v + 0.5 * step)  # 0.5 MiB/step, bar 0.1
    assert not extended_verdicts(CFG, leak, windows, pairs).by_name()["allocated_mib"].passed
    stalls = _plant(records, "gpu_time_s", lambda step, v: v * (3.0 if step % 4 == 0 else 1.0))
    assert (
        not extended_verdicts(CFG, stalls, windows, pairs)
        .by_name()["share of steps slower than 2.5 x the median step (stalls)"]
        .passed
    )
    slower_host = _plant(records, "gpu_time_s", lambda step, v: v * (1.3 if step > 250 else 1.0))
    assert (
        extended_verdicts(CFG, slower_host, windows, pairs)
        .by_name()["share of steps slower than 2.5 x the median step (stalls)"]
        .passed
    )


@pytest.mark.parametrize("path", WITH_NEW_SERIES, ids=lambda p: p.name.removesuffix(".json.gz"))
def test_issue_18_runs_pass_every_criterion(path):
    records, windows, pairs = _load(path)
    judged = extended_verdicts(CFG, records, windows, pairs)
    before_issue_28 = ["process_gpu_mib slope"] if path not in SHARED else []  # no per-process series then
    assert [m.split(":")[0] for m in judged.missing] == before_issue_28
    failed = [(v.name, v.value, v.threshold) for v in judged.verdicts if not v.passed]
    assert not failed, failed


@pytest.mark.parametrize(
    "path", [f for f in WITH_NEW_SERIES if f not in SHARED], ids=lambda p: p.name.removesuffix(".json.gz")
)
def test_a_10_percent_drift_planted_in_a_recorded_run_fails_its_criterion(path):
    records, windows, pairs = _load(path)
    late = windows["late"]
    slower = dict(windows, late=dataclasses.replace(late, clipped_s=tuple(t * 1.10 for t in late.clipped_s)))
    assert (
        not extended_verdicts(CFG, records, slower, pairs)
        .by_name()["device time per step drift (clipped kernel durations)"]
        .passed
    )
    costlier = [dataclasses.replace(p, aged_cpu_s=p.aged_cpu_s * 1.10) for p in pairs]
    assert not extended_verdicts(CFG, records, windows, costlier).by_name()["aged run's step / fresh run's step"].passed
    host_leak = _plant(records, "host_heap_mib", lambda step, v: v + 1.0 * step)
    assert not extended_verdicts(CFG, host_leak, windows, pairs).by_name()["host_heap_mib"].passed


def test_a_neighbour_on_the_gpu_moves_only_the_device_wide_context_and_a_leak_of_this_process_still_fails():
    """Issue 28's false alarm, rebuilt on a recorded run: another job on the same GPU raised NVML's device-wide used
    memory from 9877 to 16317 MiB near step 80 (its console log, an H200 on 2026-11-24) while
    this process's memory stayed flat. The device-wide slope is context; this process's series is judged."""
    records, windows, pairs = _load(WITH_NEW_SERIES[0])
    own = [dataclasses.replace(r, process_gpu_mib=r.reserved_mib + 530.0) for r in records]  # flat, context included
    shared = _plant(own, "nvml_used_mib", lambda step, v: 9877.4 + (6440.0 if step >= 80 else 0.0))
    judged = extended_verdicts(CFG, shared, windows, pairs)
    assert not judged.missing and all(v.passed for v in judged.verdicts), [v for v in judged.verdicts if not v.passed]
    context = {f[0]: f[1] for f in judged.fits}["nvml_used_mib (device-wide, every process: context)"]
    assert context > CFG.criteria.leak_slope_max_mib_per_step  # what failed before issue 28, now never a verdict
    leak = _plant(shared, "process_gpu_mib", lambda step, v: v + 2.0 * step)  # the self-test's 2 MiB/step
    assert not extended_verdicts(CFG, leak, windows, pairs).by_name()["process_gpu_mib"].passed


def test_the_shared_gpu_runs_pass_though_the_device_wide_reading_climbed_and_a_planted_leak_still_fails():
    """Issue 28's sharing proof, replayed (scripts/sharing-acceptance.sh pair on one H100, 3aaf90f): another suite
    job trained on the same GPU, and NVML's device-wide used memory climbed by several MiB per step (the old verdict's
    bar is 0.1), while this process's own memory (NVML per-process) stayed flat. Every verdict passes; a 2 MiB/step
    leak planted in this process's series fails."""
    assert len(SHARED) == 2, [f.name for f in FIXTURES]
    for path in SHARED:
        records, windows, pairs = _load(path)
        judged = extended_verdicts(CFG, records, windows, pairs)
        assert not judged.missing and all(v.passed for v in judged.verdicts)
        fits = {f[0]: f for f in judged.fits}
        device = fits["nvml_used_mib (device-wide, every process: context)"]
        assert device[1] > 10 * CFG.criteria.leak_slope_max_mib_per_step and device[3] < 0.5  # slope, r2
        assert fits["process_gpu_mib"][1] == 0.0 and fits["process_gpu_mib"][4] == fits["process_gpu_mib"][5]
        leak = _plant(records, "process_gpu_mib", lambda step, v: v + 2.0 * step)
        assert not extended_verdicts(CFG, leak, windows, pairs).by_name()["process_gpu_mib"].passed


def test_on_the_shared_runs_a_10_percent_host_slowdown_sits_at_the_aged_vs_fresh_resolution():
    """A finding of the sharing proof, kept as measured: aged-vs-fresh resolves a slowdown of about 9% (its pairs are
    added until 3% + 3 SE <= 9%), so a planted 10% fails only when the run's own median ratio is near 1. On the shared
    job1 run it was 0.9795: the plant measures 1.0775 against an allowance of 1.0848 and passes (missed by 0.007);
    on job2 (1.008) it fails. A 15% slowdown fails on both. The other criteria's plants fail on both (tests above)."""
    outcomes = {}
    for path in SHARED:
        records, windows, pairs = _load(path)
        for plant in (1.10, 1.15):
            costlier = [dataclasses.replace(p, aged_cpu_s=p.aged_cpu_s * plant) for p in pairs]
            v = extended_verdicts(CFG, records, windows, costlier).by_name()["aged run's step / fresh run's step"]
            outcomes[(path.name.split("-shared-")[1][:4], plant)] = v.passed
        slower = dict(
            windows,
            late=dataclasses.replace(windows["late"], clipped_s=tuple(t * 1.10 for t in windows["late"].clipped_s)),
        )
        assert (
            not extended_verdicts(CFG, records, slower, pairs)
            .by_name()["device time per step drift (clipped kernel durations)"]
            .passed
        )
    assert outcomes == {("job1", 1.10): True, ("job1", 1.15): False, ("job2", 1.10): False, ("job2", 1.15): False}


def test_a_one_off_rise_is_not_a_per_step_leak_but_a_leak_in_both_halves_is():
    """The trend test (leak_fit.TrendFit): a one-off 60 MiB rise mid-run moves the whole fit's slope over the bar
    (1.5 x 60 / 450 = 0.2) but only one half; a leak of 0.2 MiB/step moves both halves."""
    records, windows, pairs = _load(WITH_NEW_SERIES[0])
    own = [dataclasses.replace(r, process_gpu_mib=r.reserved_mib + 530.0) for r in records]
    jump = _plant(own, "process_gpu_mib", lambda step, v: v + (60.0 if step >= 275 else 0.0))
    v = extended_verdicts(CFG, jump, windows, pairs).by_name()["process_gpu_mib"]
    assert v.passed and "whole 0.2" in v.detail, v
    leak = _plant(own, "process_gpu_mib", lambda step, v: v + 0.2 * step)
    assert not extended_verdicts(CFG, leak, windows, pairs).by_name()["process_gpu_mib"].passed


def test_a_report_without_the_tier_series_is_named():
    with pytest.raises(ValueError, match="report 'x' has no 'extended: loss' series"):
        replay_report({"run_id": "x", "series": []})
