"""The latest night per GPU type, side by side (issue 59, the nightly over a fleet): for each implementation and tier
the history holds, one column per GPU type, one row per figure, each cell that figure's value in that GPU's latest run
of the implementation and tier, with its threshold and whether it passed; each column names its run, the run's date
and commit, and what the compare gate found regressed in it against the GPU's previous run.

What a cell holds, for GPU ``g``, implementation ``i``, tier ``t`` and figure ``f``: with ``R`` the latest run of the
group ``(g, i, t)`` (the last of ``Group.runs``, which are ordered by time), the point of ``f`` whose run is ``R``, or
nothing. So a GPU with no run of ``(i, t)`` has an empty column, and a figure its latest run lacks has an empty cell:
never an older run's value, nor another GPU's. ``latest_per_gpu`` computes the tables (a pure function of the groups
``history.collect_rows`` builds); ``encode`` packs them for the page (``history_page``), which shows those of the
implementation and tier its filters select.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field

from lora_suite.results.history_data import Group, Point


@dataclass(frozen=True)
class Latest:
    """One GPU type's latest run of an implementation and tier: a column's head."""

    gpu: str
    run: str
    when: dt.datetime
    commit: str
    regression: str = ""  # what the compare gate found against the GPU's previous run; "" when nothing


@dataclass
class SideBySide:
    """One implementation and tier: ``latest[gpu]`` (absent: that GPU has no run of them) and ``cells[figure][gpu]``
    (absent: that GPU's latest run has no such figure), over ``gpus``, every GPU type of the history."""

    implementation: str
    tier: str
    gpus: tuple[str, ...]
    latest: dict[str, Latest] = field(default_factory=dict)
    cells: dict[str, dict[str, Point]] = field(default_factory=dict)  # a figure's point in that GPU's latest run

    @property
    def figures(self) -> list[str]:
        return sorted(self.cells)

    def cell(self, figure: str, gpu: str) -> Point | None:
        return self.cells.get(figure, {}).get(gpu)


def latest_per_gpu(groups: list[Group]) -> list[SideBySide]:
    """One ``SideBySide`` per implementation and tier of ``groups``, ordered by them (see the module docstring)."""
    gpus = tuple(sorted({g.gpu for g in groups}))
    tables: dict[tuple[str, str], SideBySide] = {}
    for g in groups:
        if not g.runs:
            continue
        key = (g.implementation, g.tier)
        table = tables.setdefault(key, SideBySide(*key, gpus=gpus))
        if g.gpu in table.latest:
            raise ValueError(f"two groups of {g.title}: expected one group per GPU, implementation and tier")
        when, run = g.runs[-1]
        table.latest[g.gpu] = Latest(g.gpu, run, when, g.commits.get(run, ""), "; ".join(g.regressions.get(run, [])))
        for name, points in g.figures.items():
            point = next((p for p in reversed(points) if p.run == run), None)
            if point is not None:
                table.cells.setdefault(name, {})[g.gpu] = point
    return [tables[k] for k in sorted(tables)]


def encode(
    tables: list[SideBySide],
    sid: Callable[[str], int],
    run_index: Callable[[str], int],
    num: Callable[[float | None], float | None],
) -> dict:
    """The tables for the page, in columns: ``gpus`` (string ids), and per table its implementation and tier, each
    GPU's latest run (an index into the page's runs; -1: none), its regression text, and per figure one cell per GPU:
    ``[value, passed]``, ``[value, passed, op, threshold]`` where it has a threshold, or 0 where it is empty."""
    gpus = tables[0].gpus if tables else ()
    out = []
    for t in tables:
        heads = [t.latest.get(gpu) for gpu in gpus]
        rows = []
        for name in t.figures:
            cells: list = []
            for gpu in gpus:
                c = t.cell(name, gpu)
                if c is None:
                    cells.append(0)
                else:
                    extra = [c.op, num(c.threshold)] if c.threshold is not None else []
                    cells.append([num(c.value), int(c.passed), *extra])
            rows.append([sid(name), cells])
        out.append(
            {
                "impl": sid(t.implementation),
                "tier": sid(t.tier),
                "runs": [run_index(h.run) if h else -1 for h in heads],
                "reg": [h.regression[:300] if h else "" for h in heads],
                "rows": rows,
            }
        )
    return {"gpus": [sid(g) for g in gpus], "t": out}
