"""A user's mistake never yields a traceback (issue 44): each case runs the command line as a user does, in its own
process, and asserts the exit code (2: bad usage), a message naming what was wrong and what would be valid, and no
traceback, pytest ``INTERNALERROR`` or pytest exit code in what the user reads. The option cases run with
``GPU_TEST_DRY_RUN=1``, under which an accepted command exits 0 without running anything: a check that is removed
turns its case from 2 into 0 and fails here."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TRACES = ("Traceback (most recent call last)", "INTERNALERROR", "(exit ")


def lora_suite(*args: str, cwd: Path, env: dict | None = None, dry: bool = True) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("GPU_TEST_DRY_RUN", "LORA_SUITE_CONFIG_DIR")}
    base |= {"PYTHONPATH": str(ROOT), "GPU_TEST_DRY_RUN": "1" if dry else "0", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "lora_suite", *args], capture_output=True, text=True, cwd=cwd, env=base, timeout=300
    )


def refused(out: subprocess.CompletedProcess, *expected: str) -> None:
    text = out.stdout + out.stderr
    assert out.returncode == 2, (out.returncode, text[-1500:])
    for e in expected:
        assert e in text, text[-1500:]
    assert not any(t in text for t in TRACES), text[-3000:]


@pytest.fixture
def configs(tmp_path) -> Path:
    """A copy of the tier and model YAML, to break one of them (LORA_SUITE_CONFIG_DIR points the suite at it)."""
    out = tmp_path / "configs"
    shutil.copytree(ROOT / "lora_suite" / "configs", out)
    return out


def _break(configs: Path, tier: str, line: str, new: str) -> Path:
    """Replace the first line matching ``line`` (a regex over one line) of configs/<tier>.yaml by ``new``."""
    path = configs / f"{tier}.yaml"
    text, n = re.subn(f"(?m)^{line}.*$", new, path.read_text(), count=1)
    assert n == 1, (tier, line)
    path.write_text(text)
    return path


BROKEN_YAML = [
    ("quick", "  steps: ", "  steps: ten", "quick.yaml.train.steps: expected int, got 'ten'"),
    ("quick", "  order: ", "  order: first", "quick.yaml.suite.order: expected int, got 'first'"),
    ("extended", "suite:", "suite: [unclosed", "extended.yaml: malformed YAML: line"),
    ("memory", "  r: 16", "  r: 16\n  r: 8", "memory.yaml: malformed YAML: line"),
]


@pytest.mark.parametrize(
    "tier, old, new, message", BROKEN_YAML, ids=[c[3].split(": ", 1)[-1][:40] for c in BROKEN_YAML]
)
def test_a_broken_tier_yaml_breaks_only_that_tier(tier, old, new, message, configs, tmp_path):
    _break(configs, tier, old, new)
    env = {"LORA_SUITE_CONFIG_DIR": str(configs)}
    help_ = lora_suite("--help", cwd=tmp_path, env=env)
    assert help_.returncode == 0 and f"BROKEN: {configs}/{message.split('.yaml')[0]}" in help_.stdout, help_.stderr
    refused(lora_suite(tier, cwd=tmp_path, env=env), f"tier {tier!r} is broken:", message)
    refused(lora_suite("all", cwd=tmp_path, env=env), "'all' includes broken tier(s)", tier)
    other = "convergence"
    ok = lora_suite(other, cwd=tmp_path, env=env)
    assert ok.returncode == 0 and f"targets: {other}" in ok.stdout, ok.stderr


OPTION_CASES = [
    (["quick", "--workers", "100000"], ["--workers 100000: this machine has", "expected 1 to"]),
    (["quick", "--gpus", "2"], ["--gpus applies to multigpu and all", "not to 'quick'"]),
    (["quick", "--ledger", "mine.jsonl"], ["--ledger mine.jsonl: names the ledger --record appends to"]),
    (["scorecard", "--ledger", "mine.jsonl"], ["--ledger mine.jsonl: names the ledger --record appends to"]),
    (["quick", "--report-dir", "/nonexistent/deep/dir"], ["its parent /nonexistent/deep does not exist"]),
    (["quick", "--lora-impl", "nosuch"], ["--lora-impl 'nosuch' is not known: expected one of cupy, cupy-fused"]),
    (["quick", "--lora-impl", "my-pkg.mod:make"], ["'my-pkg.mod:make': expected package.module:factory"]),
    (["quick", "--lora-impl", "no_such_module:make"], ["no module named 'no_such_module' on the Python path"]),
    (["scorecard", "--lora-impl", "cupy,nosuch"], ["--lora-impl 'nosuch' is not known"]),
    (["ledger", "show", "--ledger", "missing.jsonl"], ["ledger show --ledger: missing.jsonl does not exist"]),
    (["ledger", "record", "no/such/run"], ["ledger record: no/such/run does not exist"]),
    (["compare", "gone/a", "gone/b"], ["compare: gone/a, gone/b do not exist"]),
    (["history", "--ledger", "missing.jsonl"], ["history --ledger: missing.jsonl does not exist"]),
    (["render-scorecard", "out", "no/such/run"], ["render-scorecard: no/such/run does not exist"]),
]


@pytest.mark.parametrize("args, expected", OPTION_CASES, ids=[" ".join(a) for a, _ in OPTION_CASES])
def test_an_option_the_target_or_machine_cannot_take_is_refused_before_anything_runs(args, expected, tmp_path):
    refused(lora_suite(*args, cwd=tmp_path, env={"SCORECARD_DRY_RUN": "1"}), *expected)
    assert not any(tmp_path.iterdir()), "a refused command wrote something"
    assert not Path("/nonexistent").exists()


MODULES = {
    "boom": ('raise RuntimeError("boom at import")\n', ["RuntimeError: boom at import", "boom.py:1"]),
    "facbad": ('def make():\n    raise ValueError("factory says no")\n', ["its factory 'make' raised ValueError"]),
    "noattr": ("x = 1\n", ["cannot load 'make' from module 'noattr'", "AttributeError"]),
}


@pytest.mark.parametrize("module", list(MODULES))
def test_an_implementation_that_fails_to_load_is_a_usage_error_not_a_crash(module, tmp_path):
    """The module is found (so the command line lets it through) and fails when pytest loads it: one line naming the
    module and its error, the summary's USAGE ERROR, exit 2, and no run folder left empty."""
    source, expected = MODULES[module]
    (tmp_path / f"{module}.py").write_text(source)
    reports = tmp_path / "reports"
    reports.mkdir()
    out = lora_suite("quick", "--lora-impl", f"{module}:make", "--report-dir", str(reports), cwd=tmp_path, dry=False)
    refused(out, f"--lora-impl {module}:make", "USAGE ERROR", *expected)
    assert not any(reports.iterdir()), "a run refused before it started left a folder"


def test_the_summary_names_outcomes_never_pytest_exit_codes():
    from lora_suite.cli.verdicts import PYTEST_OUTCOMES, verdict_of

    for rc in range(0, 8):
        assert "exit" not in verdict_of(rc)
    assert PYTEST_OUTCOMES[4] == ("USAGE ERROR (see above)", 2)  # pytest's usage error is the suite's bad usage
