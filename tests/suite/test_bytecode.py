"""lora_suite.cli.bytecode on the CPU: where the suite's pytest processes keep compiled bytecode, and its warm-up."""

from __future__ import annotations

from pathlib import Path

from lora_suite.cli import bytecode, targets


def test_an_interpreter_that_writes_bytecode_is_left_alone(tmp_path):
    env = {"HOME": str(tmp_path)}
    assert bytecode.cache_folder(env) is None and bytecode.child_env(env) == env


def test_no_bytecode_asked_for_gets_the_suites_cache_folder(tmp_path):
    env = {"PYTHONDONTWRITEBYTECODE": "1", "XDG_CACHE_HOME": str(tmp_path), "KEEP": "x"}
    out = bytecode.child_env(env)
    folder = tmp_path / "lora-suite" / "pycache"
    assert out == {"XDG_CACHE_HOME": str(tmp_path), "KEEP": "x", "PYTHONPYCACHEPREFIX": str(folder)}
    assert folder.is_dir() and "PYTHONDONTWRITEBYTECODE" in env  # the caller's mapping is not changed


def test_the_setting_picks_a_folder_or_leaves_the_interpreter_alone(tmp_path):
    env = {"PYTHONDONTWRITEBYTECODE": "1", bytecode.ENV: str(tmp_path / "mine")}
    assert bytecode.child_env(env)["PYTHONPYCACHEPREFIX"] == str(tmp_path / "mine")
    off = {"PYTHONDONTWRITEBYTECODE": "1", bytecode.ENV: "off"}
    assert bytecode.child_env(off) == off
    own = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(tmp_path / "theirs")}
    assert bytecode.child_env(own)["PYTHONPYCACHEPREFIX"] == str(tmp_path / "theirs")


def test_a_folder_that_cannot_be_made_leaves_the_environment_and_says_so(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    env = {"PYTHONDONTWRITEBYTECODE": "1", bytecode.ENV: str(blocker / "sub")}
    assert bytecode.child_env(env) == env
    assert f"bytecode not cached ({bytecode.ENV}={blocker / 'sub'}" in capsys.readouterr().err


def test_the_clis_pytest_processes_get_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(bytecode.ENV, raising=False)
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    env = targets._child_env("quick")
    assert env["PYTHONPYCACHEPREFIX"] == str(Path(tmp_path) / "lora-suite" / "pycache")
    assert "PYTHONDONTWRITEBYTECODE" not in env
