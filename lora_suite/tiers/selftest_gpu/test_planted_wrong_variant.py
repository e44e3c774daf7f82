"""selftest-gpu: a wrong kernel-variant choice planted in the SwiGLU launcher (``planted_wrong_variant``) must fail
the quick tier, run as a user runs it (``python -m lora_suite quick``, its own process and report).

The plant takes 16-byte vectors for 16-bit activations whenever I is a multiple of 4: rows with I ≡ 4 (mod 8) are
then read and written misaligned, in partial vectors. The quick tier's parity grid has such an I for every dtype
(test_kernel_variant_parity.py per variant, test_fused_parity.py through the fused MLP), so the run must exit 1 naming a
SwiGLU test. Its own process: a misaligned access is a CUDA error, after which the plugin stops the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.selftest_gpu]
ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent


def test_wrong_swiglu_variant_fails_the_quick_tier(tier, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]))
    cmd = [
        sys.executable,
        "-m",
        "lora_suite",
        "quick",
        "--report-dir",
        str(tmp_path),
        "--",
        "-p",
        "planted_wrong_variant",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    reports = sorted(tmp_path.glob("*/report.json"))
    report = json.loads(reports[-1].read_text()) if reports else {}
    failed = [
        f"{o['test'].rsplit('::', 1)[-1]}: {(o['reason'] or '').splitlines()[0][:160] if o['reason'] else ''}"
        for o in report.get("outcomes", [])
        if o["outcome"] in ("failed", "error")
    ]
    swiglu = [f for f in failed if "swiglu" in f.lower() or "mlp" in f.lower()]
    tail = (proc.stdout + proc.stderr)[-2000:]
    tier.check("planted wrong SwiGLU variant: quick's exit code", proc.returncode, "==", 1, detail=tail)
    tier.check(
        "planted wrong SwiGLU variant: failed SwiGLU / fused-MLP tests in quick",
        len(swiglu),
        ">=",
        1,
        detail=" | ".join(failed[:4]) or tail,
    )
    print("\n".join(["caught by:", *failed[:6]]))
