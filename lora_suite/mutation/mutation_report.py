"""The report of a mutation run: ``report.json`` in the run report's format (schema v3, so that ``ledger record``,
``history`` and ``compare`` read it as any run) and ``report.md`` (the score first, then every survivor with its diff,
then the killed mutants counted by what killed them), both written atomically.

In ``report.json``: the check ``mutation score`` (killed / (killed + survived) against ``--min-score``), the series
``mutation testing`` (killed, survived, equivalent, error, the score with the equivalents counted as survivors,
killed / (killed + survived + equivalent), and wall time: the ledger's figures of the run), ``mutants`` (one row per
mutant: id, file, operator, line, status, killed by, reason, seconds, diff) and ``sources`` (each file mutated, the
module it replaced, its mutants). A mutant whose run judged nothing (status ``error``) is in neither score.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

from lora_suite.harness.report import RunReport, Series, atomic_write_text
from lora_suite.mutation.mutation_run import MutationRun, Target, score, score_counting_equivalents
from lora_suite.settings.environment import Environment, package_environment

SCORE_CHECK = "mutation score (killed / (killed + survived))"
# the second score, a measured figure beside the check (no threshold of its own: --min-score judges the first)
HONEST = "score, equivalents as survivors (killed / (killed + survived + equivalent))"
# The project's target for the mutation score of a stack (issue: lora-suite mutate); --min-score overrides it.
MIN_SCORE = 0.9
MIN_SCORE_SOURCE = "the project's target for mutation testing (lora-suite mutate --min-score, default 0.9)"
TEST = "lora-suite mutate"
FIGURES = ("mutants killed", "mutants survived", "mutants equivalent", "mutants error", HONEST, "wall s")
MUTANT_COLUMNS = ("id", "file", "operator", "line", "status", "killed by", "reason", "seconds", "diff")


def _environment(report: dict) -> Environment:
    env = report.get("environment") or {}
    names = {f.name for f in dataclasses.fields(Environment)}
    if set(env) == names:
        return Environment(**env)
    return package_environment()


def build(run: MutationRun, run_id: str, targets: tuple[Target, ...], spec: str, min_score: float) -> RunReport:
    """The run report of a mutation run."""
    killed, survived, equivalent = run.counts()
    value, errors = score(killed, survived), run.count("error")
    honest = score_counting_equivalents(killed, survived, equivalent)
    report = RunReport(run_id=run_id, selection="mutate", environment=_environment(run.baseline_report))
    report.status = "complete"
    report.implementation = run.baseline_report.get("implementation") or {
        "name": spec,
        "spec": spec,
        "description": spec,
        "not_applicable": {},
    }
    report.notes += [
        f"mutated: {', '.join(t.label for t in targets)}; {len(run.results)} mutants, run against the quick tier's "
        f"fast checks; the source passed them in {run.baseline.seconds:.1f} s, each mutant's timeout "
        f"{run.timeout_s:.0f} s",
        "equivalent: survived, and bitwise the source's outputs, gradients and saved files on the fingerprint's probe "
        "grid (lora_suite/engine/fingerprint.py); left out of the score, counted as survivors in the second one",
        f"error: {errors} mutant(s) whose runs judged nothing (no report, no test ran); in neither score",
    ]
    detail = "; ".join(r.id for r in run.results if r.status == "survived")[:300]
    nothing = f"no mutant was killed or survived ({errors} error(s), {equivalent} equivalent): nothing was judged"
    second = "" if honest is None else f"{honest:.4f} with the equivalents counted as survivors; "
    report.check(
        TEST,
        SCORE_CHECK,
        float("nan") if value is None else round(value, 4),
        ">=",
        min_score,
        source=MIN_SCORE_SOURCE,
        detail=(f"{second}survivors: {detail or 'none'}" if value is not None else nothing),
    )
    impl = report.implementation.get("name", spec)
    second_value = float("nan") if honest is None else round(honest, 4)
    figures_row = (impl, killed, survived, equivalent, errors, second_value, round(run.wall_s, 1))
    report.add_series(Series(TEST, "mutation testing", ("implementation", *FIGURES), (figures_row,)))
    rows = tuple(
        (r.id, r.file, r.operator, r.line, r.status, r.killed_by, r.reason, r.seconds, r.diff) for r in run.results
    )
    report.add_series(Series(TEST, "mutants", MUTANT_COLUMNS, rows))
    per_file = Counter(r.file for r in run.results)
    sources = tuple((t.label, t.module, per_file.get(t.label, 0)) for t in targets)
    report.add_series(Series(TEST, "sources", ("file", "module", "mutants"), sources))
    return report


def markdown(report: RunReport, run: MutationRun) -> str:
    """report.md: the two scores first, then the survivors with their diffs, the errors with their reasons, the
    equivalents, the mutants per operator, then what killed the others."""
    check = report.checks[0]
    killed, survived, equivalent = run.counts()
    errors = run.count("error")
    verdict = "PASS" if check.passed else "FAIL"
    value = "n/a" if check.value != check.value else f"{check.value:.3f}"
    honest = score_counting_equivalents(killed, survived, equivalent)
    lines = [
        f"# Mutation testing: {report.implementation.get('name', '')}",
        "",
        f"**Mutation score {value}** (killed {killed} / (killed {killed} + survived {survived})), threshold "
        f">= {check.threshold}: **{verdict}** ({check.source}).",
        "",
        f"**With the equivalents counted as survivors: {'n/a' if honest is None else f'{honest:.3f}'}** (killed "
        f"{killed} / (killed {killed} + survived {survived} + equivalent {equivalent})).",
        "",
        f"{len(run.results)} mutants: {killed} killed, {survived} survived, {equivalent} equivalent (left out of the "
        f"first score), {errors} error (judged nothing: in neither score). Wall time {run.wall_s:.0f} s; the "
        f"source's own run {run.baseline.seconds:.1f} s.",
        "",
        f"Run {report.run_id}; GPU {report.environment.gpu_name or 'none'}; commit {report.environment.git_commit}.",
        "",
    ]
    lines += _listed(run)
    lines += ["## Killed, by what killed them", "", "| killed by | mutants |", "|---|---|"]
    for what, n in Counter(_kind(r.killed_by) for r in run.results if r.status == "killed").most_common():
        lines.append(f"| {what.replace('|', '/')} | {n} |")
    return "\n".join(lines) + "\n"


def _listed(run: MutationRun) -> list[str]:
    """report.md's sections of survivors (with diffs), errors (with reasons), equivalents, and mutants per operator."""
    lines = ["## Survivors", ""]
    survivors = [r for r in run.results if r.status == "survived"]
    if not survivors:
        lines += ["None: every mutant that is not equivalent was killed.", ""]
    for r in survivors:
        lines += [f"### `{r.id}`", "", f"Why it survives: {r.reason or 'not known'}", "", "```diff", r.diff.rstrip()]
        lines += ["```", ""]
    errors = [r for r in run.results if r.status == "error"]
    if errors:
        lines += ["## Errors (the run judged nothing: in neither score)", ""]
        lines += [f"- `{r.id}`: {r.reason}" for r in errors] + [""]
    equivalents = [r for r in run.results if r.status == "equivalent"]
    if equivalents:
        lines += ["## Equivalent (left out of the first score, survivors in the second)", ""]
        lines += [f"- `{r.id}`" for r in equivalents] + [""]
    lines += ["## Per operator", "", "| operator | killed | survived | equivalent | error |", "|---|---|---|---|---|"]
    for op in dict.fromkeys(r.operator for r in run.results):
        n = Counter(r.status for r in run.results if r.operator == op)
        lines.append(f"| {op} | {n['killed']} | {n['survived']} | {n['equivalent']} | {n['error']} |")
    return lines + [""]


def _kind(killed_by: str) -> str:
    """A killer as counted in report.md: a check by its name, a timeout as such, a crash by its exception type."""
    if killed_by.startswith("check "):
        return killed_by.rsplit(" (", 1)[0]
    if killed_by.startswith("timeout"):
        return "timeout"
    exc = killed_by.split(": ", 2)
    return f"crash: {exc[1].split(':', 1)[0]}" if len(exc) > 1 else killed_by


def write(directory: Path, report: RunReport, run: MutationRun) -> Path:
    """report.json and report.md into ``directory`` (each atomically); the Markdown's path."""
    report.write_json(directory)
    md = Path(directory) / "report.md"
    atomic_write_text(md, markdown(report, run))
    return md


def figures(report: dict) -> dict[str, float]:
    """The run's figures from its report.json: the score, then ``FIGURES``."""
    out = {c["name"]: c["value"] for c in report.get("checks", []) if c.get("name") == SCORE_CHECK}
    for s in report.get("series", []):
        if s.get("name") == "mutation testing" and s.get("rows"):
            out.update(zip(s["columns"][1:], s["rows"][0][1:]))
    return out
