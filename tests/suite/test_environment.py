"""The environment record every report carries."""

from __future__ import annotations

from lora_suite.core.environment import COMMIT_ENV, collect_environment, git_state


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
