"""The Hypothesis settings the suite's drawn checks run under (the layer properties, the adapter lifecycle), and the
one way a drawn check is run and its shrunk failure kept for the report (``run_drawn``).

Profiles, chosen by ``LORA_SUITE_HYPOTHESIS_PROFILE`` (default ``ci``):

- ``ci``: derandomised (the same cases on every machine and every night: a verdict that changes means the code
  changed), few examples; the CPU self-tests and the quick tier run it;
- ``nightly``: random cases (a new seed each run, printed with a failure), many more examples and longer lifecycles;
  the nightly workflow sets it.

Neither keeps an example database (a runner's leftover file must not change what a run judges) nor a deadline
(a GPU shared with another job is slow, not wrong).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NoReturn, TypeVar

from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

Case = TypeVar("Case")  # what a strategy draws and a property's body takes
ENV = "LORA_SUITE_HYPOTHESIS_PROFILE"
# name -> (derandomize, max_examples, stateful_step_count)
PROFILES = {"ci": (True, 12, 12), "nightly": (False, 200, 25)}


def profile_name() -> str:
    """The profile ``LORA_SUITE_HYPOTHESIS_PROFILE`` names (``ci`` when unset); anything else is refused by name."""
    name = os.environ.get(ENV, "").strip() or "ci"
    if name not in PROFILES:
        raise ValueError(f"{ENV}={name!r} is not a profile; expected one of {sorted(PROFILES)}")
    return name


def suite_settings(*, scale: float = 1.0) -> settings:
    """The settings of the chosen profile; ``scale`` multiplies its example count (a costly check runs fewer)."""
    derandomize, examples, steps = PROFILES[profile_name()]
    return settings(
        derandomize=derandomize,
        max_examples=max(1, int(examples * scale)),
        stateful_step_count=steps,
        deadline=None,
        database=None,
        print_blob=True,
        report_multiple_bugs=False,  # one minimal failure, not a group of them
        phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


RANGE_MARGIN = 16.0  # a case is in range when what it sums stays 16x below the dtype's largest finite value


def below_range(values: Iterable[float], dtype) -> bool:
    """Whether every magnitude in ``values`` stays ``RANGE_MARGIN`` below ``dtype``'s largest finite value."""
    import torch

    top = float(torch.finfo(dtype).max) / RANGE_MARGIN
    return all(v < top for v in values)


def outside_the_contract(why: str) -> NoReturn:
    """A drawn case (or rule sequence) whose exact values leave its dtype's range: rejected as a case (Hypothesis'
    ``assume``), never judged; outside a Hypothesis run (a printed case rerun by hand) a ValueError saying ``why``."""
    if currently_in_test_context():
        assume(False)
    raise ValueError(f"{why} (by {RANGE_MARGIN}x margin): not a case to judge")


class Falsified(AssertionError):
    """Raised by a drawn check's body: the case broke the property; the message says which tensors and by how much."""


@dataclass
class DrawnRun:
    """What ``run_drawn`` saw: the cases run (every draw, the shrinking ones included), the minimal failing case and
    why it failed (None when every case held), and Hypothesis' own lines to reproduce it."""

    cases: int
    failure: str | None = None
    reproduce: str = ""
    tally: dict[str, int] = field(default_factory=dict)  # what the caller counted over the cases (coverage)


def run_drawn(
    body: Callable[[Case], None],
    strategy: st.SearchStrategy[Case],
    *,
    scale: float = 1.0,
    explicit: Iterable[Case] = (),
) -> DrawnRun:
    """Run ``body(case)`` on cases drawn from ``strategy`` (``explicit`` cases first, as ``@example``), under the
    profile's settings. ``body`` raises ``Falsified`` when a case breaks the property; Hypothesis then shrinks the case
    to a minimal one, whose message and the lines that reproduce it (``@reproduce_failure`` and the falsifying example)
    are returned. Any other exception is the implementation's crash: shrunk the same way and reported as a failure
    naming its type (a crash on a legal case is a defect of the stack, not of the check)."""
    seen = [0]

    def counted(case):  # a case ``assume`` rejects is not counted: it was not judged
        try:
            body(case)
        except Falsified:
            seen[0] += 1
            raise
        seen[0] += 1

    test = given(strategy)(counted)
    for case in reversed(tuple(explicit)):
        test = example(case)(test)
    test = suite_settings(scale=scale)(test)
    try:
        test()
    except Exception as exc:  # noqa: BLE001  (a failing case: Hypothesis re-raises the minimal one's exception)
        notes = "\n".join(getattr(exc, "__notes__", ()))
        why = str(exc) if isinstance(exc, Falsified) else f"{type(exc).__name__}: {exc}"
        return DrawnRun(seen[0], why, notes)
    return DrawnRun(seen[0])
