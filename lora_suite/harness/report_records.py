"""The records a run report is made of (``lora_suite.harness.report.RunReport`` holds them): checks, headline
figures, not-applicable checks, series and test outcomes; and ``ReportView``, what the renderer
(``report_render``) reads of a report, so that rendering does not import the report that calls it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from lora_suite.settings.environment import Environment


@dataclass(frozen=True)
class Check:
    test: str  # pytest node id
    name: str
    value: Any
    op: str  # one of _OPS
    threshold: Any
    passed: bool
    unit: str = ""
    source: str = ""  # where the threshold came from (config key, derivation)
    detail: str = ""  # diagnosis when it fails (what is beyond, where)


@dataclass(frozen=True)
class Figure:
    """A tier's headline figure (its YAML's ``suite.figures``): a value with its unit, the clock that measured it and,
    where it is a median of samples, their 20th and 80th percentiles (``compare`` reads the spread from them)."""

    test: str
    name: str
    value: float
    unit: str
    clock: str  # device | host
    better: str  # lower | higher
    p20: float | None = None
    p80: float | None = None
    samples: int = 1


@dataclass(frozen=True)
class NotApplicable:
    """A check the implementation under test cannot take by design, with its reason: shown, never dropped."""

    test: str
    name: str  # the check that was not run
    reason: str  # the implementation's own words (LoRAImplementation.not_applicable) or the config's


@dataclass(frozen=True)
class Series:
    test: str
    name: str
    columns: tuple[str, ...]
    rows: tuple[tuple, ...]
    plot_x: str | None = None  # column to plot the others against; None: table only
    plot_y: tuple[str, ...] = ()


@dataclass(frozen=True)
class Outcome:
    test: str
    outcome: str  # passed | failed | skipped | error
    duration_s: float
    reason: str = ""  # the whole skip reason or failure message (an assertion's full text)
    location: str = ""  # file:line of a failure


class ReportView(Protocol):
    """What ``report_render`` reads of a ``RunReport``."""

    run_id: str
    selection: str
    environment: Environment
    status: str
    implementation: dict
    notes: list[str]
    checks: list[Check]
    series: list[Series]
    outcomes: list[Outcome]
    not_applicable: list[NotApplicable]
    figures: list[Figure]

    def summary(self) -> dict[str, int]: ...

    def verdict(self) -> tuple[str, str]: ...
