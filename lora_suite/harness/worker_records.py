"""One run report from a tier spread over pytest-xdist workers (``lora-suite quick --workers N``).

Each worker process keeps its own ``RunReport``; only the controlling process writes ``report.json``. After every
test phase a worker hands the records it added or changed since its last hand-off (checks, not-applicable records,
series, notes) to the controller on the test's report (``user_properties``, which xdist carries), and the
controller merges them before its incremental write: a worker that dies loses nothing it had handed off, and the
report of a killed run still holds what ran. Records are matched by their position in the worker's lists, so a
record the worker rewrites in place (a table gaining a row, a module's not-applicable count growing) replaces the
controller's copy instead of appearing twice.

The environment (GPU, torch, CUDA, versions) travels with a worker's first hand-off: the controller, which imports no
torch, records the packages' versions only (``core.environment.package_environment``) until the first worker's own
``collect_environment`` replaces them.

What exists only once per worker process (the RawKernel variants it launched, its kernels' first-load times) goes
through xdist's ``workeroutput`` when the worker ends; ``merge_variants`` adds the launch counts up.
"""

from __future__ import annotations

import json
from dataclasses import asdict, is_dataclass

from lora_suite.harness.report import Check, NotApplicable, RunReport, Series
from lora_suite.settings.environment import Environment

KEY = "lora_suite_records"  # the user_properties entry and the workeroutput key
FIELDS = ("checks", "not_applicable", "series", "notes")
ENVIRONMENT = "environment"  # sent once, with a worker's first changes


def _plain(record) -> object:
    """A record as JSON-able builtins (what xdist's channel carries): dataclasses as dicts, odd scalars as text."""
    plain = asdict(record) if is_dataclass(record) and not isinstance(record, type) else record  # an instance
    return json.loads(json.dumps(plain, default=str))


def _record(field: str, value):
    if field == "checks":
        return Check(**value)
    if field == "not_applicable":
        return NotApplicable(**value)
    if field == "series":
        rows = tuple(tuple(r) for r in value["rows"])
        return Series(
            value["test"], value["name"], tuple(value["columns"]), rows, value["plot_x"], tuple(value["plot_y"])
        )
    return value  # a note: text


class Outbox:
    """Worker side: what changed in the worker's report since the last call, by list position."""

    def __init__(self) -> None:
        self._sent: dict[str, list] = {f: [] for f in FIELDS}
        self._environment_sent = False

    def changes(self, run: RunReport) -> dict[str, object]:
        out: dict[str, object] = {}
        if not self._environment_sent:
            out[ENVIRONMENT] = _plain(run.environment)
            self._environment_sent = True
        for field in FIELDS:
            current, sent = getattr(run, field), self._sent[field]
            # records are immutable (frozen dataclasses, strings): a rewritten one is a new object in its place
            changed = [(i, _plain(r)) for i, r in enumerate(current) if i >= len(sent) or sent[i] is not r]
            if changed:
                out[field] = changed
            self._sent[field] = list(current)
        return out


class Inbox:
    """Controller side: applies each worker's changes to the controller's report, once per record."""

    def __init__(self) -> None:
        self._where: dict[tuple[str, str, int], int] = {}  # (worker, field, worker's position) -> controller's
        self.environment_from: str | None = None  # the worker whose environment the report holds

    def apply(self, run: RunReport, worker: str, changes: dict) -> None:
        for field, items in changes.items():
            if field == ENVIRONMENT:
                if self.environment_from is None:  # the run's own start time stays the controller's
                    run.environment = Environment(**{**items, "timestamp_utc": run.environment.timestamp_utc})
                    self.environment_from = worker
                continue
            if field not in FIELDS:
                raise ValueError(f"worker {worker} sent records of {field!r}: expected one of {FIELDS}")
            target = getattr(run, field)
            for index, value in items:
                key = (worker, field, int(index))
                if key in self._where:
                    target[self._where[key]] = _record(field, value)
                else:
                    self._where[key] = len(target)
                    target.append(_record(field, value))


def merge_variants(per_worker: list[list]) -> dict[tuple[str, str, str], tuple[int, tuple, tuple]]:
    """[(kernel, dtype, variant, launches, grid, block), ...] of each worker -> one mapping, launches summed, the
    first grid seen kept."""
    merged: dict[tuple[str, str, str], tuple[int, tuple, tuple]] = {}
    for rows in per_worker:
        for kernel, dtype, variant, count, grid, block in rows:
            key = (kernel, dtype, variant)
            seen = merged.get(key)
            merged[key] = (
                count + (seen[0] if seen else 0),
                seen[1] if seen else tuple(grid),
                seen[2] if seen else tuple(block),
            )
    return merged
