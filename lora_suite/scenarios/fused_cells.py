"""The fused table's summary cells (``lora_suite.scenarios.fused_table``), from each stack's rounds: the medians with
the step's spread (its least and greatest round), a stack's speed-up and peak ratio against a base stack's with
whether it is beyond the spread, and the issue 47 target (``UNSLOTH_TARGET`` times Unsloth's speed, peak no higher).
The rule for "beyond the spread" is ``lora_suite.measure.round_spread``'s."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from lora_suite.measure import round_spread as RS

UNSLOTH_TARGET = 1.2  # issue 47: cupy-fused+liger at least 1.2x Unsloth's speed, beyond the spread, peak no higher


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _r3(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _median(figs: Sequence, attr: str) -> float | None:
    return statistics.median(getattr(f, attr) for f in figs) if figs else None


MEDIAN_SPREAD_COLUMNS = ("step ms min", "step ms max", "rounds")


def median_cells(figs: Sequence, parts: Sequence[str]) -> tuple:
    """A "medians of the rounds" row's figures from one stack's rounds (``figs``, non-empty): the median of each of
    ``parts``, then the step's spread (``MEDIAN_SPREAD_COLUMNS``: its least and greatest round, the rounds)."""
    step = RS.Spread.of([f.step_ms for f in figs])
    if step is None:
        raise ValueError("median_cells needs at least one round")
    medians = (round(statistics.median(getattr(f, a) for f in figs), 3) for a in parts)
    return (*medians, round(step.low, 2), round(step.high, 2), step.rounds)


COMPARISON_COLUMNS = ("speed-up", "peak ratio", "speed-up min", "speed-up max", "beyond the spread")


def comparison_cells(base_figs: Sequence, figs: Sequence, attr: str = "step_ms") -> tuple:
    """A comparison row's figures (``COMPARISON_COLUMNS``) of a stack's rounds ``figs`` against a base stack's:
    speed-up = median base ``attr`` / median own, peak ratio = median own peak / median base peak, the speed-up's
    range over the rounds and whether it is beyond the spread (``round_spread.speedup``); None where either
    stack has no rounds."""
    speed = RS.speedup([getattr(f, attr) for f in base_figs], [getattr(f, attr) for f in figs])
    peak = ratio(_median(figs, "peak_gib"), _median(base_figs, "peak_gib"))
    return (_r3(speed.ratio), _r3(peak), _r3(speed.low), _r3(speed.high), speed.verdict)


TARGET_COLUMNS = (*COMPARISON_COLUMNS, f"{UNSLOTH_TARGET}x target, peak no higher")


def target_cells(base_figs: Sequence, figs: Sequence, target: float = UNSLOTH_TARGET) -> tuple:
    """``comparison_cells`` of the step, then whether ``figs``' stack is ``target`` times the base's speed beyond
    the spread with its peak no higher in any round (``round_spread.target_verdict``)."""
    speed = RS.speedup([f.step_ms for f in base_figs], [f.step_ms for f in figs])
    verdict = RS.target_verdict(speed, target, [f.peak_gib for f in base_figs], [f.peak_gib for f in figs])
    return (*comparison_cells(base_figs, figs), verdict)
