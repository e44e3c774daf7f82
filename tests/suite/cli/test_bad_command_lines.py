"""The bad-input battery (issue 20), command lines: ``scripts/gpu-test.sh`` (and so ``lora-suite``, its command line
in ``lora_suite/cli``) given no target, unknown targets and options, and flags without or with bad values, refused
with exit 2 and a line naming the value and what was expected, before anything is written."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "gpu-test.sh"

CLI_CASES = [
    ([], "no target given"),
    (["nosuch"], "unknown target 'nosuch'"),
    (["quick", "--report-dir"], "--report-dir needs a directory, got ''"),
    (["quick", "--report-dir=--x"], "--report-dir needs a directory, got '--x'"),
    (["quick", "--report-dir", "--check-vram"], "--report-dir needs a directory, got '--check-vram'"),
    (["quick", "--lora-impl"], "--lora-impl needs a value"),
    (["quick", "--lora-impl", "no such"], "argument --lora-impl: LoRA implementation 'no such': expected a name"),
    (["quick", "--backend", "cupy"], "--backend was replaced by --lora-impl"),
    (["quick", "--weights", "maybe"], "--weights must be auto, pretrained or random, got 'maybe'"),
    (["quick", "--weights"], "--weights needs a value"),
    (["multigpu", "--gpus", "0"], "--gpus must be a positive whole number, got '0'"),
    (["multigpu", "--gpus", "two"], "--gpus must be a positive whole number, got 'two'"),
    (["quick", "--baseline"], "--baseline needs a directory, got ''"),
    (
        ["multinode", "--nodes", "0"],
        "--nodes must be a whole number >= 2 (a job over one node is the multigpu tier's), got '0'",
    ),  # issue 59
    (["quick", "--nodes", "2"], "--nodes applies to multinode only, not to 'quick'"),
    (["multinode", "--node-rank", "1"], "--node-rank and --shared-dir run one node of a job that spans hosts"),
    (["multinode", "--rdzv-endpoint", "hostA"], "rendezvous endpoint 'hostA': expected HOST:PORT"),
    (["multinode", "--node-rank", "-1"], "--node-rank needs a node index (0 for the node that judges), got '-1'"),
    (["multinode", "--node-rank", "one"], "--node-rank must be a whole number >= 0, got 'one'"),
    (["multinode", "--rdzv-endpoint", "h:29500"], "--node-rank None: with --rdzv-endpoint, expected this host's node"),
    (
        ["multinode", "--rdzv-endpoint", "h:29500", "--node-rank", "2"],
        "--node-rank 2: with --rdzv-endpoint, expected this host's node, 0 to 1",
    ),
    (
        ["multinode", "--rdzv-endpoint", "h:29500", "--node-rank", "1", "--shared-dir", "/nonexistent/shared"],
        "--shared-dir /nonexistent/shared: with --rdzv-endpoint, expected a folder every node sees",
    ),
    (["quick", "--frobnicate"], "unknown option '--frobnicate'"),
    (["compare", "onlyone"], "compare needs two run directories"),
    (["all", "extra"], "only one target allowed, got 'all' and 'extra'"),
    (["scorecard", "--jobs", "0"], "--jobs must be a positive whole number, got '0'"),
    (["scorecard", "--lora-impl", "a b"], "--lora-impl must be names separated by commas, got 'a b'"),
    (["scorecard", "--gpus", "2"], "--gpus applies to multigpu and all only, not to 'scorecard'"),
    (["history", "--html", "page.md"], "--html needs a path ending in .html, got 'page.md'"),
    (["history", "/nonexistent/reports"], "history: /nonexistent/reports does not exist (a run folder)"),
    (["history", "--since", "yesterday"], "unknown option '--since'"),
    (["history", "--html", "/proc/nowhere/h.html"], "history: cannot write /proc/nowhere/h.html"),  # issue 28
    (["selftest", "--report-dir", "out"], "selftest (the CPU tests) writes no run report"),  # issue 28: ignored
]


@pytest.mark.parametrize("args, expected", CLI_CASES, ids=[" ".join(a) or "(none)" for a, _ in CLI_CASES])
def test_gpu_test_sh_flags(args, expected, tmp_path):
    env = {**os.environ, "GPU_TEST_BOOTSTRAP_DRY_RUN": "0"}
    out = subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60
    )
    assert out.returncode == 2, (out.returncode, out.stdout[-500:], out.stderr[-500:])
    assert expected in out.stderr, out.stderr
    assert not any(tmp_path.iterdir()), "a refused command wrote something"
