"""A run's per-step loss judged against a reference run within the band a control run sets, as a tier reports it:
the series (reference, run, relative gap, the control's envelope, the tolerance per step) and one check counting the
steps beyond the band. The band's arithmetic is ``lora_suite.measure.criteria.loss_match``:

    |L_run(t) − L_ref(t)| / L_ref(t) ≤ max(factor · e(t), floor),   e(t) = max_{s ≤ t} |L_ctl(s) − L_ref(s)| / L_ref(s)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lora_suite.harness.report import Series
from lora_suite.measure.criteria import loss_match


@dataclass(frozen=True)
class LossBand:
    """What the tier calls the two curves and the check, and where the band's settings come from."""

    title: str  # the series' title
    reference: str  # the reference curve's name ("one GPU")
    run: str  # the judged curve's name ("2 GPUs")
    check: str  # the check's name, before " (first: [...])"
    source: str  # where factor and floor come from


def judge_loss_band(
    tier, band: LossBand, losses: Sequence[float], reference: Sequence[float], control: Sequence[float], factor, floor
) -> list[int]:
    """Add the series and the check to ``tier``'s report; returns the steps beyond the band."""
    rows, beyond = loss_match(list(losses), list(reference), list(control), factor, floor)
    tier.report.add_series(
        Series(
            tier.nodeid,
            band.title,
            ("step", band.reference, band.run, "rel diff", "control envelope e(t)", "tolerance"),
            tuple(rows),
            plot_x="step",
            plot_y=(band.reference, band.run),
        )
    )
    tier.check(f"{band.check} (first: {beyond[:5]})", len(beyond), "==", 0, source=band.source)
    return beyond
