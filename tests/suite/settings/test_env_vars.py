"""The suite's environment variables (``lora_suite.settings.env_vars``, issue 72): every name the code reads is in the
registry or listed as another's; every registered variable, set to hostile values, stops a command before any work
with one line naming it, its value and what was expected (exit 2), and a pytest session with a usage error; good
values pass."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from lora_suite.cli import main
from lora_suite.settings.env_vars import ENV_VARS, FOREIGN, environment_problem

ROOT = Path(__file__).resolve().parents[3]
HOSTILE = ["abc", "-1", "nan", "inf", "1e999", " 1", "1\n", "é", "../x", "0x10", "2.5e", "yes"]
GOOD = {
    "LORA_SUITE_PROGRESS_INTERVAL_S": "2.5",
    "LORA_SUITE_FUSED_ROUNDS": "3",
    "LORA_SUITE_HYPOTHESIS_PROFILE": "nightly",
    "LORA_SUITE_RUN_ID": "20261208T000000Z-quick",
    "LORA_SUITE_CONFIG_DIR": str(ROOT / "configs"),
    "LORA_SUITE_TIERS_DIR": str(ROOT / "tiers"),
    "LORA_SUITE_BYTECODE_SETUP_S": "0.25",
    "GPU_TEST_GPU_COUNT": "0",
    "GPU_TEST_T0": "1765152000.123",
    "LORA_CORE_BACKEND": "torch",
}
# the string constants that name variables: os.environ[...] / .get(...) / getenv(...) arguments and *_ENV constants
READS = re.compile(
    r"""(?:environ(?:\.get)?\(?\[?|getenv\(|env_vars\.number\(|_ENV\s*=\s*)\s*["']([A-Z][A-Z0-9_]{2,})["']"""
)


def test_every_variable_the_code_reads_is_registered_or_anothers():
    found = set()
    for path in list((ROOT / "lora_suite").rglob("*.py")) + list((ROOT / "lora_core").rglob("*.py")):
        found |= set(READS.findall(path.read_text()))
    assert found, "the pattern finds the reads"
    assert sorted(found - set(ENV_VARS) - FOREIGN) == []
    assert {"LORA_SUITE_PROGRESS_INTERVAL_S", "LORA_SUITE_FUSED_ROUNDS", "GPU_TEST_T0"} <= found


@pytest.mark.parametrize("name", sorted(ENV_VARS))
def test_hostile_values_stop_a_command_with_one_line(name, monkeypatch, capsys, tmp_path):
    judged = 0
    for value in HOSTILE:
        if ENV_VARS[name].ok(value):
            continue
        judged += 1
        monkeypatch.setenv(name, value)
        assert main(["ledger", "show", "--ledger", str(tmp_path / "l.jsonl")]) == 2, (name, value)
        err = capsys.readouterr().err
        first = err.splitlines()[0]
        assert first.startswith(f"lora-suite: ${name}={value!r}") and "expected" in first, err
        assert "Traceback" not in err and not (tmp_path / "l.jsonl").exists()
    assert judged >= 4, f"{name}: only {judged} of the hostile values are refused"


@pytest.mark.parametrize("name", sorted(GOOD))
def test_good_values_pass(name):
    assert environment_problem({name: GOOD[name]}) is None
    assert environment_problem({name: ""}) is None  # empty: unset


def test_every_registered_variable_has_a_good_value_here_or_is_a_flag():
    flags = {n for n, v in ENV_VARS.items() if v.ok("1") and v.ok("0") and not v.ok("2")}
    assert set(ENV_VARS) == set(GOOD) | flags


def test_a_pytest_session_with_a_bad_value_is_a_usage_error(tmp_path):
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    env = {"LORA_SUITE_PROGRESS_INTERVAL_S": "soon", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "lora_suite.harness.pytest_plugin", "-q", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 4 and "$LORA_SUITE_PROGRESS_INTERVAL_S='soon'" in out, out[-2000:]
    assert "Traceback" not in out and "INTERNALERROR" not in out, out[-2000:]
