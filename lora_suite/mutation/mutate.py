"""Mutation testing of a LoRA stack: each mutant of its source (``mutants``) through the fast checks, classified.

    killed      a check failed (named), a test crashed (the test and its exception), or the run passed its timeout
    survived    every check passed; its diff is reported, and what it changes (the fingerprint parts that differ)
    equivalent  it survived and its fingerprint (``lora_suite.mutation.equivalence``) is bitwise the source's: outputs,
                gradients, saved files and the rest on a probe grid; no check could tell it apart. Only where the
                source's fingerprint runs the mutated line: where it does not, the sameness proves nothing and the
                mutant stays a survivor (a refusal no check triggers, code the stack never calls); nor for an
                operator whose class the fingerprint cannot see (``mutants.fingerprint_blind``: a bf16 rounding of
                a value the probe holds exactly, a cache of a layer called once, a NaN the probe never feeds)
    error       the run judged nothing (``check_run``: no report.json, no test ran, a crash outside the code under
                test), twice (the second run alone on the host): never a kill, left out of both scores, listed

Two scores, both printed and recorded: ``score`` = killed / (killed + survived), the equivalent mutants left out;
``score_counting_equivalents`` = killed / (killed + survived + equivalent), every equivalent counted as a survivor
(a bound from below: an "equivalent" mutant may still be a defect no probe of the fingerprint reaches). Neither
exists where no mutant was killed or survived (every one an error or equivalent): then ``mutate`` fails.

The unmutated source runs first and must pass (a score on a stack that fails its checks means nothing); its time
sets each mutant's timeout (``mutation_run.TIMEOUT_FACTOR`` x it + ``TIMEOUT_SLACK_S`` by default). That run also records which
lines of the source the checks execute (``lora_suite.mutation.line_trace``): a mutant on a line they never run cannot
change their outcome, so it is not run, and goes straight to the fingerprint (equivalent, or a survivor "not run by
the checks"). The trace also names the tests that ran each line: a mutant's run starts with those, then the rest in
the source run's order, so the check that kills it comes early (the checks stop at the first failure); every test
still runs for a mutant that survives, so the order changes the time and never the verdict. A mutant that passes its timeout while others share the host is run again alone, with
``ALONE_FACTOR`` times the timeout, before "timeout" counts as its kill: a slow host must not kill mutants. Mutants run in processes of their own,
``workers`` at a time; a mutant's file replaces its module through ``lora_suite.mutation.mutant_source``. What runs per
mutant is a command (``Plan.command``: the CLI gives pytest on the quick tier's fast tests; the CPU self-tests a
stand-in) whose run writes a ``report.json`` in the run report's format; ``Plan.runner`` starts it (the CLI: a child
of a fork server that has imported torch and the stack's packages once, ``forked_runs``). The source's own run is
always a fresh process (its line trace is written at exit).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from lora_suite.mutation.check_run import Attempt, run_checks
from lora_suite.mutation.equivalence import judge_survivors
from lora_suite.mutation.line_trace import executed, statement_starts, tests_of, trace_env
from lora_suite.mutation.mutant_source import mutant_env
from lora_suite.mutation.mutants import Mutant, mutants_of, read_source
from lora_suite.mutation.mutation_run import MutantResult, MutationRun, Plan, Target

BASELINE_TIMEOUT_S = 1800.0  # the unmutated source's own run: half an hour means something is wrong


class BaselineFailed(RuntimeError):
    """The unmutated source does not pass the checks: there is nothing to measure mutants against."""


def execute(plan: Plan, workdir: Path) -> MutationRun:
    """The whole run: the source, then every mutant, then the fingerprints of the survivors."""
    start = time.perf_counter()
    mutants = _all_mutants(plan)
    plan.log(f"mutate: {len(mutants)} mutants of {', '.join(t.label for t in plan.targets)}; the source first")
    base_dir = workdir / "source"
    base_dir.mkdir(parents=True, exist_ok=True)
    trace_out = base_dir / "executed-lines.json"
    baseline, baseline_report = _source_run(plan, base_dir, trace_out)
    timeout = plan.timeout_factor * baseline.seconds + plan.timeout_slack_s
    plan.log(f"mutate: the source passed in {baseline.seconds:.1f} s; each mutant's timeout {timeout:.0f} s")
    trace = _trace(plan, trace_out)
    starts = _starts(plan.targets)  # each line's statement, for the trace's questions below
    not_run = _not_run(plan, mutants, trace, starts)
    plan.log(f"mutate: {len(not_run)} mutant(s) on lines the checks never execute: fingerprint only")
    order = _orders(plan, mutants, trace, baseline_report, starts)
    runner = _MutantRunner(plan, workdir, mutants, not_run, order, timeout)
    with ThreadPoolExecutor(max_workers=max(1, plan.workers)) as pool:
        results = list(pool.map(runner.one, enumerate(mutants)))
        timed_out = [n for n, r in enumerate(results) if r.killed_by.startswith("timeout") or r.status == "error"]
        if timed_out:
            plan.log(f"mutate: {len(timed_out)} mutant(s) timed out or judged nothing beside the others: again, alone")
        for n in timed_out:
            results[n] = runner.alone(n, results[n])
        results = judge_survivors(plan, workdir, mutants, results, pool, starts)
    return MutationRun(tuple(results), baseline, baseline_report, timeout, time.perf_counter() - start)


def _all_mutants(plan: Plan) -> list[tuple[Target, Mutant]]:
    """Every mutant of every target by the plan's operators, with its target, in the targets' order."""
    mutants: list[tuple[Target, Mutant]] = []
    for t in plan.targets:
        mutants += [(t, m) for m in mutants_of(read_source(t.path), t.label, plan.operators)]
    return mutants


def _source_run(plan: Plan, base_dir: Path, trace_out: Path) -> tuple[Attempt, dict]:
    """The unmutated source's run of the checks in ``base_dir``, tracing the lines they execute into
    ``trace_out``; its attempt and report.json. ``BaselineFailed`` unless it passed and judged at least one test."""
    base_env = {**plan.env, **trace_env([t.path for t in plan.targets], trace_out)}
    baseline = run_checks(plan.command(base_dir, ()), base_env, base_dir, BASELINE_TIMEOUT_S)
    if not baseline.passed or baseline.judged == 0:
        why = baseline.killed_by or f"the checks judged nothing: {baseline.error or 'no test passed'}"
        raise BaselineFailed(
            f"the unmutated source does not pass the checks ({why}); a mutation score on a failing stack means "
            f"nothing: fix it first (its run: {base_dir})"
        )
    return baseline, json.loads((base_dir / "report.json").read_text())


@dataclass
class _MutantRunner:
    """Runs the checks on one mutant at a time, each in its own folder (``<workdir>/mutant-<n>``): ``one`` as the
    thread pool hands it the mutants, ``alone`` for a mutant that timed out beside the others."""

    plan: Plan
    workdir: Path
    mutants: list[tuple[Target, Mutant]]
    not_run: set[int]  # mutants on lines the checks never execute: not run, judged by the fingerprint only
    order: dict[int, tuple[str, ...]]  # mutant -> the tests to run first
    timeout: float
    done: int = 0  # mutants finished, for the progress lines

    def one(self, item: tuple[int, tuple[Target, Mutant]]) -> MutantResult:
        """Mutant ``n``'s file written in its folder and the checks run on it (unless its line is never run):
        survived when they pass, an error where they judged nothing, else killed by what failed."""
        plan = self.plan
        n, (target, m) = item
        folder = self.workdir / f"mutant-{n:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / target.path.name
        path.write_text(m.source)
        env = {**plan.env, **mutant_env(target.module, path)}
        if n in self.not_run:
            a = Attempt(True, "", 0.0)
        else:
            a = run_checks(
                plan.command(folder / "report", self.order.get(n, ())),
                env,
                folder / "report",
                self.timeout,
                plan.runner,
                path,
            )
        status = _status(a)
        self.done += 1
        plan.log(f"[{self.done}/{len(self.mutants)}] {status:<8} {m.id}  {a.killed_by or a.error}".rstrip())
        note = f"not run: the checks never execute line {m.line}" if n in self.not_run else a.error
        return MutantResult(m.id, m.file, m.operator, m.line, m.diff, status, a.killed_by, note, round(a.seconds, 2))

    def alone(self, n: int, r: MutantResult) -> MutantResult:
        """A mutant that timed out or judged nothing beside the others, run again with nothing else running
        (``alone_factor`` times the timeout); its seconds are both runs'."""
        plan = self.plan
        target = self.mutants[n][0]
        folder = self.workdir / f"mutant-{n:04d}"
        path = folder / target.path.name
        env = {**plan.env, **mutant_env(target.module, path)}
        command = plan.command(folder / "alone", self.order.get(n, ()))
        a = run_checks(command, env, folder / "alone", plan.alone_factor * self.timeout, plan.runner, path)
        why = a.killed_by.replace(")", ", run alone)") if a.killed_by.startswith("timeout") else a.killed_by
        reason = f"{a.error} (twice: beside the others, then alone)" if a.error else ""
        plan.log(f"[alone] {_status(a):<8} {r.id}  {why or reason}".rstrip())
        seconds = round(r.seconds + a.seconds, 2)
        return dataclasses.replace(r, status=_status(a), killed_by=why, reason=reason, seconds=seconds)


