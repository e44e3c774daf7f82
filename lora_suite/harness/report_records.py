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


MODULE_PREFIX, MODULE_SUFFIX = (
    "every check of the ",
    " test(s) of this module ({feature})",
)  # mark_module_not_applicable


def folded_not_applicable(records: list[NotApplicable]) -> list[NotApplicable]:
    """``records`` with the per-module records of one feature and one reason (``mark_module_not_applicable``, from
    every worker) folded into one, in the place of the first: "every check of the N test(s) of M module(s)
    (<feature>)", its ``test`` the modules' names; and a record whose check and reason repeat an earlier one's (a
    tier-wide change each worker recorded) kept once, its tests joined. One thing the implementation does not have
    is one row of the report, the scorecard and the ledger, however many modules or workers met it."""
    out: list[NotApplicable] = []
    groups: dict[tuple[str, str], tuple[int, int, list[str]]] = {}  # (name or feature, reason) -> (index, tests, where)
    for r in records:
        feature = _module_feature(r.name)
        key = (feature if feature is not None else r.name, r.reason)
        count = int(r.name[len(MODULE_PREFIX) :].split(" ", 1)[0]) if feature is not None else 0
        at, tests, where = groups.get(key, (len(out), 0, []))
        if not where:
            out.append(r)
        groups[key] = (at, tests + count, where + [r.test])
    for (what, reason), (at, tests, where) in groups.items():
        names = ", ".join(dict.fromkeys(sorted(where) if _module_feature(out[at].name) else where))
        name = out[at].name
        if _module_feature(name) is not None:
            name = f"{MODULE_PREFIX}{tests} test(s) of {len(set(where))} module(s) ({what})"
        out[at] = NotApplicable(names, name, reason)
    return out


def _module_feature(name: str) -> str | None:
    """The feature of a per-module record's name (``MODULE_PREFIX`` N ``MODULE_SUFFIX``), else None."""
    head, sep, feature = name.partition(" test(s) of this module (")
    if not (sep and head.startswith(MODULE_PREFIX) and head[len(MODULE_PREFIX) :].isdigit() and feature.endswith(")")):
        return None
    return feature[:-1]
