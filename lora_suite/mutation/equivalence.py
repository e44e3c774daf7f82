"""Which surviving mutants are equivalent: each survivor's fingerprint (``lora_suite.engine.fingerprint``: outputs,
gradients, saved files and the rest on a probe grid) against the source's. Bitwise the same, on a line the source's
fingerprint runs and for an operator whose class it can see (``mutants.fingerprint_blind``), is equivalent; else the
mutant survives, with the parts it changes or the reason its sameness proves nothing. ``subprocess_fingerprint``
makes a ``Plan.fingerprint`` that runs the fingerprint in a process of its own."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from lora_suite.engine.fingerprint import differing
from lora_suite.mutation.check_run import last_line
from lora_suite.mutation.forked_runs import run_subprocess
from lora_suite.mutation.line_trace import executed, trace_env
from lora_suite.mutation.mutant_source import mutant_env
from lora_suite.mutation.mutants import fingerprint_blind
from lora_suite.mutation.mutation_run import MutantResult, Plan


def judge_survivors(
    plan: Plan, workdir: Path, mutants, results: list[MutantResult], pool, starts
) -> list[MutantResult]:
    """Each survivor's fingerprint against the source's: equal, on a line the fingerprint runs, is equivalent; else
    it survives, with the parts it changes or the reason its sameness proves nothing."""
    survivors = [i for i, r in enumerate(results) if r.status == "survived"]
    if not survivors:
        return results
    plan.log(f"mutate: fingerprints of the source and of {len(survivors)} survivor(s)")
    trace_out = workdir / "source" / "fingerprint-lines.json"
    try:  # the source's fingerprint, traced: a mutant on a line it never runs is not shown equivalent by it
        original = plan.fingerprint({**plan.env, **trace_env([t.path for t in plan.targets], trace_out)})
    except Exception as exc:  # the survivors stay survivors, with the reason their equivalence is unknown
        return [
            _with_reason(r, f"not judged for equivalence: the source's fingerprint failed ({exc})") for r in results
        ]
    ran = _fingerprint_lines(plan, trace_out, starts)

    def judge(i: int) -> MutantResult:
        target, m = mutants[i]
        note = f"{results[i].reason}; " if results[i].reason else ""
        key = str(target.path.resolve())
        if ran is None:
            return _with_reason(results[i], f"{note}not judged for equivalence: the fingerprint left no line trace")
        if not executed(m.line, ran[key][0], ran[key][1]):
            return _with_reason(
                results[i], f"{note}the fingerprint never runs line {m.line} either: its sameness proves nothing"
            )
        path = workdir / f"mutant-{i:04d}" / target.path.name
        try:
            fp = plan.fingerprint({**plan.env, **mutant_env(target.module, path)})
        except Exception as exc:  # as above: reported, never a pass
            return _with_reason(results[i], f"{note}not judged for equivalence: its fingerprint failed ({exc})")
        parts, blind = differing(fp, original), fingerprint_blind(m.operator, original)
        if not parts and blind:  # its class lies outside what the fingerprint runs: the sameness proves nothing
            return _with_reason(results[i], f"{note}bitwise the source's fingerprint, which cannot show it: {blind}")
        if not parts:
            return dataclasses.replace(
                results[i], status="equivalent", reason=f"{note}bitwise the source's fingerprint"
            )
        return _with_reason(results[i], f"{note}changes {', '.join(parts)}; no check saw it")

    judged = dict(zip(survivors, pool.map(judge, survivors)))
    return [judged.get(i, r) for i, r in enumerate(results)]


def _fingerprint_lines(plan: Plan, trace_out: Path, starts) -> dict[str, tuple[set[int], dict[int, int]]] | None:
    """Each target -> (the lines the source's fingerprint ran, its statement starts); None where it left no trace."""
    try:
        lines = json.loads(trace_out.read_text())["lines"]
    except (OSError, ValueError, KeyError):
        plan.log("mutate: the fingerprint left no line trace: no survivor can be shown equivalent")
        return None
    return {key: (set(lines.get(key, ())), by_line) for key, by_line in starts.items()}


def _with_reason(r: MutantResult, reason: str) -> MutantResult:
    return r if r.status != "survived" else dataclasses.replace(r, reason=reason)


def subprocess_fingerprint(
    command: list[str], timeout: float = 600.0, runner=run_subprocess
) -> Callable[[dict[str, str]], dict[str, str]]:
    """A ``Plan.fingerprint`` that runs ``command`` (``mutant_source.fingerprint_command``) through ``runner``
    and reads the JSON line it prints last."""

    def take(env: dict[str, str]) -> dict[str, str]:
        done = runner(command, env, timeout)
        if done.returncode != 0:
            what = "timeout" if done.returncode is None else f"exit {done.returncode}"
            raise RuntimeError(f"{what}: {last_line(done.output) or 'no output'}")
        lines = [ln for ln in done.output.strip().splitlines() if ln.startswith("{")]
        if not lines:
            raise RuntimeError(f"no fingerprint printed: {last_line(done.output) or 'no output'}")
        return json.loads(lines[-1])

    return take