def _status(a: Attempt) -> str:
    return "error" if a.error else "survived" if a.passed else "killed"


def _starts(targets: tuple[Target, ...]) -> dict[str, dict[int, int]]:
    """Each target's resolved path -> ``line_trace.statement_starts`` of its source."""
    return {str(t.path.resolve()): statement_starts(read_source(t.path)) for t in targets}


def _trace(plan: Plan, trace_out: Path) -> dict | None:
    """The source run's line trace (``line_trace``); None where it left none."""
    try:
        return json.loads(trace_out.read_text())
    except (OSError, ValueError):
        plan.log("mutate: the source's run left no line trace: every mutant runs the checks, in their own order")
        return None


def _not_run(plan: Plan, mutants, trace: dict | None, starts: dict[str, dict[int, int]]) -> set[int]:
    """The indices of the mutants whose line the source's run never executed; none where the run left no trace, or
    one that may have missed threads (``line_trace``: before Python 3.12): then every mutant runs."""
    if trace is None:
        return set()
    if not trace.get("every_thread"):
        plan.log("mutate: the line trace could not see every thread (Python < 3.12): every mutant runs the checks")
        return set()
    lines = {f: set(v) for f, v in trace["lines"].items()}
    out = set()
    for n, (target, m) in enumerate(mutants):
        key = str(target.path.resolve())
        if key in lines and not executed(m.line, lines[key], starts[key]):
            out.add(n)
    return out


