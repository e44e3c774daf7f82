"""A figure measured in rounds taken in turns: its median and its spread, and whether a ratio of two such figures
is beyond that spread (issue 47: an eager step of the fused table's sizes swings by a third between runs, so one
round cannot carry a ratio).

Spread: the least and the greatest of the rounds (min-max), at every number of rounds. Not p20-p80: with the 3 to
5 rounds a device-time budget allows, p20 and p80 are the least and greatest rounds or interpolations between two
rounds, and the rule below needs a bound that every round keeps.

Times (lower is better) of a base stack B over its rounds b_1..b_m and of a compared stack A over a_1..a_n:

    speed-up          r     = median(b) / median(a)
    its range         r_min = min(b) / max(a)      (A's slowest round against B's fastest)
                      r_max = max(b) / min(a)      (A's fastest round against B's slowest)

A is *faster beyond the spread* when r_min > 1, i.e. max(a) < min(b): A's slowest round beat B's fastest. A is
*slower beyond the spread* when r_max < 1, i.e. max(b) < min(a). Otherwise the ratio is *within the spread*: some
round of A and some round of B overlap, and the runs do not order the two stacks. A side with a single round has no
spread: "one round: not judged" (r_min and r_max are not given).

A speed target t (A at least t times B's speed) is *met beyond the spread* when r_min >= t, with the peak no higher
in any round: max over A's rounds of its peak <= min over B's rounds of B's peak.

Pure Python (no torch): the CPU tests judge it on made-up rounds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

MIN_ROUNDS = 2  # fewer on a side: no spread, no verdict
ONE_ROUND = "one round: not judged"
FASTER = "faster beyond the spread"
SLOWER = "slower beyond the spread"
WITHIN = "within the spread"
MET = "met"


@dataclass(frozen=True)
class Spread:
    """A figure's median over its rounds, its least and greatest round, and the number of rounds."""

    median: float
    low: float
    high: float
    rounds: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread | None:
        """None for no rounds; a ValueError for a value that is not a positive finite number (a time or a peak of
        zero is a measuring defect, not a figure)."""
        vals = [float(v) for v in values]
        if not vals:
            return None
        bad = [v for v in vals if not (math.isfinite(v) and v > 0)]
        if bad:
            raise ValueError(f"round figures must be positive finite numbers, got {bad} among {vals}")
        return cls(statistics.median(vals), min(vals), max(vals), len(vals))


@dataclass(frozen=True)
class RatioSpread:
    """``ratio`` = median(base) / median(compared); ``low`` = min(base) / max(compared) and ``high`` =
    max(base) / min(compared), None with a single round on either side; ``verdict`` is None without rounds."""

    ratio: float | None
    low: float | None
    high: float | None
    verdict: str | None


def speedup(base: Sequence[float], compared: Sequence[float]) -> RatioSpread:
    """The speed-up of ``compared`` over ``base`` from their rounds' times (lower is better), with its range over
    the rounds and its verdict (module docstring)."""
    b, a = Spread.of(base), Spread.of(compared)
    if b is None or a is None:
        return RatioSpread(None, None, None, None)
    ratio = b.median / a.median
    if min(a.rounds, b.rounds) < MIN_ROUNDS:
        return RatioSpread(ratio, None, None, ONE_ROUND)
    low, high = b.low / a.high, b.high / a.low
    verdict = FASTER if a.high < b.low else SLOWER if b.high < a.low else WITHIN
    return RatioSpread(ratio, low, high, verdict)


def target_verdict(
    speed: RatioSpread, target: float, base_peaks: Sequence[float], compared_peaks: Sequence[float]
) -> str | None:
    """Whether ``compared`` is at least ``target`` times ``base``'s speed beyond the spread, with its peak no higher
    in any round (module docstring): "met", "not met: <why>", ``ONE_ROUND``, or None without rounds."""
    if speed.verdict is None:
        return None
    if speed.low is None:
        return ONE_ROUND
    why = []
    if speed.low < target:
        why.append(f"slowest against fastest round {speed.low:.3f}x < {target}x")
    bp, ap = Spread.of(base_peaks), Spread.of(compared_peaks)
    if bp is None or ap is None:
        why.append("no peak")
    elif ap.high > bp.low:
        why.append(f"peak up to {ap.high:.3f} GiB > {bp.low:.3f} GiB")
    return "not met: " + "; ".join(why) if why else MET
