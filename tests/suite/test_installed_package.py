"""`pip install .` ships the tier configs as package data: an installed lora_suite loads them from anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_an_installed_package_loads_tier_configs_from_another_directory(tmp_path):
    target = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    code = (
        "import lora_suite.core.config as c, lora_suite.core.loader as l; cfg = l.load_tier_config('quick'); "
        "print(c.CONFIG_DIR); print(cfg.tier, cfg.model.name, cfg.train.steps)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LORA_SUITE_CONFIG_DIR")}
    env["PYTHONPATH"] = str(target)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=elsewhere, capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    config_dir, summary = out.stdout.strip().splitlines()
    assert config_dir.startswith(str(target)), f"configs came from {config_dir}, not the installed package"
    assert summary == "quick smollm2-135m 10"
