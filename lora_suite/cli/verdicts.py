"""A target's verdict in the summary and its exit code, from its run report's verdict (``RunReport.verdict``):
nothing judged is never PASS; and whether a machine without a GPU is a failure (``--require-gpu``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from lora_suite.harness.verdict import only_out_of_memory

EXIT_NOT_JUDGED = 4  # a target judged nothing on a machine with a GPU, or --require-gpu found none
REQUIRE_GPU_ENV = "LORA_SUITE_REQUIRE_GPU"


EXIT_USAGE = 2
# pytest's exit codes (and 6: a regression against the baseline) as the summary's words and the suite's exit code:
# the summary names what happened, never a pytest exit code; pytest's usage error (4) is the suite's bad usage (2)
PYTEST_OUTCOMES = {
    0: ("PASS", 0),
    1: ("FAIL", 1),
    2: ("INTERRUPTED", 130),
    3: ("ERROR (pytest crashed: see above)", 1),
    4: ("USAGE ERROR (see above)", EXIT_USAGE),
    5: ("FAIL (no tests collected)", 1),
    6: ("FAIL (regression vs baseline)", 1),
}


def verdict_of(rc: int) -> str:
    return PYTEST_OUTCOMES.get(rc, (f"FAIL (the run ended with status {rc})", 1))[0]


def exit_of(rc: int) -> int:
    return PYTEST_OUTCOMES.get(rc, ("", 1))[1]


def judged_verdict(run_dir: Path | None, rc: int, have_gpu: bool) -> tuple[str, int]:
    """The summary's verdict and the target's exit code: pytest's, unless its run report says it judged nothing
    (``RunReport.verdict``): then NOT JUDGED (why), exit 4 on a machine with a GPU and 0 on one without (a CPU
    machine running the README's commands is not a failure; ``--require-gpu`` made it one before anything ran)."""
    if rc == 1 and ran_out_of_memory(run_dir):
        return "FAIL (out of memory)", 1
    if rc != 0 or run_dir is None:
        return verdict_of(rc), exit_of(rc)
    try:
        verdict = json.loads((run_dir / "report.json").read_text()).get("verdict") or {}
    except (OSError, ValueError):
        return "FAIL (no run report)", 1
    if verdict.get("result") == "PASS (RETRIED)":
        return "PASS (RETRIED: micro-batch halved)", 0
    if verdict.get("result") != "NOT JUDGED":
        return verdict_of(rc), exit_of(rc)
    if not have_gpu:
        return "NOT JUDGED (no GPU)", 0
    return f"NOT JUDGED ({verdict.get('why', '')})", EXIT_NOT_JUDGED


def ran_out_of_memory(run_dir: Path | None) -> bool:
    """Whether the run failed only by running out of memory: its report's failed checks are all out-of-memory checks
    (``lora_suite/harness/oom_verdict.py``, which released the GPU after each), and there is one at least."""
    if run_dir is None:
        return False
    try:
        checks = json.loads((run_dir / "report.json").read_text()).get("checks") or []
    except (OSError, ValueError, TypeError):
        return False
    return only_out_of_memory([str(c.get("name", "")) for c in checks if isinstance(c, dict) and not c.get("passed")])


def no_gpu_found(args, target: str) -> str:
    """The one line a target that must see a GPU (``--require-gpu`` or the environment's flag) prints without one."""
    how = "--require-gpu" if getattr(args, "require_gpu", False) else f"{REQUIRE_GPU_ENV}=1"
    return f"lora-suite {target}: {how}: no NVIDIA GPU found (nvidia-smi / NVML sees no device); nothing was judged"


def require_gpu(args) -> bool:
    return bool(getattr(args, "require_gpu", False)) or os.environ.get(REQUIRE_GPU_ENV, "") not in ("", "0")
