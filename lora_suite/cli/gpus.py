"""What ``nvidia-smi`` says about this machine's GPUs: how many, the first one's line (name, memory, driver) and its
total memory; 0 or None where it is absent or fails."""

from __future__ import annotations

import os
import shutil
import subprocess

from lora_suite.settings import env_vars


def gpu_count() -> int:
    if os.environ.get("GPU_TEST_GPU_COUNT"):  # tests of `all` without GPUs
        return int(env_vars.number("GPU_TEST_GPU_COUNT", 0))
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    out = subprocess.run([smi, "-L"], capture_output=True, text=True)
    return sum(line.startswith("GPU") for line in out.stdout.splitlines()) if out.returncode == 0 else 0


def gpu_line() -> str | None:
    """The first GPU's "name, memory.total, memory.used, memory.free, driver_version" (nvidia-smi's CSV), or None."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    q = "--query-gpu=name,memory.total,memory.used,memory.free,driver_version"
    out = subprocess.run([smi, q, "--format=csv,noheader"], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def gpu_memory_gib() -> float | None:
    """The first GPU's total memory (nvidia-smi), or None where it cannot be read."""
    line = gpu_line()
    try:
        return float(line.split(",")[1].strip().split()[0]) / 1024 if line else None  # "81559 MiB"
    except (IndexError, ValueError):
        return None
