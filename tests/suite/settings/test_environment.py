"""The environment record every report carries."""

from __future__ import annotations

from lora_suite.settings.environment import COMMIT_ENV, collect_environment, git_state


def test_environment_has_versions_and_commit():
    env = collect_environment()
    assert env.torch and env.python and env.timestamp_utc.endswith("Z") and env.git_commit


def test_commit_outside_git_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(COMMIT_ENV, "abc123")
    assert git_state(tmp_path) == ("abc123 (from $LORA_SUITE_GIT_COMMIT)", False)
    monkeypatch.delenv(COMMIT_ENV)
    assert git_state(tmp_path) == ("unknown", False)


def test_the_environment_variable_wins_over_a_git_checkout(monkeypatch):
    """A GPU runner's copy carried a .git of the last landed commit: reports named the wrong commit."""
    monkeypatch.setenv(COMMIT_ENV, "0123abc")
    assert git_state() == ("0123abc (from $LORA_SUITE_GIT_COMMIT)", False)


def test_the_package_environment_imports_no_torch_and_agrees_with_the_full_one():
    """What the controlling process of a run over workers records (it imports no torch): the installed versions."""
    import json
    import subprocess
    import sys

    code = (
        "import json, sys, dataclasses; from lora_suite.settings.environment import package_environment; "
        "e = package_environment(); print(json.dumps([dataclasses.asdict(e), sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('torch', 'cupy', 'transformers', 'peft'))]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    light, imported = json.loads(out.stdout)
    assert imported == []
    full = collect_environment()
    assert light["torch"] == full.torch.split("+")[0] or light["torch"] == full.torch
    assert (light["gpu_name"], light["cuda"]) == (None, None) and light["git_commit"] == full.git_commit
    assert (light["transformers"], light["peft"], light["python"]) == (full.transformers, full.peft, full.python)
