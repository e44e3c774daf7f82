"""Where a captured training step's device time and memory go (issue 57): the step the project's trainer captures in a
CUDA graph (``train.cuda_graph``), set beside the same stack's eager step, so that a captured step slower or heavier
than its own eager step says which kernels and which phase of the run make the difference.

``profile_captured`` drives one ``TrainingRun`` through its eager warm-up steps (on the trainer's side stream), the
capture and its first replay, then times ``steps`` replays (CUDA events around each, ``span_ms``) and profiles
``steps`` more under ``torch.profiler``: the kernels a graph replay runs are recorded with their names, so the
summed kernel time, the time by kernel kind (``step_profile.KERNEL_KINDS``) and by kernel compare one for one with
``step_profile.profile_steps``' eager profile. A profile in which no kernel was recorded is refused (a replay that
ran no kernel, or a profiler that does not see inside graphs, is not a profile of the step).

The memory is read by phase (``MemoryPhases``), each net of what was allocated before the run:

    warm-up peak     max allocated over the eager warm-up steps
    before capture   allocated when the capture begins (optimizer state, what the warm-up left)
    capture peak     max allocated over the capture and first replay (the peak stats reset just before)
    graph pool       bytes the graph's private memory pool holds (segments outside the default pool) and, of them,
                     still allocated after the capture (its outputs: the gradients, the loss)

With the eager step's own peak beside them, ``memory_reading`` says which phase makes the captured run's peak.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch

from lora_suite.scenarios import step_profile as SP

GIB = 2**30
DEFAULT_POOL = (0, 0)


class MemoryPhases(NamedTuple):
    warmup_peak: int  # bytes, net of what was allocated before the run
    before_capture: int
    capture_peak: int
    pool_reserved: int  # the graph's private pool
    pool_allocated: int

    def gib(self) -> dict[str, float]:
        return {k: round(v / GIB, 3) for k, v in self._asdict().items()}


class CapturedProfile(NamedTuple):
    profile: SP.StepProfile  # of the replays: span_ms is a replay's median CUDA-event time
    memory: MemoryPhases
    losses: tuple[float, ...]  # of the profiled replays: finite for the profile to be of a step that computes


def graph_pool_bytes(segments: Iterable[Mapping]) -> tuple[int, int]:
    """(reserved, allocated) bytes of the allocator's segments that belong to a private pool (a CUDA graph's), from
    ``torch.cuda.memory_snapshot()``: segments whose ``segment_pool_id`` is not the default pool's (0, 0)."""
    reserved = allocated = 0
    for seg in segments:
        pool = tuple(seg.get("segment_pool_id", DEFAULT_POOL))
        if pool != DEFAULT_POOL:
            reserved += int(seg["total_size"])
            allocated += int(seg["allocated_size"])
    return reserved, allocated


def replay_steps(capture_at: int, steps: int, total: int) -> tuple[range, range]:
    """The step numbers of the timed and of the profiled replays: after the capture step ``capture_at``, ``steps``
    each, inside the run's ``total`` steps (its schedule and batches); a run too short raises a ValueError naming
    both counts."""
    first = capture_at + 1
    if steps < 1 or first + 2 * steps > total:
        raise ValueError(
            f"steps={steps}: a captured profile needs {2 * max(steps, 1)} replays after the capture at step "
            f"{capture_at}, within the run's {total} steps (train.steps)"
        )
    return range(first, first + steps), range(first + steps, first + 2 * steps)


