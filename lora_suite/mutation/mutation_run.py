"""A mutation run's records: what it is asked to do (``Target``: a source file and its module; ``Plan``: the checks'
command, their environment, the fingerprint, workers and timeouts) and what it gives (``MutantResult`` per mutant,
one of ``STATUSES``; ``MutationRun``), with the two scores over them (``lora_suite.mutation.mutate`` says what each
status and score means)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lora_suite.mutation.check_run import Attempt
from lora_suite.mutation.forked_runs import Finished, run_subprocess

TIMEOUT_FACTOR, TIMEOUT_SLACK_S = 3.0, 30.0  # a mutant that runs 3x the source's time and half a minute is stuck
ALONE_FACTOR = 3.0  # a timed-out mutant's second run, alone on the host: 3x the timeout it passed
STATUSES = ("killed", "survived", "equivalent", "error")


@dataclass(frozen=True)
class Target:
    """A source file to mutate and the module name it is imported under."""

    path: Path
    module: str
    label: str  # how the file is named in ids and reports


@dataclass(frozen=True)
class MutantResult:
    id: str
    file: str
    operator: str
    line: int
    diff: str
    status: str  # one of STATUSES
    killed_by: str = ""  # killed: the check, the crash or "timeout"
    reason: str = ""  # survived: what it changes that no check saw; equivalent: the rule that made it so
    seconds: float = 0.0


@dataclass(frozen=True)
class Plan:
    targets: tuple[Target, ...]
    # (report folder, test ids in the order to run them; () for the default selection) -> the argv of one run
    command: Callable[[Path, tuple[str, ...]], list[str]]
    env: dict[str, str]  # the environment of every run (a mutant's two variables are added to it)
    fingerprint: Callable[[dict[str, str]], dict[str, str]]  # environment -> fingerprint (engine/fingerprint.py)
    workers: int = 1
    operators: tuple[str, ...] | None = None  # None: every operator of mutants.operators()
    timeout_factor: float = TIMEOUT_FACTOR
    timeout_slack_s: float = TIMEOUT_SLACK_S
    alone_factor: float = ALONE_FACTOR
    log: Callable[[str], None] = field(default=lambda line: print(line, flush=True))
    runner: Callable[[list[str], dict[str, str], float], Finished] = run_subprocess  # argv, env, timeout -> run


@dataclass(frozen=True)
class MutationRun:
    results: tuple[MutantResult, ...]
    baseline: Attempt
    baseline_report: dict  # the unmutated run's report.json (its environment and implementation)
    timeout_s: float
    wall_s: float

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    def counts(self) -> tuple[int, int, int]:
        """(killed, survived, equivalent); ``count("error")`` for the mutants whose runs judged nothing."""
        killed, survived, equivalent = STATUSES[:3]
        return self.count(killed), self.count(survived), self.count(equivalent)


def score(killed: int, survived: int) -> float | None:
    """killed / (killed + survived); None where no mutant counts (every one equivalent or an error, or none)."""
    if killed < 0 or survived < 0:
        raise ValueError(f"counts must not be negative, got killed={killed}, survived={survived}")
    return killed / (killed + survived) if killed + survived else None


def score_counting_equivalents(killed: int, survived: int, equivalent: int) -> float | None:
    """killed / (killed + survived + equivalent): every equivalent mutant counted as a survivor; None where no
    mutant was killed or survived (a score of equivalents alone would judge nothing the checks did)."""
    if equivalent < 0:
        raise ValueError(f"counts must not be negative, got equivalent={equivalent}")
    return None if score(killed, survived) is None else killed / (killed + survived + equivalent)
