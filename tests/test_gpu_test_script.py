"""scripts/gpu-test.sh: flags, help, exit codes, and a real run of the quick tier without a GPU."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu-test.sh"


def run(*args, dry=True, timeout=300):
    env = dict(os.environ, NO_COLOR="1")
    if dry:
        env["GPU_TEST_DRY_RUN"] = "1"
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_help_lists_targets_and_flags():
    out = run("--help")
    assert out.returncode == 0
    for word in ("quick", "convergence", "memory", "extended", "full", "all", "selftest", "--check-vram",
                 "--verbose", "--continue-on-error", "--report-dir", "Exit codes"):
        assert word in out.stdout


@pytest.mark.parametrize("args,message", [
    ((), "no target given"),
    (("quick", "--bogus"), "unknown option '--bogus'"),
    (("fast",), "unknown target 'fast'"),
    (("quick", "memory"), "only one target allowed"),
    (("quick", "--backend", "tpu"), "--backend must be cupy or torch"),
    (("quick", "--strict-vram"), "--strict-vram only makes sense with --check-vram"),
    (("quick", "--report-dir"), "--report-dir needs a directory"),
])
def test_bad_usage_exits_2_with_a_message(args, message):
    out = run(*args)
    assert out.returncode == 2 and message in out.stderr


def test_all_expands_to_the_five_tiers_in_order():
    out = run("all", "--check-vram", "--continue-on-error")
    assert out.returncode == 0 and out.stdout.strip() == "targets: quick convergence memory extended full"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour on a machine without a GPU")
def test_quick_without_gpu_says_so_and_passes(tmp_path):
    out = run("quick", "--report-dir", str(tmp_path), dry=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "No NVIDIA GPU found" in out.stdout and "skipped" in out.stdout
    assert "Summary (no GPU: GPU tests were skipped)" in out.stdout
    report = next(tmp_path.glob("*-quick/report.json"))
    assert '"skipped"' in report.read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour on a machine without a GPU")
def test_a_failing_target_gives_exit_1_and_continue_runs_the_rest(tmp_path):
    # `-- -k nothing_matches` collects no test in each tier: pytest exit 5, which the script counts as a failure
    out = run("all", "--continue-on-error", "--report-dir", str(tmp_path), "--", "-k", "nothing_matches", dry=False)
    assert out.returncode == 1
    assert out.stdout.count("FAIL (no tests collected)") == 5  # every tier ran despite the failures
    stop = run("all", "--report-dir", str(tmp_path), "--", "-k", "nothing_matches", dry=False)
    assert stop.returncode == 1 and "stopping (use --continue-on-error" in stop.stdout