def _orders(plan: Plan, mutants, trace: dict | None, baseline_report: dict, starts) -> dict[int, tuple[str, ...]]:
    """Each mutant -> every test of the source's run, those that ran its line first (both in the source run's
    order); no entry (the default order) where the trace names no tests, or its line also ran outside any test."""
    every = list(dict.fromkeys(o["test"] for o in baseline_report.get("outcomes", []) if o.get("test")))
    if trace is None or not every or "tests" not in trace:
        return {}
    out = {}
    for n, (target, m) in enumerate(mutants):
        key = str(target.path.resolve())
        first = tests_of(m.line, trace["tests"].get(key, {}), starts[key])
        if first:
            out[n] = tuple([t for t in every if t in first] + [t for t in every if t not in first])
    return out


def module_of(path: Path, spec_module: str | None = None, search: list[str] | None = None) -> str:
    """The module name ``path`` is imported under: ``spec_module`` (from ``--lora-impl MODULE:FACTORY``) where it
    names this file, else the dotted path under the entries of ``sys.path`` (packages with ``__init__.py`` first)."""
    path = Path(path).resolve()
    found = []
    for entry in search if search is not None else sys.path:
        root = Path(entry or ".").resolve()
        try:
            rel = path.relative_to(root).with_suffix("")
        except ValueError:
            continue
        if not all(p.isidentifier() for p in rel.parts):
            continue
        regular = all((root.joinpath(*rel.parts[:i]) / "__init__.py").is_file() for i in range(1, len(rel.parts)))
        name = ".".join(p for p in rel.parts if p != "__init__" or len(rel.parts) == 1)
        found.append((name != spec_module, not regular, len(rel.parts), name))
    if not found:
        raise ValueError(
            f"--source {path}: not importable from the Python path (put its folder on PYTHONPATH, or name a module of "
            "an installed package)"
        )
    return min(found)[3]


def scratch_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="lora-suite-mutants-"))
