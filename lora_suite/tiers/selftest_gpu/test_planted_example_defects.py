"""selftest-gpu: the shipped example implementation (``examples/plain_lora.py``) with one planted defect at a time
(``lora_suite.scenarios.example_plants``), each run through the tier that must catch it, as a user would run it
(``python -m lora_suite <tier> --lora-impl lora_suite.scenarios.example_plants:<plant>``, its own process and run
report). The unplanted example runs beside them as the control: it must pass the same tier.

A plant counts as caught only when its run exits 1 and the check ``PLANTS`` names for it (``docs/lora-spec.md``) is
among the failed checks: a crash, or another check failing, is not the catch (several runs share the GPU and the
host here; the tier's wall time is a reported target, not a check, so sharing cannot fail a run, and the control
shows it). The table defect -> tier -> the named check -> the check that fired goes into this run's report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lora_suite.harness.report import Series
from lora_suite.scenarios.example_plants import PLANTS

pytestmark = [pytest.mark.gpu, pytest.mark.selftest_gpu]
ROOT = Path(__file__).resolve().parents[3]
CONTROL = "plain_lora:make"
RUN_GIB = 4  # quick with one worker peaks at ~3 GiB of GPU memory: 4 leaves room
ONLY = "LORA_SUITE_PLANTS"  # comma-separated factory names: run only these plants (and the control)


def parallel_runs() -> int:
    """Runs at once: as many as the free GPU memory holds at RUN_GIB each and the host has two cores for, at most 12
    (six on a 24 GiB card)."""
    import torch

    free_gib = torch.cuda.mem_get_info()[0] / 2**30
    return max(1, min(12, int(free_gib // RUN_GIB), (os.cpu_count() or 2) // 2))


def chosen_plants() -> dict:
    """PLANTS, or the ones ``LORA_SUITE_PLANTS`` names (an unknown name is refused, naming the known ones)."""
    names = [n.strip() for n in os.environ.get(ONLY, "").split(",") if n.strip()]
    known = {name: d for d, (name, _, _) in PLANTS.items()}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{ONLY}={os.environ[ONLY]!r}: {unknown} are not plants; expected some of {sorted(known)}")
    return {d: v for d, v in PLANTS.items() if not names or v[0] in names}


def _run(tier: str, impl: str, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "examples"), os.environ.get("PYTHONPATH", "")])
    )
    # --workers 1: parallel_runs() runs share the GPU already (quick's default of 6 workers each would not fit 24 GiB)
    cmd = [sys.executable, "-m", "lora_suite", tier, "--lora-impl", impl, "--report-dir", str(out), "--workers", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    reports = sorted(out.glob("*/report.json"))
    report = json.loads(reports[-1].read_text()) if reports else {}
    failed = [c["name"] for c in report.get("checks", []) if not c["passed"]]
    errors = [
        f"{o['test'].rsplit('::', 1)[-1]}: {o['reason'].splitlines()[0][:120] if o['reason'] else ''}"
        for o in report.get("outcomes", [])
        if o["outcome"] in ("failed", "error") and "check(s) failed" not in (o["reason"] or "")
    ]
    return {
        "exit": proc.returncode,
        "failed": failed,
        "errors": errors,
        "checks": report.get("summary", {}).get("checks_passed", 0),
        "tail": (proc.stdout + proc.stderr)[-1500:],
    }


def test_every_planted_defect_of_the_example_is_caught_by_its_tier(tier, tmp_path):
    jobs = {"(none: the example as shipped)": (CONTROL, "quick", "")}
    plants = chosen_plants()
    if len(plants) < len(PLANTS):  # a subset judged is said so, in the report and on the console
        note = f"{ONLY}: {len(plants)} of the {len(PLANTS)} plants run: {sorted(v[0] for v in plants.values())}"
        tier.report.notes.append(note)
        print(note)
    jobs.update({d: (f"lora_suite.scenarios.example_plants:{name}", t, frag) for d, (name, t, frag) in plants.items()})
    with ThreadPoolExecutor(parallel_runs()) as pool:
        futures = {
            d: pool.submit(_run, t, impl, tmp_path / f"run{i}") for i, (d, (impl, t, _)) in enumerate(jobs.items())
        }
        results = {d: f.result() for d, f in futures.items()}
    rows = []
    for defect, (impl, t, fragment) in jobs.items():
        r = results[defect]
        fired = [name for name in r["failed"] if fragment and fragment in name]
        caught = r["exit"] == 1 and bool(fired)
        others = [name for name in r["failed"] + r["errors"] if name not in fired]
        by = fired[0] if fired else "-"
        rows.append((defect, t, fragment or "-", r["exit"], len(r["failed"]), by, "; ".join(others[:2]) or "-"))
        if impl == CONTROL:
            tier.check("the example as shipped: quick passes (exit code)", r["exit"], "==", 0, detail=r["tail"])
            tier.check(
                "the example as shipped: checks judged in quick",
                r["checks"],
                ">=",
                120,
                detail=r["tail"],
                source="issue 32: at least 120 checks judge any implementation in quick",
            )
        else:
            tier.check(f"planted {defect}: caught by {t}", caught, "==", True, detail=f"{by} | {r['tail']}")
    tier.report.add_series(
        Series(
            tier.nodeid,
            "planted defects of the example implementation",
            ("defect", "tier", "check that must catch it", "exit code", "checks failed", "check that fired", "others"),
            tuple(rows),
        )
    )
    print("\n| defect | tier | named check | exit | checks failed | fired | others |\n|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
