"""``measure.host_profile``: warm-up, timed and profiled calls in that order, the device drained around the timed
and profiled ones, and the profile holding the step's own calls."""

from __future__ import annotations

import pstats

import pytest

from lora_suite.measure.host_profile import profile_host


def test_the_calls_are_warmed_timed_then_profiled():
    events = []

    def work():
        events.append("step")

    per_call, prof = profile_host(work, warmup=2, iters=3, sync=lambda: events.append("sync"))
    assert events == ["step"] * 2 + ["sync"] + ["step"] * 3 + ["sync"] + ["step"] * 3 + ["sync"]
    assert per_call >= 0
    calls = {fn[2]: stat[0] for fn, stat in pstats.Stats(prof).stats.items()}  # type: ignore[attr-defined]  # undocumented: typeshed omits it
    assert calls["work"] == 3


def test_no_timed_call_is_an_error():
    with pytest.raises(ValueError, match="iters must be >= 1, got 0"):
        profile_host(lambda: None, warmup=0, iters=0, sync=lambda: None)
