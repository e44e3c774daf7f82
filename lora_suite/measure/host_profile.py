"""The host's share of a step, for the benchmarks' host profilers (``lora_suite/benchmarks/profile_*_host*.py``):
the step run ``warmup`` times, then timed over ``iters`` calls (wall time per call, the device drained by ``sync``
before and after), then run ``iters`` times more under cProfile, whose table says where the host's time goes."""

from __future__ import annotations

import cProfile
import time
from collections.abc import Callable


def profile_host(
    step: Callable[[], object], *, warmup: int, iters: int, sync: Callable[[], object]
) -> tuple[float, cProfile.Profile]:
    """(seconds of wall time per call of ``step``, the profile of ``iters`` more calls). ``iters`` >= 1."""
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    for _ in range(warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    per_call = (time.perf_counter() - start) / iters
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        step()
    sync()
    prof.disable()
    return per_call, prof
