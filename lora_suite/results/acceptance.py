"""A load-acceptance report: every run under a directory, by condition, with each judged figure and its allowance.

``python -m lora_suite.results.acceptance OUT_DIR`` reads ``OUT_DIR/<condition>/<run>/report.json`` (as
scripts/load-acceptance.sh lays them out) and writes ``OUT_DIR/acceptance.json`` and ``OUT_DIR/acceptance.md``
atomically: per run its condition, target, verdict and every check (value, comparison, threshold, pass); per
target the number of runs and of failed runs, and per judged figure its range over the runs against its allowance;
per planted defect of the self-test (a test parametrised ``[roundN]``) and condition, how many rounds caught it.
Runs may come from several machines and commits: each run's row names its GPU, the host's GPU count and commit.
Exit status: 0 when every run passed, 1 when one failed, 2 when the directory holds no run.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

from lora_suite.harness.report import atomic_write_text
from lora_suite.harness.verdict import verdict_of_json


def collect(root: Path) -> list[dict]:
    runs = []
    for path in sorted(root.glob("*/*/report.json")):
        report = json.loads(path.read_text())
        checks = report.get("checks", [])
        runs.append(
            {
                "condition": path.parent.parent.name,
                "run": path.parent.name,
                "target": report.get("selection"),
                "status": report.get("status"),
                "summary": report.get("summary", {}),
                # the one verdict rule (harness.verdict): a run that judged nothing is NOT JUDGED, not passed
                "verdict": (verdict := verdict_of_json(report)[0]),
                "passed": verdict == "PASS",
                "environment": report.get("environment", {}),
                "checks": [
                    {k: c.get(k) for k in ("test", "name", "value", "op", "threshold", "passed")} for c in checks
                ],
            }
        )
    return runs


def figure_ranges(runs: list[dict]) -> list[tuple]:
    """Per (target, check name with the run-specific parts cut): runs, failures, min and max value, min and max
    threshold."""
    acc: dict[tuple, list] = defaultdict(list)
    for run in runs:
        for c in run["checks"]:
            if isinstance(c["value"], (int, float)) and not isinstance(c["value"], bool):
                name = c["name"].split(" (")[0][:110]
                acc[(run["target"], name, c["op"])].append((c["value"], c["threshold"], c["passed"]))
    rows = []
    for (target, name, op), vals in sorted(acc.items()):
        values = [v for v, _, _ in vals]
        limits = [t for _, t, _ in vals if isinstance(t, (int, float))]
        rows.append(
            (
                target,
                name,
                len(vals),
                sum(not p for _, _, p in vals),
                min(values),
                max(values),
                op,
                min(limits) if limits else None,
                max(limits) if limits else None,
            )
        )
    return rows


def run_counts(runs: list[dict]) -> dict[str, dict[str, list[int]]]:
    """{target: {condition: [runs, failed runs]}}."""
    counts: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for r in runs:
        cell = counts[r["target"]][r["condition"]]
        cell[0] += 1
        cell[1] += not r["passed"]
    return {t: dict(c) for t, c in counts.items()}


def _commit(run: dict) -> str:
    return str(run["environment"].get("git_commit")).split(" ")[0]


def plant_tallies(runs: list[dict]) -> dict[str, dict[str, list[int]]]:
    """{"<planted defect> @ <commit>": {condition: [rounds caught, rounds]}}: per commit, because a change of a
    criterion makes the earlier rounds evidence of the earlier code only.

    A self-test round passes exactly when its plant was caught (the check asserts the criterion failed)."""
    tallies: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for r in runs:
        for c in r["checks"]:
            test = (c["test"] or "").split("::")[-1]
            if "[round" not in test:
                continue
            cell = tallies[f"{test.split('[round')[0]} @ {_commit(r)}"][r["condition"]]
            cell[0] += bool(c["passed"])
            cell[1] += 1
    return {t: dict(c) for t, c in tallies.items()}


def _cells(by_condition: dict[str, list[int]], conditions: list[str], fmt) -> str:
    return " | ".join(fmt(*by_condition[c]) if c in by_condition else "-" for c in conditions)


def render(runs: list[dict]) -> str:
    """acceptance.md: the machines and commits, runs per target and condition, the planted defects' tallies (where
    a self-test ran), every run's row, the judged figures' ranges, and every run's checks."""
    conditions = sorted({r["condition"] for r in runs})
    lines = _header(runs, conditions)
    lines += _counts_section(runs, conditions)
    lines += _plants_section(runs, conditions)
    lines += _runs_section(runs)
    lines += _figures_section(runs)
    lines += _checks_section(runs)
    return "\n".join(lines) + "\n"


def _verdict(run: dict) -> str:
    return run["verdict"]


def _condition_table_head(first: str, conditions: list[str]) -> list[str]:
    """The head of a table with one column per condition and a total: ``| first | c1 | ... | all |``."""
    return [f"| {first} | {' | '.join(conditions)} | all |", "|---|" + "---|" * (len(conditions) + 1)]


