"""selftest-gpu: a wrong kernel-variant choice planted in the SwiGLU launcher (the pytest plugin
``lora_suite.scenarios.swiglu_wrong_variant``, loaded by module name with ``-p``) must fail the quick tier, run as a
user runs it (``python -m lora_suite quick``, its own process and report).

The plant takes 16-byte vectors for 16-bit activations whenever I is a multiple of 4: rows with I ≡ 4 (mod 8) are
then read and written misaligned, in partial vectors. The quick tier's parity grid has such an I for every dtype
(test_kernel_variant_parity.py per variant, test_fused_parity.py through the fused MLP), so the run must exit 1 naming a
SwiGLU test. Its own process: a misaligned access is a CUDA error, after which the plugin stops the run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lora_suite.cli.plugins import autoload_plugins

pytestmark = [pytest.mark.gpu, pytest.mark.selftest_gpu]
ROOT = Path(__file__).resolve().parents[3]
PLANT = "lora_suite.scenarios.swiglu_wrong_variant"


def _failed(report: dict) -> list[tuple[str, str]]:
    return [
        (o["test"], (o["reason"] or "").splitlines()[0][:160] if o["reason"] else "")
        for o in report.get("outcomes", [])
        if o["outcome"] in ("failed", "error")
    ]


def _report(folder: Path) -> dict:
    reports = sorted(folder.glob("*/report.json")) or sorted(folder.glob("report.json"))
    return json.loads(reports[-1].read_text()) if reports else {}


def test_wrong_swiglu_variant_fails_the_quick_tier(tier, tmp_path):
    """Caught: quick exits 1 with a failed SwiGLU or fused-MLP test, and the same tests, run again without the plant
    (the control), pass: the failure is the plant's, not the machine's or another defect's."""
    planted = tmp_path / "planted"
    cmd = [
        sys.executable,
        "-m",
        "lora_suite",
        "quick",
        "--report-dir",
        str(planted),
        "--",
        "-p",
        PLANT,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    failed = _failed(_report(planted))
    swiglu = list(dict.fromkeys(test for test, _ in failed if "swiglu" in test.lower() or "mlp" in test.lower()))
    tail = (proc.stdout + proc.stderr)[-2000:]
    tier.check("planted wrong SwiGLU variant: quick's exit code", proc.returncode, "==", 1, detail=tail)
    tier.check(
        "planted wrong SwiGLU variant: failed SwiGLU / fused-MLP tests in quick",
        len(swiglu),
        ">=",
        1,
        detail=" | ".join(f"{t}: {r}" for t, r in failed[:4]) or tail,
    )
    control_dir = tmp_path / "control"
    control = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(ROOT)]
    control += [] if autoload_plugins("quick") else ["-p", "pytest_benchmark.plugin"]  # as the CLI runs quick
    control += [f"--report-dir={control_dir}", *swiglu[:8]]
    ctl = subprocess.run(control, cwd=ROOT, capture_output=True, text=True, timeout=900)
    tier.check(
        "control: the tests that caught the plant pass without it (exit code)",
        ctl.returncode if swiglu else "no test to rerun",
        "==",
        0,
        detail=" | ".join(f"{t}: {r}" for t, r in _failed(_report(control_dir))[:4])
        or (ctl.stdout + ctl.stderr)[-1500:],
    )
    print("\n".join(["caught by:", *(f"{t}: {r}" for t, r in failed[:6]), f"control exit {ctl.returncode}"]))
