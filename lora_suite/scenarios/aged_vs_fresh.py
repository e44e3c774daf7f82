"""Aged vs fresh: does a run's own accumulated state make its steps cost more host time?

At the end of a long run (the aged run), a fresh run is built from the same config and seed (model, adapters,
optimizer, trainer state). After ``warmup`` unpaired steps of the fresh run (allocations, first-use caches), the
two take turns for ``pairs`` pairs. A pair is ``repeats`` rounds of one step of each, aged first and fresh first
in turn (so that neither side always follows the other), and its ratio is that of the least process CPU time
on each side,

    ρ_i = min_r c_aged,i,r / min_r c_fresh,i,r

since preemption only ever adds to a step's process CPU time: on a virtual machine the hypervisor's time slices
show in it (a plain Python loop on a CI host: 13 of 300 runs over 3x the median, up to 0.38 s), and a loaded
one hit half of the 45 ms steps of a CPU test, where a pair of single steps was then at the host's mercy.

Noise model: the two steps of a pair run within a fraction of a second of each other in the same process, so
the host's speed at that moment (clock, neighbours' load on shared cores and caches, a GPU neighbour) moves both
alike and cancels in ρ_i; what is left is step-to-step jitter, which the median over the pairs and its standard
error on the log scale (criteria.aged_vs_fresh_allowance) absorb; a noisy host gets more pairs (``run_pairs``).
State that grows with the run (a history that every step walks, a cache that never empties, per-step Python
objects kept alive) costs only the aged side. criteria.aged_vs_fresh_verdict judges median(ρ) − 1 against an
allowance.

Limitation: state that grows process-wide (a module-level cache shared by both runs) costs both sides alike
and cancels too; if it holds memory, the resident-set-size slope sees it, and if it moves GPU work, the
device-time drift does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lora_suite.engine.step_record import StepRecord
from lora_suite.engine.trainer import TrainingRun, frozen_heap


@dataclass(frozen=True)
class Pair:
    index: int
    aged_step: int
    fresh_step: int
    aged_first: bool
    aged_cpu_s: float  # least over the pair's rounds (module docstring)
    fresh_cpu_s: float
    aged_span_s: float | None  # CUDA-event spans, least over the rounds: diagnostic (preemption moves them)
    fresh_span_s: float | None

    @property
    def ratio(self) -> float:
        return self.aged_cpu_s / self.fresh_cpu_s


def least_cpu_s(records: list[StepRecord]) -> float:
    """The least process CPU time of the steps (TrainingRun.step measures it on every step it runs)."""
    times = [r.cpu_time_s for r in records if r.cpu_time_s is not None]
    assert len(times) == len(records), f"a step without its CPU time: {[r.step for r in records]}"
    return min(times)


def run_pairs(
    aged: TrainingRun,
    fresh: TrainingRun,
    *,
    aged_start: int,
    pairs: int,
    warmup: int,
    max_pairs: int | None = None,
    resolved: Callable[[list[Pair]], bool] | None = None,
    block: int = 20,
    repeats: int = 1,
) -> list[Pair]:
    """Alternate steps of the two runs (module docstring); the aged run goes on from step ``aged_start``.

    ``pairs`` are always run; then, while ``resolved(pairs)`` is false and fewer than ``max_pairs`` ran, ``block``
    more (a noisy host needs more pairs for the same resolution: the standard error falls as 1/√n; stopping on
    the standard error, never on the estimate, leaves the verdict's false-alarm rate alone). The steps are not
    appended to either run's records (the aged run's per-step series stays the tier's run). Pair i runs
    ``repeats`` rounds: aged steps aged_start + i·repeats + r and fresh steps warmup + i·repeats + r.
    """
    max_pairs = pairs if max_pairs is None else max_pairs
    if pairs < 2 or warmup < 0 or max_pairs < pairs or block < 2 or repeats < 1:
        raise ValueError(
            f"aged vs fresh needs pairs >= 2, warmup >= 0, max_pairs >= pairs, block >= 2 and repeats >= 1, got "
            f"pairs={pairs}, warmup={warmup}, max_pairs={max_pairs}, block={block}, repeats={repeats}"
        )
    out: list[Pair] = []

    def least(values):
        return None if any(v is None for v in values) else min(values)

    def one(i: int) -> Pair:
        a_first, f_first = aged_start + i * repeats, warmup + i * repeats
        aged_recs, fresh_recs = [], []
        for r in range(repeats):
            if (i * repeats + r) % 2 == 0:
                aged_recs.append(aged.step(a_first + r, record=False))
                fresh_recs.append(fresh.step(f_first + r, record=False))
            else:
                fresh_recs.append(fresh.step(f_first + r, record=False))
                aged_recs.append(aged.step(a_first + r, record=False))
        return Pair(
            i,
            a_first,
            f_first,
            (i * repeats) % 2 == 0,
            least_cpu_s(aged_recs),
            least_cpu_s(fresh_recs),
            least([a.gpu_time_s for a in aged_recs]),
            least([f.gpu_time_s for f in fresh_recs]),
        )

    with aged, fresh, frozen_heap():
        for step in range(warmup):
            fresh.step(step, record=False)
        out += [one(i) for i in range(pairs)]
        while len(out) < max_pairs and resolved is not None and not resolved(out):
            out += [one(i) for i in range(len(out), min(len(out) + block, max_pairs))]
    return out
