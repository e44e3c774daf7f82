"""The regression gate run as a user runs it, for the selftest-gpu plants of the gate: a target of
``python -m lora_suite`` in its own process and run folder, run clean, planted and clean again, and ``compare`` of
the planted and the second clean run against the first (``lora_suite.results.compare``: exit 1 on a regression)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S, COMPARE_TIMEOUT_S = 900, 120


def run_target(out: Path, target: str, *args: str, result: str = "report.json") -> Path:
    """``python -m lora_suite TARGET --report-dir OUT ARGS...`` -> the one run folder it wrote (the folder of its
    ``result`` file). A non-zero exit fails, with the tail of the run's output."""
    cmd = [sys.executable, "-m", "lora_suite", target, "--report-dir", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    (run,) = sorted(p.parent for p in out.glob(f"*/{result}"))
    return run


def compare(base: Path, run: Path) -> subprocess.CompletedProcess:
    """``compare BASE RUN`` as the nightly gate runs it."""
    cmd = [sys.executable, "-m", "lora_suite.results.compare", str(base), str(run)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=COMPARE_TIMEOUT_S)


def clean_planted_again(runs: Path, run, planted: tuple[str, ...]) -> tuple[list[Path], list]:
    """``run(folder, *extra)`` three times under ``runs`` (clean, with ``planted`` added, clean again) ->
    (the three run folders, [compare(clean, planted), compare(clean, again)])."""
    runs.mkdir(parents=True, exist_ok=True)  # --report-dir takes a new folder inside an existing one
    folders = [run(runs / "clean"), run(runs / "planted", *planted), run(runs / "again")]
    return folders, [compare(folders[0], folders[1]), compare(folders[0], folders[2])]


def note_comparisons(notes: list[str], slow: subprocess.CompletedProcess, same: subprocess.CompletedProcess) -> None:
    """Both comparisons' outputs into a run report's notes."""
    notes.append(f"compare clean planted (exit {slow.returncode}):\n{slow.stdout.strip()}")
    notes.append(f"compare clean again (exit {same.returncode}):\n{same.stdout.strip()}")
