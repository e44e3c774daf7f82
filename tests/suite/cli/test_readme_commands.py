"""Every README command that can run without a GPU runs from the repository root with the exit code it promises.

Issue 8: `pytest -m quick`, `pytest --co -q` and `pytest -m memory --check-vram --report-dir DIR` stopped with
"import file mismatch" (exit 2) on a clean clone. Each command here must appear verbatim in the README.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
README = (ROOT / "README.md").read_text()
COMMANDS = [  # (command as the README writes it, expected exit code without a GPU)
    ("pytest -m quick", 0),
    ("pytest -m convergence", 0),
    ("pytest -m memory", 0),
    ("pytest -m extended", 0),
    ("pytest -m full", 0),
    ("pytest -m selftest_gpu", 0),
    ("pytest -m benchmark", 0),
    ("pytest --co -q", 0),
    ("pytest -m memory --check-vram --report-dir reports/_local/readme-check", 0),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour on a machine without a GPU")
@pytest.mark.parametrize("command,code", COMMANDS, ids=[c for c, _ in COMMANDS])
def test_readme_command_runs_from_the_root(command, code, tmp_path):
    assert f"`{command}`" in README or f"{command}\n" in README, f"{command!r} is no longer in the README"
    argv = shlex.split(command)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-m", *argv, "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == code, f"{command}: exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-2000:]}"