def _table_head(columns: str) -> list[str]:
    """The head of a table whose columns are ``columns`` (``"c1 | c2 | ..."``), and its rule."""
    return [f"| {columns} |", "|" + "---|" * len(columns.split(" | "))]


def _section(title: str, head: list[str]) -> list[str]:
    """A section's first lines: its title, then the head of its table."""
    return ["", f"## {title}", "", *head]


def _header(runs: list[dict], conditions: list[str]) -> list[str]:
    """The title (runs, failed runs) and the GPUs, drivers, torch versions, commits and conditions the runs span."""
    envs = [r["environment"] for r in runs]
    facts = {k: sorted({str(e.get(k)) for e in envs}) for k in ("gpu_name", "driver", "torch", "git_commit")}
    return [
        f"# Load acceptance: {len(runs)} runs, {sum(not r['passed'] for r in runs)} failed",
        "",
        f"GPU {', '.join(facts['gpu_name'])}; driver {', '.join(facts['driver'])}; torch "
        f"{', '.join(facts['torch'])}; commits {', '.join(facts['git_commit'])}; conditions: "
        f"{', '.join(conditions)}.",
    ]


def _counts_section(runs: list[dict], conditions: list[str]) -> list[str]:
    """Runs per target and condition, failed runs in brackets, with each target's totals."""
    lines = _section("Runs per target and condition (failed in brackets)", _condition_table_head("target", conditions))
    for target, by in sorted(run_counts(runs).items()):
        lines.append(
            f"| {target} | {_cells(by, conditions, lambda n, f: f'{n} ({f})')} | "
            f"{sum(n for n, _ in by.values())} ({sum(f for _, f in by.values())}) |"
        )
    return lines


def _plants_section(runs: list[dict], conditions: list[str]) -> list[str]:
    """Per planted defect and commit: rounds that caught the plant / rounds, per condition and in all; nothing
    where no self-test round ran."""
    tallies = plant_tallies(runs)
    if not tallies:
        return []
    lines = _section(
        "Planted defects: rounds that caught the plant / rounds, per commit", _condition_table_head("plant", conditions)
    )
    for plant, by in sorted(tallies.items()):
        lines.append(
            f"| {plant} | {_cells(by, conditions, lambda k, n: f'{k}/{n}')} | "
            f"{sum(k for k, _ in by.values())}/{sum(n for _, n in by.values())} |"
        )
    return lines


def _runs_section(runs: list[dict]) -> list[str]:
    """One row per run: condition, run, target, verdict, checks passed / failed, GPU, the host's GPUs, commit."""
    lines = _section(
        "Runs", _table_head("condition | run | target | verdict | checks passed / failed | GPU | host GPUs | commit")
    )
    for r in runs:
        s, e = r["summary"], r["environment"]
        lines.append(
            f"| {r['condition']} | {r['run']} | {r['target']} | {_verdict(r)} | "
            f"{s.get('checks_passed', 0)} / {s.get('checks_failed', 0)} | {e.get('gpu_name')} | "
            f"{e.get('host_gpus', 'not recorded')} | {_commit(r)} |"
        )
    return lines


def _figures_section(runs: list[dict]) -> list[str]:
    """Per judged figure (``figure_ranges``): its value range over the runs against its allowance range."""
    lines = _section(
        "Judged figures over the runs (value range against the allowance range)",
        _table_head("target | check | runs | failed | min value | max value | op | allowance (min) | allowance (max)"),
    )
    for target, name, n, failed, lo, hi, op, tlo, thi in figure_ranges(runs):
        lines.append(f"| {target} | {name} | {n} | {failed} | {lo:.4g} | {hi:.4g} | {op} | {tlo} | {thi} |")
    return lines


def _checks_section(runs: list[dict]) -> list[str]:
    """Every run's checks, a table per run: check, value, op, allowance, passed."""
    lines = _section("Every run's checks", [])
    for r in runs:
        lines += [
            f"### {r['condition']} / {r['run']} ({_verdict(r)})",
            "",
            *_table_head("check | value | op | allowance | passed"),
        ]
        lines += [
            f"| {c['test'].split('::')[-1] if c['test'] else ''}: {c['name']} | {c['value']} | {c['op']} | "
            f"{c['threshold']} | {c['passed']} |"
            for c in r["checks"]
        ]
        lines.append("")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m lora_suite.results.acceptance OUT_DIR", file=sys.stderr)
        return 2
    root = Path(argv[0])
    runs = collect(root)
    if not runs:
        print(f"{root}: no <condition>/<run>/report.json under it", file=sys.stderr)
        return 2
    atomic_write_text(
        root / "acceptance.json",
        json.dumps(
            {"runs": runs, "figures": figure_ranges(runs), "counts": run_counts(runs), "plants": plant_tallies(runs)},
            indent=1,
        ),
    )
    atomic_write_text(root / "acceptance.md", render(runs))
    failed = [f"{r['condition']}/{r['run']}" for r in runs if not r["passed"]]
    print(
        f"{len(runs)} runs, {len(failed)} failed{': ' + ', '.join(failed) if failed else ''}; {root / 'acceptance.md'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
