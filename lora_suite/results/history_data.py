"""The history's data (``lora_suite.results.history`` collects it, ``history_page`` and ``history.md`` render it): a
figure's point in one run, and a group of runs of one GPU model, LoRA implementation and tier."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field


@dataclass
class Point:
    when: dt.datetime
    run: str  # the run directory's name
    commit: str
    value: float
    threshold: float | None = None
    op: str = ""
    passed: bool = True


@dataclass
class Group:
    gpu: str
    implementation: str
    tier: str
    figures: dict[str, list[Point]] = field(default_factory=dict)
    runs: list[tuple[dt.datetime, str]] = field(default_factory=list)  # time-ordered run ids
    commits: dict[str, str] = field(default_factory=dict)  # run id -> short commit
    verdicts: dict[str, dict[str, bool]] = field(default_factory=dict)  # run id -> check name -> passed
    regressions: dict[str, list[str]] = field(default_factory=dict)  # run name -> what the gate found

    @property
    def title(self) -> str:
        return f"{self.gpu} · {self.implementation} · {self.tier}"
