"""``lora-suite longcontext`` and ``scripts/gpu-test.sh longcontext`` find the tier through the registry alone (no
list to edit): the help lists it, the pytest command runs its folder under its marker, and without a GPU both of its
tests are collected and skip, saying why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lora_suite.cli import build_parser
from lora_suite.cli.targets import pytest_args
from lora_suite.settings.registry import registry

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "gpu-test.sh"


def test_the_help_lists_it_and_its_pytest_command_runs_its_folder_under_its_marker():
    out = subprocess.run([sys.executable, "-m", "lora_suite", "--help"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "\n    longcontext " in out.stdout
    tiers = registry()
    cmd = pytest_args("longcontext", build_parser().parse_args(["longcontext"]), None, tiers)
    folder = cmd.index(str(tiers["longcontext"].tests_dir))
    assert cmd[folder + 1 : folder + 3] == ["-m", "longcontext"]


def test_the_script_names_it_as_its_target():
    env = dict(os.environ, NO_COLOR="1", GPU_TEST_DRY_RUN="1")
    out = subprocess.run(["bash", str(SCRIPT), "longcontext"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "targets: longcontext", out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour on a machine without a GPU")
def test_without_a_gpu_its_two_tests_skip_saying_why(tmp_path):
    env = dict(os.environ, NO_COLOR="1")
    out = subprocess.run(
        ["bash", str(SCRIPT), "longcontext", "--report-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "No NVIDIA GPU found" in out.stdout
    report = json.loads(next(tmp_path.glob("*-longcontext/report.json")).read_text())
    outcomes = {o["test"].rsplit("::", 1)[-1]: o for o in report["outcomes"]}
    assert sorted(outcomes) == [
        "test_checkpointed_training_at_8192_tokens",
        "test_gradients_at_8192_tokens_match_the_fp32_reference",
    ]
    for o in outcomes.values():
        assert o["outcome"] == "skipped" and "needs a CUDA GPU" in (o.get("reason") or ""), o