def profile_captured(prepared, cfg, window, steps: int = 3) -> CapturedProfile:
    """The captured step of ``prepared`` under ``cfg`` (``cfg.train.cuda_graph`` on) through the project's trainer:
    memory by phase (``window``: the run's ``PeakWindow``) and the replays' kernel profile (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    from lora_suite.engine.trainer import TrainingRun

    if not cfg.train.cuda_graph:
        raise ValueError("profile_captured needs train.cuda_graph: true (got false): there is no graph to profile")
    run = TrainingRun(prepared.model, prepared.batches, cfg.train, adapters=prepared.adapters)
    assert run.capture_at is not None  # set by TrainingRun for cfg.train.cuda_graph, checked above
    timed, profiled = replay_steps(run.capture_at, steps, cfg.train.steps)
    with run:
        for step in range(run.capture_at):
            run.step(step, record=False)
        warmup_peak, before = window.peak(), torch.cuda.memory_allocated() - window.carried
        torch.cuda.reset_peak_memory_stats()
        run.step(run.capture_at, record=False)
        capture_peak = torch.cuda.max_memory_allocated() - window.carried
        pool = graph_pool_bytes(torch.cuda.memory_snapshot())
        span = _median_ms([run.step(s, record=False).gpu_time_s for s in timed])
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            recs = [run.step(s, record=False) for s in profiled]
    step_profile = SP.profile_of(prof, steps, span, _median_ms([r.gpu_time_s for r in recs]))
    if step_profile.total_ms <= 0:
        raise RuntimeError(
            f"the profiler recorded no kernel in {steps} replays of the captured step: not a profile of the step"
        )
    memory = MemoryPhases(warmup_peak, before, capture_peak, *pool)
    return CapturedProfile(step_profile, memory, tuple(r.loss for r in recs))


def _median_ms(seconds: list[float | None]) -> float:
    """Median of CUDA-event spans in seconds, as ms."""
    values = [s * 1e3 for s in seconds if s is not None]
    if not values:
        raise RuntimeError("no CUDA-event span was recorded for the replays (not on a GPU?)")
    return statistics.median(values)


def kind_differences(eager: SP.StepProfile, captured: SP.StepProfile) -> list[tuple[str, float, float, float]]:
    """(kind, eager ms, captured ms, captured - eager) per kernel kind of either profile, the largest difference
    first: which kernels make a captured step slower (or faster) than its eager step."""
    kinds = dict.fromkeys([*eager.kinds, *captured.kinds])
    rows = [(k, eager.kinds.get(k, 0.0), captured.kinds.get(k, 0.0)) for k in kinds]
    out = [(k, e, c, c - e) for k, e, c in rows]
    out.sort(key=lambda r: -abs(r[3]))
    return out


def kernel_differences(eager: SP.StepProfile, captured: SP.StepProfile, top: int = 10) -> list[tuple]:
    """(kernel, eager launches, eager ms, captured launches, captured ms, captured - eager) for the ``top`` kernels
    whose time differs most between the two profiles (a kernel only one of them ran counts 0 on the other side)."""
    e = {k.name: k for k in eager.kernels}
    c = {k.name: k for k in captured.kernels}
    rows = []
    for name in dict.fromkeys([*e, *c]):
        ek, ck = e.get(name), c.get(name)
        el, em = (ek.launches, ek.ms) if ek else (0.0, 0.0)
        cl, cm = (ck.launches, ck.ms) if ck else (0.0, 0.0)
        rows.append((name, el, em, cl, cm, cm - em))
    rows.sort(key=lambda r: -abs(r[5]))
    return rows[:top]


def memory_reading(eager_peak: int, phases: MemoryPhases) -> str:
    """Which phase of the captured run makes its peak, against the eager step's ``eager_peak`` (bytes, net): the
    eager warm-up (the trainer's eager step already heavier than the table's), the capture (the graph's pool holding
    more than an eager step needs at once), or neither (the captured run no heavier)."""
    peak = max(phases.warmup_peak, phases.capture_peak)
    extra = peak - eager_peak
    if extra <= 0.01 * max(eager_peak, 1):
        return f"no heavier than the eager step ({peak / GIB:.3f} against {eager_peak / GIB:.3f} GiB)"
    where = "the capture" if phases.capture_peak >= phases.warmup_peak else "the eager warm-up"
    held = phases.before_capture / GIB
    return (
        f"{extra / GIB:.3f} GiB above the eager step, made in {where}: {held:.3f} GiB allocated when the capture "
        f"began, the graph's pool {phases.pool_reserved / GIB:.3f} GiB ({phases.pool_allocated / GIB:.3f} GiB of it "
        "still allocated after the capture)"
    )


def finite_losses(losses: Iterable[float]) -> bool:
    """Whether every loss is finite (and there is at least one)."""
    values = list(losses)
    return bool(values) and all(math.isfinite(v) for v in values)
